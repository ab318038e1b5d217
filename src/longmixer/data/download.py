"""Downloads and archives for every dataset: a resumable HTTPS download checked against a pinned size and digest,
unpacking of .tar(.gz) / .zip archives, and progress reporting that also works without a terminal.

A hand-written downloader rather than pooch: it must resume a multi-GB partial file with a Range request and check
servers that send no Content-Length against the pinned size, and pooch restarts partial downloads from zero.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import logging
import os
import re
import shutil
import sys
import tarfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from longmixer.utils.archives import tar_filters_missing
from longmixer.utils.errors import UserFacingError

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full disk, or the user's quota on it
# how numpy's `ndarray.tofile` (so `np.save` to a path) reports a disk that fills under it: a short `fwrite`, as an
# OSError without an errno ("2280000 requested and 524224 written")
SHORT_WRITE = re.compile(r"(\d+) requested and (\d+) written")


def is_no_space(err: OSError) -> bool:
    """Whether `err` is a full disk or quota: ENOSPC / EDQUOT, or numpy's short write (`SHORT_WRITE`), which a
    prepare step that fills the disk while it saves its arrays raises instead."""
    return err.errno in NO_SPACE or (err.errno is None and SHORT_WRITE.fullmatch(str(err)) is not None)


class DataDownloadError(UserFacingError, ConnectionError):
    """A download that could not be done or that arrived damaged; the message is one line naming the ways out."""


@dataclass(frozen=True)
class Pin:
    """What a download must be: its size in bytes and a digest (`sha256` or, where upstream publishes only that,
    `md5`); None where no trustworthy value is published (then the sha256 of the first download is recorded beside
    the file and checked on every later use)."""

    size: int | None = None
    sha256: str | None = None
    md5: str | None = None


def download_hint(what: str, err: object, dest: Path | None = None) -> str:
    """The one-line message for a download that failed (also printed by scripts/prepare_data.py); `dest`: where a
    copy of the file fetched by other means is picked up."""
    manual = "" if dest is None else f", or fetch the file by other means and put it at {dest} (it is used from there)"
    return (f"could not download {what}: {err}; check the network (or a proxy) and run the same "
            f"command again (partial downloads resume){manual}, or put the original files in a folder and pass "
            f"data.source_dir=<folder> (docs/data.md lists what each task expects)")


@contextlib.contextmanager
def progress(description: str, total: int | None, unit: str = "items",
             min_interval_s: float = 30.0) -> Iterator[Callable[[int], None]]:
    """Yield `advance(n)`. In a terminal a transient rich bar (refreshed several times a second); otherwise an INFO
    line at most every `min_interval_s` seconds and every 10% of `total`, so logs of batch jobs show progress."""
    if sys.stderr.isatty():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                       transient=True)
        with bar:
            task = bar.add_task(description, total=total)
            yield lambda n: bar.advance(task, n)
        return
    state = {"done": 0, "last_t": time.monotonic(), "last_decile": 0}

    def advance(n: int) -> None:
        state["done"] += n
        decile = state["done"] * 10 // total if total else 0
        now = time.monotonic()
        if decile > state["last_decile"] or now - state["last_t"] >= min_interval_s:
            state["last_t"], state["last_decile"] = now, decile
            log.info("%s: %d/%s %s", description, state["done"], total if total is not None else "?", unit)

    yield advance


def _digest(path: Path, algorithm: str, chunk: int = 1 << 20) -> str:
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_file(path: Path, pin: Pin) -> None:
    """Compare `path` with its pin (size first, then the digest) or with the sha256 recorded at its first download.

    Raises:
        DataDownloadError: naming the file, what differs and the fix.
    """
    size = path.stat().st_size
    fix = f"delete {path} and run the same command again to download it afresh"
    if pin.size is not None and size != pin.size:
        raise DataDownloadError(f"{path} is {size} bytes, expected {pin.size}: an interrupted or damaged download; "
                                f"{fix}")
    for algorithm in ("sha256", "md5"):
        expected = getattr(pin, algorithm)
        if expected is not None and _digest(path, algorithm) != expected:
            raise DataDownloadError(f"{path} has {algorithm} {_digest(path, algorithm)}, expected {expected}; {fix}")
    recorded = path.with_name(path.name + ".sha256")
    if pin.sha256 is None and recorded.exists():
        expected = recorded_sha256(recorded)
        if expected is None:
            raise DataDownloadError(f"{recorded} holds no sha256 (it is empty or cut, or was edited), so {path} cannot "
                                    f"be checked against it; delete {recorded} and run the same command again to "
                                    f"record {path} as it is, or delete both to download it afresh")
        if _digest(path, "sha256") != expected:
            raise DataDownloadError(f"{path} no longer matches the sha256 recorded at its download ({recorded}); {fix}")


def recorded_sha256(record: Path) -> str | None:
    """The digest in a `<file>.sha256` record (`<64 hex digits>  <name>`), or None where it holds none."""
    words = record.read_bytes().split()
    digest = words[0].decode("ascii", errors="replace").lower() if words else ""
    return digest if len(digest) == 64 and all(c in "0123456789abcdef" for c in digest) else None


def _record(path: Path) -> None:
    """Write `<path>.sha256`, which `check_file` compares `path` with on every later use: through a temporary file, so
    that a kill midway leaves the old record or the new one, never an empty one."""
    record = path.with_name(path.name + ".sha256")
    tmp = record.with_name(record.name + ".tmp")
    tmp.write_text(f"{_digest(path, 'sha256')}  {path.name}\n")
    os.replace(tmp, record)


def download(url: str, dest: Path, pin: Pin = Pin(), chunk: int = 1 << 20) -> Path:
    """Download `url` (https only) to `dest`, resuming a partial `dest.part` with an HTTP Range request.

    The file takes its final name only once its size equals the pinned size (else the server's Content-Length)
    and its digest matches the pin; an existing `dest` is checked the same way before it is reused. A transfer
    whose length nobody states (no pin, no Content-Length) is refused rather than trusted.

    Raises:
        DataDownloadError: the network failed, the transfer ended short, or the file does not match its pin;
            the message is one line (`download_hint`).
    """
    dest = Path(dest)
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "https" and not (parts.scheme == "http" and parts.hostname in LOOPBACK):
        raise ValueError(f"{url} is not https; downloads are fetched over https only (plain http only from this "
                         "machine, e.g. a local mirror)")
    if dest.exists():
        check_file(dest, pin)
        if pin.sha256 is None and not dest.with_name(dest.name + ".sha256").exists():
            _record(dest)  # a file put there by hand (as `download_hint` offers), or one whose record was deleted
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    try:
        _fetch(url, part, pin.size, chunk)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
        # a full disk is no network fault: its error goes up as it is (the datamodule names the fix)
        if isinstance(err, DataDownloadError) or is_no_space(err):
            raise
        raise DataDownloadError(download_hint(url, err, dest)) from None
    check_file(part, pin)
    record = dest.with_name(dest.name + ".sha256")
    kept = recorded_sha256(record) if pin.sha256 is None and record.exists() else None
    if kept is not None and _digest(part, "sha256") != kept:
        # the record of an earlier download of this file, which was deleted: not an error, or a changed file on the
        # server could never be downloaded again; but the data is no longer the data that earlier runs used
        log.warning("%s differs from the sha256 recorded at an earlier download (%s): the file on the server changed, "
                    "or one of the two downloads was damaged; the new download is used and recorded", dest, record)
    os.replace(part, dest)
    _record(dest)
    return dest


def _fetch(url: str, part: Path, expected_size: int | None, chunk: int) -> None:
    have = part.stat().st_size if part.exists() else 0
    if expected_size is not None and have >= expected_size:
        if have == expected_size:
            return
        raise DataDownloadError(f"{url} is pinned at {expected_size} bytes, so {part} ({have} bytes) is no part of "
                                f"it; delete {part} and run the same command again to download the file afresh")
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as err:
        if err.code != 416 or not have:
            raise
        # no byte from `have` on: the server states the file's size as "bytes */<size>" (RFC 9110 14.4). A partial
        # file of that size is whole (a run stopped after its last byte, e.g. while its digest was checked, before
        # it took its name): it is kept for `download` to check against the pin or record, as a fresh one is
        size = _unsatisfied_range_size(err.headers.get("Content-Range"))
        if size == have:
            return
        stated = f" (the file there is {size} bytes)" if size is not None else " and states no size"
        raise DataDownloadError(f"{url} sends no bytes from byte {have} on{stated}, so {part} cannot be resumed or "
                                f"told complete; delete {part} and run the same command again to download the file "
                                f"afresh") from None
    with response:
        resumed = response.status == 206
        if have and not resumed:
            log.info("server ignored the Range request; restarting %s", part.name)
            have = 0
        length = int(response.headers.get("Content-Length") or 0)
        total = have + length if length else expected_size
        if total is None:
            raise DataDownloadError(f"{url} sends no Content-Length and no size is pinned for it, so a cut transfer "
                                    f"could not be told from a complete one; pin its size in the code")
        log.info("downloading %s -> %s (%d bytes, resuming at %d)", url, part.parent, total, have)
        with progress(f"downloading {part.name[:-5]}", total, unit="bytes") as advance, \
                open(part, "ab" if resumed else "wb") as f:
            advance(have)
            while block := response.read(chunk):
                f.write(block)
                advance(len(block))
    size = part.stat().st_size
    if size != total:
        raise DataDownloadError(f"download of {url} stopped at {size} of {total} bytes; run the same command again "
                                f"to resume (the partial file is {part})")


def _unsatisfied_range_size(content_range: str | None) -> int | None:
    """The size in a 416 response's `Content-Range: bytes */<size>`, or None where it states none."""
    unit, _, rest = (content_range or "").partition(" ")
    span, _, size = rest.partition("/")
    return int(size) if unit == "bytes" and span == "*" and size.isdigit() else None


# what reading a damaged or cut .tar(.gz) / .zip raises (a gzip CRC or length that differs: BadGzipFile)
UNPACK_ERRORS = (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error, gzip.BadGzipFile)


def damaged_archive(archive: Path, err: BaseException, also: str) -> DataDownloadError:
    """The one-line error for an archive that `UNPACK_ERRORS` stopped, naming it and the fix (`also`: what else
    the caller's user can do). The sha256 record of an unpinned download was taken from this damaged file, so it is
    named for deletion too."""
    record = archive.with_name(archive.name + ".sha256")
    what = f"{archive} and its sha256 record {record}" if record.exists() else str(archive)
    return DataDownloadError(f"{archive} could not be unpacked ({type(err).__name__}: {err}): a damaged or cut "
                             f"download; delete {what} and run the same command again to download it afresh, "
                             f"{also}")


class UnsafeToUnpackError(UserFacingError, RuntimeError):
    """This Python cannot unpack a tar archive safely; the message names the archive and the ways out."""


def require_tar_filter(archive: Path) -> None:
    """Refuse to unpack `archive` on a Python without tarfile's extraction filters (`utils.archives`).

    Raises:
        UnsafeToUnpackError: naming the Python, the archive and the ways out.
    """
    if problem := tar_filters_missing(archive):
        raise UnsafeToUnpackError(f"{problem}; use a newer Python, or unpack the archive by hand and pass "
                                  "data.source_dir=<folder> (docs/data.md lists what each task expects)")


def extract_marker(dest: Path, archive_name: str) -> Path:
    """The file that `extract` writes in `dest` once every member of `archive_name` is in place."""
    return Path(dest) / f".extracted-{archive_name}"


def extracted(dest: Path, archive_name: str) -> bool:
    """Whether `extract` finished unpacking `archive_name` into `dest` (a killed extraction leaves no marker)."""
    return extract_marker(dest, archive_name).exists()


def extract(archive: Path, dest: Path) -> None:
    """Unpack a .tar(.gz) or .zip archive into `dest`, all or nothing.

    The members are unpacked into a scratch folder `dest/.extracting-<archive>` first, then each top-level entry is
    moved to its final name in `dest` (replacing what an earlier, unfinished attempt left there) and the marker
    `extract_marker` is written last. A killed extraction therefore leaves no partial file under a final name that a
    rerun could take for the real one: the rerun sees no marker (`extracted`) and unpacks again.

    Raises:
        DataDownloadError: the archive is damaged or cut short (an interrupted or bad download), naming it and the fix.
        UnsafeToUnpackError: a tar on a Python without tarfile's extraction filters (`require_tar_filter`).
    """
    archive, dest = Path(archive), Path(dest)
    if archive.suffix != ".zip":
        require_tar_filter(archive)
    log.info("extracting %s -> %s", archive, dest)
    scratch = dest / f".extracting-{archive.name}"
    marker = extract_marker(dest, archive.name)
    marker.unlink(missing_ok=True)
    if scratch.exists():
        shutil.rmtree(scratch)
    scratch.mkdir(parents=True)
    try:
        if archive.suffix == ".zip":
            with zipfile.ZipFile(archive) as z:
                z.extractall(scratch)
        else:
            with tarfile.open(archive) as t:
                t.extractall(scratch, filter="data")
    except UNPACK_ERRORS as err:
        shutil.rmtree(scratch, ignore_errors=True)
        raise damaged_archive(archive, err, "or pass data.source_dir=<folder> with the files extracted by hand") \
            from None
    except OSError:
        shutil.rmtree(scratch, ignore_errors=True)  # a full disk: what was unpacked so far would only hold its room
        raise
    for entry in scratch.iterdir():
        target = dest / entry.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
        os.replace(entry, target)
    scratch.rmdir()
    marker.write_text(f"{archive.name}\n")
