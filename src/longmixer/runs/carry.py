"""Moving run dirs between machines through a channel that takes only a few files of bounded size.

A rented GPU machine is given back when its lease ends or after a short idle gap, and its run dirs go with it. What
such a machine can hand back is often limited to a few files of a fixed size each (the `device` tool of our own
workflow: 8 files of 16 MB), while a checkpoint with its optimizer state is larger. `pack` writes a folder of run dirs
as one tar stream cut into parts of at most `part_mib`; `unpack` joins them, checks the whole against the digest in
the part names and extracts it, so a later machine resumes the runs (`resume=auto`) instead of starting over.

Parts are named `<name>-<digest>-<i>of<n>.tar-part`: the digest is the first 16 hex digits of the joined tar's
sha256, so parts of two packs never mix, a missing or truncated part is named before anything is written, and the
names use only letters, digits, `-`, `.` and `_`. Extraction goes through tarfile's `data` filter: no absolute paths,
no `..`, no links out of the destination, no device files. A checkpoint inside is still only ever read with
`weights_only=True` (runs/checkpoints.py).

    python -m longmixer.runs.carry pack logs/learning_curves --out $OUT/state        # on the machine that trained
    python -m longmixer.runs.carry unpack /path/to/state --into logs/learning_curves  # where training goes on
"""

from __future__ import annotations

import argparse
import hashlib
import io
import re
import sys
import tarfile
import tempfile
from pathlib import Path

from longmixer.utils.archives import tar_filters_missing
from longmixer.utils.cli import quiet_on_closed_stdout

PART_RE = re.compile(r"^(?P<name>[A-Za-z0-9_.]+)-(?P<digest>[0-9a-f]{16})-(?P<i>\d+)of(?P<n>\d+)\.tar-part$")
DEFAULT_PART_MIB = 15.0  # under a 16 MB per-file limit with room to spare
SKIPPED_SUFFIXES = (".tmp", ".lock", ".lock.owner")  # half-written checkpoints and run locks never travel


class CarryError(RuntimeError):
    """A pack or unpack that cannot go on; the message names the file and the fix."""


def _members(src: Path, last_only: bool) -> list[Path]:
    files = []
    for path in sorted(p for p in src.rglob("*") if p.is_file() and not p.is_symlink()):
        if path.name.endswith(SKIPPED_SUFFIXES):
            continue
        if last_only and path.suffix == ".ckpt" and path.name != "last.ckpt":
            continue
        files.append(path)
    return files


