"""Compose-time validation: every key under a `_target_` (model, data, optim, scheduler, ...) must be a parameter
of it, top-level keys must be known, and enumerated values must be allowed. Errors name the key, the value and the
fix."""

from __future__ import annotations

import difflib
import importlib
import inspect
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from longmixer.utils.backends import BACKENDS
from longmixer.utils.compose import CONFIG_DIR
from longmixer.utils.errors import UserFacingError, raised_by_a_check

HYDRA_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_", "_args_"}
TOP_LEVEL = {"data", "model", "task", "optim", "scheduler", "trainer", "logger", "callbacks", "paths", "run_name", "tags",
             "seed", "deterministic", "resume", "ckpt_path", "train", "test", "run_tag", "run_dir", "ops",
             "optimized_metric", "hydra"}
RESUME = ("auto", "never", "force")
# nodes without a `_target_` whose keys their yaml fixes: nothing reads another key under them, so one added with `+`
# (`+ops.backnd=torch`, `+paths.data_dri=...`: the form Hydra's "not in struct" error and our hint for it suggest) is
# a typo that would otherwise run on the default without a word
FIXED_KEYS = {"ops": ("backend",), "paths": ("root_dir", "data_dir", "log_dir", "output_dir")}
# groups whose every entry is built from its `_target_` (runs/run.py: instantiate_group), with what an entry is
TARGET_GROUPS = {"callbacks": "callbacks", "logger": "loggers"}


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


def _signature(fn) -> inspect.Signature:
    """`fn`'s signature with its annotations evaluated where they can be (postponed ones are strings; one that names
    a type imported only for type checkers stays a string, which `_scalar_kinds` reads as far as it can)."""
    try:
        return inspect.signature(fn, eval_str=True)
    except Exception:  # noqa: BLE001 - any failure to evaluate an annotation: the unevaluated signature is enough
        return inspect.signature(fn)


# classes whose **kwargs go to another callable rather than up the class hierarchy: Lightning's DDP strategy hands
# them to torch's DistributedDataParallel (`trainer.strategy.gradient_as_bucket_view`, `bucket_cap_mb`, ...)
KWARGS_FORWARDED = {
    "pytorch_lightning.strategies.ddp.DDPStrategy": "torch.nn.parallel.DistributedDataParallel",
    "lightning.pytorch.strategies.ddp.DDPStrategy": "torch.nn.parallel.DistributedDataParallel",
}
_FORWARD_SKIPPED = {"self", "module"}  # filled in by the class that forwards them


def target_parameters(target) -> tuple[dict[str, inspect.Parameter], bool]:
    """The parameters `target` accepts by name, following **kwargs up the class hierarchy (a subclass's own
    declaration of a name wins) or to the callable a class forwards them to (`KWARGS_FORWARDED`); the flag says
    whether any name is accepted (a **kwargs that reaches no named parameters)."""
    params: dict[str, inspect.Parameter] = {}
    classes = inspect.getmro(target) if inspect.isclass(target) else (None,)
    for cls in classes:
        fn = target if cls is None else cls.__dict__.get("__init__")
        if fn is None:
            continue
        own = _signature(fn).parameters.values()
        for p in own:
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self":
                params.setdefault(p.name, p)
        if not any(p.kind == p.VAR_KEYWORD for p in own):
            return params, False
        forwarded = cls is not None and KWARGS_FORWARDED.get(f"{cls.__module__}.{cls.__qualname__}")
        if forwarded:
            for p in _signature(locate(forwarded).__init__).parameters.values():
                if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in _FORWARD_SKIPPED:
                    params.setdefault(p.name, p)
            return params, False
        if cls is None or cls is object:
            return params, True
    return params, True


def accepted_parameters(target) -> tuple[set[str], bool]:
    """Names `target` accepts and whether it accepts any name (`target_parameters`)."""
    params, open_ended = target_parameters(target)
    return set(params), open_ended


_SCALARS = {int: "int", float: "float", bool: "bool", str: "str", type(None): "None"}


