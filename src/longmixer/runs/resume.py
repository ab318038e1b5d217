"""Starting a run in its directory: the lock, the config-drift check, the finished check and the checkpoint to
resume from.

The same command maps to the same run dir (`configs/hydra/default.yaml`), so re-running it continues the run:
- a second process on the same dir fails fast (`RunLockedError` names the lock file and the holder's PID/host);
- a run whose `results.json` says finished is not trained again;
- a changed config is refused (`ConfigDriftError` lists the keys) unless `resume=force`;
- the run resumes from `checkpoints/last.ckpt`, or from the newest intact checkpoint if that file is corrupt.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path

import yaml
from filelock import FileLock, Timeout
from omegaconf import DictConfig, OmegaConf

from longmixer.runs.checkpoints import (
    check_lightning_checkpoint,
    load_checkpoint,
    newest_intact,
    not_a_checkpoint_file,
)
from longmixer.utils.errors import UserFacingError

log = logging.getLogger("longmixer")

RESUME_MODES = ("auto", "never", "force")
STORED_CONFIG = "config_resolved.yaml"
# keys that do not change what a run computes: they may differ between the stored and the new config.
# `trainer.max_time` decides when a run stops, not what any step computes (the schedules follow max_steps /
# max_epochs), so a resumed run may be given a longer budget; Lightning restores the time already spent.
DRIFT_IGNORED = ("resume", "ckpt_path", "run_dir", "train", "test", "tags", "trainer.max_time", "paths.root_dir",
                 "paths.log_dir", "paths.output_dir", "logger", "callbacks.progress", "callbacks.summary",
                 "callbacks.lr_monitor", "callbacks.throughput", "callbacks.params", "callbacks.resume_step",
                 "trainer.enable_progress_bar", "trainer.enable_model_summary", "trainer.log_every_n_steps",
                 "data.num_workers")


class RunLockedError(UserFacingError, RuntimeError):
    """Another process holds the run dir's lock."""


class ResumeRefusedError(UserFacingError, ValueError):
    """`resume=never` for a run dir that holds checkpoints, or a `ckpt_path` that does not exist."""


class ConfigDriftError(UserFacingError, ValueError):
    """The resolved config differs from the one the run dir was started with."""


