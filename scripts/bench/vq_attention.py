"""Benchmark of LongVQ's VQ attention op (longmixer.ops.vq_attention) on the GPU.

1. parity: the Triton search (codes, counts, sums) and attention (forward and every gradient) against the torch
   references: fp32 against float64, bf16 against float32; bidirectional and causal, softmax and laplace, ragged
   lengths and widths that are not powers of two;
2. timings (triton.testing.do_bench, median ms): the fused search + statistics vs the materialized torch
   reference (fp32 [N, S] distances, argmin, index_add) at N = 64K..1M keys; the blockwise attention (the public
   op, statistics included) vs quadratic SDPA over the same quantized keys at T = 4K..64K, forward and
   forward+backward, bf16, plus the torch blockwise reference;
3. peak memory of one forward+backward;
4. markdown tables at the end.

GPU:  PYTHONUNBUFFERED=1 PYTHONPATH=src python3 scripts/bench/vq_attention.py
CPU:  TRITON_INTERPRET=1 PYTHONPATH=src python scripts/bench/vq_attention.py --quick  (tiny sizes; checks the
      script runs, timings meaningless)
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton

from longmixer.ops.vq_attention import vq_attention, vq_search, vq_search_ref, window_bias

from _common import out_of_bound, parity_status, skip_status  # scripts/bench/_common.py (this folder is sys.path[0])

# parity bounds. Attention (max error relative to max |ref|): float32 against float64 1e-4, as scripts/bench/parity.py;
# bf16 against float32 3e-2 (recorded on GPUs up to 1.84e-2, bidirectional B1 L4133 S300: less margin than parity.py's
# 2e-2 leaves, docs/benchmarks.md). Search (tf32 distances): codes equal to an exact search for >= 99% of keys
# (99.8-99.9% recorded), the chosen codeword at most 1e-2 farther than the best (2e-3), and the statistics of the
# kernel's own codes within 1e-4 (counts exact, sums 2e-6).
PARITY_BOUND = {"float32": 1e-4, "bfloat16": 3e-2}
SEARCH_AGREE, SEARCH_GAP, SEARCH_STATS = 0.99, 1e-2, 1e-4


def rel_err(ref, out):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-6)).item()


def make(B, L, E, H, S, C, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, L, E, device=device, generator=g) * E ** -0.5
    k = torch.randn(B, L, E, device=device, generator=g)
    v = torch.randn(B, L, H, device=device, generator=g)
    cb = torch.randn(S, E, device=device, generator=g)
    table = 0.3 * torch.randn(4 * C - 1, device=device, generator=g)
    mask = torch.ones(B, L, dtype=torch.bool, device=device)
    mask[-1, L - L // 7:] = False
    codes = vq_search_ref(k.flatten(0, 1), cb)[0].view(B, L)
    return q, k, v, cb, table, mask, codes


def attention_grads(q, k, v, cb, table, mask, codes, C, causal, attention, dtype, backend, do):
    leaves = [t.to(dtype).requires_grad_(True) for t in (q, k, v, table)]
    cbd = cb.to(dtype)
    k_hat = leaves[1] + (cbd[codes] - leaves[1]).detach()
    o = vq_attention(leaves[0], k_hat, leaves[2], cbd, codes, mask, window_bias(leaves[3], C), block_size=C,
                     causal=causal, attention=attention, backend=backend)
    return [o] + list(torch.autograd.grad(o, leaves, do.to(o.dtype)))


def parity(device, quick):
    cases = [(2, 50, 8, 12, 10, 16), (1, 40, 12, 70, 20, 16)] if quick else [
        (2, 1000, 64, 128, 512, 128), (1, 4133, 64, 256, 512, 256), (2, 777, 40, 100, 300, 64),
        (1, 16384, 64, 128, 512, 512)]
    rows = []
    for B, L, E, H, S, C in cases:
        ins = make(B, L, E, H, S, C, device)
        do = torch.randn(B, L, H, device=device)
        for causal in (False, True):
            for attention in ("softmax", "laplace"):
                pairs = [(torch.float32, torch.float64)] + ([] if quick else [(torch.bfloat16, torch.float32)])
                for dtype, ref_dtype in pairs:
                    ref = attention_grads(*ins, C, causal, attention, ref_dtype, "torch", do)
                    tri = attention_grads(*ins, C, causal, attention, dtype, "triton", do)
                    errs = [rel_err(r, t) for r, t in zip(ref, tri)]
                    rows.append((f"B{B}-L{L}-E{E}-H{H}-S{S}-C{C}", f"{'causal' if causal else 'bidir'}-{attention}",
                                 str(dtype).split(".")[-1], errs))
                    print("parity", rows[-1][:3], " ".join(f"{e:.1e}" for e in errs), flush=True)
    return rows


def search_parity(device, quick):
    """Codes agree except on near ties (tf32 distances on the GPU); the statistics match the kernel's codes."""
    rows = []
    for N, E, S in ([(300, 12, 40)] if quick else [(1000, 64, 512), (100003, 40, 300), (262144, 64, 512)]):
        g = torch.Generator(device=device).manual_seed(1)
        k, cb = torch.randn(N, E, device=device, generator=g), torch.randn(S, E, device=device, generator=g)
        mask = torch.rand(N, device=device, generator=g) > 0.1
        codes_ref, _, _ = vq_search_ref(k.double(), cb.double(), mask)
        codes, counts, sums = vq_search(k, cb, mask, backend="triton")
        dist = torch.cdist(k.double(), cb.double())
        gap = (dist.gather(1, codes[:, None]) - dist.gather(1, codes_ref[:, None])).max().item()
        w = mask.double()
        counts_ref = torch.zeros(S, dtype=torch.float64, device=device).index_add_(0, codes, w)
        sums_ref = torch.zeros(S, E, dtype=torch.float64, device=device).index_add_(0, codes, k.double() * w[:, None])
        agree = (codes == codes_ref).double().mean().item()
        rows.append((f"N{N}-E{E}-S{S}", agree, gap, rel_err(counts_ref, counts), rel_err(sums_ref, sums)))
        print("search parity", rows[-1], flush=True)
    return rows


