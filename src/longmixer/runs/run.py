"""Support for the entry points: resume selection, instantiation of callbacks and loggers, the result table."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("longmixer")


def select_resume_checkpoint(cfg: DictConfig, run_dir: Path) -> str | None:
    """`ckpt_path` if given; else `<run_dir>/checkpoints/last.ckpt` under resume=auto.

    Raises:
        FileNotFoundError: `ckpt_path` does not exist.
        ValueError: resume=never but the run dir already holds a checkpoint.
    """
    if cfg.ckpt_path is not None:
        path = Path(cfg.ckpt_path)
        if not path.is_file():
            raise FileNotFoundError(f"ckpt_path={cfg.ckpt_path} does not exist")
        return str(path)
    last = run_dir / "checkpoints" / "last.ckpt"
    if not last.exists():
        return None
    if cfg.resume == "never":
        raise ValueError(f"run dir {run_dir} already holds {last}; pass resume=auto to continue that run, or "
                         "run_tag=<name> to start a separate run")
    log.info("resume=auto: continuing from %s", last)
    return str(last)


def instantiate_group(group: DictConfig | None, what: str) -> list[Any]:
    """Instantiate every entry of the `callbacks` or `logger` group (a dict of `_target_` nodes)."""
    objects = []
    for name, node in (group or {}).items():
        if node is None:
            continue
        if "_target_" not in node:
            raise ValueError(f"{what}.{name} has no _target_")
        log.info("instantiating %s.%s <%s>", what, name, node._target_)
        objects.append(instantiate(node))
    return objects


def to_number(value) -> float:
    return float(value.item() if hasattr(value, "item") else value)


def majority_rates(manifest: dict | None) -> dict[str, float]:
    """The majority-class rate of each split whose manifest records label counts (the accuracy to beat)."""
    rates = {}
    for split, info in ((manifest or {}).get("splits") or {}).items():
        counts = list((info.get("labels") or {}).values()) if isinstance(info, dict) else []
        if counts and sum(counts) > 0:
            rates[split] = max(counts) / sum(counts)
    return rates


def write_results(run_dir: Path, cfg: DictConfig, choices: dict, metrics: dict[str, float], best_ckpt: str | None,
                  majority_rate: dict[str, float] | None = None) -> dict:
    """`<run_dir>/results.json`: what report.py collects (experiment, model, data, seed, metrics)."""
    results = {"run_name": cfg.run_name, "experiment": choices.get("experiment"), "model": choices.get("model"),
               "data": choices.get("data"), "seed": cfg.seed, "tags": list(cfg.tags), "metrics": metrics,
               "best_ckpt": best_ckpt, "run_dir": str(run_dir), "majority_rate": majority_rate}
    (run_dir / "results.json").write_text(json.dumps(results, indent=2))
    return results


def result_table(results: dict) -> str:
    """The final metrics as an aligned text table."""
    rows = [("run", results["run_name"]), ("seed", str(results["seed"]))]
    rows += [(k, f"{v:.4f}") for k, v in sorted(results["metrics"].items())]
    for split in ("val", "test"):
        if split in (results.get("majority_rate") or {}):
            rows.append((f"majority-class rate ({split})", f"{results['majority_rate'][split]:.4f}"))
    width = max(len(k) for k, _ in rows)
    lines = ["", "=" * (width + 20), *(f"{k:<{width}}  {v}" for k, v in rows), "=" * (width + 20)]
    return "\n".join(lines)


def resolved_config(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
