"""Training speed and memory, logged once per window of steps: tokens/s, samples/s, step time, peak GPU memory.

Kept instead of Lightning's ThroughputMonitor, which logs per-second rates under its own fixed names and no peak
memory; the notebook and the bench comparison read `train/speed/{tokens_per_s, step_ms, peak_mem_gib}`.
"""

from __future__ import annotations

import time

import torch
from pytorch_lightning.callbacks import Callback


class Throughput(Callback):
    """Logs `train/speed/{tokens_per_s, samples_per_s, step_ms}` and `train/speed/peak_mem_gib` (CUDA only)
    averaged over `window` training steps. Tokens are the real (unpadded) positions of `inputs` (+ `inputs2`)."""

    def __init__(self, window: int = 20):
        if window < 1:
            raise ValueError(f"callbacks.throughput.window={window} must be >= 1")
        self.window = window
        self._reset()

    def _reset(self):
        self.tokens = self.samples = self.steps = 0
        self.elapsed = 0.0
        self._start: float | None = None

    @staticmethod
    def _sync(trainer):
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._sync(trainer)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self._start is None:
            return
        self._sync(trainer)
        self.elapsed += time.perf_counter() - self._start
        self.steps += 1
        for key, mask_key in (("inputs", "mask"), ("inputs2", "mask2")):
            if key in batch:
                mask = batch.get(mask_key)
                self.tokens += int(mask.sum()) if mask is not None else batch[key].shape[0] * batch[key].shape[1]
        first = batch["inputs"]
        self.samples += first.shape[0]
        if self.steps >= self.window:
            metrics = {"train/speed/tokens_per_s": self.tokens / self.elapsed,
                       "train/speed/samples_per_s": self.samples / self.elapsed,
                       "train/speed/step_ms": 1000.0 * self.elapsed / self.steps}
            device = trainer.strategy.root_device
            if device.type == "cuda":
                metrics["train/speed/peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                torch.cuda.reset_peak_memory_stats(device)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
            self._reset()
