"""GPU parity and speed of the MD-EMA convolution (`longmixer.ops.ema.ema`): the chunked state-passing kernels
(`chunked.py`, what `ema` runs for untruncated kernels) against the official torch computation (`ema_ref`:
Vandermonde + FFT) and the Triton kernel generation + cuFFT path (`ema_fft`, what `ema` runs for truncated ones;
`--truncated-only` times it at the LRA recipes' truncated shapes).

Run on the GPU:  PYTHONUNBUFFERED=1 PYTHONPATH=src python3 scripts/bench/ema_chunked.py
Smoke test here: TRITON_INTERPRET=1 PYTHONPATH=src python scripts/bench/ema_chunked.py --quick
"""

from __future__ import annotations

import argparse
import sys

import torch

from longmixer.ops.ema import ema, ema_ref
from longmixer.ops.ema.function import ema_fft

# scripts/bench/_common.py (this folder is sys.path[0])
from _common import ROWS, bench, fwd_bwd, out_of_bound, parity_status, peak_mem, rel, row, skip_status

# parity bounds (relative L2 error against float64, worst over y and every gradient), "float32" keys and 16-bit ones
PARITY_BOUND = {"float32": 1e-5, "16-bit": 2e-2}


def inputs(B, L, D, N, bidirectional, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed + L + D)
    Dk = 2 * D if bidirectional else D
    x = torch.randn(B, L, D, generator=g).to(device, dtype).requires_grad_()
    coef_in = torch.randn(Dk, N, generator=g).to(device).requires_grad_()
    decay = (torch.rand(Dk, N, generator=g) * 0.5 + 0.49).to(device).requires_grad_()
    coef_out = (torch.randn(Dk, N, generator=g) * 0.25).to(device).requires_grad_()
    return x, coef_in, decay, coef_out


def parity(device, quick) -> dict:
    """Worst relative error of y and every gradient (fp32 and bf16 x) against the float64 official reference."""
    # the last entries truncate the kernel (K < L): `ema` takes the kernel-gen + cuFFT path there (fft.py)
    # --quick (the interpreter's smoke test of the script; tests/ops covers the op's parity): one length past a
    # 64-step chunk, untruncated and truncated
    shapes = [(1, 70, 2, 4, None), (1, 70, 2, 4, 20)] if quick else [
        (2, 1000, 96, 16, None), (1, 4097, 130, 16, None), (3, 333, 64, 2, None), (1, 65, 1000, 16, None),
        (2, 8191, 40, 8, None), (1, 4097, 130, 16, 1024), (3, 333, 64, 8, 100)]
    worst = {}
    for B, L, D, N, trunc in shapes:
        for bidir in (False, True):
            x, ci, q, co = inputs(B, L, D, N, bidir, device, torch.float64)
            dy = torch.randn(B, L, D, device=device, dtype=torch.float64)
            for dtype in (torch.float32, torch.bfloat16):
                xs = x.detach().to(dtype).requires_grad_()
                cs = [t.detach().float().requires_grad_() for t in (ci, q, co)]
                y = ema(xs, *cs, bidirectional=bidir, truncation=trunc, backend="triton")
                g_tri = torch.autograd.grad(y, [xs, *cs], dy.to(dtype))
                # the reference sees the same rounded input and output gradient
                xr = xs.detach().double().requires_grad_()
                ref = ema_ref(xr, ci, q, co, bidirectional=bidir, truncation=trunc)
                g_ref = torch.autograd.grad(ref, [xr, ci, q, co], dy.to(dtype).double())
                errs = [rel(y, ref)] + [rel(a, b) for a, b in zip(g_tri, g_ref)]
                key = f"{'bidir' if bidir else 'causal'}{' truncated' if trunc else ''} {str(dtype)[6:]}"
                worst[key] = max(worst.get(key, 0.0), max(errs))
                print(f"parity B{B} L{L} D{D} N{N} {key}: y dx dcoef_in ddecay dcoef_out = "
                      + " ".join(f"{e:.1e}" for e in errs))
    print("ema parity worst rel err vs float64: " + ", ".join(f"{k} {v:.1e}" for k, v in worst.items()))
    return worst



def time_paths(paths, ins, quick, device) -> dict:
    """{name: (fwd ms, fwd+bwd ms, peak GiB)} of each (name, fn); NaN where a path runs out of memory."""
    res = {}
    for name, fn in paths:
        try:
            with torch.no_grad():
                f_ms = bench(fn, quick)
            fb = fwd_bwd(fn, ins)
            res[name] = (f_ms, bench(fb, quick), peak_mem(fb, device))
        except torch.OutOfMemoryError:
            res[name] = (float("nan"),) * 3
            torch.cuda.empty_cache()
    return res


def report(bidir: bool, shape: str, res: dict) -> None:
    """One table row per path, with its speed-up over the official torch path."""
    ref = res["official torch"]
    for name, (f_ms, fb_ms, mem) in res.items():
        row(f"| {'bidir' if bidir else 'causal'} | {shape} | {name} | {f_ms:.3f} | {fb_ms:.3f} | "
            f"{ref[0] / f_ms:.2f}x / {ref[1] / fb_ms:.2f}x | {mem:.2f} |")


