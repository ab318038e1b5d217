"""Training speed and memory, logged once per window of steps: tokens/s, samples/s, step time, peak GPU memory.

Kept instead of Lightning's ThroughputMonitor, which logs per-second rates under its own fixed names and no peak
memory; the notebook and the bench comparison read `train/speed/{tokens_per_s, step_ms, peak_mem_gib}`.

The callback never waits for the GPU inside a window: a synchronize (or an `int(mask.sum())`) per step would drain
the launch queue every step, leaving the GPU idle while the host prepares the next one (on a small model such as
CHELA's ListOps recipe that halved the GPU's busy time). Real tokens are summed on the device, and the host reads
them and the clock once per window, after one synchronize, so the window's time is the GPU's time for its steps.
"""

from __future__ import annotations

import time

import torch
from pytorch_lightning.callbacks import Callback


def real_tokens(batch) -> torch.Tensor | int:
    """Real (unpadded) positions of `inputs` (+ `inputs2`): a device tensor where a key mask is counted (summed on
    the device, not read), else an int."""
    total: torch.Tensor | int = 0
    for key, mask_key in (("inputs", "mask"), ("inputs2", "mask2")):
        if key in batch:
            mask = batch.get(mask_key)
            total = total + (mask.sum() if mask is not None else batch[key].shape[0] * batch[key].shape[1])
    return total


class Throughput(Callback):
    """Logs `train/speed/{tokens_per_s, samples_per_s, step_ms}` and `train/speed/peak_mem_gib` (CUDA only)
    averaged over `window` training steps. Tokens are the real (unpadded) positions of `inputs` (+ `inputs2`).

    One host sync per window (at its end, and when a validation interrupts it); none per step."""

    def __init__(self, window: int = 50):
        if window < 1:
            raise ValueError(f"callbacks.throughput.window={window} must be >= 1")
        self.window = window
        self._reset()

    def _reset(self):
        self.samples = self.steps = 0
        self.tokens: torch.Tensor | int = 0  # a device tensor while the window runs: read once at its end
        self._start: float | None = None

    @staticmethod
    def _sync(trainer):
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._start is None:
            # the previous window ended with a sync (or nothing ran yet): the GPU's queue is empty here
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._start is None:
            return
        self.steps += 1
        self.tokens = self.tokens + real_tokens(batch)  # a device-side sum: no host read here
        self.samples += batch["inputs"].shape[0]
        if self.steps >= self.window:
            self._log_window(trainer)

    def on_validation_start(self, trainer, pl_module):
        # a validation inside a window would count its time as training: close the window before it
        if self.steps and not trainer.sanity_checking:
            self._log_window(trainer)

    def _log_window(self, trainer):
        self._sync(trainer)
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        tokens = int(self.tokens)  # after the sync: no wait
        metrics = {"train/speed/tokens_per_s": tokens / elapsed,
                   "train/speed/samples_per_s": self.samples / elapsed,
                   "train/speed/step_ms": 1000.0 * elapsed / self.steps}
        device = trainer.strategy.root_device
        if device.type == "cuda":
            metrics["train/speed/peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.reset_peak_memory_stats(device)
        # the step of the window's last batch as Lightning logs a training step's metrics: the optimizer steps
        # before that batch. A resume drops the rows at or after its checkpoint's step (`ResumableCSVLogger.rewind`),
        # so a row stamped with the count after the batch would be dropped for a checkpoint written at that batch
        # and never logged again.
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=max(trainer.global_step - 1, 0))
        self._reset()
