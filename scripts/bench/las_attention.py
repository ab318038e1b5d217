"""Benchmark of the las_attention op (LaS eq. 3, arXiv:2311.16620): parity, then speed and peak memory.

(1) Parity of both Triton paths (prep + SDPA; flash kernel) against the float64 materialized reference, forward and
backward, at several shapes with ragged tails. (2) Times with `triton.testing.do_bench` (median, ms), fwd and
fwd+bwd, T = 1K..16K, 8 heads, d 64 (`--heads`, `--head-dim`), 32K tokens per call: ours (prep + SDPA, prep + the
flash kernel without the decay, the flash kernel; each Triton backward with dq by atomics where the op takes them and
from its own kernel, `*_dq_kernel`; `ours_dispatch` is what `las_attention` picks) vs the materialized reference, the
separable form in plain torch ops, FlexAttention (compiled, same score_mod + causal block mask) and causal SDPA
without the decay.
(3) Peak memory of one fwd+bwd. (4) A markdown table at the end.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 scripts/bench/las_attention.py            # GPU
    TRITON_INTERPRET=1 PYTHONPATH=src python3 scripts/bench/las_attention.py --quick    # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
from torch.nn import functional as F

from longmixer.ops.las_attention import las_attention, las_attention_ref, las_attention_separable_ref, smooth_values
from longmixer.ops.las_attention.function import las_attention_flash, las_attention_separable

# scripts/bench/_common.py (this folder is sys.path[0])
from _common import out_of_bound, parity_status, peak_mem, skip_status

# parity bounds (relative L2 error against float64), as scripts/bench/parity.py's: the GPU gave float32 <= 1.1e-6
# and bf16 <= 5.6e-3 (docs/benchmarks.md)
PARITY_BOUND = {"float32": 1e-4, "bfloat16": 2e-2}

H, K = 8, 64


def alphas(n_heads: int, b: float) -> torch.Tensor:
    """The LaS mixer's alpha_c (mixers/las.py `las_alphas`), rebuilt here so the script needs no mixer import."""
    return torch.tensor([-math.log1p(-b * c / (n_heads - 1)) for c in range(n_heads)], dtype=torch.float32)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def parity(device: str, shapes, dtypes, b_values, pool_size: int) -> list[dict]:
    rows = []
    for (B, L) in shapes:
        for b in b_values:
            alpha = alphas(H, b).to(device)
            g = torch.Generator(device=device).manual_seed(L)
            q, k, v = (torch.randn(B, H, L, K, device=device, generator=g, dtype=torch.float64).requires_grad_()
                       for _ in range(3))
            ref = las_attention_ref(q, k, v, alpha.double(), pool_size=pool_size)
            do = torch.randn_like(ref)
            refs = [ref, *torch.autograd.grad(ref, (q, k, v), do)]
            for dtype in dtypes:
                for name, fn in (("separable", las_attention_separable),
                                 ("separable_triton", lambda *a, **kw: las_attention_separable(*a, attention="triton",
                                                                                               **kw)),
                                 ("flash", las_attention_flash)):
                    if name.startswith("separable") and b * (L - 1) / 2 > 30:
                        continue  # out of the separable path's range: `las_attention` would pick flash
                    x = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
                    out = fn(*x, alpha, pool_size=pool_size)
                    got = [out, *torch.autograd.grad(out, x, do.to(dtype))]
                    errs = {n: rel_err(a, r) for n, a, r in zip(("o", "dq", "dk", "dv"), got, refs)}
                    finite = all(torch.isfinite(t).all().item() for t in got)
                    rows.append(dict(B=B, L=L, B_decay=b, dtype=str(dtype).split(".")[-1], path=name,
                                     finite=finite, **errs))
                    print(f"parity B={B} L={L} b={b} {rows[-1]['dtype']} {name}: " +
                          " ".join(f"{n}={e:.2e}" for n, e in errs.items()) + f" finite={finite}")
    return rows


def timer(fn, grads=None) -> float:
    if torch.cuda.is_available():
        import triton
        return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grads, quantiles=[0.5, 0.2, 0.8])[0]
    fn()
    t0 = time.perf_counter()
    for _ in range(2):
        fn()
    return (time.perf_counter() - t0) / 2 * 1e3


