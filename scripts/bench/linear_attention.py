"""Benchmark of CHELA's tiled linear attention (longmixer.ops.linear_attention) on the GPU.

1. parity: Triton kernel vs the torch reference, forward and every gradient (fp32 against float64, bf16 against
   float32), causal and not, ragged lengths, widths that are not powers of two;
2. timings (triton.testing.do_bench, median ms) of the kernel vs the torch reference, causal SDPA and FLA's
   `chunk_simple_gla` (when `fla` imports), forward and forward+backward, bf16;
3. peak memory of one forward+backward;
4. markdown tables at the end.

GPU:  PYTHONUNBUFFERED=1 PYTHONPATH=src python3 scripts/bench/linear_attention.py
      --tables b --skip-parity: the B8 grid alone; --only "T4096 H16" keeps the matching shapes;
      --sweep: our tile / segment configurations per shape (kernel.py's `tune`); --profile: per-kernel device
      times of one fwd+bwd; --old FILE: also time a saved copy of an earlier kernel.py (the before column).
CPU:  TRITON_INTERPRET=1 PYTHONPATH=src python scripts/bench/linear_attention.py --quick  (tiny sizes, no timings
      worth reading; checks the script runs)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
import triton

from longmixer.ops.linear_attention import linear_attention, linear_attention_ref
from longmixer.ops.linear_attention.function import linear_attention_triton

# scripts/bench/_common.py (this folder is sys.path[0])
from _common import out_of_bound, parity_status, peak_mem, skip_status

# parity bounds (max error relative to max |ref|). float32 against float64: 1e-4, as scripts/bench/parity.py. bf16:
# 6e-2, about twice the worst recorded on a GPU (3.1e-2, dq of B2 L777 K128 causal against the reference of the
# rounded inputs: saving the raw output in bf16, amplified by the norm's backward on rows of small norm;
# docs/benchmarks.md). The CHELA layer check (triton against torch, bf16 autocast; 6.6e-3 recorded): 3e-2.
PARITY_BOUND = {"float32": 1e-4, "bfloat16": 6e-2}
LAYER_BOUND = 3e-2


def load_fla():
    """FLA's chunk_simple_gla, or None with the reason printed (FLA is carried as a wheel to the GPU machine)."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as exc:  # the benchmark still measures the other columns; the table says "n/a"
        print(f"FLA not importable ({exc}); its columns are n/a")
        return None
    return chunk_simple_gla


def load_old(path):
    """An earlier kernel.py (its launchers `linear_attention_fwd(q, k, v, g, **opts) -> (o, h)` and
    `linear_attention_bwd(q, k, v, g, do, h, **opts)`), wrapped in autograd: the before column of a comparison."""
    spec = importlib.util.spec_from_file_location("la_old_kernel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    class Old(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, scale):
            ctx.opts = dict(causal=True, scale=scale, normalize=False, eps=1e-5, chunk_size=64, num_segments=None)
            o, h = mod.linear_attention_fwd(q, k, v, None, **ctx.opts)
            ctx.save_for_backward(q, k, v, h)
            return o

        @staticmethod
        def backward(ctx, do):
            q, k, v, h = ctx.saved_tensors
            dq, dk, dv, _ = mod.linear_attention_bwd(q, k, v, None, do, h, **ctx.opts)
            return dq, dk, dv, None

    return lambda q, k, v: Old.apply(q, k, v, q.shape[-1] ** -0.5)


def rel_err(ref, out):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-6)).item()


