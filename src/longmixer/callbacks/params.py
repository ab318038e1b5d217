"""Parameter counts (total, trainable, non-trainable, and per top-level module) sent to every logger at fit start."""

from __future__ import annotations

import logging

from pytorch_lightning.callbacks import Callback

from longmixer.utils.optim import count_parameters

log = logging.getLogger(__name__)


class ParameterCount(Callback):
    def on_fit_start(self, trainer, pl_module):
        counts = {f"model/params/{k}": v for k, v in count_parameters(pl_module).items()}
        for name, child in pl_module.named_children():
            for sub, module in child.named_children():
                counts[f"model/params/by_module/{name}.{sub}"] = count_parameters(module)["total"]
        if trainer.is_global_zero:
            log.info("parameters: %s total, %s trainable", f"{counts['model/params/total']:,}",
                     f"{counts['model/params/trainable']:,}")
        for logger in trainer.loggers:
            logger.log_hyperparams({k: v for k, v in counts.items() if "by_module" not in k})
            logger.log_metrics({k: float(v) for k, v in counts.items()}, step=0)
