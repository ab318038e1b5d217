"""The official Long Range Arena release (Tay et al. 2021, arXiv 2011.04006): resumable download, extraction, and
where each task's files sit inside it.

`lra_release.gz` is a gzipped tar of about 8 GB (18.6 GB unpacked, LRA issue #12) that holds, under one or two
`lra_release/` levels, `listops-1000/`, `tsv_data/` (AAN retrieval), and `pathfinder{32,64,128,256}/` with
`curv_baseline/`, `curv_contour_length_9/` and `curv_contour_length_14/` (frameworks.md section 2). No checksum is
published; the download is checked against the server's Content-Length and its sha256 is recorded beside it
at the first download and checked on every later use.
"""

from __future__ import annotations

import gzip
import logging
import tarfile
from collections.abc import Sequence
from pathlib import Path

from filelock import FileLock, Timeout

from longmixer.data.download import UNPACK_ERRORS, damaged_archive, download, progress, require_tar_filter
from longmixer.data.integrity import SourceFileMissingError

log = logging.getLogger(__name__)

LRA_URL = "https://storage.googleapis.com/long-range-arena/lra_release.gz"
ARCHIVE_NAME = "lra_release.gz"
PARTS = ("listops-1000", "tsv_data", "pathfinder32", "pathfinder64", "pathfinder128", "pathfinder256")


def find_part(root: Path, part: str) -> Path | None:
    """The folder under `root` (up to three levels down) that directly holds the folder `part`, or None.

    Each part is looked up on its own: a part unpacked by hand at one nesting (`root/tsv_data`) and one that
    `extract` took from the archive at another (`root/lra_release/lra_release/listops-1000`) are both found. Where
    `extract` unpacked the part, its marker names the folder it went to, which is taken first."""
    root = Path(root)
    marker = root / f".extracted-{part}"
    home = marker.read_text().strip() if marker.exists() else ""
    if home and (root / home / part).is_dir():
        return root / home
    frontier = [root]
    for _ in range(4):
        for folder in frontier:
            if (folder / part).is_dir():
                return folder
        frontier = [child for folder in frontier if folder.is_dir() for child in sorted(folder.iterdir())
                    if child.is_dir()]
    return None


def extract(archive: Path, dest: Path, parts: Sequence[str] | None = None) -> None:
    """Stream the tar.gz into `dest`, keeping only members under the top-level `parts` (all when None). Each part
    carries a marker `.extracting-<part>` while its members come out and `.extracted-<part>` (holding the folder,
    relative to `dest`, that the part went into) once all are out, so a killed extraction (the archive is 18.6 GB
    unpacked) is told from a finished one and redone. Callers hold `dest/.lock` (`ensure_lra_release`).

    Raises:
        DataDownloadError: the archive is damaged or cut short (also where only gzip's CRC32 or length check at the
            end of the stream tells), naming it and the fix.
        UnsafeToUnpackError: this Python lacks tarfile's extraction filters (`download.require_tar_filter`).
    """
    wanted = tuple(parts) if parts else PARTS
    unknown = [p for p in wanted if p not in PARTS]
    if unknown:
        raise ValueError(f"parts={unknown} are not in the LRA release; choose from {PARTS}")
    dest = Path(dest)
    require_tar_filter(archive)
    dest.mkdir(parents=True, exist_ok=True)
    for part in wanted:
        (dest / f".extracted-{part}").unlink(missing_ok=True)
        (dest / f".extracting-{part}").touch()
    homes: dict[str, str] = {}
    try:
        with progress(f"extracting {archive.name}", archive.stat().st_size, unit="bytes") as advance, \
                open(archive, "rb") as raw, gzip.GzipFile(fileobj=raw) as stream, \
                tarfile.open(fileobj=stream, mode="r|") as tar:
            done = 0
            for member in tar:
                names = Path(member.name).parts
                part = next((p for p in wanted if p in names), None)
                if part is not None:
                    tar.extract(member, dest, filter="data")
                    homes.setdefault(part, Path(*names[:names.index(part)]).as_posix())
                advance(raw.tell() - done)
                done = raw.tell()
            # tar stops at its end-of-archive blocks, short of the gzip trailer: only a stream read to its end has
            # its CRC32 and length checked, the one check of a first download (no checksum is published), so a
            # byte flipped inside a member would otherwise be unpacked as if it were the release's
            while stream.read(1 << 20):
                advance(raw.tell() - done)
                done = raw.tell()
    except UNPACK_ERRORS as err:
        raise damaged_archive(archive, err, "and the parts unpacked so far are redone") from None
    for part in wanted:
        (dest / f".extracted-{part}").write_text(homes.get(part, "") + "\n")
        (dest / f".extracting-{part}").unlink(missing_ok=True)


