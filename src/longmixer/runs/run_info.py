"""What a run directory records about itself: the git commit (and whether the tree was dirty), the installed
package versions, the command line, and the hardware."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

PACKAGES = ("longmixer", "torch", "pytorch-lightning", "hydra-core", "omegaconf", "triton", "numpy", "wandb",
            "datasets", "einops")


def _git(*args: str, cwd: Path) -> str | None:
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
    status = _git("status", "--porcelain", "--untracked-files=no", cwd=repo_dir)
    return {
        "git_commit": _git("rev-parse", "HEAD", cwd=repo_dir),
        "git_dirty": None if status is None else bool(status),
        "packages": versions,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "command": sys.argv,
        "cuda_devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }


def write_run_info(run_dir: Path, repo_dir: Path) -> dict:
    info = collect_run_info(repo_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run_info.json").write_text(json.dumps(info, indent=2))
    return info
