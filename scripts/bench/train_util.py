"""GPU utilization of a real training run: `python -m longmixer.train <overrides>` (what `make train ARGS="..."`
runs) with `nvidia-smi` sampled twice a second (utils/gpu_monitor.py).

    python scripts/bench/train_util.py --out bench_out -- experiment=chela/listops trainer=gpu data=listops_gen \
        +trainer.max_time=00:00:04:00

Written under --out: `train_util_<name>.csv` (t_s, util_pct, mem_mib) and `train_util_<name>.json` (the command,
GPU, exit code, the whole-run and steady-state means; see `gpu_monitor.summarize` for what "steady" excludes).
Issue "speed"'s target is a steady figure >= 85% for `experiment=chela/listops trainer=gpu`; with no overrides
that run is what this script measures (on generated ListOps, 4 minutes). Without `nvidia-smi` (no NVIDIA GPU) it
says so and exits 0, so `make bench` runs on any machine. Otherwise it exits with the training run's status (2 for a
refused setting, 143 when a SIGTERM stopped it), written beside the figures, so `make bench` stops at a run that
failed.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from longmixer.utils.gpu_monitor import GpuSampler, available, gpu_name, summarize

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_RUN = ["experiment=chela/listops", "trainer=gpu", "data=listops_gen", "+trainer.max_time=00:00:04:00"]


def run_name(overrides: list[str]) -> str:
    """A file-name-safe label from the experiment override (`chela/listops` -> `chela_listops`)."""
    for o in overrides:
        if o.startswith("experiment="):
            return re.sub(r"[^A-Za-z0-9._-]+", "_", o.split("=", 1)[1])
    return "run"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--interval-s", type=float, default=0.5, help="seconds between nvidia-smi samples")
    parser.add_argument("--settle-s", type=float, default=30.0,
                        help="seconds after the first busy sample left out of the steady mean (start-up, compiling)")
    parser.add_argument("--name", default=None, help="label of the output files (default: from experiment=)")
    parser.add_argument("overrides", nargs="*", default=DEFAULT_RUN,
                        help=f"the training run's Hydra overrides, after -- (default: {' '.join(DEFAULT_RUN)})")
    args = parser.parse_args(argv)
    if not available():
        print("train_util: no nvidia-smi here (no NVIDIA GPU); nothing measured")
        return {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or run_name(args.overrides)
    cmd = [sys.executable, "-m", "longmixer.train", *args.overrides]
    start = time.time()
    with GpuSampler(args.interval_s) as sampler:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        # a SIGTERM (a `timeout`, a scheduler) goes on to the run, which checkpoints and exits 143; the figures
        # sampled so far are still written below
        signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signal.SIGTERM))
        code = proc.wait()
    summary = {"command": "python -m longmixer.train " + " ".join(args.overrides), "gpu": gpu_name(),
               "host_cpus": os.cpu_count(), "exit_code": code, "wall_s": round(time.time() - start, 1),
               "settle_s": args.settle_s, **summarize(sampler.rows, args.settle_s)}
    with open(out / f"train_util_{name}.csv", "w", newline="") as f:
        csv.writer(f).writerows([("t_s", "util_pct", "mem_mib"), *sampler.rows])
    (out / f"train_util_{name}.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    if code != 0:
        print(f"train_util: the training run exited with status {code}: {summary['command']}", file=sys.stderr)
    return summary


def exit_status(summary: dict) -> int:
    """The script's exit status: the training run's (0 when nothing was measured); 1 for a run ended by a signal
    it did not handle (a negative returncode)."""
    code = summary.get("exit_code", 0)
    return code if 0 <= code < 256 else 1


if __name__ == "__main__":
    sys.exit(exit_status(main()))
