"""Support for the entry points: instantiation of callbacks and loggers, results.json and the result table."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import traceback
from pathlib import Path
from typing import Any, Callable

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import IterableDataset

from longmixer.runs.resume import write_atomically
from longmixer.utils.config import ConfigError
from longmixer.utils.errors import UserFacingError, raised_by_a_check

log = logging.getLogger("longmixer")


def instantiate_node(node: DictConfig, **kwargs) -> Any:
    """`hydra.utils.instantiate`, with a constructor's refusal of a setting raised as a ConfigError that names the
    config key and the class in one line (the entry points print it and exit 2, as for the checks on the composed
    config): a ValueError raised by an argument check (`raised_by_a_check`) or Lightning's
    MisconfigurationException, a TypeError about an argument of the target's own signature, or torch's RuntimeError
    for a tensor of negative size (a width the checks on the composed config do not know; the line names the node's
    keys that hold that size). The line says where it was raised; the whole traceback is logged at DEBUG (at ERROR
    with HYDRA_FULL_ERROR=1). Other errors, a ValueError of a bug among them, keep Hydra's error, which names the
    `_target_`, and their traceback. An error of ours that a user fixes (`UserFacingError`) is raised as it is."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        while isinstance(cause, InstantiationException) and cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, UserFacingError):
            raise cause from None
        target = re.search(r"Error in call to target '([^']+)'", str(err))
        name = target.group(1).rsplit(".", 1)[-1] if target else ""
        negative = re.search(r"negative dimension (-\d+)", str(cause)) if isinstance(cause, RuntimeError) else None
        refused = (isinstance(cause, ValueError) and raised_by_a_check(cause)) or (
            type(cause).__name__ == "MisconfigurationException") or (
            isinstance(cause, TypeError) and bool(name) and str(cause).startswith((f"{name}.__init__()", f"{name}()"))
            and re.search(r"unexpected keyword argument|missing \d+ required", str(cause)) is not None) or bool(negative)
        if not refused:
            raise
        trace = "".join(traceback.format_exception(cause))
        log.log(logging.ERROR if os.environ.get("HYDRA_FULL_ERROR") == "1" else logging.DEBUG, "%s", trace)
        key = re.search(r"full_key: (\S+)", str(err))
        key = key.group(1) if key else (node._key() or "config")
        key = "model" + key[len("task.model"):] if key.startswith("task.model") else key  # task.model is ${model}
        frame = traceback.extract_tb(cause.__traceback__)[-1] if cause.__traceback__ else None
        at = f" (raised at {Path(frame.filename).name}:{frame.lineno})" if frame else ""
        sizes = _keys_holding(node, int(negative.group(1)), key) if negative else []
        fix = f"; {' or '.join(sizes)}: a size must be >= 1" if sizes else ""
        raise ConfigError(f"{key} ({name}): {' '.join(str(cause).split())}{fix}{at}") from err


def _keys_holding(node: DictConfig, value: int, prefix: str) -> list[str]:
    """`<key>=<value>` for each key under `node` whose resolved value is the int `value` (the candidates for the
    negative size torch names without its key)."""
    found = []
    try:
        container = OmegaConf.to_container(node, resolve=True, throw_on_missing=False)
    except Exception:  # noqa: BLE001 - an interpolation that resolves only inside a run: the line goes without keys
        return found

    def walk(item, path):
        if isinstance(item, dict):
            for k, v in item.items():
                walk(v, f"{path}.{k}")
        elif isinstance(item, int) and not isinstance(item, bool) and item == value:
            found.append(f"{path}={value}")

    walk(container, prefix)
    return found


def instantiate_group(group: DictConfig | None, what: str) -> list[Any]:
    """Instantiate every entry of the `callbacks` or `logger` group (a dict of `_target_` nodes)."""
    objects = []
    for name, node in (group or {}).items():
        if node is None:
            continue
        if "_target_" not in node:
            raise ValueError(f"{what}.{name} has no _target_")
        log.debug("instantiating %s.%s <%s>", what, name, node._target_)
        objects.append(instantiate_node(node))
    if objects:
        log.info("%s: %s", what, ", ".join(name for name, node in (group or {}).items() if node is not None))
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
                  majority_rate: dict[str, float] | None = None, status: str = "finished",
                  drop: Callable[[str], bool] | None = None) -> dict:
    """`<run_dir>/results.json`: what report.py collects (experiment, model, data, seed, metrics). Metrics of an
    earlier results.json that this call does not recompute are kept, so no metric is lost across resumes, except
    the keys `drop` selects (values that no longer belong with the new ones): then `val_left_out` says that val/*
    keys were left out on purpose (`_unpaired_val` in train.py: the per-validation ones, not `val/<metric>_best`)."""
    path = run_dir / "results.json"
    previous = json.loads(path.read_text()).get("metrics", {}) if path.exists() else {}
    previous = {k: v for k, v in previous.items() if drop is None or not drop(k)}
    results = {"run_name": cfg.run_name, "experiment": choices.get("experiment"), "model": choices.get("model"),
               "data": choices.get("data"), "seed": cfg.seed, "tags": list(cfg.tags),
               "metrics": {**previous, **metrics}, "best_ckpt": best_ckpt, "run_dir": str(run_dir),
               "majority_rate": majority_rate, "status": status}
    if drop is not None:  # `longmixer-report` must not refill the dropped keys from the run's logs
        results["val_left_out"] = True
    write_atomically(path, json.dumps(results, indent=2))
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