def parity(device, quick):
    """Max relative error of o, dq, dk, dv, dg per case: fp32 against the float64 reference; bf16 against the fp32
    reference of the fp32 inputs, and of the bf16-rounded inputs ("rounded"), which leaves out what rounding the
    inputs costs every bf16 implementation (the norm's backward amplifies it on rows of small norm)."""
    cases = [(2, 50, 2, 20, 24, 16), (1, 70, 1, 16, 16, 16)] if quick else [
        (2, 1000, 4, 64, 64, 64), (1, 4133, 2, 80, 80, 64), (2, 777, 3, 128, 128, 64), (1, 16384, 2, 64, 64, 64)]
    rows = []
    for B, L, H, K, V, C in cases:
        for causal in (True, False):
            pairs = [(torch.float32, torch.float64, False)] + (  # the interpreter has no bfloat16
                [] if quick else [(torch.bfloat16, torch.float32, False), (torch.bfloat16, torch.float32, True)])
            for dtype, ref_dtype, rounded in pairs:
                gen = torch.Generator(device=device).manual_seed(0)
                ins = [torch.randn(B, L, H, d, device=device, generator=gen) for d in (K, K, V, V)]
                ref_in = [(t.to(dtype) if rounded else t).to(ref_dtype).requires_grad_() for t in ins]
                ref = linear_attention_ref(*ref_in, causal=causal, chunk_size=C)
                do = torch.randn_like(ref)
                do = do.to(dtype).to(ref_dtype) if rounded else do
                ref_g = torch.autograd.grad(ref, ref_in, do)
                tri_in = [t.to(dtype).requires_grad_() for t in ins]
                out = linear_attention(*tri_in, causal=causal, chunk_size=C, backend="triton")
                tri_g = torch.autograd.grad(out, tri_in, do.to(dtype))
                errs = [rel_err(ref, out)] + [rel_err(r, t) for r, t in zip(ref_g, tri_g)]
                rows.append((f"B{B}-L{L}-H{H}-K{K}-V{V}", "causal" if causal else "bidir",
                             str(dtype).split(".")[-1] + (" rounded" if rounded else ""), errs))
                print("parity", rows[-1][:3], " ".join(f"{e:.1e}" for e in errs), flush=True)
    return rows


def layer_check(device, quick):
    """The CHELA layer under bf16 autocast: backend triton vs torch (output, input gradient) and fwd+bwd ms."""
    from longmixer.mixers.chela import CHELA

    B, L, D = (2, 136, 32) if quick else (8, 4096, 128)
    rows = []
    for causal in (False, True):
        torch.manual_seed(0)
        m = CHELA(D, causal=causal, max_len=L, attention="laplace").to(device)
        x = torch.randn(B, L, D, device=device, requires_grad=True)
        res = {}
        for backend in ("triton", "torch"):
            m.backend = backend

            def step():
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not quick):
                    y, _ = m(x)
                y.float().square().mean().backward()
                return y

            x.grad = None
            y = step()
            res[backend] = (y.detach().float(), x.grad.clone(), bench(step, quick))
        err_y = rel_err(res["torch"][0], res["triton"][0])
        err_dx = rel_err(res["torch"][1], res["triton"][1])
        rows.append((f"B{B} L{L} D{D}", "causal" if causal else "bidir", err_y, err_dx, res["triton"][2],
                     res["torch"][2]))
        print("layer", rows[-1], flush=True)
    return rows


def bench(fn, quick):
    if quick:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def fwd_bwd(f, ins, grad_out):
    """One forward+backward; the gradients are dropped first, so the timing holds no accumulation into .grad."""
    def run():
        for t in ins:
            t.grad = None
        out = f(*ins)
        out.backward(grad_out)
    return run


