"""GPU parity and speed of the causal MD-EMA scan (`longmixer.ops.ema.scan`) against the official torch computation
(`ema_ref`: Vandermonde + FFT) and the Triton kernel generation + cuFFT path (`ema_conv_fast`).

Run on the GPU:  PYTHONUNBUFFERED=1 PYTHONPATH=src python3 scripts/bench/ema_scan.py
Smoke test here: TRITON_INTERPRET=1 PYTHONPATH=src python scripts/bench/ema_scan.py --quick
"""

from __future__ import annotations

import argparse
import sys

import torch

from longmixer.ops.ema import ema, ema_ref, ema_scan
from longmixer.ops.ema import scan
from longmixer.ops.ema.function import EMAKernelFunction, ema_conv_fast

from _common import ROWS, bench, peak_mem, rel, row  # scripts/bench/_common.py (this folder is sys.path[0])


def inputs(B, L, D, N, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed + L + D)
    x = torch.randn(B, L, D, generator=g).to(device, dtype).requires_grad_()
    coef_in = torch.randn(D, N, generator=g).to(device).requires_grad_()
    decay = (torch.rand(D, N, generator=g) * 0.5 + 0.49).to(device).requires_grad_()
    coef_out = (torch.randn(D, N, generator=g) * 0.25).to(device).requires_grad_()
    return x, coef_in, decay, coef_out


def kernel_gen_fft(x, coef_in, decay, coef_out):
    """The previous triton path for the causal EMA: kernel generation in Triton, convolution by cuFFT."""
    k = EMAKernelFunction.apply(coef_in * coef_out, decay, x.shape[1])
    return ema_conv_fast(x, k, False).to(x.dtype)


def parity(device, quick) -> float:
    """Worst relative error of y and every gradient, fp32 and bf16 x, against the float64 official reference."""
    shapes = [(2, 70, 5, 16), (1, 130, 3, 2)] if quick else [
        (2, 1000, 96, 16), (1, 4097, 130, 16), (3, 333, 64, 2), (1, 65, 1000, 16), (2, 8191, 40, 8)]
    worst = {torch.float32: 0.0, torch.bfloat16: 0.0}
    for B, L, D, N in shapes:
        x, ci, q, co = inputs(B, L, D, N, device, torch.float64)
        dy = torch.randn(B, L, D, device=device, dtype=torch.float64)
        ref = ema_ref(x, ci, q, co)
        g_ref = torch.autograd.grad(ref, [x, ci, q, co], dy)
        for dtype in worst:
            xs = x.detach().to(dtype).requires_grad_()
            cs = [t.detach().float().requires_grad_() for t in (ci, q, co)]
            y = ema_scan(xs, *cs, backend="triton")
            g_tri = torch.autograd.grad(y, [xs, *cs], dy.to(dtype))
            if dtype == torch.bfloat16:  # compare with the reference on the same rounded input
                xr = x.detach().to(dtype).double().requires_grad_()
                ref_d = ema_ref(xr, ci, q, co)
                g_ref_d = torch.autograd.grad(ref_d, [xr, ci, q, co], dy.to(dtype).double())
            else:
                ref_d, g_ref_d = ref, g_ref
            errs = [rel(y, ref_d)] + [rel(a, b) for a, b in zip(g_tri, g_ref_d)]
            worst[dtype] = max(worst[dtype], max(errs))
            print(f"parity B{B} L{L} D{D} N{N} {str(dtype)[6:]}: y dx dcoef_in ddecay dcoef_out = "
                  + " ".join(f"{e:.1e}" for e in errs))
    ok = worst[torch.float32] < 1e-4 and worst[torch.bfloat16] < 2e-2
    row(f"parity: worst fp32 {worst[torch.float32]:.2e}, worst bf16 {worst[torch.bfloat16]:.2e} -> "
        + ("PASS" if ok else "FAIL"))
    return ok


def timed(name, shape, fn, tensors, quick, device):
    def fb():
        out = fn()
        out.backward(torch.ones_like(out))
        for t in tensors:
            t.grad = None
    with torch.no_grad():
        t_f = bench(fn, quick)
    t_fb = bench(fb, quick)
    mem = peak_mem(fb, device)
    return t_f, t_fb, mem


def speed(device, quick):
    shapes = [(2, 64, 8, 16)] if quick else [(8, 1024, 1024, 16), (8, 4096, 1024, 16), (8, 16384, 1024, 16),
                                            (1, 16384, 1024, 16)]
    dtype = torch.float32 if quick else torch.bfloat16
    row("")
    row("| shape (causal, N16) | implementation | fwd ms | fwd+bwd ms | speedup fwd / fwd+bwd vs torch | peak GiB |")
    row("| --- | --- | --- | --- | --- | --- |")
    for B, L, D, N in shapes:
        x, ci, q, co = inputs(B, L, D, N, device, dtype)
        base = None
        for name, fn in (("torch (MEGA official)", lambda: ema(x, ci, q, co, backend="torch")),
                         ("triton kernel-gen + cuFFT", lambda: kernel_gen_fft(x, ci, q, co)),
                         ("triton scan", lambda: ema_scan(x, ci, q, co, backend="triton"))):
            t_f, t_fb, mem = timed(name, (B, L, D), fn, (x, ci, q, co), quick, device)
            base = base or (t_f, t_fb)
            row(f"| B{B} L{L} D{D} {str(dtype)[6:]} | {name} | {t_f:.3f} | {t_fb:.3f} | "
                f"{base[0] / t_f:.2f}x / {base[1] / t_fb:.2f}x | {mem:.2f} |")


def sweep(device, quick):
    """Scan launch configurations (channels per program, warps, pipeline stages) on two shapes."""
    shapes = [(2, 64, 8, 16)] if quick else [(8, 4096, 1024, 16), (1, 16384, 1024, 16)]
    configs = [(32, 1, 2)] if quick else [(16, 1, 2), (32, 1, 1), (32, 1, 2), (32, 1, 3), (32, 2, 2), (64, 2, 2),
                                          (64, 4, 2), (128, 4, 2)]
    dtype = torch.float32 if quick else torch.bfloat16
    row("")
    row("| shape | BLOCK_D, warps, stages | scan fwd ms | scan bwd ms |")
    row("| --- | --- | --- | --- |")
    for B, L, D, N in shapes:
        x, ci, q, co = (t.detach() for t in inputs(B, L, D, N, device, dtype))
        pb, qq, g = (t.float().t().contiguous() for t in (ci, q, co))
        dy = torch.randn_like(x)
        for bd, nw, st in configs:
            _, states = scan.ema_scan_fwd(x, pb, qq, g, True, block_d=bd, num_warps=nw, stages=st)
            t_f = bench(lambda: scan.ema_scan_fwd(x, pb, qq, g, False, block_d=bd, num_warps=nw, stages=st), quick)
            t_b = bench(lambda: scan.ema_scan_bwd(x, dy, pb, qq, g, states, block_d=bd, num_warps=nw, stages=st),
                        quick)
            row(f"| B{B} L{L} D{D} | {bd}, {nw}, {st} | {t_f:.3f} | {t_b:.3f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU, TRITON_INTERPRET=1)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.quick else "cuda")
    if device.type == "cuda":
        print(torch.cuda.get_device_name(), "torch", torch.__version__)
    ok = parity(device, args.quick)
    speed(device, args.quick)
    sweep(device, args.quick)
    print("\n## summary\n")
    print("\n".join(ROWS))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
