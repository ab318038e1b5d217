"""GPU utilization sampled from `nvidia-smi` while another process trains: the figure issue "speed" asks for
(`make train ARGS="experiment=chela/listops trainer=gpu"` keeps the GPU >= 85% busy) and the one the learning-curve
runs record beside their curves.

`utilization.gpu` is the percentage of the driver's last sample period (1/6 s to 1 s) in which any kernel ran: the
same notion as the bench's GPU busy %, measured from outside the process, so it includes data loading, logging,
validation and everything else a real run does between steps.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

QUERY = ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"]


def available() -> bool:
    return shutil.which("nvidia-smi") is not None


def device_ids(indices: list[int]) -> list[str]:
    """The ids `nvidia-smi -i` and `CUDA_VISIBLE_DEVICES` take for CUDA device indices as this process sees them:
    through `CUDA_VISIBLE_DEVICES` when it is set (a scheduler that handed out GPUs 4 and 5 makes index 0 mean GPU
    4), else the indices themselves.

    Raises:
        ValueError: an index past the visible devices, naming both.
    """
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if "CUDA_VISIBLE_DEVICES" not in os.environ or not visible:
        return [str(i) for i in indices]
    bad = [i for i in indices if not 0 <= i < len(visible)]
    if bad:
        raise ValueError(f"GPU index {bad[0]} is past the {len(visible)} visible device(s) "
                         f"(CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']}): use indices 0..{len(visible) - 1}")
    return [visible[i] for i in indices]


def gpu_name() -> str:
    if not available():
        return "none"
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"


def parse_sample(text: str) -> tuple[int, int] | None:
    """(util %, memory MiB) of the first GPU from one `nvidia-smi` query line; None for anything else (an error
    message, `[N/A]`)."""
    lines = text.strip().splitlines()
    if not lines:
        return None
    parts = [p.strip() for p in lines[0].split(",")]
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def parse_samples(text: str) -> list[tuple[int, int]] | None:
    """(util %, memory MiB) of every GPU in one `nvidia-smi` query answer, one line each; None when any line is
    not a sample (the answer is then dropped whole, so the GPUs' rows stay aligned in time)."""
    lines = text.strip().splitlines()
    samples = [parse_sample(line) for line in lines]
    return samples if samples and all(s is not None for s in samples) else None


class GpuSampler:
    """Samples GPUs every `interval_s` in a background thread while the `with` block runs.

    `gpus=None` samples the first GPU this process sees; a list of device indices samples those (`nvidia-smi -i`,
    through `CUDA_VISIBLE_DEVICES`: `device_ids`), for runs spread over several GPUs of one host. `by_gpu[index]`
    holds (seconds since start, util %, memory MiB) rows of each sampled GPU, and `rows` those of the first one.
    Without `nvidia-smi` it records nothing.
    """

    def __init__(self, interval_s: float = 0.5, gpus: list[int] | None = None):
        self.interval_s = interval_s
        self.gpus = list(gpus) if gpus else [0]
        self.by_gpu: dict[int, list[tuple[float, int, int]]] = {g: [] for g in self.gpus}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.start_time = time.time()

    @property
    def rows(self) -> list[tuple[float, int, int]]:
        return self.by_gpu[self.gpus[0]]

    def _loop(self) -> None:
        query = QUERY + ["-i", ",".join(device_ids(self.gpus))]
        while not self._stop.is_set():
            out = subprocess.run(query, capture_output=True, text=True)
            t = round(time.time() - self.start_time, 2)
            samples = parse_samples(out.stdout) if out.returncode == 0 else None
            if samples is not None and len(samples) == len(self.gpus):
                for g, sample in zip(self.gpus, samples):
                    self.by_gpu[g].append((t, *sample))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> GpuSampler:
        self.start_time = time.time()
        if available():
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def summarize(rows: list[tuple[float, int, int]], settle_s: float = 30.0) -> dict:
    """Mean utilization over the whole sampling and over the steady part of the run.

    The steady part starts `settle_s` after the first sample with a kernel running (start-up: imports, data
    checks, model build, compilation) and ends at the last such sample (the process tearing down). Both means are
    reported; the steady one is the run's figure.
    """
    if not rows:
        return {"samples": 0, "mean_util_pct": None, "steady_util_pct": None, "steady_s": 0.0}
    busy = [t for t, util, _ in rows if util > 0]
    steady = []
    if busy:
        lo, hi = busy[0] + settle_s, busy[-1]
        steady = [util for t, util, _ in rows if lo <= t <= hi]
    return {"samples": len(rows), "mean_util_pct": round(sum(u for _, u, _ in rows) / len(rows), 1),
            "steady_util_pct": round(sum(steady) / len(steady), 1) if steady else None,
            "steady_s": round(max(0.0, busy[-1] - busy[0] - settle_s), 1) if busy else 0.0,
            "max_mem_mib": max(m for _, _, m in rows)}
