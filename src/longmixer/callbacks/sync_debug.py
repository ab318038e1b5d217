"""`HostSyncCounter` (`debug=syncs`): which calls inside training steps make the host wait for the GPU.

A host sync (`.item()`, `int(tensor)`, a data-dependent shape such as `nonzero` or `torch.unique`, a blocking copy to
the CPU) drains the launch queue: the host stops running ahead, and the GPU idles while the host prepares the next
work. One sync per step is enough to make a small model host-bound. PyTorch can report every such call
(`torch.cuda.set_sync_debug_mode("warn")`); this callback turns that on for a window of training steps only, catches
the warnings instead of printing them, and at the end of the window logs the count per step and the call sites.
Syncs made while compiling (Inductor's constant folding reads values) are counted apart: they happen once per
compiled graph, not per step.
"""

from __future__ import annotations

import logging
import os
import traceback
import warnings
from collections import Counter

import torch
from pytorch_lightning.callbacks import Callback

log = logging.getLogger(__name__)

_MESSAGE = "called a synchronizing CUDA operation"
_COMPILING = ("torch/_dynamo/convert_frame", "torch/_inductor/compile_fx")  # frames of a compilation in progress


def _site(stack: list[traceback.FrameSummary]) -> tuple[str, bool]:
    """The call site of a sync: the innermost frame, then the innermost two of longmixer's own; and whether it
    happened while compiling."""
    stack = [f for f in stack if f.filename != __file__ and os.path.basename(f.filename) != "warnings.py"]
    compiling = any(any(mark in f.filename for mark in _COMPILING) for f in stack)

    def name(frame):
        path = frame.filename.replace("\\", "/")
        for root in ("site-packages/", "/src/"):
            path = path.split(root)[-1]
        return f"{path}:{frame.lineno} ({frame.name})"

    ours = [f for f in stack if "longmixer" in f.filename.replace("\\", "/").split("site-packages/")[-1]]
    parts = [name(stack[-1])] + [name(f) for f in reversed(ours[-2:]) if f is not stack[-1]]
    return " <- ".join(parts), compiling


class HostSyncCounter(Callback):
    """Count host syncs in training steps [start, stop) (global steps) and log them once the window has passed:
    `train/debug/host_syncs_per_step` to the loggers, and the call sites to the console log.

    Args:
        start: the first global step counted (after the first steps' compiling and CUDA-graph recording).
        stop: the first global step no longer counted.
        top: call sites listed.

    On a CPU it logs that it needs a CUDA GPU and does nothing.
    """

    def __init__(self, start: int = 20, stop: int = 70, top: int = 8):
        if not 0 <= start < stop:
            raise ValueError(f"callbacks.host_syncs: start={start}, stop={stop} must satisfy 0 <= start < stop")
        self.start, self.stop, self.top = start, stop, top
        self.sites: Counter[str] = Counter()
        self.compiling: Counter[str] = Counter()
        self.steps = 0
        self._active = False
        self._reported = False
        self._saved: tuple | None = None

    # --- the window ------------------------------------------------------------------------------------------------
    def _capture(self, message, category, filename, lineno, file=None, line=None):
        if _MESSAGE in str(message):
            site, compiling = _site(traceback.extract_stack()[:-1])
            (self.compiling if compiling else self.sites)[site] += 1
        else:
            self._saved[0](message, category, filename, lineno, file, line)

    def _begin(self) -> None:
        self._saved = (warnings.showwarning, warnings.filters[:])
        warnings.filterwarnings("always", message=f".*{_MESSAGE}")  # every occurrence, not once per line
        warnings.showwarning = self._capture
        torch.cuda.set_sync_debug_mode("warn")
        self._active = True

    def _end(self) -> None:
        if not self._active:
            return
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning, warnings.filters[:] = self._saved
        self._active = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.strategy.root_device.type != "cuda":
            if not self._reported:
                log.warning("debug=syncs counts CUDA host syncs: this run has no CUDA device, nothing is counted")
                self._reported = True
            return
        if self.start <= trainer.global_step < self.stop:
            self._begin()
            self.steps += 1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._end()
        if trainer.global_step >= self.stop and not self._reported:
            self.report(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._end()
        if self.steps and not self._reported:
            self.report(trainer)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._end()

    # --- the result ------------------------------------------------------------------------------------------------
    def per_step(self) -> float:
        return sum(self.sites.values()) / max(self.steps, 1)

    def report(self, trainer) -> None:
        self._reported = True
        lines = [f"host syncs in {self.steps} training steps (global steps {self.start}-{self.start + self.steps - 1}):"
                 f" {self.per_step():.2f} per step, {sum(self.compiling.values())} more while compiling"]
        lines += [f"  {n:6d}  {site}" for site, n in self.sites.most_common(self.top)]
        lines += [f"  {n:6d}  (compiling) {site}" for site, n in self.compiling.most_common(max(1, self.top // 4))]
        if trainer.is_global_zero:
            log.info("\n".join(lines))
        for logger in trainer.loggers:
            logger.log_metrics({"train/debug/host_syncs_per_step": self.per_step()}, step=trainer.global_step)