def time_shape(B, T, H, D, device, dtype, fla, quick, with_ref, with_sdpa, fused, old=None):
    """ms for forward and forward+backward of every implementation at one shape (causal)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, g = (torch.randn(B, T, H, D, device=device, dtype=dtype, generator=gen).requires_grad_()
                  for _ in range(4))
    do = torch.randn(B, T, H, D, device=device, dtype=dtype, generator=gen)
    impl = {"ours": (lambda q, k, v: linear_attention(q, k, v, causal=True, normalize=False, backend="triton"),
                     (q, k, v)),
            "ours bidir": (lambda q, k, v: linear_attention(q, k, v, causal=False, normalize=False,
                                                            backend="triton"), (q, k, v))}
    if old is not None:
        impl["old"] = (old, (q, k, v))
    if fused:  # CHELA's full op: Norm(.) * G fused in our epilogue; FLA + the same epilogue in torch
        impl["ours+norm+gate"] = (lambda q, k, v, g: linear_attention(q, k, v, g, causal=True, backend="triton"),
                                  (q, k, v, g))
    if fla is not None:
        impl["fla"] = (lambda q, k, v: fla(q, k, v, scale=D ** -0.5)[0], (q, k, v))
        if fused:
            def fla_fused(q, k, v, g):
                o = fla(q, k, v, scale=D ** -0.5)[0].float()
                return (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * g).to(dtype)
            impl["fla+norm+gate"] = (fla_fused, (q, k, v, g))
    if with_ref:
        impl["torch ref"] = (lambda q, k, v: linear_attention_ref(q, k, v, causal=True, normalize=False), (q, k, v))
    if with_sdpa:
        qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
        impl["sdpa causal"] = (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), (qt, kt, vt))
    res = {}
    for name, (f, ins) in impl.items():
        grad = do if ins[0].shape == do.shape else do.transpose(1, 2).contiguous()
        with torch.no_grad():
            t_f = bench(lambda: f(*ins), quick)
        t_fb = bench(fwd_bwd(f, ins, grad), quick)
        mem = peak_mem(fwd_bwd(f, ins, grad), device) * 1024  # MiB
        for t in ins:
            t.grad = None
        res[name] = (t_f, t_fb, mem)
        print(f"B{B} T{T} H{H} D{D} {name:15s} fwd {t_f:8.3f} ms  fwd+bwd {t_fb:8.3f} ms  "
              f"peak {mem:8.1f} MiB", flush=True)
    del q, k, v, g, do
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


DEFAULT_TILES = {64: "32,4,64,3;64,4,64,3;32,4,128,3", 128: "64,4,64,3;64,8,64,3;128,8,64,3"}


def sweep_configs(B, T, H, D, quick, tiles=None, segments=(1, 2, 4, 8, 16, 32)):
    """Configurations to time at one shape: `tiles` is "block,warps,chunk,stages;..." (DEFAULT_TILES by width),
    crossed with the segment counts that keep <= ~8 programs per SM and >= 2 chunks per segment."""
    if quick:
        return [dict(block=16, warps=4, chunk=16, stages=2, segments=s) for s in (1, 2)]
    tiles = tiles or DEFAULT_TILES[64 if D <= 64 else 128]
    out = []
    for spec in tiles.split(";"):
        block, warps, chunk, stages = (int(x) for x in spec.split(","))
        programs = B * H * triton.cdiv(D, block)
        for seg in segments:
            if seg == 1 or (programs * seg <= 8 * 132 and T // chunk >= 2 * seg):
                out.append(dict(block=block, warps=warps, chunk=chunk, stages=stages, segments=seg))
    return out


def sweep(B, T, H, D, device, dtype, quick, tiles=None, segments=(1, 2, 4, 8, 16, 32)):
    """ms (fwd, fwd+bwd) of linear_attention_triton at each configuration of `sweep_configs`."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    do = torch.randn(B, T, H, D, device=device, dtype=dtype, generator=gen)
    rows = []
    for cfg in sweep_configs(B, T, H, D, quick, tiles, segments):
        tune = {key: cfg[key] for key in ("block", "warps", "stages", "segments")}

        def f(q, k, v, chunk=cfg["chunk"], tune=tune):
            return linear_attention_triton(q, k, v, None, True, D ** -0.5, False, 1e-5, chunk, tune)

        with torch.no_grad():
            t_f = bench(lambda: f(q, k, v), quick)
        t_fb = bench(fwd_bwd(f, (q, k, v), do), quick)
        rows.append((cfg, t_f, t_fb))
        print(f"sweep B{B} T{T} H{H} D{D} {cfg} fwd {t_f:.3f} fwd+bwd {t_fb:.3f}", flush=True)
    return rows


