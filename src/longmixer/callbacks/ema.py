"""Weight EMA: Lightning's `EMAWeightAveraging`, with the averaged weights also used when testing after fit."""

from __future__ import annotations

from pytorch_lightning.callbacks import EMAWeightAveraging
from pytorch_lightning.trainer.states import TrainerFn


class EMAWeights(EMAWeightAveraging):
    """An exponential moving average of the weights (`decay` per optimizer step), used for validation and stored
    as the checkpoints' `state_dict`; the raw weights keep training and are stored as `current_model_state`.

    Lightning's callback, on loading a checkpoint while it holds an average (that is, in the same process after
    `fit`), puts the raw `current_model_state` back into the module whatever the stage, so the test of the best
    checkpoint would score the raw weights. Outside fitting the checkpoint's `state_dict` (the average) is what the
    papers' rule evaluates, so this class restores the averaging state only while fitting (a resume).
    """

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            super().on_load_checkpoint(trainer, pl_module, checkpoint)
