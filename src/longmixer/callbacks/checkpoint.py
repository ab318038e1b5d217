"""Checkpointing a run can be resumed from at any time.

`AtomicModelCheckpoint` keeps two kinds of files in `<run dir>/checkpoints/`:
- `best-<step>.ckpt`: the best validation checkpoint by the monitored metric (a non-finite value never counts);
- `last.ckpt`: the newest state, rewritten on a fixed cadence whether or not the metric improved: every
  `every_n_train_steps` steps, after every validation, at the end of training, and when the run is stopped by
  SIGTERM, SIGINT or SIGUSR2.

Every file is written to `<name>.tmp` and renamed over the target, so a run killed while saving keeps its previous
checkpoint intact.

A run dir that was moved (copied to another machine, unpacked by `longmixer.runs.carry`) resumes with its best-k
bookkeeping: the paths in the stored state are rewritten from the old checkpoint dir to the new one, where
Lightning's `ModelCheckpoint` would drop them and test whichever checkpoint improves next.

SIGTERM (what SLURM sends at the time limit and before preemption), SIGUSR2 (SLURM's warning before the time limit,
which our SLURM launcher asks for) and SIGINT (Ctrl+C) do not kill the run mid-step (`utils.signals`): the handler
only records the signal; at the end of the current training step (or of a mid-epoch validation; after an
end-of-epoch validation, at the end of the next step, or at the end of training after the last one) every rank
agrees to stop, `last.ckpt` is written and `RunInterrupted` is raised, before the test phase: a `SystemExit` with
code 128 + signal number (143 for SIGTERM, 140 for SIGUSR2, 130 for SIGINT). A second SIGINT stops at once without a
checkpoint. With several ranks the agreement is an all-reduce whose result is read at the next check (`AgreedStop`),
one step later: reading it at once would make the host wait for the GPU in every step.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
from pathlib import Path
from weakref import proxy

import torch
from pytorch_lightning.callbacks import Callback, ModelCheckpoint

from longmixer.utils.errors import UserFacingError
from longmixer.utils.signals import STOP_SIGNALS

log = logging.getLogger("longmixer")


class RunInterrupted(SystemExit):
    """The run stopped on one of `STOP_SIGNALS` after writing `checkpoint`. A `SystemExit` whose code is 128 + the
    signal number, so the process ends with the status a scheduler expects (143 for SIGTERM, 140 for SIGUSR2, 130 for
    SIGINT)."""

    def __init__(self, signum: int, step: int, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(128 + signum)


class AgreedStop:
    """The stop signal all ranks agree on (the largest of theirs), without a host sync per check.

    Each `exchange` all-reduces this rank's signal and returns the agreed value of the previous exchange. On a GPU
    the result travels to pinned host memory by an asynchronous copy and an event marks its arrival; by the next
    check (a training step later) the GPU is usually past it, so waiting on that event does not drain the launch
    queue, where `.item()` on the fresh result would wait for the whole step. Every rank calls `exchange` at the
    same points of the loop, so every rank reads the same value at the same step and stops there.
    """

    def __init__(self):
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None

    def exchange(self, signum: int, device: torch.device) -> int:
        import torch.distributed as dist

        value = torch.full((1,), signum, dtype=torch.int64, device=device)  # a fill kernel, no host copy
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        if device.type == "cuda":
            result = torch.empty(1, dtype=torch.int64, pin_memory=True)
            result.copy_(value, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record()
        else:
            result, arrived = value, None
        previous, self._pending = self._pending, (result, arrived)
        if previous is None:
            return 0
        result, arrived = previous
        if arrived is not None:
            arrived.synchronize()
        return int(result[0])


class AtomicModelCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` with atomic writes, a fixed `last.ckpt` cadence, non-finite scores kept out of "best",
    and a checkpoint-then-stop on SIGTERM / SIGUSR2 / SIGINT.

    Args:
        every_n_train_steps: also rewrite `last.ckpt` every this many optimizer steps (0: only at validations).
        Other arguments are `ModelCheckpoint`'s; `save_last` is always on.
    """

    def __init__(self, *args, every_n_train_steps: int = 0, **kwargs):
        if every_n_train_steps < 0:
            raise ValueError(f"callbacks.checkpoint.every_n_train_steps={every_n_train_steps} must be >= 0")
        kwargs["save_last"] = True
        super().__init__(*args, **kwargs)
        self.last_every_n_steps = every_n_train_steps
        self.val_metrics: dict[str, float] = {}  # the last validation's val/* values (checkpointed)
        self._stop_signal: int | None = None
        self._agreed = AgreedStop()

    # --- signals -----------------------------------------------------------------------------------------------
    def on_train_start(self, trainer, pl_module) -> None:
        # installed here, after Lightning registered its own SIGTERM handler (which would stop without saving). They
        # also replace submitit's USR2 handler, which ends the job mid-step without a checkpoint, and a Lightning
        # SLURM requeue handler set to USR2 (which saves mid-step). Lightning restores the original handlers at
        # teardown
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._make_handler(trainer))
        if trainer.is_global_zero and trainer.ckpt_path and self.dirpath:
            self._set_aside_orphans(trainer.global_step)

    def _set_aside_orphans(self, step: int) -> None:
        """Move best checkpoints that a killed attempt wrote after the checkpoint this one resumed from into
        `orphaned/`: the restored state does not track them, and the resumed run writes that step's best again
        (under the same name, not Lightning's `-v1` beside a file nobody would ever delete)."""
        tracked = {os.path.abspath(p) for p in (*self.best_k_models, self.best_model_path) if p}
        prefix = (self.filename or "").split("{", 1)[0]
        for path in sorted(Path(self.dirpath).glob(f"{prefix}*{self.FILE_EXTENSION}")):
            steps = re.findall(r"\d+", path.stem[len(prefix):])
            if os.path.abspath(path) in tracked or not steps or int(steps[0]) < step:
                continue
            orphaned = path.parent / "orphaned"
            orphaned.mkdir(exist_ok=True)
            path.replace(orphaned / path.name)
            log.warning("%s was written after the checkpoint this run resumed from (step %d): moved to %s",
                        path.name, step, orphaned)

    def _make_handler(self, trainer):
        def handler(signum, frame):
            if signum == signal.SIGINT and self._stop_signal is not None:
                raise KeyboardInterrupt  # second Ctrl+C: stop now
            self._stop_signal = signum
            launcher = trainer.strategy.launcher
            if trainer.is_global_zero and launcher is not None and hasattr(launcher, "kill"):
                launcher.kill(signum)  # DDP on one host: rank 0 forwards the signal to the other ranks
        return handler

    def _stop_requested(self, trainer, now: bool = False) -> int | None:
        """The signal to stop for, agreed by all ranks (any rank that got one stops every rank; with several ranks,
        as of the previous check: `AgreedStop`; `now`: as of this check, by a second exchange)."""
        signum = self._stop_signal or 0
        if trainer.world_size > 1:
            signum = self._agreed.exchange(signum, trainer.strategy.root_device)
            if now:
                signum = self._agreed.exchange(self._stop_signal or 0, trainer.strategy.root_device)
        return signum or None

    def _stop(self, trainer, signum: int) -> None:
        self._save_last(trainer)
        log.warning("received %s: wrote %s at step %d; run the same command again to resume (exit code %d)",
                    signal.Signals(signum).name, self.last_model_path, trainer.global_step, 128 + signum)
        raise RunInterrupted(signum, trainer.global_step, self.last_model_path)

    # --- when to save ------------------------------------------------------------------------------------------
    def _fitting(self, trainer) -> bool:
        from pytorch_lightning.trainer.states import TrainerFn

        return not trainer.fast_dev_run and trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not self._fitting(trainer):
            return
        step = trainer.global_step
        signum = self._stop_requested(trainer)
        due = self.last_every_n_steps and step % self.last_every_n_steps == 0 and self._last_global_step_saved != step
        if signum is None and not due:
            return
        loop = trainer.fit_loop.epoch_loop
        if loop._should_accumulate():
            # inside a gradient accumulation: the gradients of this update's earlier batches are in no checkpoint,
            # so a stop (or save) here would resume the update from its remaining batches alone. The stop waits for
            # the batch that completes the optimizer step.
            return
        # the step at max_steps is validated (SequenceTask.on_train_batch_end asks Lightning to stop, which runs after
        # this hook, so `_should_check_val_fx` cannot see it yet)
        last_step_validated = 0 < trainer.max_steps <= step and loop._should_check_val_epoch()
        if last_step_validated or loop._should_check_val_fx(trainer.fit_loop._data_fetcher):
            # a validation follows this batch: save (or stop) at its end instead. A checkpoint written here would
            # make a resumed run skip that validation (Lightning fast-forwards it, or ends at max_steps)
            return
        # Lightning logs this step's row only after this hook; a resume from this checkpoint will not log it
        # again, so it is logged (and flushed by the save) now. The loggers' second copy is the same row.
        trainer._logger_connector.update_train_step_metrics()
        if signum is not None:
            self._stop(trainer, signum)
        self._save_last(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self._fitting(trainer) and self._should_save_on_train_epoch_end(trainer):
            self._save_last(trainer)  # a run without validation: the epoch end is its save point

    def on_validation_end(self, trainer, pl_module) -> None:
        if not self._fitting(trainer):
            return
        candidates = self._monitor_candidates(trainer)
        self.val_metrics = {k: float(v) for k, v in candidates.items() if k.startswith("val/")}
        current = candidates.get(self.monitor)
        if current is not None and not math.isfinite(float(current)):
            log.warning("%s=%s at step %d is not finite: it cannot become the best checkpoint", self.monitor,
                        float(current), trainer.global_step)
        elif self.save_top_k != 0:
            self._save_topk_checkpoint(trainer, candidates)
        self._save_last(trainer)
        if trainer.is_global_zero:
            shown = "  ".join(f"{k}={v:.4f}" for k, v in sorted(self.val_metrics.items()) if "/stats/" not in k)
            best = "n/a" if self.best_model_score is None else f"{float(self.best_model_score):.4f}"
            log.info("step %d epoch %d | %s | best %s=%s", trainer.global_step, trainer.current_epoch, shown,
                     self.monitor, best)
        signum = self._stop_requested(trainer)
        # at an epoch's end the stop waits for the next step: Lightning logs the epoch's aggregated training
        # metrics after this hook, and a resume would not log them again
        if signum is not None and not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self._stop(trainer, signum)

    def on_train_end(self, trainer, pl_module) -> None:
        if not self._fitting(trainer):
            return
        if self._last_global_step_saved != trainer.global_step:
            self._save_last(trainer)
        # a signal during the last step or its validation, whose stop would wait for a next step: training is
        # complete and saved, but the test phase is not started inside a scheduler's grace period. The same
        # command resumes at the end and tests.
        signum = self._stop_requested(trainer, now=True)
        if signum is not None:
            log.warning("received %s after the last training step: %s holds the finished training; run the same "
                        "command again to test it (exit code %d)", signal.Signals(signum).name,
                        self.last_model_path, 128 + signum)
            raise RunInterrupted(signum, trainer.global_step, self.last_model_path)

    def on_exception(self, trainer, pl_module, exception) -> None:
        return  # a crash is not a save point: the previous last.ckpt stays the resume point

    def state_dict(self) -> dict:
        return {**super().state_dict(), "val_metrics": self.val_metrics}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(_relocated_state(state_dict, self.dirpath))
        self.val_metrics = dict(state_dict.get("val_metrics", {}))

    # --- writing -----------------------------------------------------------------------------------------------
    def _save_last(self, trainer) -> None:
        self.last_model_path = os.path.join(self.dirpath, self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)
        self._save_checkpoint(trainer, self.last_model_path)

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage == "fit" and trainer.is_global_zero and self.dirpath:
            _check_writable(self.dirpath)  # now, not at the first save after an hour of training

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        # ModelCheckpoint._save_checkpoint (Lightning 2.6) with the write redirected to a temporary file.
        # The rows logged so far go to disk before the checkpoint does: a run resumed from it does not log them
        # again, so a kill between the checkpoint and their flush would lose them, where a kill before the
        # checkpoint leaves the previous one, and the rewind moves the rows logged after that aside
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.save()
        tmp = filepath + ".tmp"
        trainer.save_checkpoint(tmp, self.save_weights_only)
        if trainer.is_global_zero:
            if not os.path.isfile(tmp):  # Lightning's atomic save drops a PermissionError silently
                _check_writable(os.path.dirname(filepath))
                raise CheckpointDirError(f"the checkpoint {tmp} was not written; check the space and permissions "
                                         f"of {os.path.dirname(filepath)}")
            os.replace(tmp, filepath)
        trainer.strategy.barrier("atomic_checkpoint")
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))


