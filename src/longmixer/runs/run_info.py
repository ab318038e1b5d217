"""What a run directory records about itself: the git commit (and whether the tree was dirty), the installed
package versions, the command line, and the hardware; and, in `attempts`, the same for every attempt that ran in
it (a resumed run may continue on other code, another host or other GPUs)."""

from __future__ import annotations

import json
import logging
import platform
import socket
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from longmixer.runs.resume import write_atomically

log = logging.getLogger("longmixer")

PACKAGES = ("longmixer", "torch", "pytorch-lightning", "hydra-core", "omegaconf", "triton", "numpy", "wandb",
            "datasets", "einops")


def git_output(*args: str, cwd: Path) -> str | None:
    """`git <args>`'s stripped output in `cwd`, or None where git is missing, fails (not a checkout) or hangs."""
    try:
        out = subprocess.run(["git", *args], check=False, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def collect_run_info(repo_dir: Path) -> dict:
    """A JSON-able dict: git commit/dirty, package versions, python, command, CUDA devices."""
    import torch

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    status = git_output("status", "--porcelain", "--untracked-files=no", cwd=repo_dir)
    return {
        "git_commit": git_output("rev-parse", "HEAD", cwd=repo_dir),
        "git_dirty": None if status is None else bool(status),
        "packages": versions,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "command": sys.argv,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


ATTEMPT_KEYS = ("git_commit", "git_dirty", "command", "cuda_devices")


def write_run_info(run_dir: Path, repo_dir: Path, resumed_from: str | None = None) -> dict:
    """Write `<run_dir>/run_info.json`: this attempt's `collect_run_info` at the top level, and under `attempts`
    the list of every attempt so far (when it started, the host, commit, command, GPUs and the checkpoint it
    resumed from), this one appended. Warns when this attempt's commit is not the previous attempt's."""
    path = run_dir / "run_info.json"
    try:
        previous = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        kept = path.with_name(f"{path.name}.unreadable.{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
        path.replace(kept)
        log.warning("%s is unreadable: kept as %s; the record of attempts starts again", path, kept.name)
        previous = {}
    attempts = previous.get("attempts") if isinstance(previous, dict) else None
    if attempts is None:  # written before attempts were recorded: its top level is the one earlier attempt
        attempts = [{k: previous.get(k) for k in ATTEMPT_KEYS}] if previous else []
    info = collect_run_info(repo_dir)
    attempt = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": socket.gethostname(),
               **{k: info[k] for k in ATTEMPT_KEYS}, "resumed_from": resumed_from}
    last = attempts[-1].get("git_commit") if attempts else None
    if last and info["git_commit"] and last != info["git_commit"]:
        log.warning("this run started on commit %s and continues on %s (run_info.json lists every attempt)",
                    last[:10], info["git_commit"][:10])
    info["attempts"] = [*attempts, attempt]
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(info, indent=2))
    return info


def record_attempt_end(run_dir: Path, outcome: str) -> None:
    """Set this attempt's `ended` in run_info.json (`finished`, `failed: <error>`, `stopped by signal 15`, ...), so
    that a run listed as unfinished says why; nothing when the file is missing or unreadable."""
    path = run_dir / "run_info.json"
    try:
        info = json.loads(path.read_text())
        info["attempts"][-1]["ended"] = outcome
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return
    write_atomically(path, json.dumps(info, indent=2))