def pack(src: str | Path, out: str | Path, *, name: str = "runs", part_mib: float = DEFAULT_PART_MIB,
         last_only: bool = False, max_parts: int | None = None) -> list[Path]:
    """Write the files under `src` as parts of at most `part_mib` MiB in `out`; returns the part paths.

    `last_only` leaves out every checkpoint but `last.ckpt` (a run's best checkpoint is what its final test loads,
    so use it only for slices of a run that a later call continues). `max_parts` refuses a pack that would need more
    parts than the channel takes, before any part is written.
    """
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise CarryError(f"{src} is not a folder; pass the folder that holds the run dirs (e.g. logs/learning_curves)")
    if not re.fullmatch(r"[A-Za-z0-9_.]+", name):
        raise CarryError(f"name {name!r}: use letters, digits, '_' and '.' only")
    part_bytes = int(part_mib * 2**20)
    if part_bytes <= 0:
        raise CarryError(f"part_mib={part_mib}: give a positive size")
    files = _members(src, last_only)
    if not files:
        raise CarryError(f"{src} holds no files to carry")
    with tempfile.TemporaryFile() as buf:
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for path in files:
                tar.add(path, arcname=path.relative_to(src).as_posix(), recursive=False)
        size = buf.tell()
        n = max(1, -(-size // part_bytes))
        if max_parts is not None and n > max_parts:
            largest = sorted(files, key=lambda p: p.stat().st_size, reverse=True)[:3]
            raise CarryError(
                f"{src} packs to {size / 2**20:.1f} MiB = {n} parts of {part_mib} MiB, more than max_parts={max_parts}; "
                f"the largest files are {', '.join(f'{p.relative_to(src)} ({p.stat().st_size / 2**20:.1f} MiB)' for p in largest)}. "
                "Carry fewer runs per call, or pass --last-only for a slice that a later call continues")
        buf.seek(0)
        digest = hashlib.sha256()
        for block in iter(lambda: buf.read(2**20), b""):
            digest.update(block)
        tag = digest.hexdigest()[:16]
        out.mkdir(parents=True, exist_ok=True)
        buf.seek(0)
        parts = []
        for i in range(1, n + 1):
            part = out / f"{name}-{tag}-{i}of{n}.tar-part"
            part.write_bytes(buf.read(part_bytes))
            parts.append(part)
    return parts


def _find_parts(folder: Path) -> tuple[str, list[Path]]:
    groups: dict[tuple[str, str, int], dict[int, Path]] = {}
    for path in folder.iterdir():
        m = PART_RE.match(path.name)
        if m:
            groups.setdefault((m["name"], m["digest"], int(m["n"])), {})[int(m["i"])] = path
    if not groups:
        raise CarryError(f"{folder} holds no '<name>-<digest>-<i>of<n>.tar-part' files; pass the folder that "
                         "`python -m longmixer.runs.carry pack` wrote")
    if len(groups) > 1:
        raise CarryError(f"{folder} holds parts of {len(groups)} packs "
                         f"({', '.join(sorted(f'{k[0]}-{k[1]}' for k in groups))}); keep one pack per folder")
    (_, digest, n), found = next(iter(groups.items()))
    missing = [i for i in range(1, n + 1) if i not in found]
    if missing:
        raise CarryError(f"{folder}: part(s) {missing} of {n} of pack {digest} are missing; copy every part")
    return digest, [found[i] for i in range(1, n + 1)]


def unpack(folder: str | Path, into: str | Path) -> list[str]:
    """Join the parts in `folder`, check the digest and extract into `into` (files there are replaced by the
    carried ones); returns the extracted member names."""
    folder, into = Path(folder), Path(into)
    if not folder.is_dir():
        raise CarryError(f"{folder} is not a folder of parts")
    if problem := tar_filters_missing(folder):
        raise CarryError(f"{problem}; unpack with a newer Python")
    digest, parts = _find_parts(folder)
    joined = io.BytesIO()
    for part in parts:
        joined.write(part.read_bytes())
    got = hashlib.sha256(joined.getbuffer()).hexdigest()[:16]
    if got != digest:
        raise CarryError(f"the parts in {folder} join to digest {got}, not {digest}: a part is truncated or from "
                         "another pack; copy the parts again")
    joined.seek(0)
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=joined, mode="r") as tar:
        names = tar.getnames()
        try:
            tar.extractall(into, filter="data")
        except tarfile.FilterError as e:
            raise CarryError(f"{folder}: refused member {e.tarinfo.name!r} ({e}); this pack was not written by "
                             "`longmixer.runs.carry pack`") from None
    return names


@quiet_on_closed_stdout
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m longmixer.runs.carry", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="write a folder of run dirs as size-bounded parts")
    p.add_argument("src", help="the folder that holds the run dirs")
    p.add_argument("--out", required=True, help="where the parts go")
    p.add_argument("--name", default="runs", help="the parts' name prefix")
    p.add_argument("--part-mib", type=float, default=DEFAULT_PART_MIB, help="largest part, MiB")
    p.add_argument("--max-parts", type=int, default=None, help="refuse a pack that needs more parts than this")
    p.add_argument("--last-only", action="store_true", help="leave out checkpoints other than last.ckpt")
    u = sub.add_parser("unpack", help="join, check and extract the parts of one pack")
    u.add_argument("folder", help="the folder that holds the parts")
    u.add_argument("--into", required=True, help="where the run dirs go (files there are replaced)")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "pack":
            parts = pack(args.src, args.out, name=args.name, part_mib=args.part_mib, last_only=args.last_only,
                         max_parts=args.max_parts)
            total = sum(p.stat().st_size for p in parts)
            print(f"packed {args.src} into {len(parts)} part(s), {total / 2**20:.1f} MiB, in {args.out}")
        else:
            names = unpack(args.folder, args.into)
            runs = sorted({n.split("/")[0] for n in names})
            print(f"unpacked {len(names)} file(s) into {args.into}: {', '.join(runs)}")
    except CarryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