def _scalar_kinds(annotation) -> frozenset[str] | None:
    """The scalar types an annotation is made of (`int | None` -> {int, None}), or None where it also allows
    something else (a list, a module, a callable, a Literal, Any) or none is written: such a parameter's value is
    not checked here."""
    if annotation is inspect.Parameter.empty:
        return None
    if isinstance(annotation, str):  # not evaluable: read `a | b` of builtin names, nothing else
        atoms = [a.strip() for a in annotation.split("|")]
        return frozenset(atoms) if all(a in _SCALARS.values() for a in atoms) else None
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [_scalar_kinds(a) for a in typing.get_args(annotation)]
        return None if any(k is None for k in kinds) else frozenset().union(*kinds)
    return frozenset((_SCALARS[annotation],)) if annotation in _SCALARS else None


def _type_problem(value, kinds: frozenset[str]) -> str | None:
    """What a scalar value's type lacks for a parameter of `kinds` (None where it fits or is not checked). An int
    parameter takes no float (64.0 and 1e5 reach `range`, `nn.Linear` and Lightning as floats) and no string; a
    float one takes any number; a bool one takes only true or false (a string or number would be truthy)."""
    if value is None or "str" in kinds:
        return None
    if isinstance(value, bool):
        fits = "bool" in kinds
    elif isinstance(value, int):
        fits = bool(kinds & {"int", "float"})
    elif isinstance(value, float):
        fits = "float" in kinds
    else:
        fits = not kinds & {"int", "float", "bool"}
    if fits:
        return None
    wants = [w for k, w in (("int", "a whole number"), ("float", "a number"), ("bool", "true or false")) if k in kinds]
    if "int" in kinds and "float" in kinds:
        wants.remove("a whole number")
    return " or ".join(wants + (["null"] if "None" in kinds else []))


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
# counts Lightning divides by (a ZeroDivisionError inside fit at 0) or silently misreads below 0: it takes a
# negative `log_every_n_steps` as its absolute value (`step % -N`), and at 0 it logs no training value per step
# (no loss or learning-rate curve) without a word
COUNT_KEYS = {"trainer.accumulate_grad_batches": "the batches of one optimizer step; 1: a step per batch",
              "trainer.check_val_every_n_epoch": "validate every N epochs; or null to count "
                                                 "trainer.val_check_interval across epochs",
              "trainer.log_every_n_steps": "log the training loss and learning rate every N optimizer steps, e.g. "
                                           "50; Lightning logs none at 0 and reads -N as N"}
NUMBER_KEYS = ("optim.weight_decay", "trainer.gradient_clip_val", "trainer.val_check_interval",
               "trainer.limit_train_batches", "trainer.limit_val_batches", "trainer.limit_test_batches")
