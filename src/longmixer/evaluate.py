"""Re-score a checkpoint on the validation and test splits (the reporting rule: test at the best validation
checkpoint, which train.py applies automatically).

    python -m longmixer.evaluate run_dir=logs/runs/chela/listops/<hash>_seed0
    python -m longmixer.evaluate run_dir=<run dir> ckpt_path=<run dir>/checkpoints/last.ckpt

With `run_dir`, the run's own `config_resolved.yaml` is used (command-line overrides apply on top of it) and the
best checkpoint recorded in its results.json, unless `ckpt_path` names another. Everything is written under
`<run_dir>/eval/<checkpoint name>/` (results.json, csv/metrics.csv); the training run's files are never touched.
Checkpoints are read with `weights_only=True`.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
import yaml
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from longmixer.runs.checkpoints import load_checkpoint, trusted_best_path
from longmixer.runs.run import to_number
from longmixer.utils.compose import CONFIG_SEARCH_PATH, refuse_null_group_choices
from longmixer.utils.config import validate_config
from longmixer.utils.resolvers import register_resolvers

log = logging.getLogger("longmixer")


def _run_config(run_dir: Path, cfg: DictConfig) -> DictConfig:
    """The run's stored config with this invocation's `trainer.*` device keys and `ckpt_path` on top."""
    path = run_dir / "config_resolved.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"run_dir={run_dir} holds no config_resolved.yaml; pass a run dir made by train")
    stored = OmegaConf.create(yaml.safe_load(path.read_text()))
    with open_dict(stored):
        stored.ckpt_path = cfg.ckpt_path
        stored.logger = None
        stored.callbacks = None
    return stored


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Validate and test one checkpoint; writes `<run_dir>/eval/<checkpoint stem>/results.json`."""
    run_dir = Path(cfg.run_dir) if cfg.get("run_dir") else None
    if run_dir is None:
        raise ValueError("evaluate needs run_dir=<a training run dir>; it reads that run's config and writes "
                         "under <run_dir>/eval/")
    run_cfg = _run_config(run_dir, cfg)
    validate_config(run_cfg)
    ckpt_dir = run_dir / "checkpoints"
    if cfg.ckpt_path is not None:
        ckpt = Path(cfg.ckpt_path)
        if not ckpt.is_file():
            raise FileNotFoundError(f"ckpt_path={cfg.ckpt_path} does not exist")
    else:
        results = run_dir / "results.json"
        best = json.loads(results.read_text()).get("best_ckpt") if results.is_file() else None
        if not best:
            raise FileNotFoundError(f"{results} records no best checkpoint; pass ckpt_path=<file.ckpt>")
        moved = ckpt_dir / Path(best).name
        if Path(best).resolve().parent != ckpt_dir.resolve() and moved.is_file():
            best = str(moved)  # the run dir was moved (another machine or root) after results.json was written
        ckpt = Path(trusted_best_path(best, ckpt_dir))
    load_checkpoint(ckpt)  # refuse a corrupt or unsafe file before building anything
    out_dir = run_dir / "eval" / ckpt.stem
    out_dir.mkdir(parents=True, exist_ok=True)
    with open_dict(run_cfg):
        run_cfg.trainer.default_root_dir = str(out_dir)
        run_cfg.trainer.logger = False
        run_cfg.trainer.enable_progress_bar = False
        run_cfg.trainer.enable_model_summary = False
    datamodule = instantiate(run_cfg.data)
    task = instantiate(run_cfg.task)
    trainer = instantiate(run_cfg.trainer, callbacks=[])
    metrics: dict[str, float] = {}
    for result in trainer.validate(task, datamodule=datamodule, ckpt_path=str(ckpt), weights_only=True,
                                   verbose=False):
        metrics.update({k: to_number(v) for k, v in result.items()})
    for result in trainer.test(task, datamodule=datamodule, ckpt_path=str(ckpt), weights_only=True, verbose=False):
        metrics.update({k: to_number(v) for k, v in result.items()})
    (out_dir / "results.json").write_text(json.dumps({"ckpt_path": str(ckpt), "metrics": metrics}, indent=2))
    log.info("evaluation of %s: %s", ckpt, metrics)
    return metrics


@hydra.main(version_base="1.3", config_path=CONFIG_SEARCH_PATH, config_name="train")
def _main(cfg: DictConfig) -> None:
    evaluate(cfg)


def main() -> None:
    refuse_null_group_choices(sys.argv[1:])
    register_resolvers()
    # Hydra's own output (its log, .hydra/) goes to <run_dir>/eval too, never into a training run dir
    run_dirs = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("run_dir=")]
    if run_dirs:
        sys.argv += [f"hydra.run.dir={Path(run_dirs[-1]) / 'eval'}"]
    _main()


if __name__ == "__main__":
    main()
