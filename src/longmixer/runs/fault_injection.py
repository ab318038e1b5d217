"""A test hook: make a run send itself a signal at a chosen point, so kill-and-resume tests are deterministic.

Enabled only by the environment variable `LONGMIXER_FAULT=<SIGNAL>:<where>:<step>`, e.g. `SIGKILL:train:6`
(before the training batch that follows optimizer step 6, i.e. after step 6's validation and checkpoints) or
`SIGTERM:val:4` (at the first validation batch of the validation run at step 4). A fourth field `group`
(`SIGTERM:train:9:group`) sends the signal to the run's whole process group, DataLoader workers included, as
SLURM's `scancel`, coreutils' `timeout` and Ctrl+C in a terminal do. Without the variable the entry
point does not add the callback. Under DDP rank 0 sends the signal; SIGKILL then goes to the whole process
group, as a scheduler killing the job would.
"""

from __future__ import annotations

import os
import signal
import time

from pytorch_lightning.callbacks import Callback

ENV = "LONGMIXER_FAULT"
WHERE = ("train", "val")


class SignalAtStep(Callback):
    def __init__(self, spec: str):
        try:
            name, self.where, step, *target = spec.split(":")
            self.signum, self.step = signal.Signals[name], int(step)
            if target not in ([], ["group"]):
                raise ValueError
        except (ValueError, KeyError):
            raise ValueError(f"{ENV}={spec!r}: expected <SIGNAL>:<train|val>:<step>[:group], e.g. SIGKILL:train:6"
                             ) from None
        self.group = target == ["group"]
        if self.where not in WHERE:
            raise ValueError(f"{ENV}={spec!r}: where must be one of {WHERE}")
        self.fired = False

    def _fire(self, trainer) -> None:
        if self.fired or trainer.global_step != self.step or not trainer.is_global_zero:
            return
        self.fired = True
        if self.group or (self.signum == signal.SIGKILL and trainer.world_size > 1):
            os.killpg(os.getpgid(0), self.signum)
            # the rest of a real step (seconds of GPU work) gives the group's other processes time to act on the
            # signal before the step ends: wait as long, so that a worker's death is noticed here too
            time.sleep(1.0)
        else:
            os.kill(os.getpid(), self.signum)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.where == "train":
            self._fire(trainer)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.where == "val" and not trainer.sanity_checking and trainer.state.fn == "fit":
            self._fire(trainer)


def fault_callbacks() -> list[Callback]:
    spec = os.environ.get(ENV)
    return [SignalAtStep(spec)] if spec else []