def methods(alpha: torch.Tensor, P: int, use_flex: bool, sdpa_backends):
    from torch.nn.attention import sdpa_kernel

    def with_backend(fn, backend):
        def run(q, k, v):
            with sdpa_kernel([backend]):
                return fn(q, k, v)
        return run

    out = {}
    for be in sdpa_backends:
        tag = str(be).split(".")[-1].lower().replace("_attention", "")
        out[f"sdpa_causal[{tag}]"] = with_backend(lambda q, k, v: F.scaled_dot_product_attention(q, k, v,
                                                                                                  is_causal=True), be)
        out[f"ours_separable[{tag}]"] = with_backend(lambda q, k, v: las_attention_separable(q, k, v, alpha,
                                                                                             pool_size=P), be)
    out["ours_separable_triton"] = lambda q, k, v: las_attention_separable(q, k, v, alpha, pool_size=P,
                                                                           attention="triton")
    out["ours_separable_triton_dq_kernel"] = out["ours_separable_triton"]  # `speed` sets ONE_PASS_MAX_K = 0
    out["ours_flash"] = lambda q, k, v: las_attention_flash(q, k, v, alpha, pool_size=P)
    out["ours_flash_dq_kernel"] = out["ours_flash"]
    max_alpha = float(alpha.max())  # the LaS mixer's bound, a Python float
    out["ours_dispatch"] = lambda q, k, v: las_attention(q, k, v, alpha, pool_size=P, max_alpha=max_alpha)
    out["separable_unfused"] = lambda q, k, v: las_attention_separable_ref(q, k, v, alpha, pool_size=P)
    out["materialized"] = lambda q, k, v: las_attention_ref(q, k, v, alpha, pool_size=P)
    if use_flex:
        import torch._dynamo
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        for knob in ("cache_size_limit", "recompile_limit"):  # one graph per (T, grad mode): 10 in all
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 64)
        flex = torch.compile(flex_attention, dynamic=False)

        def score_mod(score, b, h, q_idx, kv_idx):
            d = q_idx - kv_idx
            return torch.where(d >= 0, score * torch.exp(-alpha[h] * d.to(torch.float32)), score)

        masks = {}

        def run_flex(q, k, v):
            L = q.shape[-2]
            if L not in masks:
                masks[L] = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, L, L, device=q.device)
            return flex(q, k, smooth_values(v, P, False), score_mod=score_mod, block_mask=masks[L])
        out["flex_attention"] = run_flex
    return out


def speed(device: str, lengths, tokens: int, dtype, b: float, P: int, use_flex: bool, sdpa_backends,
          skip_materialized_above: int, only: list[str]) -> list[dict]:
    from longmixer.ops.las_attention import kernel

    alpha = alphas(H, b).to(device)
    rows = []
    for L in lengths:
        B = max(1, tokens // L)
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(B, H, L, K, device=device, dtype=dtype, generator=g).requires_grad_() for _ in range(3))
        do = torch.randn_like(q)
        for name, fn in methods(alpha, P, use_flex, sdpa_backends).items():
            if only and not any(o in name for o in only):
                continue
            row = dict(T=L, B=B, method=name)
            if name == "materialized" and L > skip_materialized_above:
                row.update(fwd_ms=None, fwdbwd_ms=None, peak_gib=None, note="skipped (O(L^2) memory)")
                rows.append(row)
                continue
            one_pass_max_k = kernel.ONE_PASS_MAX_K
            if name.endswith("_dq_kernel"):  # the backward's dq from its own kernel at every head width
                kernel.ONE_PASS_MAX_K = 0
            try:
                def fwd():
                    with torch.no_grad():
                        fn(q, k, v)

                def fwdbwd():
                    fn(q, k, v).backward(do)
                fwdbwd()  # compile / warm every path before timing
                row["fwd_ms"] = timer(fwd)
                row["fwdbwd_ms"] = timer(fwdbwd, grads=[q, k, v])
                row["peak_gib"] = peak_mem(fwdbwd, torch.device(device))
            except torch.OutOfMemoryError:
                row.update(fwd_ms=None, fwdbwd_ms=None, peak_gib=None, note="OOM")
            except Exception as e:  # noqa: BLE001 - a baseline that fails on this machine is reported, not fatal
                row.update(fwd_ms=None, fwdbwd_ms=None, peak_gib=None, note=f"{type(e).__name__}: {str(e)[:120]}")
            kernel.ONE_PASS_MAX_K = one_pass_max_k
            q.grad = k.grad = v.grad = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            print(json.dumps(row))
            rows.append(row)
    return rows