def config_tree(cfg: DictConfig, choices: dict | None = None, compact: bool = False) -> str:
    """The composed config as a rich tree, rendered to text: the top-level scalars in one branch (`run`), then one
    branch per group (data, model, task, optim, trainer, ...). `compact`: one line per group, its chosen yaml and
    `_target_` (what the log shows at start; the full tree goes to `<run dir>/config_tree.txt`)."""
    import io

    import rich.tree
    from rich.console import Console

    tree = rich.tree.Tree("config")
    scalars = {k: v for k, v in cfg.items() if not isinstance(v, DictConfig)}
    groups = [(k, v) for k, v in cfg.items() if isinstance(v, DictConfig)]
    if compact:
        tree.add("run: " + ", ".join(f"{k}={v}" for k, v in scalars.items() if k in ("run_name", "seed", "resume")))
        for key, node in groups:
            choice = (choices or {}).get(key)
            target = node.get("_target_") if "_target_" in node else None
            parts = [p for p in (choice and f"{choice}.yaml", target) if p]
            tree.add(f"{key}: {' -> '.join(parts) if parts else f'{len(node)} keys'}")
    else:
        for key, node in [("run", OmegaConf.create(scalars)), *groups]:
            tree.add(str(key)).add(OmegaConf.to_yaml(node, resolve=True).rstrip())
    out = io.StringIO()
    Console(file=out, width=120, color_system=None, highlight=False).print(tree)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())


