"""Re-score a checkpoint on the validation and test splits (the reporting rule: test at the best validation
checkpoint, which train.py applies automatically).

    python -m longmixer.evaluate experiment=chela/listops ckpt_path=logs/runs/chela/listops/<...>/checkpoints/best-001000.ckpt
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig

from longmixer.utils.compose import CONFIG_SEARCH_PATH, apply_mixer_blocks
from longmixer.utils.config import validate_config
from longmixer.utils.resolvers import register_resolvers
from longmixer.utils.run import instantiate_group, to_number

log = logging.getLogger("longmixer")


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Validate and test `cfg.ckpt_path`; writes `<run dir>/eval_results.json`."""
    hydra_cfg = HydraConfig.get()
    apply_mixer_blocks(cfg, dict(hydra_cfg.runtime.choices), hydra_cfg.overrides.task)
    validate_config(cfg)
    if cfg.ckpt_path is None or not Path(cfg.ckpt_path).is_file():
        raise FileNotFoundError(f"evaluate needs an existing ckpt_path=<file.ckpt>; got {cfg.ckpt_path!r}")
    datamodule = instantiate(cfg.data)
    task = instantiate(cfg.task)
    trainer = instantiate(cfg.trainer, logger=instantiate_group(cfg.get("logger"), "logger"),
                          callbacks=[cb for cb in instantiate_group(cfg.get("callbacks"), "callbacks")
                                     if "Checkpoint" not in type(cb).__name__])
    metrics: dict[str, float] = {}
    for result in trainer.validate(task, datamodule=datamodule, ckpt_path=cfg.ckpt_path, weights_only=False):
        metrics.update({k: to_number(v) for k, v in result.items()})
    for result in trainer.test(task, datamodule=datamodule, ckpt_path=cfg.ckpt_path, weights_only=False):
        metrics.update({k: to_number(v) for k, v in result.items()})
    out = Path(hydra_cfg.runtime.output_dir) / "eval_results.json"
    out.write_text(json.dumps({"ckpt_path": cfg.ckpt_path, "metrics": metrics}, indent=2))
    log.info("evaluation of %s: %s", cfg.ckpt_path, metrics)
    return metrics


@hydra.main(version_base="1.3", config_path=CONFIG_SEARCH_PATH, config_name="train")
def _main(cfg: DictConfig) -> None:
    evaluate(cfg)


def main() -> None:
    register_resolvers()
    _main()


if __name__ == "__main__":
    main()
