"""Running `python -m longmixer.train` as a real subprocess with a tiny config, and comparing two run dirs."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
# 96 examples / batch 16 = 6 steps per epoch; validation at every epoch end; last.ckpt also every 4 steps
TINY = ["data.num_train=96", "data.num_val=32", "data.num_test=32", "data.max_depth=3", "data.max_args=3",
        "data.min_length=3", "data.max_length=30", "data.seq_len=30", "data.batch_size=16", "model.d_model=16",
        "model.d_ffn=32", "model.d_classifier=16", "model.n_layers=1", "model.dropout=0.1", "trainer.max_steps=15",
        "trainer.limit_val_batches=2", "trainer.limit_test_batches=2", "trainer.enable_progress_bar=false",
        "trainer.num_sanity_val_steps=0", "trainer.log_every_n_steps=1", "callbacks.checkpoint.every_n_train_steps=4",
        "~callbacks.summary", "~callbacks.throughput", "trainer.enable_model_summary=false"]


def run_train(tmp_path: Path, args: list[str], fault: str | None = None, timeout: float = 300,
              entry: str = "longmixer.train", tiny: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]), "WANDB_MODE": "offline", "HYDRA_FULL_ERROR": "1",
           "OMP_NUM_THREADS": "1"}
    tmp_path.mkdir(parents=True, exist_ok=True)
    env.pop("LONGMIXER_FAULT", None)
    if fault:
        env["LONGMIXER_FAULT"] = fault
    paths = [f"paths.log_dir={tmp_path / 'logs'}", f"paths.data_dir={tmp_path / 'data'}"] if tiny else []
    cmd = [sys.executable, "-m", entry, *paths, *(TINY if tiny else []), *args]
    return subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
                          start_new_session=True)


def run_dir_of(tmp_path: Path) -> Path:
    dirs = [p.parent for p in (tmp_path / "logs" / "runs").rglob("config_resolved.yaml")]
    assert len(dirs) == 1, dirs
    return dirs[0]


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]


TIMING = ("train/speed/", "time")


# training metrics aggregated over an epoch: a resume mid-epoch restarts their accumulators (Lightning does not
# checkpoint them), so after such a resume only their presence is compared
EPOCH_AGGREGATES = ("train/acc", "train/loss_epoch")


def metric_rows(run_dir: Path, skip_values: tuple[str, ...] = ()) -> list[tuple]:
    """metrics.csv as a sorted list of rows, each a tuple of (column, value) pairs without the timing columns;
    columns in `skip_values` keep their place with the value replaced by None."""
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        rows = [tuple(sorted((k, None if k in skip_values else float(v)) for k, v in row.items()
                             if v not in ("", None) and not k.startswith(TIMING))) for row in csv.DictReader(f)]
    return sorted(rows, key=repr)


def describe(proc: subprocess.CompletedProcess) -> str:
    return f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
