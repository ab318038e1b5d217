"""OmegaConf resolvers used by configs/train.yaml and configs/hydra/default.yaml (registered by the entry points)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf


def _canonical(value):
    """Overrides compare by meaning: 2e-3, 0.002 and 2.0e-3 are one value; 1000 and 1000.0 too."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return str(value)


def parse_override(text: str, parser=None) -> tuple[str, str, str, Any]:
    """One command-line override read as the run-dir hash reads it: (key or group, its slot `key[@package]`, its
    prefix "~" | "++" | "+" | "", its value normalized by `_canonical`, None for a bare deletion). Hydra's grammar
    parses it (`parser`: an `OverridesParser` to reuse); an override it cannot parse raises its error."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    override = (parser or OverridesParser.create()).parse_override(str(text))
    key = override.key_or_group
    prefix = "~" if override.is_delete() else "++" if override.is_force_add() else "+" if override.is_add() else ""
    value = None if override.is_delete() and override.value() is None else _canonical(override.value())
    return key, f"{key}@{override.package}" if override.package else key, prefix, value


def _run_hash(overrides, exclude_keys) -> str:
    """A short stable hash of the command-line overrides that change results: the same command maps to the same
    run dir. Each override is parsed (Hydra's grammar) and its value normalized before hashing, so `optim.lr=2e-3`
    and `optim.lr=0.002` share a run dir; keys in `exclude_keys` (and keys under them) are left out. A key given
    more than once counts by its last override, the one Hydra applies last and so the value the run gets
    (`X=a X=b` is `X=b`, not `X=b X=a`). A command line without a repeated key hashes as it always has, so existing
    run dirs stay where their commands find them (tests/utils/test_resolvers.py pins two hashes)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    excluded = [str(k) for k in (exclude_keys or [])]
    parser = OverridesParser.create()
    items: dict[str, str] = {}
    for text in overrides or []:
        key, slot, prefix, value = parse_override(text, parser)
        if any(key == k or key.startswith(k + ".") for k in excluded):
            continue
        items[slot] = f"{prefix}{key}={json.dumps(value, sort_keys=True)}"
    return "default" if not items else hashlib.sha1("\n".join(sorted(items.values())).encode()).hexdigest()[:10]


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


def _mul(a: int, b: int) -> int:
    """Product of two config integers, e.g. the longest LM training segment
    `${lm.mul:${data.k_max},${data.seq_len}}`."""
    return int(a) * int(b)


def _direction(mode: str) -> str:
    """An Optuna study's direction from `task.mode` (the monitored metric's): max -> maximize, min -> minimize, so
    that a language-model sweep on `val/loss_best` minimizes it without an override."""
    directions = {"max": "maximize", "min": "minimize"}
    if mode not in directions:
        raise ValueError(f"task.mode={mode!r} is not max or min, so hydra.sweeper.direction cannot follow it: set "
                         "task.mode=max|min or hydra.sweeper.direction=maximize|minimize")
    return directions[mode]


def register_resolvers() -> None:
    """Register `lm.run_hash`, `lm.run_name`, `lm.abspath`, `lm.mul` and `lm.direction` (idempotent)."""
    for name, fn in (("lm.run_hash", _run_hash), ("lm.run_name", _run_name), ("lm.abspath", _abspath), ("lm.mul", _mul),
                     ("lm.direction", _direction)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)
