"""The datamodule base: prepared-data layout, manifests, padding collate and resumable, epoch-seeded loaders.

`prepare_data()` runs on rank 0 behind a file lock and writes `<data_dir>/<name>/` with a `manifest.json`;
`setup()` only reads and raises `DatasetNotPreparedError` naming the command that prepares the data.

Integrity (docs/data.md): the manifest records every file's sha256 and every array's shape and dtype, plus a
digest of its own content. `setup()` runs the cheap checks on every run (`integrity.check_prepared`: manifest
digest, shapes, dtypes, counts, label histograms, label and token ranges); `verify()` re-hashes every file
(`prepare_data.py` calls it). The settings that determine the prepared files (`prepare_fingerprint`, plus
`source_dir`) are stored in the manifest: other settings rebuild the data in `prepare_data()` and are refused in
`setup()`.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import io
import json
import logging
import multiprocessing
import os
import shutil
import signal
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from filelock import FileLock
from torch.utils.data import DataLoader, Dataset, Sampler

from longmixer.data.download import SHORT_WRITE, is_no_space
from longmixer.data.integrity import (DataIntegrityError, DatasetNotPreparedError, check_prepared, sha256_of,
                                      verify_files, warn_truncated)
from longmixer.utils.errors import UserFacingError
from longmixer.utils.signals import STOP_SIGNALS

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)
SET_ASIDE = ".previous"  # the prepared files of other settings, kept while a rebuild runs
MANIFEST = "manifest.json"
MANIFEST_VERSION = 2
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)  # what writing into a read-only data folder raises


def default_num_workers(gpu: bool) -> int:
    """DataLoader workers when the config leaves `num_workers` null: min(8, CPUs) when a GPU consumes the batches
    (decoding must not starve it), 0 on CPU (workers would compete with the model for the same cores)."""
    return min(8, os.cpu_count() or 1) if gpu else 0


def init_worker(worker_id: int) -> None:
    """DataLoader `worker_init_fn`: the workers leave the stop signals (SIGTERM, SIGINT, SLURM's pre-timeout SIGUSR2:
    `utils.signals`) to the training process, and end with it.

    SLURM (`scancel`, the time limit and its `--signal` warning), coreutils' `timeout` and Ctrl+C in a terminal
    signal every process of the job or the process group. A worker that died of the signal made the training process
    fail mid-step ("DataLoader worker ... is killed by signal: Terminated", seen on a GPU run) instead of
    checkpointing and exiting 143 / 140 / 130. The workers still end with the run: the loader shuts them down.

    A training process killed outright (SIGKILL: the OOM killer, a scheduler's kill after its grace period) cannot
    shut them down. torch's workers watch for it by comparing their parent's pid with the one they saw at start-up,
    but they read it after this function: a kill while the workers start (the LM loader starts new ones every epoch)
    left workers that took pid 1 for their parent and waited forever, holding the run's log and the pipes of whoever
    started the run (a test runner waiting for the output hung on them). So on Linux each worker asks the kernel to
    kill it when its parent dies (`PR_SET_PDEATHSIG`; the signal follows the thread that forked it, the one iterating
    the loader), and one whose parent is already gone exits here."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is None:  # not a multiprocessing child (called in the main process)
        return
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent.pid:  # the parent died before the request above
        os._exit(0)


def default_data_dir() -> Path:
    """`$LONGMIXER_DATA` if set, else `./data`."""
    return Path(os.environ.get("LONGMIXER_DATA", "data"))


def manifest_digest(manifest: Mapping[str, Any]) -> str:
    """sha256 of the manifest's content (its `digest` key excluded): an edited manifest no longer matches it."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_manifest(root: Path, splits: Mapping[str, Mapping[str, Any]], meta: Mapping[str, Any],
                   check: Callable[[dict], None] | None = None) -> dict:
    """Write `root/manifest.json`: per split counts and label balance, the config that made the data, a sha256 of
    every file in `root` (the manifest itself excluded), the shape and dtype of every `.npy` array, and a digest
    of all of it. Written last and atomically, so a manifest means the data is complete; `check`, given the manifest
    before it is written, may refuse it by raising (then nothing is written)."""
    tmp = root / (MANIFEST + ".tmp")
    # a scratch copy left by a kill while an earlier manifest was written: not data, and the rename below removes
    # it, so listing it would make the new manifest name a file that is gone
    tmp.unlink(missing_ok=True)
    paths = [p for p in sorted(root.iterdir()) if p.is_file() and p.name not in (MANIFEST, ".lock")]
    files = {p.name: sha256_of(p) for p in paths}
    arrays = {}
    for p in paths:
        if p.suffix == ".npy":
            array = np.load(p, mmap_mode="r", allow_pickle=False)
            arrays[p.name] = {"shape": list(array.shape), "dtype": array.dtype.str}
    manifest = {"version": MANIFEST_VERSION, "splits": json.loads(json.dumps(splits)), "meta": dict(meta),
                "files": files, "arrays": arrays}
    manifest["digest"] = manifest_digest(manifest)
    if check is not None:
        check(manifest)
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    os.replace(tmp, root / MANIFEST)
    return manifest


def _file_being_written(err: BaseException) -> str | None:
    """The name of the file that the innermost frame of `err`'s traceback was writing (a local that is a file open
    for writing): numpy's short write (`SHORT_WRITE`) names no file, but `np.save` holds the one it fills."""
    frames = []
    tb = err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        for value in frame.f_locals.values():
            if isinstance(value, (io.BufferedWriter, io.FileIO)) and "r" not in getattr(value, "mode", "r"):
                return str(value.name)
    return None