def _epoch_batches(cfg: DictConfig, datamodule, world_size: int) -> int | None:
    """Training batches an epoch on each rank (after `limit_train_batches` / `overfit_batches`), or None where it
    cannot be known before training: an iterable train set without a length, or one whose per-rank length is set
    only once the ranks run (the LM streams under DDP)."""
    trainer = cfg.trainer
    datamodule.prepare_data()
    datamodule.setup("fit")
    loader = datamodule.train_dataloader()
    if world_size > 1 and isinstance(loader.dataset, IterableDataset):
        return None
    try:
        batches = len(loader)
    except TypeError:
        return None
    limit = trainer.get("limit_train_batches")
    if trainer.get("overfit_batches"):  # Lightning then trains on that many batches an epoch (debug=overfit)
        limit = trainer.overfit_batches  # of its own sequential sampler over the whole set, on every rank
    else:
        batches = -(-batches // world_size)
    if isinstance(limit, int) and not isinstance(limit, bool):
        batches = min(batches, limit)
    elif isinstance(limit, float):
        batches = int(batches * limit)
    return batches


def first_validation_step(cfg: DictConfig, batches: int | None) -> int | None:
    """The optimizer step of the first validation, given the training batches an epoch on each rank
    (`_epoch_batches`), or None where it cannot be known before training (an iterable train set). Validation runs
    only in every `check_val_every_n_epoch`-th epoch, at its `val_check_interval` batches (an int: every that many
    batches; a float: that fraction of the epoch); an epoch ends with an optimizer step even when its batches are not
    a multiple of `accumulate_grad_batches`."""
    trainer = cfg.trainer
    accumulate = max(1, int(trainer.get("accumulate_grad_batches") or 1))
    interval = trainer.get("val_check_interval")
    epochs = int(trainer.get("check_val_every_n_epoch") or 1)
    counted = isinstance(interval, int) and not isinstance(interval, bool)
    if counted and epochs == 1:
        return interval // accumulate
    if batches is None:
        return None
    at = min(interval, batches) if counted else max(1, int(batches * (interval if isinstance(interval, float) else 1.0)))
    steps_in_epoch = -(-at // accumulate) if at == batches else at // accumulate
    return (epochs - 1) * -(-batches // accumulate) + steps_in_epoch


def _validates_by(max_steps: int, cfg: DictConfig, batches: int | None) -> bool:
    """Whether a run of `max_steps` validates at least once: at a scheduled validation, or at `max_steps` itself,
    which Lightning validates when it falls in a validating epoch (the task stops there,
    `SequenceTask.on_train_batch_end`). True where the epoch length is unknown."""
    first = first_validation_step(cfg, batches)
    if first is None or first <= max_steps:
        return True
    epochs = int(cfg.trainer.get("check_val_every_n_epoch") or 1)
    accumulate = max(1, int(cfg.trainer.get("accumulate_grad_batches") or 1))
    # the optimizer steps of the epochs before the first validating one: max_steps beyond them ends inside it
    return batches is None or max_steps > (epochs - 1) * -(-batches // accumulate)


def check_validation_schedule(cfg: DictConfig, datamodule, world_size: int) -> None:
    """The checks on when a run validates, before training (`check_validation_between_updates`,
    `check_validation_reachable`). The epoch's batches, which set up the data, are counted once, and only when a
    check needs them."""
    batches = functools.cache(lambda: _epoch_batches(cfg, datamodule, world_size))
    check_validation_between_updates(cfg, batches)
    check_validation_reachable(cfg, batches)


def check_validation_between_updates(cfg: DictConfig, epoch_batches: Callable[[], int | None]) -> None:
    """Refuse a fractional `trainer.val_check_interval` whose validations fall between an optimizer update's batches
    (Lightning validates every `int(batches * fraction)` batches of an epoch): a checkpoint written there holds half
    an update's gradients, which no resume continues exactly. The int form is checked without data
    (`validate_config`).

    Raises:
        ConfigError: with the int interval (a multiple of the accumulation) to use instead.
    """
    interval = cfg.trainer.get("val_check_interval")
    accumulate = max(1, int(cfg.trainer.get("accumulate_grad_batches") or 1))
    if not isinstance(interval, float) or interval >= 1.0 or accumulate == 1:
        return
    batches = epoch_batches()
    if batches is None:
        return
    every = max(1, int(batches * interval))
    if every >= batches or every % accumulate == 0:
        return
    instead = every // accumulate * accumulate  # at least as often as asked
    use = (f"trainer.val_check_interval={instead} (batches, a multiple of {accumulate})" if instead else
           f"trainer.val_check_interval=null (validation at the epoch's end: an epoch of {batches} batches holds no "
           "other update boundary)")
    raise ConfigError(f"trainer.val_check_interval={interval} validates every {every} of an epoch's {batches} batches "
                      f"on each rank; with trainer.accumulate_grad_batches={accumulate} that is inside an optimizer "
                      f"update, where a checkpoint cannot be resumed exactly: use {use}")


def check_validation_reachable(cfg: DictConfig, epoch_batches: Callable[[], int | None]) -> None:
    """Stop before training when no validation (and so no best checkpoint) would happen before `max_steps`.

    Raises:
        ValueError: naming the keys, when the run also tests (the papers' rule needs a best checkpoint).
    """
    max_steps = cfg.trainer.get("max_steps")
    if cfg.trainer.get("fast_dev_run") or max_steps is None or max_steps < 0:
        return
    interval, per_epoch = cfg.trainer.get("val_check_interval"), cfg.trainer.get("check_val_every_n_epoch", 1)
    if isinstance(interval, int) and not isinstance(interval, bool) and per_epoch is not None:
        # Lightning refuses it too, but only once the data is loaded, with a traceback
        batches = epoch_batches()
        if batches is not None and interval > batches:
            raise ConfigError(f"trainer.val_check_interval={interval} batches is longer than an epoch ({batches} "
                              f"batches on each rank) while trainer.check_val_every_n_epoch={per_epoch} counts "
                              f"validations by epoch: use trainer.val_check_interval={batches} or less, or "
                              "trainer.check_val_every_n_epoch=null to count the interval across epochs")
    fix = "Raise trainer.max_steps or validate earlier (trainer.val_check_interval=<batches>)"
    if max_steps == 0:  # "the step at max_steps is validated" below needs a step: fit ends before the first
        problem = "trainer.max_steps=0 trains no step"
        fix = "Set trainer.max_steps to the optimizer steps to train (or -1: trainer.max_epochs decides)"
    elif cfg.trainer.get("limit_val_batches") == 0:
        problem = "trainer.limit_val_batches=0 disables validation"
        fix = "Leave trainer.limit_val_batches out (or give it a number of batches > 0)"
    elif cfg.trainer.get("check_val_every_n_epoch", 1) in (None, 1):
        return  # the step at max_steps is validated (SequenceTask.on_train_batch_end)
    else:
        batches = epoch_batches()
        if _validates_by(max_steps, cfg, batches):
            return
        first = first_validation_step(cfg, batches)
        problem = (f"the first validation comes at step {first} (trainer.val_check_interval, "
                   f"trainer.check_val_every_n_epoch, trainer.limit_train_batches, the epoch length) but "
                   f"trainer.max_steps={max_steps}")
    message = f"{problem}: no validation, so no best checkpoint, before training stops. {fix}"
    if cfg.test:
        raise ConfigError(message + "; or pass test=false")
    log.warning(message)