# the model's sizes (its own and its mixer's): a count or width below 1 reaches a constructor as a tensor of negative
# size, a division by zero or a model that builds and then fails in the first step; null stays where the parameter
# takes None (a size that is off: `d_ffn`, `window`, `chunk_size`, ...)
SIZE_KEYS = ("d_model", "n_layers", "d_ffn", "d_classifier", "max_len", "n_heads", "zdim", "hdim", "ndim", "d_qk",
             "d_v", "ema_ndim", "s4d_state", "n_codes", "chunk_size", "window", "truncation", "kernel_len",
             "pool_size")


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
    for node, allowed in FIXED_KEYS.items():
        for key in (cfg[node].keys() if isinstance(cfg.get(node), DictConfig) else ()):
            if key not in allowed:
                raise ConfigError(f"unknown key {node}.{key}{_suggest(str(key), allowed)}; allowed: {sorted(allowed)}")
    for group, entries in TARGET_GROUPS.items():
        _check_group_entries(cfg, group, entries)
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
    for key, meaning in COUNT_KEYS.items():
        value = OmegaConf.select(cfg, key)
        if value is not None and value < 1:
            raise ConfigError(f"{key}={value} must be >= 1 ({meaning})")
    for key in NUMBER_KEYS:
        _number(cfg, key, float)
    clip = OmegaConf.select(cfg, "trainer.gradient_clip_val")
    if clip is not None and clip < 0:
        # neither Lightning nor torch refuses it: the clipping coefficient max_norm / norm turns negative and flips
        # every gradient, so the optimizer climbs the loss
        raise ConfigError(f"trainer.gradient_clip_val={clip} must be >= 0: the largest gradient norm (e.g. 1.0); "
                          "0 or null: no clipping")
    interval = OmegaConf.select(cfg, "trainer.val_check_interval")
    if interval is not None and not interval > 0:
        raise ConfigError(f"trainer.val_check_interval={interval!r} must be > 0: a number of training batches (e.g. "
                          "1000) or a fraction of the epoch (e.g. 0.5)")
    accumulate = OmegaConf.select(cfg, "trainer.accumulate_grad_batches") or 1
    if isinstance(interval, int) and not isinstance(interval, bool) and interval % accumulate:
        # Lightning counts the interval in batches: a validation between an update's batches writes checkpoints
        # that hold half an update's gradients, which no resume can continue exactly
        raise ConfigError(f"trainer.val_check_interval={interval} counts batches; with "
                          f"trainer.accumulate_grad_batches={accumulate} it validates inside an optimizer update, "
                          f"where a checkpoint cannot be resumed exactly: use a multiple of {accumulate}")
    for path, node in _targets(cfg, ""):
        if path.startswith("hydra"):
            continue
        _check_target_keys(path, node)
    _check_optimizer(cfg)
    _check_scheduler(cfg)
    _check_early_stopping(cfg)


def _check_group_entries(cfg: DictConfig, group: str, what: str) -> None:
    """Every entry of `callbacks` / `logger` must be a node with a `_target_`. One without is a key set with `+` on an
    entry this run does not have (`+callbacks.early_stopping.patience=5` under callbacks=default,
    `+logger.wandb.project=x` under logger=csv, a typo'd entry name): its keys would build nothing, so it is refused
    here with the entries the run has and the group option that brings the entry, where one does."""
    entries = cfg.get(group)
    if not isinstance(entries, DictConfig):
        return
    present = [str(k) for k, v in entries.items() if isinstance(v, DictConfig) and "_target_" in v]
    for name, node in entries.items():
        if node is None or (isinstance(node, DictConfig) and "_target_" in node):
            continue
        option = Path(CONFIG_DIR) / group / f"{name}.yaml"
        fix = f"; {group}={name} adds it" if option.is_file() else _suggest(str(name), present)
        raise ConfigError(f"{group}.{name} is not one of this run's {what} (it has no _target_){fix}; the run's "
                          f"{what}: {', '.join(present)}")


def _check_early_stopping(cfg: DictConfig) -> None:
    """An early-stopping callback's `patience` must be >= 0: Lightning takes no exception to a negative one and
    stops training at the first validation without improvement, as it does at 0 or 1."""
    from pytorch_lightning.callbacks import EarlyStopping

    callbacks = cfg.get("callbacks")
    if not isinstance(callbacks, DictConfig):
        return
    for name, node in callbacks.items():
        if not isinstance(node, DictConfig) or "_target_" not in node:
            continue
        target = locate(node["_target_"])
        if not (inspect.isclass(target) and issubclass(target, EarlyStopping)):
            continue
        patience = node.get("patience")
        if isinstance(patience, int) and not isinstance(patience, bool) and patience < 0:
            monitor = OmegaConf.select(node, "monitor", throw_on_resolution_failure=False)
            raise ConfigError(f"callbacks.{name}.patience={patience} must be >= 0: the validations without an "
                              f"improvement of {monitor} after which training stops, e.g. 10 (below 0, Lightning "
                              "stops at the first)")