def bench(fn, quick):
    if quick:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def peak_mib(fn, device):
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def search_timing(device, quick):
    rows = []
    E, S = 64, 512
    for N in ([512] if quick else [65536, 262144, 1048576]):
        k = torch.randn(N, E, device=device, dtype=torch.float32 if quick else torch.bfloat16)
        cb = torch.randn(S, E, device=device)
        mask = torch.ones(N, dtype=torch.bool, device=device)
        t_ref = bench(lambda: vq_search_ref(k, cb, mask), quick)
        t_tri = bench(lambda: vq_search(k, cb, mask, backend="triton"), quick)
        from longmixer.ops.vq_attention.kernel import vq_search_fwd
        t_nostat = bench(lambda: vq_search_fwd(k, cb, mask, with_stats=False), quick)
        m_ref = peak_mib(lambda: vq_search_ref(k, cb, mask), device)
        m_tri = peak_mib(lambda: vq_search(k, cb, mask, backend="triton"), device)
        rows.append((N, t_ref, t_tri, t_nostat, m_ref, m_tri))
        print("search", rows[-1], flush=True)
    return rows


def attention_timing(device, quick):
    rows = []
    E, H, S, C = 64, 128, 512, 256
    lengths = [64] if quick else [4096, 8192, 16384, 32768, 65536]
    tokens = 128 if quick else 65536  # B * T fixed, so time per token compares lengths at equal work
    if quick:
        E, H, C, S = 16, 16, 16, 16
    dtype = torch.float32 if quick else torch.bfloat16
    for T in lengths:
        B = tokens // T
        q, k, v, cb, table, _, codes = make(B, T, E, H, S, C, device)
        q, v = q.to(dtype).requires_grad_(True), v.to(dtype).requires_grad_(True)
        k = k.to(dtype).requires_grad_(True)
        cbd = cb.to(dtype)
        k_hat = (k + (cbd[codes] - k).detach())
        bias = window_bias(table, C)
        do = torch.randn(B, T, H, device=device, dtype=dtype)
        for causal in (False, True):
            def ours(backend="triton"):
                return vq_attention(q, k_hat, v, cbd, codes, None, bias, block_size=C, causal=causal,
                                    backend=backend)

            def sdpa():  # quadratic attention over the same quantized keys, one head
                return F.scaled_dot_product_attention(q[:, None], k_hat[:, None], v[:, None], scale=1.0,
                                                      is_causal=causal)[:, 0]

            def fb(f):
                return lambda: torch.autograd.grad(f(), (q, k, v), do, retain_graph=True)

            r = dict(T=T, B=B, causal=causal)
            r["ours_fwd"] = bench(lambda: ours(), quick)
            r["ours_fb"] = bench(fb(ours), quick)
            r["sdpa_fwd"] = bench(sdpa, quick)
            r["sdpa_fb"] = bench(fb(sdpa), quick)
            r["ref_fb"] = bench(fb(lambda: ours("torch")), quick)
            r["ours_mem"] = peak_mib(fb(ours), device)
            r["sdpa_mem"] = peak_mib(fb(sdpa), device)
            rows.append(r)
            print("attention", r, flush=True)
    return rows


