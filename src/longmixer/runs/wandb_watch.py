"""A `WandbLogger` that can `watch` the model: gradient and / or parameter histograms every `log_freq` steps."""

from __future__ import annotations

from pytorch_lightning.loggers import WandbLogger

WATCH = (None, "gradients", "parameters", "all")


class WatchingWandbLogger(WandbLogger):
    """`WandbLogger` plus `watch` (None | gradients | parameters | all) and `watch_log_freq` (steps).

    The watch starts in `log_graph`, the hook the trainer calls with the LightningModule when a fit or test starts,
    so the factory needs no model; it is started once per logger.
    """

    def __init__(self, *args, watch: str | None = None, watch_log_freq: int = 100, **kwargs):
        if watch not in WATCH:
            raise ValueError(f"logger.wandb.watch={watch!r} is not one of {WATCH}")
        if watch_log_freq < 1:
            raise ValueError(f"logger.wandb.watch_log_freq={watch_log_freq} must be >= 1")
        super().__init__(*args, **kwargs)
        self._watch, self._watch_log_freq, self._watching = watch, watch_log_freq, False

    def log_graph(self, model, input_array=None) -> None:
        if self._watch is not None and not self._watching:
            self.watch(model, log=self._watch, log_freq=self._watch_log_freq, log_graph=False)
            self._watching = True
