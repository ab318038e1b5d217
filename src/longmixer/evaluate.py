"""Re-score a checkpoint on the validation and test splits (the reporting rule: test at the best validation
checkpoint, which train.py applies automatically).

    python -m longmixer.evaluate run_dir=logs/runs/chela/listops/<hash>_seed0
    python -m longmixer.evaluate run_dir=<run dir> ckpt_path=<run dir>/checkpoints/last.ckpt

With `run_dir`, the run's own `config_resolved.yaml` is used and the best checkpoint recorded in its results.json,
unless `ckpt_path` names another. Of the command line's overrides only the device keys (`trainer=<name>`,
`trainer.accelerator` / `devices` / `strategy` / `num_nodes` / `precision`) and `paths.data_dir` or `data.data_dir`
(the data on another machine) and `task.compile` (how the model is compiled, not what it computes: `none` where the
run's mode cannot compile here) apply; any other key is refused, since the checkpoint is scored with the config it
was trained with. The run's relative folders (`paths.*`, `data.*_dir`: `./data` by default) are read from the
directory it was trained from (Hydra's `hydra.runtime.cwd` in `<run_dir>/.hydra/hydra.yaml`), as train read them;
a folder given on this command line is relative to this one's. The metrics are written to
`<run_dir>/eval/<checkpoint name>/results.json` (a checkpoint from outside `<run_dir>/checkpoints` adds a short hash of
its path to the name: `eval/last-1a2b3c4d/`), and the results of an earlier evaluation there (the same file scored
again, e.g. a `last.ckpt` that has moved on) are kept in that folder's `history/results.<UTC time>.json`. This
command's Hydra log goes to `<run_dir>/eval/`; the training run's files are never touched.
Checkpoints are read with `weights_only=True`. A checkpoint records the model config it was trained with, and one
trained with another than the run's (LaS-chunk's scored as LaS: the same weight shapes) is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from longmixer.runs.checkpoints import (
    check_lightning_checkpoint,
    check_model_config,
    check_weights_fit,
    load_checkpoint,
    not_a_checkpoint_file,
    trusted_best_path,
)
from longmixer.runs.resume import keep_in_history, read_run_file, refuse_unusable_folders, write_atomically
from longmixer.runs.run import instantiate_node, to_number
from longmixer.utils.cli import quiet_on_closed_stdout
from longmixer.utils.compose import CONFIG_SEARCH_PATH, refuse_before_hydra, run_explaining_refusals
from longmixer.utils.compile import release_cuda_graphs
from longmixer.utils.config import validate_config
from longmixer.utils.errors import UserFacingError
from longmixer.utils.resolvers import register_resolvers

log = logging.getLogger("longmixer")


class EvaluateError(UserFacingError, FileNotFoundError):
    """A run dir or checkpoint that evaluate cannot use; the message names it and the fix."""


# the trainer keys that say where and how the evaluation runs, which this invocation may change (the run's other
# trainer keys stay as trained)
DEVICE_KEYS = ("accelerator", "devices", "strategy", "num_nodes", "precision")
# how the model is compiled for this machine: the mode a GPU run trained with may not compile on another (Inductor
# on a CPU needs a C++ compiler), and CompileFailedError's fix is this key
COMPILE_KEY = "task.compile"


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def _device_overrides(overrides: list[str]) -> tuple[bool, set[str]]:
    """From this invocation's command-line overrides: whether it chose a `trainer=<name>` group, and which
    `trainer.<key>=` device keys it set."""
    keys = [_key(o) for o in overrides]
    return "trainer" in keys, {k.split(".", 1)[1] for k in keys if k.startswith("trainer.")} & set(DEVICE_KEYS)


# what else an evaluation's command line may hold: its own inputs, and keys that change nothing it computes
OWN_KEYS = ("run_dir", "ckpt_path", "hydra", "paths.log_dir", "paths.data_dir", "data.data_dir",
            "trainer.enable_progress_bar")



def _refuse_unused(overrides: list[str]) -> None:
    """Refuse overrides that would be silently ignored: the checkpoint is scored with the run's stored config."""
    unused = []
    for override in overrides:
        key = _key(override)
        device = key == "trainer" or (key.startswith("trainer.") and key.split(".", 1)[1] in DEVICE_KEYS)
        if not device and key != COMPILE_KEY and not any(key == k or key.startswith(f"{k}.") for k in OWN_KEYS):
            unused.append(override)
    if unused:
        raise EvaluateError(f"evaluate scores the checkpoint with the run's own config (config_resolved.yaml), so "
                            f"{' '.join(unused)} would not apply; drop it. The command line may set run_dir, "
                            f"ckpt_path, paths.data_dir (or data.data_dir), {COMPILE_KEY} and the device: trainer=<name>, "
                            f"trainer.{{{','.join(DEVICE_KEYS)}}}")