def speed(device, quick, dtype):
    shapes = [(1, 64, 2)] if quick else [(8, 1024, 1024), (8, 4096, 1024), (8, 16384, 1024), (1, 16384, 1024),
                                          (1, 65536, 1024)]
    for B, L, D in shapes:
        for bidir in (False, True):
            ins = inputs(B, L, D, 16, bidir, device, dtype)
            res = time_paths([("official torch", lambda: ema_ref(*ins, bidirectional=bidir)),
                              ("kernel-gen + cuFFT", lambda: ema_fft(*ins, bidirectional=bidir)),
                              ("chunked (ema)", lambda: ema(*ins, bidirectional=bidir, backend="triton"))],
                             ins, quick, device)
            report(bidir, f"B{B} L{L} D{D} N16 {str(dtype)[6:]}", res)


def speed_truncated(device, quick):
    """Truncated kernels (K < L, what MEGA's and LongVQ's LRA recipes run), bf16 x: `ema` (kernel generation +
    cuFFT with its backward written out, ops/ema/fft.py) against the official torch path."""
    shapes = [(1, 64, 16, 16)] if quick else [(8, 4096, 128, 1024), (2, 16384, 128, 1024), (8, 4096, 1024, 1024)]
    for B, L, D, K in shapes:
        for bidir in (False, True):
            ins = inputs(B, L, D, 16, bidir, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
            res = time_paths([("official torch", lambda: ema_ref(*ins, bidirectional=bidir, truncation=K)),
                              ("truncated (ema)", lambda: ema(*ins, bidirectional=bidir, truncation=K,
                                                              backend="triton"))], ins, quick, device)
            report(bidir, f"B{B} L{L} D{D} K{K} N16", res)


def sweep(device, quick):
    """Tile variants of the chunked kernels alone (transposed rows, kernel taps precomputed): fwd / bwd ms."""
    from longmixer.ops.ema import chunked, kernel

    shapes = [(1, 64, 2)] if quick else [(8, 4096, 1024), (1, 16384, 1024)]
    variants = [(32, 16, 1, 1), (16, 32, 1, 1)] if quick else [
        (32, 32, 1, 1), (32, 64, 1, 1), (16, 32, 1, 1), (16, 64, 1, 1), (64, 32, 1, 1), (32, 32, 2, 2),
        (32, 16, 1, 1), (64, 16, 2, 2)]
    for B, L, D in shapes:
        x, ci, q, co = inputs(B, L, D, 16, False, device, torch.bfloat16)
        xt = x.detach().transpose(1, 2).contiguous()
        dyt = torch.randn_like(xt)
        c32, q32 = (ci * co).detach().float().contiguous(), q.detach().float().contiguous()
        ours = bench(lambda: chunked.transpose(x), quick)
        torch_ms = bench(lambda: x.transpose(1, 2).contiguous(), quick)
        row(f"| sweep B{B} L{L} D{D} | transpose [B, L, D] -> [B, D, L]: ours {ours:.3f} ms, torch {torch_ms:.3f} ms, "
            f"copy {bench(x.clone, quick):.3f} ms |")
        for C, J, wf, wb in variants:
            k = kernel.ema_kernel_fwd(c32, q32, C)
            try:
                f_ms = bench(lambda: chunked.ema_chunk_fwd(xt, k, c32, q32, False, out_dtype=xt.dtype, block_j=J,
                                                           num_warps=wf), quick)
                b_ms = bench(lambda: chunked.ema_chunk_bwd(xt, dyt, k, c32, q32, False, block_j=J, num_warps=wb),
                             quick)
            except Exception as e:  # a tile that does not fit the chip: report and go on
                print(f"variant C{C} J{J} warps {wf}/{wb}: {type(e).__name__}: {str(e)[:120]}")
                continue
            row(f"| sweep causal B{B} L{L} D{D} | C{C} J{J} warps fwd {wf} bwd {wb} | {f_ms:.3f} | {b_ms:.3f} |")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU interpreter): check the script runs")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--truncated-only", action="store_true", help="parity, then only the truncated-kernel rows")
    args = ap.parse_args()
    if (status := skip_status("ema_chunked.py", args.quick)) is not None:
        return status
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        print(torch.cuda.get_device_name(), torch.__version__)
    worst = {} if args.skip_parity else parity(device, args.quick)
    print("| direction | shape | path | fwd ms | fwd+bwd ms | speedup vs official fwd / fwd+bwd | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    if not args.truncated_only:
        speed(device, args.quick, torch.bfloat16 if device.type == "cuda" else torch.float32)
    speed_truncated(device, args.quick)
    if not args.truncated_only:
        if device.type == "cuda" and not args.quick:
            speed_fp32_row(device)
        if not args.skip_sweep:
            sweep(device, args.quick)
    print("\n".join(["", "summary:"] + ROWS))
    failures = []
    for key, err in worst.items():
        out_of_bound(failures, f"worst {key}", err, PARITY_BOUND["float32" if "float32" in key else "16-bit"])
    return parity_status("ema_chunked.py", failures)


def speed_fp32_row(device):
    """float32 x (3xTF32 dots) at B8 L4096 D1024: the training dtype of MEGA's fp32 recipes."""
    for bidir in (False, True):
        ins = inputs(8, 4096, 1024, 16, bidir, device, torch.float32)
        res = time_paths([("official torch", lambda: ema_ref(*ins, bidirectional=bidir)),
                          ("kernel-gen + cuFFT", lambda: ema_fft(*ins, bidirectional=bidir)),
                          ("chunked (ema)", lambda: ema(*ins, bidirectional=bidir, backend="triton"))],
                         ins, False, device)
        report(bidir, "B8 L4096 D1024 N16 float32", res)


if __name__ == "__main__":
    sys.exit(main())
