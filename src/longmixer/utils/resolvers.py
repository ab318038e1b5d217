"""OmegaConf resolvers used by configs/train.yaml and configs/hydra/default.yaml (registered by the entry points)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from omegaconf import OmegaConf


def _hash(text: str) -> str:
    """A short stable hash of the run's overrides: the same command maps to the same run dir."""
    text = text or ""
    return "default" if not text else hashlib.sha1(text.encode()).hexdigest()[:10]


def _run_name(experiment, model, data) -> str:
    """`<family>/<task>` for a recipe run with its own family's model, `<family>/<task>-<model>` for a variant or
    another family on the recipe (`mega/listops-mega_chunk`), `<model>-<data>` without a recipe."""
    if experiment in (None, "None", "null"):
        return f"{model}-{data}"
    experiment = str(experiment)
    family = experiment.split("/")[0] if "/" in experiment else None
    if family is not None and model not in (None, "None", "null", family):
        return f"{experiment}-{model}"
    return experiment


def _abspath(path: str) -> str:
    return str(Path(path).resolve())


def register_resolvers() -> None:
    """Register `lm.hash`, `lm.run_name` and `lm.abspath` (idempotent)."""
    for name, fn in (("lm.hash", _hash), ("lm.run_name", _run_name), ("lm.abspath", _abspath)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