def _run_config(run_dir: Path, cfg: DictConfig, overrides: list[str] = ()) -> DictConfig:
    """The run's stored config with this invocation's `trainer.*` device keys (`trainer=cpu`, or
    `trainer.accelerator=...`: a run trained on a GPU re-scored on a CPU), `task.compile` and `ckpt_path` on top."""
    path = run_dir / "config_resolved.yaml"
    if not path.is_file():
        raise EvaluateError(f"run_dir={run_dir} holds no config_resolved.yaml; pass a run dir made by train "
                            "(logs/runs/<run name>/<hash>_seed<seed>)")
    _refuse_unused(list(overrides))
    stored = OmegaConf.create(read_run_file(path, "restore it from the run's .hydra/ or history/ records"))
    group, keys = _device_overrides(list(overrides))
    with open_dict(stored):
        stored.ckpt_path = cfg.ckpt_path
        given = {_key(o) for o in overrides}
        _anchor_relative_folders(stored, run_dir, given)
        if "data.data_dir" in given:
            stored.data.data_dir = cfg.data.data_dir
        elif "paths.data_dir" in given:  # the data folder of the machine the run trained on, moved
            if stored.data.get("data_dir") != stored.paths.get("data_dir"):
                raise EvaluateError(f"the run read its data from data.data_dir={stored.data.get('data_dir')}, not "
                                    "from paths.data_dir; pass data.data_dir=<folder> instead")
            stored.paths.data_dir = stored.data.data_dir = cfg.paths.data_dir
        if COMPILE_KEY in given:
            stored.task.compile = cfg.task.compile
        stored.logger = None
        stored.callbacks = None
        for key in DEVICE_KEYS if group else sorted(keys):
            if key in cfg.trainer:
                stored.trainer[key] = cfg.trainer[key]
            elif group:
                stored.trainer.pop(key, None)  # the chosen trainer leaves it at Lightning's default
    return stored


def _anchor_relative_folders(stored: DictConfig, run_dir: Path, given: set[str]) -> None:
    """Make the run's relative folders (`paths.*`, `data.*_dir`) absolute against the directory it was trained from:
    train reads them relative to its working directory (hydra.job.chdir=false), which may not be this one's, where
    `./data` is missing or holds other data of the same task. The folders given on this command line are replaced
    afterwards and stay relative to this one's."""
    overridden = given | ({"data.data_dir"} if "paths.data_dir" in given else set())
    relative = [(group, key) for group in ("paths", "data") for key, value in (stored.get(group) or {}).items()
                if (group == "paths" or key.endswith("_dir")) and isinstance(value, str) and value
                and not Path(value).expanduser().is_absolute() and f"{group}.{key}" not in overridden]
    if not relative:
        return
    record = run_dir / ".hydra" / "hydra.yaml"
    recorded = read_run_file(record, "pass paths.data_dir=<folder> to name the run's data") if record.is_file() else {}
    cwd = (recorded.get("hydra") or {}).get("runtime", {}).get("cwd")
    if cwd and Path(cwd).is_dir():
        for group, key in relative:
            stored[group][key] = str(Path(cwd) / stored[group][key])
        return
    why = (f"{cwd}, where the run was trained, no longer exists" if cwd else
           f"{record} does not record where the run was trained")
    names = " ".join(f"{group}.{key}={stored[group][key]}" for group, key in relative)
    log.warning("%s: the relative %s is read from this directory (%s); pass paths.data_dir=<folder> (or "
                "data.data_dir=<folder>) to name the run's data", why, names, Path.cwd())