def bwd_sweep(device: str, lengths, tokens: int, b: float, configs) -> list[dict]:
    """Backward of the flash kernel alone (dq, dk, dv from saved o, lse), bf16, for several tile configurations."""
    from longmixer.ops.las_attention.kernel import las_attention_bwd, las_attention_fwd
    alpha = alphas(H, b).to(device)
    rows = []
    for L in lengths:
        B = max(1, tokens // L)
        q, k, v, do = (torch.randn(B, H, L, K, device=device, dtype=torch.bfloat16) for _ in range(4))
        o, lse = las_attention_fwd(q, k, v, alpha, K ** -0.5)
        for cfg in configs:
            ms = timer(lambda: las_attention_bwd(q, k, v, alpha, o, lse, do, K ** -0.5, config=cfg))
            rows.append(dict(T=L, B=B, config=list(cfg), bwd_ms=ms))
            print(json.dumps(rows[-1]))
    return rows


def table(rows: list[dict], baseline_prefix: str) -> str:
    base = {r["T"]: r for r in rows if r["method"].startswith(baseline_prefix) and r.get("fwd_ms")}
    lines = ["| T | B | method | fwd ms | fwd+bwd ms | peak GiB | fwd / SDPA | fwd+bwd / SDPA |",
             "|---|---|---|---|---|---|---|---|"]

    def fmt(x, f="{:.3f}"):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f.format(x)

    for r in rows:
        b = base.get(r["T"])
        rf = r["fwd_ms"] / b["fwd_ms"] if b and r.get("fwd_ms") else None
        rb = r["fwdbwd_ms"] / b["fwdbwd_ms"] if b and r.get("fwdbwd_ms") else None
        lines.append(f"| {r['T']} | {r['B']} | {r['method']} | {fmt(r.get('fwd_ms'))} | {fmt(r.get('fwdbwd_ms'))} | "
                     f"{fmt(r.get('peak_gib'), '{:.2f}')} | {fmt(rf, '{:.2f}x')} | {fmt(rb, '{:.2f}x')} |"
                     + (f" {r['note']}" if r.get("note") else ""))
    return "\n".join(lines)


def main() -> int | None:
    global H, K
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU, TRITON_INTERPRET=1)")
    ap.add_argument("--lengths", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--tokens", type=int, default=32768, help="B * T per call")
    ap.add_argument("--b", type=float, default=0.001, help="the paper's B (alpha_max)")
    ap.add_argument("--pool", type=int, default=3, help="the paper's P")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time the flash backward at several tile configs")
    ap.add_argument("--only", default="", help="comma-separated substrings: time only the methods matching one")
    ap.add_argument("--heads", type=int, default=H)
    ap.add_argument("--head-dim", type=int, default=K, help="K = V per head (LaS Text: 8 heads of 8)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="dtype of the timed calls")
    args = ap.parse_args()
    if (status := skip_status("las_attention.py", args.quick)) is not None:
        return status
    H, K = args.heads, args.head_dim
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    if cuda:
        import triton
        from torch.nn.attention import SDPBackend
        print(f"GPU {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__} "
              f"cuDNN {torch.backends.cudnn.version()}; {H} heads of {K}, {args.dtype}")
        # cuDNN and FlashAttention take 16-bit inputs only; float32 runs the memory-efficient kernel
        backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION] if args.dtype == "bfloat16" else \
            [SDPBackend.EFFICIENT_ATTENTION]
    else:
        from torch.nn.attention import SDPBackend
        backends = [SDPBackend.MATH]
    if args.quick:
        shapes, dtypes, lengths, tokens = [(1, 37), (2, 64)], [torch.float32], [64, 128], 128
    else:
        shapes, dtypes, lengths, tokens = [(2, 1000), (1, 2085)], [torch.float32, torch.bfloat16], args.lengths, \
            args.tokens
    prows = [] if args.skip_parity else parity(device, shapes, dtypes, [args.b, 0.05], args.pool)
    srows = speed(device, lengths, tokens, getattr(torch, args.dtype) if cuda else torch.float32, args.b, args.pool,
                  use_flex=cuda and not args.no_flex, sdpa_backends=backends, skip_materialized_above=8192,
                  only=[o for o in args.only.split(",") if o])
    sweep_configs = [(64, 64, 4, 2), (64, 32, 4, 2), (128, 32, 4, 3), (128, 32, 4, 5), (128, 64, 8, 2), (128, 32, 8, 3)]
    wrows = bwd_sweep(device, [4096, 16384], tokens, args.b, sweep_configs) if args.sweep and cuda else []
    baseline = "sdpa_causal[" + str(backends[0]).split(".")[-1].lower().replace("_attention", "")
    md = table(srows, baseline)
    worst = max((max(r[n] for n in ("o", "dq", "dk", "dv")) for r in prows), default=float("nan"))
    summary = f"parity: {len(prows)} checks, worst relative error {worst:.2e}, all finite: " \
              f"{all(r['finite'] for r in prows)}"
    print("\n" + summary + "\n\n" + md)
    failures = []
    for r in prows:  # relative L2 errors against float64; the bounds of scripts/bench/parity.py
        label = f"B={r['B']} L={r['L']} b={r['B_decay']} {r['dtype']} {r['path']}"
        if not r["finite"]:
            failures.append(f"{label}: not finite")
        for n in ("o", "dq", "dk", "dv"):
            out_of_bound(failures, f"{label} {n}", r[n], PARITY_BOUND[r["dtype"]])
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "las_attention.json"), "w") as f:
            json.dump(dict(parity=prows, speed=srows, bwd_sweep=wrows), f, indent=1)
        with open(os.path.join(os.environ["OUT"], "las_attention.md"), "w") as f:
            f.write(summary + "\n\n" + md + "\n")
    return parity_status("las_attention.py", failures)


if __name__ == "__main__":
    sys.exit(main())
