"""Train one configuration: compose -> instantiate data, model, task, trainer -> fit -> test the best checkpoint.

    python -m longmixer.train experiment=chela/listops trainer=gpu seed=3
    python -m longmixer.train -m experiment=quickstart seed=0,1,2
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import hydra
import pytorch_lightning as pl
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from longmixer.utils.compose import CONFIG_DIR, CONFIG_SEARCH_PATH, apply_mixer_blocks
from longmixer.utils.config import validate_config
from longmixer.utils.resolvers import register_resolvers
from longmixer.utils.run import (instantiate_group, majority_rates, resolved_config, result_table,
                                 select_resume_checkpoint, to_number, write_results)
from longmixer.utils.run_info import write_run_info

log = logging.getLogger("longmixer")


def train(cfg: DictConfig) -> dict:
    """Fit and test one composed config; returns the results dict written to `<run dir>/results.json`."""
    hydra_cfg = HydraConfig.get()
    choices = dict(hydra_cfg.runtime.choices)
    apply_mixer_blocks(cfg, choices, hydra_cfg.overrides.task)
    validate_config(cfg)
    run_dir = Path(hydra_cfg.runtime.output_dir)
    ckpt_path = select_resume_checkpoint(cfg, run_dir)
    pl.seed_everything(cfg.seed, workers=True)

    log.info("instantiating data <%s>", cfg.data._target_)
    datamodule = instantiate(cfg.data)
    log.info("instantiating task <%s> with model <%s>", cfg.task._target_, cfg.model._target_)
    task = instantiate(cfg.task)
    callbacks = instantiate_group(cfg.get("callbacks"), "callbacks")
    loggers = instantiate_group(cfg.get("logger"), "logger")
    log.info("instantiating trainer <%s>", cfg.trainer._target_)
    trainer: pl.Trainer = instantiate(cfg.trainer, callbacks=callbacks, logger=loggers)

    if trainer.is_global_zero:
        write_run_info(run_dir, Path(CONFIG_DIR).parent)
        (run_dir / "config_resolved.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    for logger in trainer.loggers:
        logger.log_hyperparams(resolved_config(cfg))

    if cfg.train:
        trainer.fit(task, datamodule=datamodule, ckpt_path=ckpt_path)
    metrics = {k: to_number(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}

    best_ckpt = None
    if cfg.test:
        if trainer.fast_dev_run:
            log.info("fast_dev_run writes no checkpoints: testing the current weights (debug only)")
        else:
            best_ckpt = trainer.checkpoint_callback.best_model_path if trainer.checkpoint_callback else ""
            if not best_ckpt:
                raise RuntimeError("no best checkpoint was written, so the papers' reporting rule (test at the "
                                   "best validation checkpoint) cannot be applied; check callbacks.checkpoint and "
                                   "that validation ran (trainer.limit_val_batches, check_val_every_n_epoch)")
        for result in trainer.test(task, datamodule=datamodule, ckpt_path=best_ckpt or None, weights_only=False):
            metrics.update({k: to_number(v) for k, v in result.items()})

    majority = majority_rates(getattr(datamodule, "manifest", None))
    results = write_results(run_dir, cfg, choices, metrics, best_ckpt, majority) if trainer.is_global_zero else {}
    if trainer.is_global_zero:
        log.info(result_table(results))
    for logger in trainer.loggers:
        if type(logger).__name__ == "WandbLogger":
            logger.experiment.finish()
    return {"metrics": metrics, **results}


@hydra.main(version_base="1.3", config_path=CONFIG_SEARCH_PATH, config_name="train")
def _main(cfg: DictConfig) -> float | None:
    results = train(cfg)
    metric = cfg.get("optimized_metric")
    if metric is None:
        return None
    value = results["metrics"].get(metric)
    return math.nan if value is None else value


def main() -> None:
    register_resolvers()
    _main()


if __name__ == "__main__":
    main()
