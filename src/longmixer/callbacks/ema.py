"""Weight EMA: Lightning's `EMAWeightAveraging`, with the averaged weights also used when testing after fit."""

from __future__ import annotations

import itertools

import torch
from pytorch_lightning.callbacks import EMAWeightAveraging
from pytorch_lightning.trainer.states import TrainerFn


class EMAWeights(EMAWeightAveraging):
    """An exponential moving average of the weights (`decay` per optimizer step), used for validation and stored
    as the checkpoints' `state_dict`; the raw weights keep training and are stored as `current_model_state`.

    Lightning's callback, on loading a checkpoint while it holds an average (that is, in the same process after
    `fit`), puts the raw `current_model_state` back into the module whatever the stage, so the test of the best
    checkpoint would score the raw weights. Outside fitting the checkpoint's `state_dict` (the average) is what the
    papers' rule evaluates, so this class restores the averaging state only while fitting (a resume).

    Until the first update (`update_starting_at_step` later, e.g. after the warmup) there is no average yet, and
    Lightning's averaged copy still holds the weights of the start of training: validation, checkpoints and the end
    of training would use those initial weights. Until then the copy is set to the current weights wherever it is
    read, so the run is validated and saved with the weights it trains.
    """

    def _follow_current_until_averaging(self, pl_module) -> None:
        average = self._average_model
        if average is None or int(average.n_averaged) > 0:  # read at validations and saves only
            return
        with torch.no_grad():
            targets = itertools.chain(average.module.parameters(), average.module.buffers())
            sources = itertools.chain(pl_module.parameters(), pl_module.buffers())
            for target, source in zip(targets, sources):
                target.copy_(source)

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._follow_current_until_averaging(pl_module)
        super().on_validation_epoch_start(trainer, pl_module)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._follow_current_until_averaging(pl_module)
        super().on_save_checkpoint(trainer, pl_module, checkpoint)

    def on_train_end(self, trainer, pl_module) -> None:
        self._follow_current_until_averaging(pl_module)
        super().on_train_end(trainer, pl_module)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)