def check_backend_on_device(cfg: DictConfig, device_type: str) -> None:
    """Raise `ConfigError` where `ops.backend=triton` cannot run on the run's device: the ops refuse it at the first
    step, inside Lightning's fit, with a traceback (exit status 1). The same conditions as the ops' dispatch
    (`ops/backend.py: resolve_backend`): Triton installed, and CUDA tensors or Triton's CPU interpreter.

    Args:
        cfg: the composed run config.
        device_type: the type of the device the run trains on (`trainer.strategy.root_device.type`).
    """
    if OmegaConf.select(cfg, "ops.backend") != "triton":
        return
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        raise ConfigError("ops.backend=triton but Triton is not installed: `pip install triton==3.6.0`, or set "
                          "ops.backend=auto (the PyTorch reference where Triton cannot run)")
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ConfigError(f"ops.backend=triton runs the Triton kernels on CUDA tensors, and this run is on the "
                          f"{device_type} (trainer.accelerator={OmegaConf.select(cfg, 'trainer.accelerator')}): set "
                          "ops.backend=auto (Triton on a GPU, the PyTorch reference elsewhere) or torch, or "
                          "TRITON_INTERPRET=1 to run the kernels in Triton's CPU interpreter")


LM_MODEL_KEYS = "model.num_classes=null model.causal=true model.pool=none model.head=lm_tied"


def check_task_and_data(cfg: DictConfig) -> None:
    """Raise `ConfigError` for a classification task or model on language-modelling data (which has no
    `num_classes`), or the language-model task on classification data: a run failed on an interpolation
    (`${data.num_classes}` of the backbone, `${data.metric}` of the task) with a traceback. An LM recipe sets the
    task and model keys. Training runs it (evaluate reads a run's config, which training checked; not
    `prepare_data.py`, which composes a task's data on the default recipe)."""
    data, task, model = (cfg.get(key) for key in ("data", "task", "model"))
    if not all(isinstance(node, DictConfig) for node in (data, task, model)) or "_target_" not in task:
        return
    lm_data = "num_classes" not in data
    lm_task = str(task["_target_"]).endswith(".LanguageModel")
    name = str(data.get("_target_", "data")).rsplit(".", 1)[-1]
    recipe = ("start from a language-model recipe, which sets them: experiment=<family>/enwik8 or "
              "<family>/wikitext103 (data=<name> and model=<name> swap the data and the model)")
    if lm_data and not lm_task:
        raise ConfigError(f"data ({name}) is language-modelling data (no data.num_classes), and the task is "
                          f"{str(task['_target_']).rsplit('.', 1)[-1]}: it needs task=language_model and the model's "
                          f"LM keys ({LM_MODEL_KEYS}); {recipe}")
    classes = OmegaConf.to_container(model, resolve=False).get("num_classes")
    if lm_data and isinstance(classes, str) and "data.num_classes" in classes:
        raise ConfigError(f"data ({name}) is language-modelling data (no data.num_classes), and model.num_classes "
                          f"reads it: a model on it needs the LM keys ({LM_MODEL_KEYS}); {recipe}")
    if lm_task and not lm_data:
        raise ConfigError(f"task=language_model needs language-modelling data (data=enwik8, wikitext103 or "
                          f"synthetic_bytes); data ({name}) is classification data with "
                          f"data.num_classes={data.get('num_classes')}: use task=classification (the default)")


