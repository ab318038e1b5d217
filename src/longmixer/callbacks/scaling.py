"""A probe for scale-out measurements: the global-batch loss of every step, tokens/s over all ranks and the peak
memory of each rank, written once to a JSON file at the end of training (`scripts/bench/scaling.py` reads it).

Nothing is read or reduced while training runs: each rank keeps its per-step losses and real-token counts on its
own device (an `int(mask.sum())` per step would wait for the GPU at every step, which left the GPU idle while the host
prepared the next step and made a small model's multi-GPU rows follow the host's load), and the ranks exchange them
once in `on_train_end`. On a GPU the timed steps are measured on the GPU's own timeline, by CUDA events recorded as
each step starts and ends (no wait either): from the start of the first timed step to the end of the last, idle gaps
between kernels included, and the end of training (loggers, loops closing) left out. On a CPU, by the host's clock.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import Callback

from longmixer.callbacks.throughput import real_tokens


class ScalingProbe(Callback):
    """Records, per optimizer step, the loss averaged over the global batch (each rank's loss weighted by its rows)
    and the tokens of the global batch; times the steps after the first `warmup_steps`.

    The file `out` (written by global rank 0) holds: `world_size`, `steps`, `loss` (one float per step),
    `rows_per_step`, `tokens_per_step`, `timed_steps`, `timed_s` (the timed steps' time, the slowest rank: the GPU's
    timeline between CUDA events on a GPU, the host's clock on a CPU), `clock` ("cuda-events" | "host"), `step_ms`
    (rank 0's time of each timed step, start to start and the last to its end), `tokens_per_s` (all ranks' tokens of
    the timed steps / timed_s) and `peak_mem_gib` (one per rank; CUDA only, else null).

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
        self._tokens: list[torch.Tensor | int] = []  # `real_tokens` of each step, read at the end
        # the timed steps' marks: one as each starts, and the last one's end (CUDA events on a GPU, else host times)
        self._starts: list = []
        self._end = None

    def _mark(self, trainer):
        if trainer.strategy.root_device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(trainer.strategy.root_device))
        return event

    def on_train_start(self, trainer, pl_module):
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.strategy.root_device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if len(self._losses) >= self.warmup_steps:
            self._starts.append(self._mark(trainer))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is None:
            raise RuntimeError("ScalingProbe needs training_step to return the loss (got None)")
        self._losses.append(loss.detach().float().reshape(()))
        self._rows.append(int(batch["inputs"].shape[0]))
        self._tokens.append(real_tokens(batch))
        if self._starts:
            self._end = self._mark(trainer)

    def _step_seconds(self, trainer) -> list[float]:
        """Each timed step's time: from its start mark to the next step's, the last to its end mark."""
        marks = [*self._starts, self._end]
        if trainer.strategy.root_device.type != "cuda":
            return [b - a for a, b in zip(marks, marks[1:])]
        torch.cuda.synchronize(trainer.strategy.root_device)
        return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]

    def on_train_end(self, trainer, pl_module):
        device = trainer.strategy.root_device
        steps = len(self._losses)
        if steps <= self.warmup_steps or self._end is None:
            raise RuntimeError(f"ScalingProbe saw {steps} steps, not more than warmup_steps={self.warmup_steps}; "
                               "raise trainer.max_steps")
        step_s = self._step_seconds(trainer)
        rows = torch.tensor(self._rows, dtype=torch.float64, device=device)
        weighted = torch.stack(self._losses).double() * rows  # [steps] this rank's loss x rows
        tokens = torch.stack([torch.as_tensor(t, dtype=torch.float64, device=device) for t in self._tokens])
        elapsed = torch.tensor([sum(step_s)], dtype=torch.float64, device=device)
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
                  "timed_s": float(elapsed), "clock": "cuda-events" if device.type == "cuda" else "host",
                  "step_ms": [round(1e3 * s, 3) for s in step_s], "tokens_per_s": timed_tokens / float(elapsed),
                  "peak_mem_gib": peaks}
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(result, indent=1))
