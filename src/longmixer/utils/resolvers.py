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
    if experiment not in (None, "None", "null"):
        return str(experiment)
    return f"{model}-{data}"


def _abspath(path: str) -> str:
    return str(Path(path).resolve())


def _mul(a: int, b: int) -> int:
    """Product of two config integers, e.g. the longest LM training segment
    `${lm.mul:${data.k_max},${data.seq_len}}`."""
    return int(a) * int(b)


def register_resolvers() -> None:
    """Register `lm.hash`, `lm.run_name`, `lm.abspath` and `lm.mul` (idempotent)."""
    for name, fn in (("lm.hash", _hash), ("lm.run_name", _run_name), ("lm.abspath", _abspath), ("lm.mul", _mul)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
