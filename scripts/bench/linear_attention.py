"""Benchmark of CHELA's tiled linear attention (longmixer.ops.linear_attention) on the GPU.

1. parity: Triton kernel vs the torch reference, forward and every gradient (fp32 against float64, bf16 against
   float32), causal and not, ragged lengths, widths that are not powers of two;
2. timings (triton.testing.do_bench, median ms) of the kernel vs the torch reference, causal SDPA and FLA's
   `chunk_simple_gla` (when `fla` imports), forward and forward+backward, bf16;
3. peak memory of one forward+backward;
4. markdown tables at the end.

GPU:  PYTHONUNBUFFERED=1 PYTHONPATH=src python3 scripts/bench/linear_attention.py
CPU:  TRITON_INTERPRET=1 PYTHONPATH=src python scripts/bench/linear_attention.py --quick  (tiny sizes, no timings
      worth reading; checks the script runs)
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import triton

from longmixer.ops.linear_attention import linear_attention, linear_attention_ref


def load_fla():
    """FLA's chunk_simple_gla, or None with the reason printed (FLA is carried as a wheel to the GPU machine)."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as exc:  # the benchmark still measures the other columns; the table says "n/a"
        print(f"FLA not importable ({exc}); its columns are n/a")
        return None
    return chunk_simple_gla


def rel_err(ref, out):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-6)).item()


def parity(device, quick):
    """Max relative error of o, dq, dk, dv, dg per case."""
    cases = [(2, 50, 2, 20, 24, 16), (1, 70, 1, 16, 16, 16)] if quick else [
        (2, 1000, 4, 64, 64, 64), (1, 4133, 2, 80, 80, 64), (2, 777, 3, 128, 128, 64), (1, 16384, 2, 64, 64, 64)]
    rows = []
    for B, L, H, K, V, C in cases:
        for causal in (True, False):
            pairs = [(torch.float32, torch.float64)] + ([] if quick else [(torch.bfloat16, torch.float32)])
            for dtype, ref_dtype in pairs:  # the interpreter has no bfloat16
                gen = torch.Generator(device=device).manual_seed(0)
                ins = [torch.randn(B, L, H, d, device=device, generator=gen) for d in (K, K, V, V)]
                ref_in = [t.to(ref_dtype).requires_grad_() for t in ins]
                ref = linear_attention_ref(*ref_in, causal=causal, chunk_size=C)
                do = torch.randn_like(ref)
                ref_g = torch.autograd.grad(ref, ref_in, do)
                tri_in = [t.to(dtype).requires_grad_() for t in ins]
                out = linear_attention(*tri_in, causal=causal, chunk_size=C, backend="triton")
                tri_g = torch.autograd.grad(out, tri_in, do.to(dtype))
                errs = [rel_err(ref, out)] + [rel_err(r, t) for r, t in zip(ref_g, tri_g)]
                rows.append((f"B{B}-L{L}-H{H}-K{K}-V{V}", "causal" if causal else "bidir",
                             str(dtype).split(".")[-1], errs))
                print("parity", rows[-1][:3], " ".join(f"{e:.1e}" for e in errs), flush=True)
    return rows


def layer_check(device, quick):
    """The CHELA layer under bf16 autocast: backend triton vs torch (output, input gradient) and fwd+bwd ms."""
    from longmixer.mixers.chela import CHELA

    B, L, D = (2, 40, 32) if quick else (8, 4096, 128)
    rows = []
    for causal in (False, True):
        torch.manual_seed(0)
        m = CHELA(D, causal=causal, max_len=L, attention="laplace", chunk_size=16 if quick else 64).to(device)
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
    def run():
        out = f(*ins)
        out.backward(grad_out)
    return run


def peak_mib(fn, device):
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def time_shape(B, T, H, D, device, dtype, fla, quick, with_ref, with_sdpa, fused):
    """ms for forward and forward+backward of every implementation at one shape (causal)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, g = (torch.randn(B, T, H, D, device=device, dtype=dtype, generator=gen).requires_grad_()
                  for _ in range(4))
    do = torch.randn(B, T, H, D, device=device, dtype=dtype, generator=gen)
    impl = {"ours": (lambda q, k, v: linear_attention(q, k, v, causal=True, normalize=False, backend="triton"),
                     (q, k, v)),
            "ours bidir": (lambda q, k, v: linear_attention(q, k, v, causal=False, normalize=False,
                                                            backend="triton"), (q, k, v))}
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
        mem = peak_mib(fwd_bwd(f, ins, grad), device)
        for t in ins:
            t.grad = None
        res[name] = (t_f, t_fb, mem)
        print(f"B{B} T{T} H{H} D{D} {name:15s} fwd {t_f:8.3f} ms  fwd+bwd {t_fb:8.3f} ms  "
              f"peak {mem:8.1f} MiB", flush=True)
    del q, k, v, g, do
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU interpreter): check the script runs")
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--tables", default="ab", help="which timing tables: a (64K tokens per call), b (B8 grid)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)"
    print(f"device: {name}; torch {torch.__version__}; triton {triton.__version__}", flush=True)
    fla = None if args.quick else load_fla()
    par = [] if args.skip_parity else parity(device, args.quick)
    layer = [] if args.skip_parity else layer_check(device, args.quick)
    dtype = torch.float32 if args.quick else torch.bfloat16

    # (A) 64K tokens per call, H16 D64: the reference points; time per token vs T (Fig. 4 claim: flat)
    fixed = [(4, 16, 2, 32)] if args.quick else [(64, 1024), (16, 4096), (4, 16384), (1, 65536)]
    fixed = fixed if "a" in args.tables else []
    rows_a = []
    for item in fixed:
        B, T, H, D = item if args.quick else (*item, 16, 64)
        res = time_shape(B, T, H, D, device, dtype, fla, args.quick, with_ref=T <= 16384, with_sdpa=T <= 16384,
                         fused=True)
        rows_a.append((f"B{B} T{T} H{H} D{D}", B * T, res))
    # (B) the B8 grid of the issue, trimmed to fit the time budget (SDPA and the reference up to 16K)
    grid = [(2, 32, 2, 32)] if args.quick else [
        (8, T, H, D) for (H, D) in ((8, 64), (16, 128)) for T in (1024, 4096, 16384, 65536)]
    grid = grid if "b" in args.tables else []
    rows_b = []
    for B, T, H, D in grid:
        res = time_shape(B, T, H, D, device, dtype, fla, args.quick, with_ref=T <= 4096, with_sdpa=T <= 4096,
                         fused=False)
        rows_b.append((f"B{B} T{T} H{H} D{D}", B * T, res))

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
    names_a = ["ours", "fla", "ours bidir", "ours+norm+gate", "fla+norm+gate", "torch ref", "sdpa causal"]
    print(table("64K tokens per call (B x T = 65536), H16, D64", rows_a, names_a))
    print(table("B8 grid", rows_b, ["ours", "fla", "ours bidir", "torch ref", "sdpa causal"]))
    print("\n| shape | ours peak MiB (fwd+bwd) | fla peak MiB |\n|---|---|---|")
    for shape, _, res in rows_a + rows_b:
        fla_mem = f"{res['fla'][2]:.0f}" if "fla" in res else "n/a"
        print(f"| {shape} | {res['ours'][2]:.0f} | {fla_mem} |")


if __name__ == "__main__":
    main()