def _prepared_files(root: Path) -> list[Path]:
    """The prepared files of `root`: its top-level files (the arrays and the manifest; downloads live in folders)."""
    return [p for p in root.iterdir() if p.is_file() and p.name != ".lock"]


# Setting the prepared files of other settings aside while a rebuild runs, and putting them back, in steps that a
# kill may stop anywhere and a rerun (under the task's lock) finishes: the top-level manifest is the last file moved
# in and the first moved out, so a manifest at the top level always lies over complete files (the fast path of
# `prepare_data` reads it without the lock); `.previous/.names` lists the files set aside, so a restore can tell
# them from what the unfinished rebuild wrote.
NAMES = ".names"


def _set_prepared_aside(root: Path, aside: Path) -> None:
    """Move the prepared files into `aside`, the manifest first: renames, so a run still reading the old arrays
    through memory maps keeps reading them."""
    files = _prepared_files(root)
    aside.mkdir()
    (aside / NAMES).write_text("\n".join(p.name for p in files) + "\n")
    for path in sorted(files, key=lambda p: p.name != MANIFEST):
        os.replace(path, aside / path.name)


def _restore_prepared(root: Path, aside: Path) -> None:
    """Undo `_set_prepared_aside`: the old files back over what an unfinished rebuild wrote, its other files
    removed, the old manifest last."""
    if (aside / MANIFEST).exists():
        (root / MANIFEST).unlink(missing_ok=True)
    names = {p.name for p in aside.iterdir()}  # the files still set aside, and those already moved back:
    names |= set((aside / NAMES).read_text().split()) if (aside / NAMES).exists() else set()
    for path in aside.iterdir():
        if path.name not in (NAMES, MANIFEST):
            os.replace(path, root / path.name)
    for path in _prepared_files(root):
        if path.name not in names and path.name != MANIFEST:
            path.unlink()
    if (aside / MANIFEST).exists():
        os.replace(aside / MANIFEST, root / MANIFEST)
    _discard(aside)


def _discard(folder: Path) -> None:
    """Delete `folder` by first renaming it out of `SET_ASIDE`'s name, so that a kill midway leaves a
    `.discard-*` folder that nothing reads (the next locked run deletes it) rather than half a `.previous`."""
    doomed = folder.with_name(f".discard-{folder.name.lstrip('.')}-{os.getpid()}")
    os.replace(folder, doomed)
    shutil.rmtree(doomed)