CRASHED: list[str] = []  # the parts that raised (a parity part among them fails the run)


def section(fn, device, quick):
    """Run one part; a failure is printed and leaves its table empty so the other parts still report."""
    try:
        return fn(device, quick)
    except Exception:  # a benchmark run reports every part it can; the traceback is in the output
        traceback.print_exc()
        CRASHED.append(fn.__name__)
        return []


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU interpreter smoke run)")
    args = parser.parse_args()
    if (status := skip_status("vq_attention.py", args.quick)) is not None:
        return status
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    print(f"device {name}; torch {torch.__version__}; triton {triton.__version__}", flush=True)
    p_rows, s_rows, st_rows, at_rows = (section(fn, device, args.quick)
                                        for fn in (parity, search_parity, search_timing, attention_timing))

    print(f"\n### VQ attention parity ({name}; max error relative to max |ref|: o, dq, dk, dv, dbias)\n")
    print("| shape | mode | dtype | o | dq | dk | dv | dbias |\n|---|---|---|---|---|---|---|---|")
    for shape, mode, dtype, errs in p_rows:
        print(f"| {shape} | {mode} | {dtype} | " + " | ".join(f"{e:.1e}" for e in errs) + " |")
    print("\n### VQ search parity (fp32 keys; tf32 distances)\n")
    print("| shape | codes equal to exact | worst distance gap | counts err | sums err |\n|---|---|---|---|---|")
    for shape, agree, gap, ec, es in s_rows:
        print(f"| {shape} | {agree:.5f} | {gap:.1e} | {ec:.1e} | {es:.1e} |")
    failures = [f"{part}: raised (traceback above)" for part in CRASHED if "parity" in part]
    for shape, mode, dtype, errs in p_rows:
        for n, e in zip(("o", "dq", "dk", "dv", "dbias"), errs):
            out_of_bound(failures, f"{shape} {mode} {dtype} {n}", e, PARITY_BOUND[dtype])
    for shape, agree, gap, ec, es in s_rows:
        out_of_bound(failures, f"search {shape} share of codes not exact", 1 - agree, 1 - SEARCH_AGREE)
        out_of_bound(failures, f"search {shape} distance gap", gap, SEARCH_GAP)
        out_of_bound(failures, f"search {shape} counts", ec, SEARCH_STATS)
        out_of_bound(failures, f"search {shape} sums", es, SEARCH_STATS)
    print("\n### VQ search + statistics, E=64, S=512, bf16 keys (ms; peak MiB)\n")
    print("| N keys | torch materialized | Triton fused (+stats) | speedup | Triton codes only | peak MiB torch | "
          "peak MiB Triton |\n|---|---|---|---|---|---|---|")
    for N, t_ref, t_tri, t_ns, m_ref, m_tri in st_rows:
        print(f"| {N} | {t_ref:.3f} | {t_tri:.3f} | {t_ref / t_tri:.1f}x | {t_ns:.3f} | {m_ref:.0f} | {m_tri:.0f} |")
    print("\n### VQ attention vs quadratic SDPA over the quantized keys, B*T=65536, E=64, H=128, S=512, C=256, "
          "bf16\n")
    print("| T | B | mode | ours fwd ms | ours fwd+bwd ms | ns/token (f+b) | SDPA fwd ms | SDPA fwd+bwd ms | "
          "speedup f+b | torch ref f+b ms | peak MiB ours | peak MiB SDPA |\n" + "|---" * 12 + "|")
    for r in at_rows:
        mode = "causal" if r["causal"] else "bidir"
        print(f"| {r['T']} | {r['B']} | {mode} | {r['ours_fwd']:.3f} | {r['ours_fb']:.3f} | "
              f"{r['ours_fb'] / (r['B'] * r['T']) * 1e6:.0f} | {r['sdpa_fwd']:.3f} | {r['sdpa_fb']:.3f} | "
              f"{r['sdpa_fb'] / r['ours_fb']:.2f}x | {r['ref_fb']:.3f} | {r['ours_mem']:.0f} | {r['sdpa_mem']:.0f} |")
    return parity_status("vq_attention.py", failures)


if __name__ == "__main__":
    sys.exit(main())