class CheckpointDirError(UserFacingError, OSError):
    """The run's checkpoint dir cannot be written; the message names it."""


def _check_writable(dirpath: str) -> None:
    """Create `dirpath` and write and delete a file in it, or raise CheckpointDirError naming it."""
    probe = os.path.join(dirpath, f".write-check-{os.getpid()}")
    try:
        os.makedirs(dirpath, exist_ok=True)
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as err:
        raise CheckpointDirError(f"cannot write checkpoints to {dirpath} ({err.strerror or err}); make it writable "
                                 "or run under another paths.log_dir") from None


def _relocated_state(state: dict, dirpath: str | None) -> dict:
    """`state` with paths inside its stored `dirpath` moved under `dirpath` (the checkpoint dir this run has now)."""
    old = state.get("dirpath")
    if not old or not dirpath or old == dirpath:
        return state

    def move(path):
        if isinstance(path, str) and os.path.dirname(path) == old:
            return os.path.join(dirpath, os.path.basename(path))
        return path

    moved = {**state, "dirpath": dirpath}
    for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
        if key in state:
            moved[key] = move(state[key])
    if isinstance(state.get("best_k_models"), dict):
        moved["best_k_models"] = {move(k): v for k, v in state["best_k_models"].items()}
    log.info("checkpoint dir moved from %s to %s: best-k paths rewritten", old, dirpath)
    return moved