def read_manifest(root: Path, prepare_hint: str) -> dict:
    path = root / MANIFEST
    if not path.exists():
        raise DatasetNotPreparedError(f"no prepared data at {root} (missing {MANIFEST}); prepare it with "
                                      f"`{prepare_hint}`")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataIntegrityError(f"{path} is not valid JSON ({err}); re-run "
                                 f"`{prepare_hint}`") from None
    version = manifest.get("version") if isinstance(manifest, dict) else None
    if version != MANIFEST_VERSION:
        raise DataIntegrityError(f"{path} has manifest version {version}, this code reads version {MANIFEST_VERSION}; "
                                 f"re-run `{prepare_hint}`, which prepares the data again")
    if manifest.get("digest") != manifest_digest(manifest):
        raise DataIntegrityError(f"{path} was edited after it was written (its digest no longer matches its "
                                 f"content); re-run `{prepare_hint}`, which prepares the data again")
    missing = [name for name in manifest["files"] if not (root / name).exists()]
    if missing:
        raise DatasetNotPreparedError(f"prepared data at {root} is incomplete (missing {missing[:3]}); re-run "
                                      f"`{prepare_hint}`")
    return manifest


def label_counts(labels: Sequence[int] | np.ndarray) -> dict[str, int]:
    values, counts = np.unique(np.asarray(labels), return_counts=True)
    return {str(int(v)): int(c) for v, c in zip(values, counts)}


# --- prepared storage: ragged token sequences (concatenated + offsets) and fixed-size arrays, both memory-mapped ---

def save_ragged(root: Path, split: str, sequences: Sequence[np.ndarray], labels: Sequence[int] | None,
                dtype=np.int32) -> None:
    lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    flat = np.concatenate([np.asarray(s, dtype=dtype) for s in sequences]) if sequences else np.zeros(0, dtype)
    np.save(root / f"{split}.tokens.npy", flat)
    np.save(root / f"{split}.offsets.npy", offsets)
    if labels is not None:
        np.save(root / f"{split}.labels.npy", np.asarray(labels, dtype=np.int64))


class RaggedDataset(Dataset):
    """Memory-mapped variable-length token sequences with labels; items are `{"inputs", "labels"}`."""

    def __init__(self, root: Path, split: str, max_len: int | None = None):
        self.tokens = np.load(root / f"{split}.tokens.npy", mmap_mode="r")
        self.offsets = np.load(root / f"{split}.offsets.npy")
        self.labels = np.load(root / f"{split}.labels.npy")
        self.max_len = max_len
        if max_len is not None:
            warn_truncated(f"{root.name} {split}", np.diff(self.offsets), max_len)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        seq = np.asarray(self.tokens[self.offsets[i]:self.offsets[i + 1]], dtype=np.int64)
        if self.max_len is not None:
            seq = seq[:self.max_len]
        return {"inputs": torch.from_numpy(seq), "labels": torch.tensor(int(self.labels[i]))}


