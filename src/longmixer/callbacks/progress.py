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
