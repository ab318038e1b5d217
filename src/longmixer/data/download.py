"""Downloads and archives for every dataset: a resumable HTTP download (Range requests, size check, sha256 recorded
beside the file) and unpacking of .tar(.gz) / .zip archives."""

from __future__ import annotations

import hashlib
import logging
import os
import tarfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)


def progress_bar(description: str, total: int | None):
    """A transient rich progress bar for byte transfers, and its task id."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, \
        TransferSpeedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn(), transient=True)
    return bar, bar.add_task(description, total=total)


def download(url: str, dest: Path, expected_size: int | None = None, chunk: int = 1 << 20) -> Path:
    """Download `url` to `dest`, resuming a partial `dest.part` with an HTTP Range request.

    The file keeps its final name only once its size equals the server's Content-Length (or `expected_size`);
    a server that ignores the Range header makes the download restart from zero.

    Raises:
        OSError: the transfer ended short of the announced size (re-run to resume).
    """
    dest = Path(dest)
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    have = part.stat().st_size if part.exists() else 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request)
    except urllib.error.HTTPError as err:
        if err.code != 416:  # 416: the partial file is already complete
            raise
        response = None
    if response is None:
        total = have
    else:
        with response:
            resumed = response.status == 206
            if have and not resumed:
                log.info("server ignored the Range request; restarting %s", dest.name)
                have = 0
            length = int(response.headers.get("Content-Length") or 0)
            total = have + length if length else expected_size
            log.info("downloading %s -> %s (%s bytes, resuming at %d)", url, dest, total, have)
            bar, task = progress_bar(dest.name, total)
            with bar, open(part, "ab" if resumed else "wb") as f:
                bar.update(task, completed=have)
                while block := response.read(chunk):
                    f.write(block)
                    bar.advance(task, len(block))
    size = part.stat().st_size
    expected = expected_size or total
    if expected is not None and size != expected:
        raise OSError(f"download of {url} stopped at {size} of {expected} bytes; re-run the same command to resume "
                      f"(the partial file is {part})")
    os.replace(part, dest)
    digest = hashlib.sha256()
    with open(dest, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    dest.with_name(dest.name + ".sha256").write_text(f"{digest.hexdigest()}  {dest.name}\n")
    return dest


def extract(archive: Path, dest: Path) -> None:
    """Unpack a .tar(.gz) or .zip archive into `dest`."""
    log.info("extracting %s -> %s", archive, dest)
    if archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as z:
            z.extractall(dest)
    else:
        with tarfile.open(archive) as t:
            t.extractall(dest, filter="data")