def _check_target_keys(path: str, node: DictConfig) -> None:
    """Every key of a `_target_` node is a parameter of the target, its value (where written in this node, not
    interpolated) of the type the parameter's annotation allows, and a model size >= 1."""
    target = locate(node["_target_"])
    params, open_ended = target_parameters(target)
    name = node["_target_"].rsplit(".", 1)[-1]
    for key in node.keys():
        if key in HYDRA_KEYS:
            continue
        if key not in params:
            if open_ended:
                continue
            raise ConfigError(f"unknown key {path}.{key}{_suggest(key, params)} for {node['_target_']}; "
                              f"allowed: {sorted(params)}")
        if OmegaConf.is_interpolation(node, key) or OmegaConf.is_missing(node, key):
            continue  # checked where its value is written
        value = node[key]
        if isinstance(value, (DictConfig, ListConfig)):
            continue
        kinds = _scalar_kinds(params[key].annotation)
        want = kinds and _type_problem(value, kinds)
        if want:
            shown = " | ".join(k for k in _SCALARS.values() if k in kinds)
            raise ConfigError(f"{path}.{key}={value!r} must be {want} ({name} takes {key}: {shown})")
        if (path == "model" or path.startswith("model.")) and key in SIZE_KEYS and isinstance(value, int) \
                and not isinstance(value, bool) and value < 1:
            null = " or null" if kinds and "None" in kinds else ""
            raise ConfigError(f"{path}.{key}={value}: a size of the model must be >= 1{null} ({name} takes "
                              f"{key}: {' | '.join(k for k in _SCALARS.values() if k in kinds) if kinds else 'int'})")


# words torch's optimizers use in their refusals for the keys of the `optim` group ("Invalid epsilon value: -1")
_OPTIM_WORDS = {"epsilon": "eps", "beta": "betas"}


def _check_optimizer(cfg: DictConfig) -> None:
    """Build the optimizer once on a stand-in parameter, so that a value its constructor refuses
    (`optim.weight_decay=-1`, `optim.eps=-1`, `optim.betas=[0.9,1.5]`, `optim.momentum=-1`) stops here with the key:
    the task builds it only inside Lightning's fit, where the refusal came as a traceback naming no key."""
    node = cfg.get("optim")
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return
    import re

    import torch
    from hydra.utils import instantiate

    name = node["_target_"].rsplit(".", 1)[-1]
    try:
        optimizer = instantiate(node)
        optimizer([torch.zeros(1, requires_grad=True)])
    except UserFacingError:
        raise
    except Exception as err:  # noqa: BLE001 - hydra wraps the constructor's error; its message names the argument
        cause = _innermost_cause(err)
        if not isinstance(cause, (ValueError, TypeError)) or not raised_by_a_check(cause):
            raise  # a bug in the optimizer keeps its traceback
        words = set(re.findall(r"[a-z_]+", str(cause).lower()))
        keys = [f"optim.{key}={OmegaConf.to_container(node, resolve=True)[key]}" for key in node.keys()
                if key not in HYDRA_KEYS and (key in words or key in {_OPTIM_WORDS.get(w) for w in words})]
        raise ConfigError(f"optim ({name}): {' '.join(str(cause).split())}"
                          + (f"; change {' or '.join(keys)}" if keys else "")) from err


def _innermost_cause(err: BaseException) -> BaseException:
    """The constructor's own error under hydra's `InstantiationException` wrappers: the end of the `__cause__`
    chain."""
    while err.__cause__ is not None:
        err = err.__cause__
    return err


def _check_scheduler(cfg: DictConfig) -> None:
    """Build the schedule once on a stand-in optimizer, so that a value its constructor refuses
    (`scheduler.warmup_steps=-1`, `scheduler.factor=2`) stops here with the key: the task builds it only inside
    Lightning's fit, where the refusal came as a traceback."""
    node = cfg.get("scheduler")
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return
    import torch
    from hydra.utils import instantiate

    name = node["_target_"].rsplit(".", 1)[-1]
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        schedule = instantiate(node)
        schedule(optimizer, total_steps=max(int(OmegaConf.select(cfg, "trainer.max_steps") or 1), 1))
    except UserFacingError:
        raise
    except Exception as err:  # noqa: BLE001 - hydra wraps the constructor's error; its own message names the key
        cause = _innermost_cause(err)
        bug = isinstance(cause, ValueError) and not raised_by_a_check(cause)
        if bug or not isinstance(cause, (ValueError, TypeError)):
            raise  # a ValueError of a bug in the schedule keeps its traceback
        raise ConfigError(f"scheduler ({name}): {' '.join(str(cause).split())}") from err