def padded_length(longest: int, multiple: int | None, cap: int | None) -> int:
    """`longest` rounded up to a multiple of `multiple` (None: not rounded), at most `cap` (but never below
    `longest`)."""
    if not multiple:
        return longest
    length = -(-longest // multiple) * multiple
    return max(longest, min(length, cap)) if cap else length


def pad_collate(items: list[dict[str, torch.Tensor]], pad_value: float = 0, pad_to: int | None = None,
                multiple: int | None = None, cap: int | None = None, full_mask: bool = True) -> dict[str, torch.Tensor]:
    """Stack items, right-padding every sequence key (`inputs`, `inputs2`, `targets`) to the batch maximum (or
    `pad_to`; with `multiple`, the maximum rounded up to a multiple of it, at most `cap`) and adding `mask` /
    `mask2` (True = real token).

    `full_mask=False` leaves a key's mask out where none of its sequences was padded: the models then take their
    unmasked paths, which are the faster ones (PyTorch's fused attention takes 1.4-1.6x longer with an all-true mask,
    and a causal Transformer with a mask builds an [L, L] one instead of using `is_causal`; docs/benchmarks.md).
    Fixed-length tasks collate so; variable-length ones keep the mask in every batch, so that its presence does not
    change from batch to batch (a compiled model would compile again and record other CUDA graphs)."""
    batch: dict[str, torch.Tensor] = {}
    for key in items[0]:
        values = [item[key] for item in items]
        if key in ("inputs", "inputs2", "targets"):
            length = pad_to or padded_length(max(v.shape[0] for v in values), multiple, cap)
            fill = -100 if key == "targets" else pad_value
            out = torch.full((len(values), length, *values[0].shape[1:]), fill, dtype=values[0].dtype)
            mask = torch.zeros(len(values), length, dtype=torch.bool)
            for i, v in enumerate(values):
                n = min(v.shape[0], length)
                out[i, :n] = v[:n]
                mask[i, :n] = True
            batch[key] = out
            if key != "targets" and (full_mask or any(v.shape[0] < length for v in values)):
                batch["mask" if key == "inputs" else "mask2"] = mask
        else:
            batch[key] = torch.stack(values)
    return batch


# --- resumable, epoch-seeded loading -----------------------------------------------------------------------------

class EpochSampler(Sampler[int]):
    """Shuffles with a generator seeded by (seed, epoch) so the order of an epoch never depends on what ran
    before it, shards by DDP rank, and can skip the indices of batches already consumed (mid-epoch resume)."""

    def __init__(self, size: int, seed: int, shuffle: bool, rank: int = 0, world_size: int = 1):
        self.size, self.seed, self.shuffle, self.rank, self.world_size = size, seed, shuffle, rank, world_size
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _indices(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            order = torch.randperm(self.size, generator=g).tolist()
        else:
            order = list(range(self.size))
        if self.world_size > 1:
            per_rank = -(-self.size // self.world_size)
            order = (order + order[:per_rank * self.world_size - self.size])[self.rank::self.world_size]
        return order

    def __iter__(self) -> Iterator[int]:
        order, self.skip = self._indices()[self.skip:], 0
        return iter(order)

    def __len__(self) -> int:
        return -(-self.size // self.world_size) if self.world_size > 1 else self.size


def epoch_complete(consumed: int, pass_batches: int, epoch_batches: int | None) -> bool:
    """Whether a resumable training loader that handed out `consumed` batches of its epoch has finished it: the
    whole pass, or the `epoch_batches` Lightning takes under `trainer.limit_train_batches` (`ResumableLoader`,
    `LMStreamLoader`). The next pass then starts the next epoch."""
    return consumed >= (pass_batches if epoch_batches is None else min(pass_batches, epoch_batches))


class ResumableLoader(DataLoader):
    """A DataLoader whose position (epoch, batches consumed) is saved in checkpoints (Lightning's `state_dict`
    protocol), so a run killed anywhere resumes on the next unseen batch.

    The loader counts its own epochs: a pass that consumed every batch moves the next pass to the next epoch. It
    does not follow the epoch Lightning passes to `sampler.set_epoch`, which after a resume from an end-of-epoch
    checkpoint is one ahead (Lightning 2.6) and would train on the wrong epoch's order.

    Kept instead of torchdata's StatefulDataLoader: with the seeded EpochSampler, (epoch, batches consumed) already
    reproduces the order exactly, and the core install stays without torchdata."""

    def __init__(self, dataset: Dataset, sampler: EpochSampler, epoch_batches: int | None = None, **kwargs):
        super().__init__(dataset, sampler=sampler, **kwargs)
        # the batches Lightning takes an epoch when `trainer.limit_train_batches` cuts it short: each epoch is then
        # that many batches of a fresh pass, as without this loader (continuing the pass gave short epochs, which
        # skipped the epoch's scheduled validation and, under accumulation, lost a batch's gradients)
        self.epoch_batches = epoch_batches
        self._epoch, self._consumed = 0, 0

    def __iter__(self):
        if epoch_complete(self._consumed, len(self), self.epoch_batches):
            self._epoch, self._consumed = self._epoch + 1, 0
        if isinstance(self.sampler, EpochSampler):  # not a sampler Lightning put in (trainer.overfit_batches)
            self.sampler.set_epoch(self._epoch)
            self.sampler.skip = self._consumed * self.batch_size
        for batch in super().__iter__():
            self._consumed += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "consumed": self._consumed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self._epoch, self._consumed = int(state["epoch"]), int(state["consumed"])


class SequenceDataModule(pl.LightningDataModule):
    """Base of every task's datamodule.

    Subclasses set `name`, implement `_prepare(root)` (download or generate into `root`, return
    `(splits, meta)` for the manifest) and `_load(root, manifest)` (return a dict split -> Dataset), and may
    override `collate`.

    Args:
        data_dir: where prepared data lives (`${paths.data_dir}`: `$LONGMIXER_DATA` or `./data`).
        batch_size: per-device training batch size; evaluation uses `eval_batch_size` (default the same).
        num_workers: DataLoader workers; None: `default_num_workers()` (min(8, CPUs) with a GPU, 0 without).
        seed: shuffling seed (the run's `seed`); `split_seed` freezes train/val splits where the task makes them.
        pin_memory: page-locked batches for faster host-to-GPU copies; None: on when a GPU is present.
        persistent_workers: keep worker processes between epochs (only with num_workers > 0); None: on.
    """

    name = "base"
    # True where examples differ in length (ListOps, Text, Retrieval): each batch is padded to its own longest
    # unless `pad_multiple` is set, and carries a key mask. Fixed-length tasks' batches carry none (`pad_collate`).
    variable_length = False

    @property
    def few_shapes(self) -> bool:
        """Whether batches come in a handful of shapes: what `task.compile=auto` needs to choose CUDA graphs."""
        return not self.variable_length or self.pad_multiple is not None

    def __init__(self, data_dir: str | Path | None = None, batch_size: int = 32, eval_batch_size: int | None = None,
                 num_workers: int | None = None, seed: int = 0, split_seed: int = 0, pin_memory: bool | None = None,
                 persistent_workers: bool | None = None, pad_multiple: int | None = None):
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"data.batch_size={batch_size} must be >= 1")
        if eval_batch_size is not None and eval_batch_size < 1:
            raise ValueError(f"data.eval_batch_size={eval_batch_size} must be >= 1 (or null: data.batch_size)")
        if pad_multiple is not None and pad_multiple < 1:
            raise ValueError(f"data.pad_multiple={pad_multiple} must be >= 1 (or null: pad to the batch's longest)")
        # variable-length batches padded to a multiple of this many tokens (at most data.seq_len): a handful of
        # shapes instead of one per batch, which compiled and CUDA-graph runs need (task.compile=reduce-overhead
        # records one graph per shape)
        self.pad_multiple = pad_multiple
        if num_workers is not None and num_workers < 0:
            raise ValueError(f"data.num_workers={num_workers} must be >= 0 (or null for the default)")
        self.data_dir = Path(data_dir) if data_dir is not None else default_data_dir()
        self.batch_size = batch_size
        self.eval_batch_size = batch_size if eval_batch_size is None else eval_batch_size
        gpu = torch.cuda.is_available()
        self.num_workers = default_num_workers(gpu) if num_workers is None else num_workers
        self.pin_memory = gpu if pin_memory is None else pin_memory
        self.persistent_workers = self.num_workers > 0 and (persistent_workers is not False)
        self.seed, self.split_seed = seed, split_seed
        self.datasets: dict[str, Dataset] = {}
        self.manifest: dict | None = None

    @property
    def root(self) -> Path:
        return self.data_dir / self.name

    @property
    def prepare_hint(self) -> str:
        return self._prepare_command(self.name)

    def _prepare_command(self, task: str) -> str:
        """The `prepare_data.py` command for this data: the settings that determine the prepared files
        (`prepare_fingerprint`, whose keys are the config's) and `source_dir` with it, or the command would prepare
        the defaults (another Pathfinder difficulty, other document lengths) and leave this data as it was."""
        settings = "".join(f" data.{key}={value}" for key, value in self.prepare_fingerprint().items())
        source = getattr(self, "source_dir", None)
        extra = "" if source is None else f" data.source_dir={source}"
        return f"python scripts/prepare_data.py {task} paths.data_dir={self.data_dir}{settings}{extra}"

    def prepare_fingerprint(self) -> dict[str, Any]:
        """The config values that determine the prepared files; a manifest made with others is rebuilt."""
        return {}

    def note_old_layout(self, old: Path, key: str) -> None:
        """Warn, while preparing, that data prepared in `old` itself (before each `key` had its own folder under it)
        is no longer read: it is prepared again in `root`, from the downloads or images already there."""
        if (old / MANIFEST).exists():
            log.warning("%s holds %s data prepared before each %s had its own folder; it is no longer read, and the "
                        "data is prepared again in %s (what it is made from is reused); the old %s and .npy files "
                        "directly in %s may be deleted", old, self.name, key, self.root, MANIFEST, old)

    def fingerprint(self) -> dict[str, Any]:
        """`prepare_fingerprint()` plus the resolved `source_dir` (None: the task's download or generator)."""
        source = getattr(self, "source_dir", None)
        return {**self.prepare_fingerprint(),
                "source_dir": None if source is None else str(Path(source).expanduser().resolve())}

    def _stale(self, meta: Mapping[str, Any]) -> dict[str, tuple]:
        # a json round trip, so that tuples compare equal to the lists the manifest holds
        wanted = json.loads(json.dumps(self.fingerprint()))
        return {k: (meta.get(k), v) for k, v in wanted.items() if meta.get(k) != v}

    def _manifest_staleness(self) -> dict[str, tuple] | None:
        """None where no manifest exists; else what differs between it and the requested settings (empty: it is
        current). A manifest that `setup()` would refuse (unreadable, of another version, edited, or listing a file
        that is gone) counts as stale under the key `manifest.json`: taken as current, it was never rebuilt, and
        the command that `setup()` names to fix it did nothing."""
        if not (self.root / MANIFEST).exists():
            return None
        try:
            manifest = read_manifest(self.root, self.prepare_hint)
        except DatasetNotPreparedError as err:
            return {MANIFEST: (str(err).split("; ")[0], "complete")}
        return self._stale(manifest.get("meta", {}))

    def prepare_data(self) -> None:
        # data that is already prepared needs no lock: a shared, read-only copy can be trained on
        if self._manifest_staleness() == {}:
            return
        try:
            self._prepare_locked()
        except OSError as err:
            if isinstance(err, UserFacingError):
                raise
            if is_no_space(err):
                raise self._no_space(err) from None
            if err.errno not in NOT_WRITABLE:
                raise
            raise self._not_writable(err) from None

    def _no_space(self, err: OSError) -> DatasetNotPreparedError:
        """The one-line error for a disk that filled up while the data was prepared (the LRA release takes about
        27 GB with every part unpacked, archive included; Speech Commands about 6 GB). What was written is redone or
        resumed by the next run."""
        short = SHORT_WRITE.fullmatch(str(err)) if err.errno is None else None
        path = err.filename or (_file_being_written(err) if short else None)
        where = f" ({path})" if path else ""
        what = (f"No space left on device (a write of {short[1]} bytes stopped after {short[2]})" if short else
                err.strerror)
        command = self.prepare_hint.replace(f"paths.data_dir={self.data_dir}", "paths.data_dir=<folder with room>")
        return DatasetNotPreparedError(
            f"preparing the {self.name} data at {self.root} stopped: {what}{where}; free space on that disk "
            f"and run the same command again (downloads resume), or prepare the data on a disk with room: `{command}`")

    def _not_writable(self, err: OSError) -> DatasetNotPreparedError:
        """The one-line error for data that must be prepared in a folder this process may not write (a shared,
        read-only copy without this setting's data), or from a file it may not read."""
        path = Path(err.filename) if err.filename else self.root
        if path.resolve().is_relative_to(self.data_dir.resolve()):
            # the task's command, not its folder's name (`mnist` is the folder of the smnist and pmnist configs)
            command = self.prepare_hint.replace(f"paths.data_dir={self.data_dir}", "paths.data_dir=<writable folder>")
            return DatasetNotPreparedError(
                f"the {self.name} data at {self.root} is not prepared, and it cannot be prepared there: {path} "
                f"gives {err.strerror}; prepare it in a folder you can write, with `{command}` (or the training run "
                f"with paths.data_dir=<writable folder>), or ask the folder's owner to run `{self.prepare_hint}`")
        return DatasetNotPreparedError(f"preparing the {self.name} data at {self.root} needs {path}, which gives "
                                       f"{err.strerror}; make it readable, or point data.source_dir at a copy "
                                       "you can read")

    def _prepare_locked(self) -> None:
        """`prepare_data` past its lock-free check: prepare (or rebuild) under the task's lock."""
        self.root.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.root / ".lock")):
            self._finish_interrupted_rebuild()
            stale = self._manifest_staleness()  # again under the lock: another process may have prepared it
            if stale == {}:
                return
            aside = self.root / SET_ASIDE
            if stale is not None:
                what = ("is not usable as it is" if MANIFEST in stale else "was made with other settings")
                log.warning("prepared data at %s %s (key: (prepared, requested) = %s); rebuilding it (the old files "
                            "are kept until the new ones are complete)", self.root, what, stale)
                _set_prepared_aside(self.root, aside)
            try:
                splits = self._prepare_and_check()
            except BaseException:
                if stale is not None:
                    _restore_prepared(self.root, aside)
                    log.warning("rebuilding %s failed; the data prepared before (with %s) is back in place",
                                self.root, {k: prepared for k, (prepared, _) in stale.items()})
                raise
            if stale is not None:
                _discard(aside)
            log.info("prepared %s at %s: %s", self.name, self.root,
                     {k: v.get("count") for k, v in splits.items()})

    def _finish_interrupted_rebuild(self) -> None:
        """What a killed process left (under the lock): deleted folders' remains go; a `.previous` beside a
        top-level manifest belongs to a rebuild (or restore) that completed, and goes; one without puts the old
        data back (the rebuild did not complete)."""
        for doomed in self.root.glob(".discard-*"):
            shutil.rmtree(doomed, ignore_errors=True)
        aside = self.root / SET_ASIDE
        if aside.exists():
            if (self.root / MANIFEST).exists():
                _discard(aside)
            else:
                _restore_prepared(self.root, aside)

    def _prepare_and_check(self) -> dict:
        """`_prepare` into the root, then the manifest, written only once the checks `setup()` runs pass: the
        source's own faults (a label out of range, an empty split) must not pass as a complete dataset. Returns the
        splits' summary."""
        splits, meta = self._prepare(self.root)

        def check(manifest: dict) -> None:
            try:
                check_prepared(self.root, manifest, self.prepare_hint, num_classes=getattr(self, "num_classes", None),
                               vocab_size=getattr(self, "vocab_size", None))
            except DatasetNotPreparedError as err:
                source = getattr(self, "source_dir", None)
                fix = (f"correct the files in data.source_dir={source}" if source is not None else
                       f"delete {self.root} and run `{self.prepare_hint}` again to download the source afresh")
                reason = str(err).split("; delete ")[0]  # its own fix (delete and re-prepare) would repeat this
                raise DataIntegrityError(f"the {self.name} data prepared from "
                                         f"{source if source is not None else 'the download'} fails its checks, so "
                                         f"it is not marked prepared: {reason}; {fix}") from None

        write_manifest(self.root, splits, {**meta, **self.fingerprint()}, check=check)
        return splits

    def setup(self, stage: str | None = None) -> None:
        if self.datasets:
            return
        self.manifest = read_manifest(self.root, self.prepare_hint)
        stale = self._stale(self.manifest.get("meta", {}))
        if stale:
            raise DatasetNotPreparedError(f"prepared data at {self.root} was made with other settings "
                                          f"(key: (prepared, requested) = {stale}); re-run `{self.prepare_hint}`")
        check_prepared(self.root, self.manifest, self.prepare_hint, num_classes=getattr(self, "num_classes", None),
                       vocab_size=getattr(self, "vocab_size", None))
        self.datasets = self._load(self.root, self.manifest)

    def verify(self) -> int:
        """Re-hash every prepared file against the manifest (the slow check); returns the number of files."""
        manifest = read_manifest(self.root, self.prepare_hint)
        check_prepared(self.root, manifest, self.prepare_hint, num_classes=getattr(self, "num_classes", None),
                       vocab_size=getattr(self, "vocab_size", None))
        return verify_files(self.root, manifest, self.prepare_hint)

    def _prepare(self, root: Path) -> tuple[dict, dict]:
        raise TypeError(f"{type(self).__name__} must implement _prepare(root)")

    def _load(self, root: Path, manifest: dict) -> dict[str, Dataset]:
        raise TypeError(f"{type(self).__name__} must implement _load(root, manifest)")

    def collate(self, items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return pad_collate(items, multiple=self.pad_multiple, cap=getattr(self, "seq_len", None),
                           full_mask=self.variable_length)

    def _loader(self, split: str, train: bool) -> DataLoader:
        if split not in self.datasets:
            raise KeyError(f"{self.name} has no {split!r} split (has {sorted(self.datasets)})")
        dataset = self.datasets[split]
        rank, world = 0, 1
        if self.trainer is not None and train:
            rank, world = self.trainer.global_rank, self.trainer.world_size
        sampler = EpochSampler(len(dataset), self.seed, shuffle=train, rank=rank, world_size=world)
        kwargs = dict(batch_size=self.batch_size if train else self.eval_batch_size, collate_fn=self.collate,
                      num_workers=self.num_workers, pin_memory=self.pin_memory, drop_last=False,
                      persistent_workers=self.persistent_workers, worker_init_fn=init_worker,
                      # a private generator: creating an iterator must not draw from the global RNG, or a resumed
                      # run's dropout masks would drift from the uninterrupted run's
                      generator=torch.Generator().manual_seed(self.seed))
        if train:
            # the sampler by keyword: Lightning re-creates the loader with its own sampler= (overfit_batches, a
            # sequential one), which a positional sampler would collide with
            # under trainer.overfit_batches Lightning puts in its own sequential sampler, which restarts every epoch
            overfit = self.trainer is not None and getattr(self.trainer, "overfit_batches", 0)
            epoch_batches = None if overfit else self._epoch_batches(-(-len(sampler) // kwargs["batch_size"]))
            return ResumableLoader(dataset, sampler=sampler, epoch_batches=epoch_batches, **kwargs)
        return DataLoader(dataset, sampler=sampler, **kwargs)

    def _epoch_batches(self, batches: int) -> int | None:
        """Lightning's training batches an epoch of a loader whose pass holds `batches` batches, under
        `trainer.limit_train_batches` (an int: at most that many; a float: that fraction, rounded down; Lightning sets
        it to `trainer.overfit_batches` when that is on), or None for whole passes."""
        limit = getattr(self.trainer, "limit_train_batches", None) if self.trainer is not None else None
        if limit is None:
            return None
        if isinstance(limit, float):
            return None if limit >= 1.0 else int(batches * limit)
        return int(limit) if limit < batches else None

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", train=False)
