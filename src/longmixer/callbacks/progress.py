"""The progress bar: Lightning's rich bar, with an epoch count that makes sense for step-bounded runs."""

from __future__ import annotations

from pytorch_lightning.callbacks import RichProgressBar


class RichProgress(RichProgressBar):
    """`RichProgressBar` that shows "Epoch 3" rather than "Epoch 3/-2" when the run is bounded by
    `trainer.max_steps` or `trainer.max_time` (`trainer.max_epochs=-1`, the default config): Lightning prints
    max_epochs - 1 as the last epoch whatever its sign."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            description = description.replace(f"/{self.trainer.max_epochs - 1}", "", 1)
        return description

    def _update_metrics(self, trainer, pl_module) -> None:
        # With several ranks, an epoch metric that is summed across them (the torchmetrics accuracy) is computed by
        # a collective the first time anything reads it. Only rank 0 shows a bar, so its read at a train epoch's end
        # would wait in that collective while the other ranks go on to the next one (the checkpoint's divergence
        # check), and the run would hang: every rank reads the bar's metrics here, in step (rank 0's own read below
        # then finds them computed).
        if trainer.world_size > 1:
            trainer.progress_bar_metrics
        super()._update_metrics(trainer, pl_module)
