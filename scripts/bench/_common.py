"""Helpers shared by the kernel benchmark scripts in this folder (imported as `_common`; `make bench` skips it)."""

from __future__ import annotations

import os
import sys
import time

import torch

ROWS: list[str] = []


def skip_status(script: str, quick: bool) -> int | None:
    """None when `script` can run here: on a CUDA GPU, or with `--quick` in Triton's CPU interpreter
    (TRITON_INTERPRET=1, the smoke test). Otherwise say why and return the exit status: 0 without a GPU, so that
    `make bench` on a CPU machine goes on to the next script, and 2 for full sizes in the interpreter (hours)."""
    interpreter = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreter and not quick:
        print(f"{script}: full sizes in Triton's interpreter would take hours; add --quick for its smoke test",
              file=sys.stderr)
        return 2
    if torch.cuda.is_available() or interpreter:
        return None
    print(f"{script} times GPU kernels: it needs a CUDA GPU (skipped; on a CPU, `TRITON_INTERPRET=1 PYTHONPATH=src "
          f"python scripts/bench/{script} --quick` runs its smoke test)")
    return 0


def row(line: str) -> None:
    """Keep a table row for the summary and print it now (a run cut short still shows what it measured)."""
    ROWS.append(line)
    print(line)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of `a` against the reference `b`, in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def bench(fn, quick: bool) -> float:
    """Median ms (triton.testing.do_bench; one timed call under --quick on CPU)."""
    if quick:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=60, quantiles=[0.5, 0.2, 0.8])[0]


def peak_mem(fn, device) -> float:
    """Peak memory in GiB above the memory in use before `fn` (CUDA only)."""
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def fwd_bwd(fn, tensors):
    """One training-style step of `fn`: forward, backward of a ones gradient, then the tensors' .grad dropped (so
    no step pays for accumulating into the previous one's gradients)."""
    def run():
        out = fn()
        out.backward(torch.ones_like(out))
        for t in tensors:
            t.grad = None
    return run


def out_of_bound(failures: list[str], label: str, err: float, bound: float) -> None:
    """Record `label` in `failures` when its parity error `err` is above `bound` or not a number."""
    if not err <= bound:  # NaN fails too
        failures.append(f"{label}: {err:.2e} > {bound:.0e}")


def parity_status(script: str, failures: list[str]) -> int:
    """The exit status of a kernel script after its parity checks: 1 when any case was out of its bound (each named
    on stderr), so that a run that goes on to time a wrong kernel still fails; else 0."""
    for failure in failures:
        print(f"{script}: parity FAILED {failure}", file=sys.stderr)
    return 1 if failures else 0
