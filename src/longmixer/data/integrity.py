"""Checks that prepared data is what its manifest says, and named errors for damaged or unreadable files.

Two levels (docs/data.md): `check_prepared` is cheap and runs at every `setup()` (array headers, shapes, dtypes,
counts, label histograms, label and token ranges); `verify_files` re-hashes every file against the sha256 recorded
at prepare time (`python scripts/prepare_data.py <task>`, i.e. `make data TASK=<task>`, runs it).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from longmixer.utils.errors import UserFacingError

log = logging.getLogger(__name__)

_warned: set[tuple] = set()


class DatasetNotPreparedError(UserFacingError, RuntimeError):
    """The prepared data is missing or incomplete; the message names the command that prepares it."""


class SourceFileMissingError(UserFacingError, FileNotFoundError):
    """A source file the prepare step reads is absent; the message names the file and where it comes from."""


class SourceFileError(UserFacingError, ValueError):
    """A source file that does not read as its format (cut short, damaged, not what its name says); the message
    names the file and the fix. A ValueError, as the readers' other refusals of a malformed source."""


class DataIntegrityError(DatasetNotPreparedError):
    """Prepared data that does not match its manifest (damaged or edited); the message names the file and the
    command that rebuilds it."""


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def rebuild_hint(root: Path, hint: str) -> str:
    """The fix for prepared data that fails its checks: delete its manifest, and the command prepares it again from
    its source. Not the whole folder: for several tasks it also holds what the data is made from (the downloads of
    CIFAR, Speech Commands, MNIST, WikiText-103 and enwik8, and the generated Pathfinder images, core-hours of work
    at the LRA size)."""
    return f"delete {Path(root) / 'manifest.json'} and re-run `{hint}`"


def _load(root: Path, name: str, hint: str) -> np.ndarray:
    path = root / name
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as err:
        raise DataIntegrityError(f"{path} is unreadable ({type(err).__name__}: {err}); "
                                 f"{rebuild_hint(root, hint)}") from None


def check_prepared(root: Path, manifest: Mapping, hint: str, num_classes: int | None = None,
                   vocab_size: int | None = None) -> None:
    """The cheap checks of `setup()`.

    Every `.npy` array must load with the shape and dtype the manifest recorded; every `<split>...labels.npy`
    must hold the split's count and label histogram and lie in [0, num_classes); every `*.tokens.npy` must lie in
    [0, vocab_size) with offsets that end at its length; no split may be empty.

    Raises:
        DataIntegrityError: naming the file, what differs, and `hint` (the command that rebuilds the data).
    """
    root = Path(root)
    splits = manifest.get("splits", {})
    for split, stats in splits.items():
        if int(stats.get("count", 1)) == 0:
            raise DataIntegrityError(f"split {split!r} of {root} is empty (manifest count 0); check the source "
                                     f"files and re-run `{hint}`")
    for name, spec in manifest.get("arrays", {}).items():
        array = _load(root, name, hint)
        if list(array.shape) != list(spec["shape"]) or array.dtype.str != spec["dtype"]:
            raise DataIntegrityError(f"{root / name} is {array.dtype.str} {list(array.shape)}, the manifest recorded "
                                     f"{spec['dtype']} {spec['shape']}: the file was changed; "
                                     f"{rebuild_hint(root, hint)}")
        if name.endswith(".labels.npy"):
            _check_labels(root / name, np.asarray(array), splits.get(name.split(".")[0]), num_classes, hint)
        elif name.endswith(".tokens.npy") and vocab_size is not None and array.size:
            lo, hi = int(array.min()), int(array.max())
            if lo < 0 or hi >= vocab_size:
                bad = int(np.flatnonzero((np.asarray(array) < 0) | (np.asarray(array) >= vocab_size))[0])
                raise DataIntegrityError(f"{root / name}: token {int(array[bad])} at index {bad} is outside "
                                         f"[0, data.vocab_size={vocab_size}); {rebuild_hint(root, hint)}")
            offsets_name = name.replace(".tokens.npy", ".offsets.npy")
            if offsets_name in manifest.get("arrays", {}):
                offsets = np.asarray(_load(root, offsets_name, hint))
                if offsets[0] != 0 or offsets[-1] != array.shape[0] or (np.diff(offsets) < 0).any():
                    raise DataIntegrityError(f"{root / offsets_name} does not index {root / name}; "
                                             f"{rebuild_hint(root, hint)}")


def _check_labels(path: Path, labels: np.ndarray, stats: Mapping | None, num_classes: int | None, hint: str) -> None:
    if num_classes is not None and labels.size:
        bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
        if bad.size:
            raise DataIntegrityError(f"{path}: label {int(labels[bad[0]])} at index {int(bad[0])} is outside "
                                     f"[0, data.num_classes={num_classes}); {rebuild_hint(path.parent, hint)}")
    if stats is None:
        return
    if "count" in stats and labels.shape[0] != int(stats["count"]):
        raise DataIntegrityError(f"{path} holds {labels.shape[0]} labels, the manifest {stats['count']}; "
                                 f"{rebuild_hint(path.parent, hint)}")
    if "labels" in stats:
        values, counts = np.unique(labels, return_counts=True)
        found = {str(int(v)): int(c) for v, c in zip(values, counts)}
        if found != dict(stats["labels"]):
            raise DataIntegrityError(f"{path}: label counts {found} differ from the manifest's {stats['labels']}: "
                                     f"the labels were changed; {rebuild_hint(path.parent, hint)}")


def verify_files(root: Path, manifest: Mapping, hint: str) -> int:
    """Re-hash every file the manifest lists; returns the number checked.

    Raises:
        DataIntegrityError: the first file whose sha256 differs.
    """
    for name, expected in manifest["files"].items():
        if sha256_of(Path(root) / name) != expected:
            raise DataIntegrityError(f"{Path(root) / name} has another sha256 than when it was prepared: the file "
                                     f"is damaged or was changed; {rebuild_hint(root, hint)}")
    return len(manifest["files"])


def warn_truncated(what: str, lengths: np.ndarray, max_len: int) -> int:
    """Log once per (what, max_len) how many of `lengths` exceed `max_len` and are cut to it; returns the count."""
    n = int((np.asarray(lengths) > max_len).sum())
    if n and (what, max_len) not in _warned:
        _warned.add((what, max_len))
        log.warning("%s: %d of %d examples are longer than data.seq_len=%d and are truncated", what, n,
                    len(lengths), max_len)
    return n


def locate_bad_utf8(path: Path) -> tuple[int, int, int]:
    """(line number, column, byte value) of the first byte sequence in `path` that is not UTF-8."""
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as err:
                return line_no, err.start + 1, line[err.start]
    raise ValueError(f"{path} decodes as UTF-8")


def read_utf8_lines(path: Path, what: str, fix: str) -> list[str]:
    """The lines of a UTF-8 text file (no line ends).

    Raises:
        ValueError: naming the file, the line, the column and the bad byte, and `fix`.
    """
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        line, col, byte = locate_bad_utf8(path)
        raise SourceFileError(f"{path}:{line}:{col}: byte 0x{byte:02x} is not UTF-8; {what} files are UTF-8 text: "
                         f"{fix}") from None
    return text.splitlines()