def _located(root: Path, wanted: Sequence[str]) -> dict[str, Path] | None:
    """Each wanted part's folder when every one is in place; None when one is missing or its extraction by
    `extract` was cut short (`.extracting-<part>`: a tree unpacked by hand has no markers and is taken as it is)."""
    if any((root / f".extracting-{p}").exists() for p in wanted):
        return None
    found = {p: find_part(root, p) for p in wanted}
    return None if any(folder is None for folder in found.values()) else found


def ensure_lra_release(root: Path, parts: Sequence[str] | None = None, url: str = LRA_URL) -> dict[str, Path]:
    """Make the requested parts of the LRA release available under `root`; returns, for each, the folder that holds
    it (`listops_dir`, `aan_dir` and `pathfinder_dir` take that folder).

    A part already extracted under `root` (by this function, or by hand: `tar xzf lra_release.gz -C root`) is
    used as it is; one whose extraction by this function was cut short is extracted again. Otherwise
    `root/lra_release.gz` (downloaded, resumable, unless it is already there) is opened and the missing parts
    extracted. Tasks share `root`: the check, download and extraction run under the lock `root/.lock`, so two
    runs (pathfinder at two difficulties, listops beside retrieval) neither unpack over each other nor read a half
    written file; parts already in place are read without the lock, so a read-only copy serves.

    Args:
        root: where the archive and its extracted tree live (`<data_dir>/lra_release`).
        parts: the top-level folders needed (`PARTS`); None: all of them. Only these are extracted.
        url: the archive's address.
    Raises:
        ValueError: an unknown part.
        FileNotFoundError: the archive holds none of the requested parts.
    """
    root = Path(root)
    wanted = tuple(parts) if parts else PARTS
    unknown = [p for p in wanted if p not in PARTS]
    if unknown:
        raise ValueError(f"parts={unknown} are not in the LRA release; choose from {PARTS}")
    found = _located(root, wanted)
    if found is not None:
        return found
    root.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(root / ".lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another run to finish downloading or extracting the LRA release in %s (%s)", root,
                 root / ".lock")
        lock.acquire()
    try:
        found = _located(root, wanted)  # again under the lock: another run may have extracted them meanwhile
        if found is not None:
            return found
        missing = [p for p in wanted if (root / f".extracting-{p}").exists() or find_part(root, p) is None]
        archive = download(url, root / ARCHIVE_NAME)
        extract(archive, root, missing)
        found = {p: find_part(root, p) for p in wanted}
        absent = [p for p, folder in found.items() if folder is None]
        if absent:
            raise SourceFileMissingError(f"{archive} does not hold {absent}; delete it and re-run to download "
                                         "it again")
        return found
    finally:
        lock.release()


def listops_dir(release: Path) -> Path:
    """`basic_{train,val,test}.tsv` of ListOps."""
    return _existing(Path(release) / "listops-1000")


def aan_dir(release: Path) -> Path:
    """`new_aan_pairs.{train,eval,test}.tsv` of the AAN retrieval task."""
    return _existing(Path(release) / "tsv_data")


def pathfinder_dir(release: Path, resolution: int, difficulty_folder: str) -> Path:
    """`<release>/pathfinder<resolution>/<difficulty_folder>` (e.g. `curv_contour_length_14`)."""
    return _existing(Path(release) / f"pathfinder{resolution}" / difficulty_folder)


def _existing(path: Path) -> Path:
    if not path.is_dir():
        raise SourceFileMissingError(f"{path} is missing from the LRA release; re-extract it with "
                                "`python scripts/prepare_data.py <task>` or point data.source_dir at a copy")
    return path