def evaluate(cfg: DictConfig) -> dict[str, float]:
    """Validate and test one checkpoint; writes `<run_dir>/eval/<checkpoint stem>[-<path hash>]/results.json`."""
    run_dir = Path(cfg.run_dir) if cfg.get("run_dir") else None
    if run_dir is None:
        raise EvaluateError("evaluate needs run_dir=<a training run dir>; it reads that run's config and writes "
                            "under <run_dir>/eval/")
    run_cfg = _run_config(run_dir, cfg, _invocation_overrides())
    validate_config(run_cfg)
    ckpt_dir = run_dir / "checkpoints"
    if cfg.ckpt_path is not None:
        ckpt = Path(cfg.ckpt_path)
        why = not_a_checkpoint_file(ckpt)
        if why is not None:
            raise EvaluateError(f"ckpt_path={cfg.ckpt_path} {why}; the run's checkpoints are in {ckpt_dir}")
    else:
        results = run_dir / "results.json"
        recorded = read_run_file(results, f"pass ckpt_path=<file.ckpt> (the run's checkpoints are in {ckpt_dir})"
                                 ) if results.is_file() else {}
        best = recorded.get("best_ckpt")
        if not best:
            # a run killed before its test, or trained with test=false: its best validation checkpoint so far is
            # the one to score (the reporting rule), not last.ckpt
            why = f"its status: {recorded['status']}" if recorded.get("status") else "the run has not finished"
            kept = sorted(ckpt_dir.glob("best-*.ckpt"))
            example = f"{kept[-1]} (its best validation checkpoint so far)" if kept else ckpt_dir / "last.ckpt"
            raise EvaluateError(f"{results} records no best checkpoint ({why}); pass ckpt_path=<file.ckpt>, e.g. "
                                f"{example}")
        moved = ckpt_dir / Path(best).name
        if Path(best).resolve().parent != ckpt_dir.resolve() and moved.is_file():
            best = str(moved)  # the run dir was moved (another machine or root) after results.json was written
        ckpt = Path(trusted_best_path(best, ckpt_dir))
    state = load_checkpoint(ckpt)  # refuse a corrupt or unsafe file before building anything
    check_lightning_checkpoint(state, ckpt)
    out_dir = run_dir / "eval" / _eval_name(ckpt, run_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open_dict(run_cfg):
        run_cfg.trainer.default_root_dir = str(out_dir)
        run_cfg.trainer.logger = False
        run_cfg.trainer.enable_progress_bar = False
        run_cfg.trainer.enable_model_summary = False
    datamodule = instantiate_node(run_cfg.data)
    task = instantiate_node(run_cfg.task)
    check_weights_fit(task, state, ckpt, f"pass a checkpoint of this run ({run_dir / 'checkpoints'}) or the "
                      f"run_dir of the run that wrote it (the model is {run_dir / 'config_resolved.yaml'}'s)")
    writer = ckpt.resolve().parent.parent
    if writer == run_dir.resolve():  # the run's config changed after it was written (resume=force)
        fix = f"the run's earlier config is in {run_dir / 'history'}; score another of its checkpoints"
    else:
        fix = ("score it with the config of the run that wrote it: run_dir="
               f"{writer if (writer / 'config_resolved.yaml').is_file() else '<that run dir>'}")
    check_model_config(state, OmegaConf.to_container(run_cfg.model, resolve=True), ckpt,
                       str(run_dir / "config_resolved.yaml"), fix)
    del state
    trainer = instantiate_node(run_cfg.trainer, callbacks=[])
    metrics: dict[str, float] = {}
    for result in trainer.validate(task, datamodule=datamodule, ckpt_path=str(ckpt), weights_only=True,
                                   verbose=False):
        metrics.update({k: to_number(v) for k, v in result.items()})
    for result in trainer.test(task, datamodule=datamodule, ckpt_path=str(ckpt), weights_only=True, verbose=False):
        metrics.update({k: to_number(v) for k, v in result.items()})
    kept = keep_in_history(out_dir, "results.json")  # the same file scored before (last.ckpt, since moved on)
    if kept is not None:
        log.info("the results of the earlier evaluation in %s are kept as %s", out_dir, kept)
    write_atomically(out_dir / "results.json", json.dumps({"ckpt_path": str(ckpt), "metrics": metrics}, indent=2))
    log.info("evaluation of %s: %s", ckpt, metrics)
    return metrics


def _eval_name(ckpt: Path, run_dir: Path) -> str:
    """The folder under `<run_dir>/eval/` for `ckpt`: the run's own checkpoints by name (`best-000200`), one from
    elsewhere with a short hash of its resolved path too (`last-1a2b3c4d`), so two runs' `last.ckpt` never share
    one results.json."""
    resolved = ckpt.resolve()
    if resolved.parent == (run_dir / "checkpoints").resolve():
        return ckpt.stem
    return f"{ckpt.stem}-{hashlib.sha1(str(resolved).encode()).hexdigest()[:8]}"


def _invocation_overrides() -> list[str]:
    """The command line's overrides (Hydra's record of them; none outside a Hydra app, e.g. in tests)."""
    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


@hydra.main(version_base="1.3", config_path=CONFIG_SEARCH_PATH, config_name="train")
def _main(cfg: DictConfig) -> dict[str, float] | None:
    try:
        return evaluate(cfg)  # the metrics: a sweep's summary reads the monitored one
    except UserFacingError as err:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            raise  # the sweep records the failed job and goes on
        log.error("%s", err)
        sys.exit(2)
    finally:
        release_cuda_graphs()  # before Lightning's exit handler destroys the process group


@quiet_on_closed_stdout
def main() -> None:
    refuse_before_hydra(sys.argv[1:])
    refuse_unusable_folders(sys.argv[1:])
    register_resolvers()
    # Hydra's own output (its log, .hydra/) goes to <run_dir>/eval too, never into a training run dir
    run_dirs = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("run_dir=")]
    if run_dirs:
        swept = "," in run_dirs[-1] or run_dirs[-1].startswith(("glob(", "choice(", "range("))
        if swept and not Path(run_dirs[-1]).exists():
            # its logs and summary go under the one run dir's eval/ (Hydra's sweep dir is one folder)
            print(f"error: run_dir={run_dirs[-1]}: evaluate sweeps (-m) the checkpoints or devices of one run dir "
                  "(ckpt_path=<a>,<b>, trainer.devices=0,1); score several runs with one command per run dir "
                  "(for d in <run dir> <run dir>; do longmixer-evaluate run_dir=$d; done)", file=sys.stderr)
            sys.exit(2)
        if not (Path(run_dirs[-1]) / "config_resolved.yaml").is_file():  # before Hydra makes <run_dir>/eval
            print(f"error: run_dir={run_dirs[-1]} is not a training run dir (no config_resolved.yaml there); "
                  "pass one made by train (logs/runs/<run name>/<hash>_seed<seed>)", file=sys.stderr)
            sys.exit(2)
        eval_dir = Path(run_dirs[-1]) / "eval"
        sys.argv += [f"hydra.run.dir={eval_dir}"]
        # a sweep's jobs (`-m`) keep their Hydra output there too, not in new dirs under logs/runs
        if not any(a.startswith("hydra.sweep.dir=") for a in sys.argv[1:]):
            sys.argv += [f"hydra.sweep.dir={eval_dir / 'sweeps'}/${{now:%Y-%m-%d_%H-%M-%S-%f}}"]
        if not any(a.startswith("hydra.sweep.subdir=") for a in sys.argv[1:]):
            sys.argv += ["hydra.sweep.subdir=${hydra.job.num}"]
    run_explaining_refusals(_main, sys.argv[1:])


if __name__ == "__main__":
    main()
