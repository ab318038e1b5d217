"""Compose-time validation: every key under a `_target_` (model, data, optim, scheduler, ...) must be a parameter
of it, top-level keys must be known, and enumerated values must be allowed. Errors name the key, the value and the
fix."""

from __future__ import annotations

import difflib
import importlib
import inspect
from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from longmixer.utils.backends import BACKENDS
from longmixer.utils.errors import UserFacingError

HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}
TOP_LEVEL = {"data", "model", "task", "optim", "scheduler", "trainer", "logger", "callbacks", "paths", "run_name", "tags",
             "seed", "deterministic", "resume", "ckpt_path", "train", "test", "run_tag", "run_dir", "ops",
             "optimized_metric", "hydra"}
RESUME = ("auto", "never", "force")


class ConfigError(UserFacingError, ValueError):
    """A composed config that cannot run; the message names the key and the fix."""


def _suggest(key: str, allowed) -> str:
    close = difflib.get_close_matches(key, list(allowed), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def locate(target: str):
    module_name, _, attr = target.rpartition(".")
    try:
        module = importlib.import_module(module_name)
        obj = module
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj
    except (ImportError, AttributeError) as err:
        # A class path inside a module (e.g. pkg.mod.Class.method) is not supported on purpose.
        raise ConfigError(f"_target_ {target!r} cannot be imported: {err}") from err


def accepted_parameters(target) -> tuple[set[str], bool]:
    """Names `target` accepts, following **kwargs up the class hierarchy; the flag says whether any name is
    accepted (a **kwargs that reaches no named parameters)."""
    names: set[str] = set()
    classes = inspect.getmro(target) if inspect.isclass(target) else (None,)
    for cls in classes:
        fn = target if cls is None else cls.__dict__.get("__init__")
        if fn is None:
            continue
        params = inspect.signature(fn).parameters.values()
        names |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            return names, False
        if cls is None or cls is object:
            return names, True
    return names, True


def _targets(node: Any, path: str) -> Iterator[tuple[str, DictConfig]]:
    if isinstance(node, DictConfig):
        if "_target_" in node:
            yield path, node
        for key in node.keys():
            if isinstance(key, str) and key in HYDRA_KEYS:
                continue
            if OmegaConf.is_interpolation(node, key):
                continue  # checked where it is defined (e.g. task.model -> model)
            yield from _targets(node[key], f"{path}.{key}" if path else str(key))
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node):
            yield from _targets(item, f"{path}[{i}]")


# numeric keys a typo'd value reaches deep inside Lightning or a scheduler from (a TypeError there names no key)
INTEGER_KEYS = ("trainer.max_steps", "trainer.max_epochs", "trainer.min_steps", "trainer.accumulate_grad_batches",
                "trainer.check_val_every_n_epoch", "trainer.log_every_n_steps", "data.batch_size", "data.seq_len")
NUMBER_KEYS = ("optim.weight_decay", "trainer.gradient_clip_val", "trainer.val_check_interval",
               "trainer.limit_train_batches", "trainer.limit_val_batches", "trainer.limit_test_batches")


def _number(cfg: DictConfig, key: str, kind: type) -> float | int | None:
    """The value of `key`, None where unset; one that is not of `kind` (int: an integer, so not 1e5 or 64.0, which
    reach Lightning and the DataLoader as floats; float: any number) raises `ConfigError` naming the key."""
    value = OmegaConf.select(cfg, key)
    if value is None:
        return None
    ok = isinstance(value, int if kind is int else (int, float)) and not isinstance(value, bool)
    if not ok:
        want = "a whole number" if kind is int else "a number"
        raise ConfigError(f"{key}={value!r} must be {want} (e.g. {key}={'100' if kind is int else '0.001'})")
    return value


def validate_config(cfg: DictConfig) -> None:
    """Raise `ConfigError` for unknown keys, impossible values or unimportable targets in a composed config."""
    for key in cfg.keys():
        if key not in TOP_LEVEL:
            raise ConfigError(f"unknown top-level key {key!r}{_suggest(key, TOP_LEVEL)}; allowed: {sorted(TOP_LEVEL)}")
    seed = cfg.get("seed")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ConfigError(f"seed={seed!r} must be an integer >= 0 (0 is a valid seed)")
    if cfg.get("resume") not in RESUME:
        raise ConfigError(f"resume={cfg.get('resume')!r} is not one of {RESUME}")
    backend = OmegaConf.select(cfg, "ops.backend")
    if backend not in BACKENDS:
        raise ConfigError(f"ops.backend={backend!r} is not one of {BACKENDS}")
    lr = _number(cfg, "optim.lr", float)
    if lr is not None and not lr > 0:
        raise ConfigError(f"optim.lr={lr!r} must be > 0")
    for key in INTEGER_KEYS:
        _number(cfg, key, int)
    for key in NUMBER_KEYS:
        _number(cfg, key, float)
    for path, node in _targets(cfg, ""):
        if path.startswith("hydra"):
            continue
        target = locate(node["_target_"])
        names, open_ended = accepted_parameters(target)
        if open_ended:
            continue
        for key in node.keys():
            if key not in HYDRA_KEYS and key not in names:
                raise ConfigError(f"unknown key {path}.{key}{_suggest(key, names)} for {node['_target_']}; "
                                  f"allowed: {sorted(names)}")
