"""Checkpointing that never leaves a half-written file: write `<name>.tmp`, then rename over the target."""

from __future__ import annotations

import os
from weakref import proxy

from pytorch_lightning.callbacks import ModelCheckpoint


class AtomicModelCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` (best by the monitored metric + `last.ckpt`) with atomic writes, so a run killed while
    saving still has its previous checkpoint intact for `resume=auto`."""

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        # ModelCheckpoint._save_checkpoint (Lightning 2.6) with the write redirected to a temporary file
        tmp = filepath + ".tmp"
        trainer.save_checkpoint(tmp, self.save_weights_only)
        if trainer.is_global_zero:
            os.replace(tmp, filepath)
        trainer.strategy.barrier("atomic_checkpoint")
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(proxy(self))