def profile(B, T, H, D, device, dtype, fla):
    """Device time per kernel (mean over 5 fwd+bwd calls) of ours and FLA's, from torch.profiler."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, device=device, dtype=dtype, generator=gen).requires_grad_() for _ in range(3))
    do = torch.randn(B, T, H, D, device=device, dtype=dtype, generator=gen)
    impls = {"ours": lambda: linear_attention(q, k, v, causal=True, normalize=False, backend="triton")}
    if fla is not None:
        impls["fla"] = lambda: fla(q, k, v, scale=D ** -0.5)[0]
    for name, f in impls.items():
        step = fwd_bwd(lambda *_: f(), (q, k, v), do)
        step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        per = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_async:
                per[e.name[:60]] += e.device_time_total / 5 / 1e3
        total = sum(per.values())
        print(f"\nprofile B{B} T{T} H{H} D{D} {name}: {total:.3f} ms of kernels per fwd+bwd")
        for kname, ms in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"  {ms:8.3f} ms  {kname}")
        q.grad = k.grad = v.grad = None


def table(title, rows, names):
    lines = [f"\n### {title}\n", "| shape | " + " | ".join(f"{n} fwd / fwd+bwd ms" for n in names)
             + " | ours vs fla fwd / fwd+bwd | ours ns/token fwd+bwd |",
             "|---" * (len(names) + 3) + "|"]
    for shape, tokens, res in rows:
        cells = [f"{res[n][0]:.3f} / {res[n][1]:.3f}" if n in res else "n/a" for n in names]
        ratio = (f"{res['fla'][0] / res['ours'][0]:.2f}x / {res['fla'][1] / res['ours'][1]:.2f}x"
                 if "fla" in res else "n/a")
        lines.append(f"| {shape} | " + " | ".join(cells) + f" | {ratio} | {res['ours'][1] * 1e6 / tokens:.2f} |")
    return "\n".join(lines)


def sweep_table(rows):
    lines = ["\n### sweep (ours; fwd / fwd+bwd ms; best of each column in bold)\n",
             "| shape | block, warps, chunk, stages | segments: fwd / fwd+bwd ms |", "|---|---|---|"]
    for shape, res in rows:
        best_f, best_fb = min(r[1] for r in res), min(r[2] for r in res)
        groups = defaultdict(list)
        for cfg, t_f, t_fb in res:
            cell = (f"**{t_f:.3f}**" if t_f == best_f else f"{t_f:.3f}") + " / " + \
                (f"**{t_fb:.3f}**" if t_fb == best_fb else f"{t_fb:.3f}")
            groups[(cfg["block"], cfg["warps"], cfg["chunk"], cfg["stages"])].append(f"s{cfg['segments']}: {cell}")
        for key, cells in groups.items():
            lines.append(f"| {shape} | {key} | " + ", ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU interpreter): check the script runs")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--skip-layer", action="store_true")
    ap.add_argument("--tables", default="ab", help="which timing tables: a (64K tokens per call), b (B8 grid)")
    ap.add_argument("--only", action="append", default=[], help="keep shapes whose name contains this (repeatable)")
    ap.add_argument("--sweep", action="store_true", help="time our tile / segment configurations per B8 shape")
    ap.add_argument("--sweep-tiles", action="append", default=[],
                    help='WIDTH=block,warps,chunk,stages;... (e.g. 64=64,4,64,3;32,4,64,4); default DEFAULT_TILES')
    ap.add_argument("--sweep-segments", default="1,2,4,8,16,32")
    ap.add_argument("--sweep-only", action="append", default=[], help="sweep only shapes containing this")
    ap.add_argument("--profile", action="append", default=[], help="per-kernel times at a shape 'B,T,H,D'")
    ap.add_argument("--old", default=None, help="path of an earlier kernel.py to time beside ours")
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-ref", action="store_true", help="skip the torch reference and SDPA columns")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new grid shape after this many seconds")
    args = ap.parse_args()
    if (status := skip_status("linear_attention.py", args.quick)) is not None:
        return status
    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)"
    print(f"device: {name}; torch {torch.__version__}; triton {triton.__version__}", flush=True)
    fla = None if args.quick or args.no_fla else load_fla()
    old = load_old(args.old) if args.old else None
    par = [] if args.skip_parity else parity(device, args.quick)
    layer = [] if args.skip_parity or args.skip_layer else layer_check(device, args.quick)
    dtype = torch.float32 if args.quick else torch.bfloat16

    def keep(shape):
        return not args.only or any(o in shape for o in args.only)

    # (B) the B8 grid: H {8, 16} x D {64, 128} x T {1K, 4K, 16K, 64K} (SDPA and the reference up to 4K)
    grid = [(2, 32, 2, 32)] if args.quick else [
        (8, T, H, D) for (H, D) in ((8, 64), (16, 64), (8, 128), (16, 128)) for T in (1024, 4096, 16384, 65536)]
    grid = [s for s in grid if keep(f"B{s[0]} T{s[1]} H{s[2]} D{s[3]}")]
    rows_b, rows_s = [], []
    for B, T, H, D in grid:
        shape = f"B{B} T{T} H{H} D{D}"
        if args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
            print(f"time budget spent: {shape} and later shapes skipped", flush=True)
            break
        if args.sweep and (not args.sweep_only or any(o in shape for o in args.sweep_only)):
            segs = tuple(int(x) for x in args.sweep_segments.split(","))
            tiles = dict(spec.split("=", 1) for spec in args.sweep_tiles).get(str(D))
            rows_s.append((shape, sweep(B, T, H, D, device, dtype, args.quick, tiles, segs)))
        if "b" in args.tables:
            res = time_shape(B, T, H, D, device, dtype, fla, args.quick, with_ref=T <= 4096 and not args.no_ref,
                             with_sdpa=T <= 4096 and not args.no_ref, fused=False, old=old)
            rows_b.append((shape, B * T, res))
    # (A) after the grid: 64K tokens per call, H16 D64, the reference points; time per token vs T (Fig. 4)
    fixed = [(4, 16, 2, 32)] if args.quick else [(64, 1024), (16, 4096), (4, 16384), (1, 65536)]
    fixed = fixed if "a" in args.tables else []
    rows_a = []
    for item in fixed:
        B, T, H, D = item if args.quick else (*item, 16, 64)
        shape = f"B{B} T{T} H{H} D{D}"
        if args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
            print(f"time budget spent: {shape} and later shapes skipped", flush=True)
            break
        if keep(shape):
            res = time_shape(B, T, H, D, device, dtype, fla, args.quick, with_ref=T <= 16384 and not args.no_ref,
                             with_sdpa=T <= 16384 and not args.no_ref, fused=True, old=old)
            rows_a.append((shape, B * T, res))
    for spec in args.profile:
        profile(*(int(x) for x in spec.split(",")), device, dtype, fla)

    failures = []
    for case, mode, dt, errs in par:
        for n, e in zip(("o", "dq", "dk", "dv", "dg"), errs):
            out_of_bound(failures, f"{case} {mode} {dt} {n}", e, PARITY_BOUND[dt.split()[0]])
    for shape, mode, ey, edx, _, _ in layer:
        out_of_bound(failures, f"CHELA layer {shape} {mode} y", ey, LAYER_BOUND)
        out_of_bound(failures, f"CHELA layer {shape} {mode} dx", edx, LAYER_BOUND)
    print(f"\n## linear_attention on {name}, {str(dtype).split('.')[-1]}, causal\n")
    if par:
        print("| case | mode | dtype | o | dq | dk | dv | dg |\n|---|---|---|---|---|---|---|---|")
        for case, mode, dt, errs in par:
            print(f"| {case} | {mode} | {dt} | " + " | ".join(f"{e:.1e}" for e in errs) + " |")
    if layer:
        print("\n| CHELA layer (bf16 autocast) | mode | rel err y | rel err dx | triton fwd+bwd ms | torch fwd+bwd ms |"
              "\n|---|---|---|---|---|---|")
        for shape, mode, ey, edx, tt, tr in layer:
            print(f"| {shape} | {mode} | {ey:.1e} | {edx:.1e} | {tt:.2f} | {tr:.2f} |")
    if rows_s:
        print(sweep_table(rows_s))
    names = ["ours", "old", "fla", "ours bidir", "torch ref", "sdpa causal"]
    if rows_a:
        print(table("64K tokens per call (B x T = 65536), H16, D64", rows_a,
                    names[:4] + ["ours+norm+gate", "fla+norm+gate"] + names[4:]))
    if rows_b:
        print(table("B8 grid", rows_b, names))
    if rows_a or rows_b:
        print("\n| shape | ours peak MiB (fwd+bwd) | old peak MiB | fla peak MiB |\n|---|---|---|---|")
        for shape, _, res in rows_a + rows_b:
            cells = [f"{res[n][2]:.0f}" if n in res else "n/a" for n in ("ours", "old", "fla")]
            print(f"| {shape} | " + " | ".join(cells) + " |")
    return parity_status("linear_attention.py", failures)


if __name__ == "__main__":
    sys.exit(main())