class HydraRecord:
    """The run dir's `.hydra/{config,hydra,overrides}.yaml`, kept as the record of the last attempt that ran.

    Hydra writes those files into the run dir before the task function starts, so every command that maps to the
    dir rewrites them, including one that is then refused (the dir locked by a running attempt, a changed config, a
    refused setting) or that finds the run finished. This attempt's files are read at start; `accept` writes them
    again (a concurrent refused command may have overwritten them meanwhile) and keeps a copy in
    `.hydra/accepted/`; `restore` puts that copy back for an attempt that did not run."""

    FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")

    def __init__(self, hydra_dir: Path | None):
        self.dir = hydra_dir
        self.kept = None if hydra_dir is None else hydra_dir / "accepted"
        self.own = {} if hydra_dir is None else {
            name: (hydra_dir / name).read_text() for name in self.FILES if (hydra_dir / name).is_file()}
        self.accepted = False

    def accept(self) -> None:
        for folder in (self.dir, self.kept):
            if folder is not None and self.own:
                folder.mkdir(parents=True, exist_ok=True)
                for name, text in self.own.items():
                    write_atomically(folder / name, text)
        self.accepted = True

    def restore(self) -> None:
        """Put back the record of the last attempt that ran (none: a run dir's first attempt, or one written by a
        version that kept no copy, keeps this attempt's files)."""
        if self.accepted or self.kept is None or not self.kept.is_dir():
            return
        for name in self.FILES:
            if (self.kept / name).is_file():
                write_atomically(self.dir / name, (self.kept / name).read_text())


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` by a rename, so a killed process leaves the old file or the new one, never a part."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class RunFileError(UserFacingError, ValueError):
    """A file of the run dir (results.json, config_resolved.yaml) cannot be parsed; the message names it."""


def read_run_file(path: Path, fix: str) -> dict:
    """The mapping in a run dir's JSON or YAML file (`.json`: JSON, else YAML, read safely).

    Raises:
        RunFileError: the file is no valid JSON / YAML mapping (cut short by a kill or a full disk, or edited); the
            message names it and `fix`.
    """
    text = path.read_text(errors="replace")
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as err:
        reason = " ".join(str(err).split())
        raise RunFileError(f"{path} cannot be read ({reason[:160]}); {fix}") from None
    if not isinstance(data, dict):
        raise RunFileError(f"{path} holds no mapping ({type(data).__name__}); {fix}")
    return data


class RunLock:
    """An exclusive lock on `<run_dir>/.lock` (released by the OS when the process dies, even on SIGKILL), with
    `<run_dir>/.lock.owner` naming the holder."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / ".lock"
        self.owner = run_dir / ".lock.owner"
        self._lock = FileLock(str(self.path), timeout=0)

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire()
        except Timeout:
            holder = self.owner.read_text().strip() if self.owner.exists() else "unknown"
            raise RunLockedError(f"run dir {self.path.parent} is in use: {self.path} is held by {holder}. Wait "
                                 "for that run, stop it, or pass run_tag=<name> to start a separate run") from None
        self.owner.write_text(f"pid {os.getpid()} on host {socket.gethostname()}\n")
        return self

    def release(self) -> None:
        if self._lock.is_locked:
            self.owner.unlink(missing_ok=True)
            self._lock.release()


def _normalize(value):
    """YAML-typed values compare by meaning: "2e-3" == 0.002 == 2.0e-3, 1 == 1.0."""
    if isinstance(value, str):
        try:
            value = yaml.safe_load(value) if value.strip() else value
        except yaml.YAMLError:
            return value
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                return value
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return float(value)
    return value


def _flatten(node, prefix: str = "") -> dict[str, object]:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    if isinstance(node, list):
        return {prefix[:-1]: [_normalize(v) for v in node]}
    return {prefix[:-1]: _normalize(node)}


def _ignored(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in DRIFT_IGNORED)


def _relocated(flat: dict[str, object], old_dir: object, new_dir: object) -> dict[str, object]:
    """`flat` with paths inside the run dir `old_dir` rewritten under `new_dir`: a run dir that was moved (copied to
    another machine, unpacked by `longmixer.runs.carry`) is the same run, and keys derived from `paths.output_dir`
    (`callbacks.checkpoint.dirpath`, `trainer.default_root_dir`) only say where it lies."""
    if not isinstance(old_dir, str) or not isinstance(new_dir, str) or not old_dir or old_dir == new_dir:
        return flat
    return {k: new_dir + v[len(old_dir):] if isinstance(v, str) and (v == old_dir or v.startswith(old_dir + "/"))
            else v for k, v in flat.items()}


def config_drift(stored: dict, current: dict) -> dict[str, tuple]:
    """`{key: (stored, current)}` for every result-changing key whose normalized value differs."""
    old, new = _flatten(stored), _flatten(current)
    old = _relocated(old, old.get("paths.output_dir"), new.get("paths.output_dir"))
    # a key present on one side only counts as null there (a key added with a null default changes nothing)
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
            if not _ignored(k) and old.get(k) != new.get(k)}


def check_config_drift(cfg: DictConfig, run_dir: Path) -> dict[str, tuple]:
    """Compare `cfg` with `<run_dir>/config_resolved.yaml`.

    Raises:
        ConfigDriftError: keys differ and resume is not `force` (the message lists them and the ways out).
    """
    path = run_dir / STORED_CONFIG
    if not path.exists():
        return {}
    stored = read_run_file(path, "restore it (the run's .hydra/ holds the config it was composed from, history/ "
                                 "earlier ones), or move it aside to record this command's config as the run's")
    drift = config_drift(stored, OmegaConf.to_container(cfg, resolve=True))
    if not drift:
        return {}
    listing = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in drift.items())
    if cfg.resume == "force":
        log.warning("resume=force: continuing %s with a changed config (%s)", run_dir, listing)
        return drift
    raise ConfigDriftError(f"the config differs from the one {run_dir} was started with ({path}): {listing}. Undo "
                           "the change, pass run_tag=<name> to start a separate run, or resume=force to continue "
                           "this run with the new values")


def keep_in_history(run_dir: Path, name: str) -> Path | None:
    """Move `<run_dir>/<name>` to `<run_dir>/history/<stem>.<UTC time><suffix>`; returns that path (None: no such
    file)."""
    path = run_dir / name
    if not path.exists():
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    kept = run_dir / "history" / f"{path.stem}.{stamp}{path.suffix}"
    kept.parent.mkdir(exist_ok=True)
    for n in range(1, 1000):
        if not kept.exists():
            break
        kept = kept.with_name(f"{path.stem}.{stamp}-{n}{path.suffix}")
    os.replace(path, kept)
    return kept


def keep_replaced_config(run_dir: Path) -> Path | None:
    """Before `resume=force` replaces the run's config_resolved.yaml with the changed one: keep the old file as
    `history/config_resolved.<UTC time>.yaml` (the config its earlier steps trained with). Returns that path."""
    kept = keep_in_history(run_dir, STORED_CONFIG)
    if kept is not None:
        log.info("resume=force: the config the run trained with so far is kept as %s", kept)
    return kept


def keep_finished_results(run_dir: Path) -> Path | None:
    """Before an attempt runs in a finished run dir (`resume=force`, or `ckpt_path=`): keep its results.json as
    `history/results.<UTC time>.json`. Left in place, it would say "finished" for a run whose attempt is then
    killed, and the same command would report those results instead of resuming. Returns that path."""
    kept = keep_in_history(run_dir, "results.json")
    if kept is not None:
        log.info("the results of the finished run are kept as %s; this attempt writes results.json again", kept)
    return kept


def finished_results(run_dir: Path) -> dict | None:
    """The run's results.json if it records a finished run."""
    path = run_dir / "results.json"
    if not path.exists():
        return None
    results = read_run_file(path, "move it aside: the same command then resumes the run from its checkpoints (or "
                                  "tests its best one) and writes it again")
    # "finished" from a version that also wrote it for test=false and fast_dev_run runs: only with test metrics
    tested = any(str(k).startswith("test/") for k in results.get("metrics") or {})
    return results if results.get("status") == "finished" and tested else None


def refuse_unusable_folders(argv: list[str]) -> None:
    """Before Hydra makes the run dir: refuse a log or data folder (`paths.log_dir=` / `paths.data_dir=` on the
    command line, else `$LONGMIXER_LOGS` / `$LONGMIXER_DATA`) under a path that is a file, which Hydra would meet in
    its own traceback. Prints one line and exits 2."""
    for key, env in (("paths.log_dir", "LONGMIXER_LOGS"), ("paths.data_dir", "LONGMIXER_DATA")):
        given = [a.split("=", 1)[1] for a in argv if a.startswith(f"{key}=")]
        value, source = (given[-1], key) if given else (os.environ.get(env), f"${env}")
        if not value or "${" in value:
            continue
        for folder in (Path(value), *Path(value).parents):
            if folder.exists():
                if not folder.is_dir():
                    print(f"error: {source}={value}: {folder} is a file, not a folder; point {source} at a folder",
                          file=sys.stderr)
                    raise SystemExit(2)
                break


def select_resume_checkpoint(cfg: DictConfig, run_dir: Path) -> str | None:
    """`ckpt_path` if given; else the run dir's newest intact checkpoint (normally `last.ckpt`) under
    resume=auto|force.

    Raises:
        FileNotFoundError: `ckpt_path` does not exist or is a directory.
        ValueError: unknown `resume`, or resume=never but the run dir already holds a checkpoint.
        CheckpointError: the checkpoint cannot be read safely.
        CheckpointAccessError: a checkpoint could not be read at all (permissions, an I/O error).
    """
    if cfg.resume not in RESUME_MODES:
        raise ValueError(f"resume={cfg.resume!r} is not one of {RESUME_MODES}")
    if cfg.ckpt_path is not None:
        path = Path(cfg.ckpt_path)
        why = not_a_checkpoint_file(path)
        if why is not None:
            raise ResumeRefusedError(f"ckpt_path={cfg.ckpt_path} {why}")
        check_lightning_checkpoint(load_checkpoint(path), path)  # refuse an unsafe or corrupt file before anything starts
        return str(path)
    ckpt_dir = run_dir / "checkpoints"
    if not ckpt_dir.is_dir() or not any(ckpt_dir.glob("*.ckpt")):
        return None
    if cfg.resume == "never":
        raise ResumeRefusedError(f"run dir {run_dir} already holds checkpoints in {ckpt_dir} (resume=never); pass "
                                 "resume=auto to continue that run (or report it, if it finished), or run_tag=<name> "
                                 "to start a separate run")
    path = newest_intact(ckpt_dir)
    if path is not None:
        log.info("resuming from %s", path)
    return None if path is None else str(path)
