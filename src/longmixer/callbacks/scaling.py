"""A probe for scale-out measurements: the global-batch loss of every step, tokens/s over all ranks and the peak
memory of each rank, written once to a JSON file at the end of training (`scripts/bench/scaling.py` reads it).

Nothing is reduced while training runs: each rank keeps its per-step losses and token counts on its own device, and
the ranks exchange them once in `on_train_end`, so the probe adds no synchronisation to the steps it times.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import Callback


def _tokens(batch) -> int:
    """Real (unpadded) positions of `inputs` (+ `inputs2`), as `callbacks/throughput.py` counts them."""
    total = 0
    for key, mask_key in (("inputs", "mask"), ("inputs2", "mask2")):
        if key in batch:
            mask = batch.get(mask_key)
            total += int(mask.sum()) if mask is not None else batch[key].shape[0] * batch[key].shape[1]
    return total


class ScalingProbe(Callback):
    """Records, per optimizer step, the loss averaged over the global batch (each rank's loss weighted by its rows)
    and the tokens of the global batch; times the steps after the first `warmup_steps`.

    The file `out` (written by global rank 0) holds: `world_size`, `steps`, `loss` (one float per step),
    `rows_per_step`, `tokens_per_step`, `timed_steps`, `timed_s` (wall clock of the timed steps, the slowest rank),
    `tokens_per_s` (all ranks' tokens of the timed steps / timed_s) and `peak_mem_gib` (one per rank; CUDA only,
    else null).

    Args:
        out: the JSON file to write.
        warmup_steps: steps left out of the timing (compilation, autotuning, allocator growth).
    """

    def __init__(self, out: str, warmup_steps: int = 5):
        if warmup_steps < 0:
            raise ValueError(f"callbacks.scaling.warmup_steps={warmup_steps} must be >= 0")
        self.out, self.warmup_steps = Path(out), warmup_steps
        self._losses: list[torch.Tensor] = []
        self._rows: list[int] = []
        self._tokens: list[int] = []
        self._t0: float | None = None
        self._t1: float | None = None

    @staticmethod
    def _sync(trainer) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize(trainer.strategy.root_device)

    def on_train_start(self, trainer, pl_module):
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if len(self._losses) == self.warmup_steps and self._t0 is None:
            self._sync(trainer)
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is None:
            raise RuntimeError("ScalingProbe needs training_step to return the loss (got None)")
        self._losses.append(loss.detach().float().reshape(()))
        self._rows.append(int(batch["inputs"].shape[0]))
        self._tokens.append(_tokens(batch))

    def on_train_end(self, trainer, pl_module):
        self._sync(trainer)
        self._t1 = time.perf_counter()
        device = trainer.strategy.root_device
        steps = len(self._losses)
        if steps <= self.warmup_steps:
            raise RuntimeError(f"ScalingProbe saw {steps} steps, not more than warmup_steps={self.warmup_steps}; "
                               "raise trainer.max_steps")
        rows = torch.tensor(self._rows, dtype=torch.float64, device=device)
        weighted = torch.stack(self._losses).double() * rows  # [steps] this rank's loss x rows
        tokens = torch.tensor(self._tokens, dtype=torch.float64, device=device)
        elapsed = torch.tensor([self._t1 - self._t0], dtype=torch.float64, device=device)
        world = trainer.world_size
        if world > 1:
            for t in (weighted, rows, tokens):
                dist.all_reduce(t, op=dist.ReduceOp.SUM)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        peaks = [None] * world
        if world > 1:
            dist.all_gather_object(peaks, peak)
        else:
            peaks = [peak]
        if not trainer.is_global_zero:
            return
        timed_tokens = float(tokens[self.warmup_steps:].sum())
        result = {"world_size": world, "steps": steps, "warmup_steps": self.warmup_steps,
                  "loss": (weighted / rows).tolist(), "rows_per_step": rows.long().tolist(),
                  "tokens_per_step": tokens.long().tolist(), "timed_steps": steps - self.warmup_steps,
                  "timed_s": float(elapsed), "tokens_per_s": timed_tokens / float(elapsed), "peak_mem_gib": peaks}
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(result, indent=1))