class ResumedLoggingStep(Callback):
    """After a resume, sets the logging step to the optimizer step count before the first batch's hooks log.

    Lightning 2.6 restores its logging step (`_batches_that_stepped`) one too far after an end-of-epoch
    checkpoint, so every metrics.csv row of the resumed run would carry a step one past the uninterrupted run's.
    With automatic optimization it equals `global_step` at every batch start. Put it first in the callback list,
    so that callbacks logging in `on_train_batch_start` (the LR monitor) see the corrected step.

    A resume from a checkpoint of the last training step (a stop in that step, or a run trained with test=false)
    runs no batch: Lightning skips its fit loop, whose state stays as the checkpoint saved it, before the loop's
    end closed the last epoch. `on_fit_end` closes it, so the test rows carry the epoch and step of an
    uninterrupted run's (3 and 15, not 2 and 14).
    """

    def __init__(self):
        self._resumed = False

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._resumed = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._resumed:
            self._resumed = False
            if pl_module.automatic_optimization:
                trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step

    def on_fit_end(self, trainer, pl_module) -> None:
        if not self._resumed:
            return  # a batch ran after the resume: the loop ended the fit itself
        self._resumed = False
        # what `_FitLoop.on_advance_end` does at the end of an uninterrupted run's last epoch, and its logging step
        progress = trainer.fit_loop.epoch_progress
        if progress.current.processed < progress.current.started:
            progress.increment_processed()
        if progress.current.completed < progress.current.processed:
            progress.increment_completed()
        if pl_module.automatic_optimization:
            trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step
