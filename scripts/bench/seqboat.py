"""Benchmark of SeqBoat's fused compress -> local attention -> extract (ops/sparse_local_attention) against the
paper's scatter / gather implementation (the torch reference), on the GPU.

1. parity: forward and backward of the Triton path against the reference (fp32 and bf16, ragged shapes, every mode);
2. timing (triton.testing.do_bench): fused vs reference, forward and forward+backward, activation 10/50/100 %,
   T = 1K .. 16K at a constant 32K tokens per batch;
3. memory bandwidth of the reference's compress / extract (paper Listings 1-2) against a plain copy;
4. peak memory of forward+backward;
5. the whole SeqBoat layer (forward+backward) with backend=torch vs triton at fixed activation rates;
6. a markdown table.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 scripts/bench/seqboat.py            # GPU
    TRITON_INTERPRET=1 PYTHONPATH=src python3 scripts/bench/seqboat.py --quick    # CPU smoke test, tiny sizes
    ... seqboat.py --sections parity layer    # some sections only (parity speed bandwidth layer)
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from longmixer.ops.sparse_local_attention import compress_ref, extract_ref, sparse_local_attention

from _common import skip_status  # scripts/bench/_common.py (this folder is sys.path[0])


def _inputs(B, L, K, V, rate, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k = (torch.randn(B, L, K, generator=g).to(device, dtype) for _ in range(2))
    v = torch.randn(B, L, V, generator=g).to(device, dtype)
    active = (torch.rand(B, L, generator=g) < rate).to(device)
    bias = (torch.randn(2 * L - 1, generator=g) * 0.1).to(device, dtype)
    return q, k, v, active, bias


def parity(device, quick):
    """Max relative error of o, dq, dk, dv, dbias (Triton vs reference in fp32) for several shapes and modes."""
    cases = [  # B, L, K, V, rate, opts
        (2, 1000, 64, 256, 0.5, dict(window=256)),
        (2, 1000, 64, 256, 0.3, dict(window=256, causal=True, attention="relu2", rel_pos="compressed")),
        (1, 4097, 64, 160, 0.2, dict(window=None, attention="relu2")),
        (3, 777, 30, 120, 0.9, dict(window=None, causal=True)),
        (2, 2048, 128, 1232, 0.4, dict(window=1024, causal=True)),
        (2, 1000, 96, 320, 0.6, dict(chunk=256)),
    ]
    if quick:
        cases = [(2, 45, 16, 40, 0.5, dict(window=6)), (1, 33, 12, 20, 0.7, dict(window=None, attention="relu2"))]
    rows = []
    # Triton's CPU interpreter computes bf16 tl.dot wrongly (triton 3.6), so bf16 is checked on the GPU only.
    for dtype in (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,):
        for B, L, K, V, rate, opts in cases:
            q, k, v, active, bias = _inputs(B, L, K, V, rate, dtype, device, seed=L)
            ref_in = [t.float().requires_grad_() for t in (q, k, v, bias)]
            tri_in = [t.clone().requires_grad_() for t in (q, k, v, bias)]
            do = torch.randn(B, L, V, device=device).to(dtype)
            o_ref = sparse_local_attention(*ref_in[:3], active, ref_in[3], backend="torch", **opts)
            o_tri = sparse_local_attention(*tri_in[:3], active, tri_in[3], backend="triton", **opts)
            g_ref = torch.autograd.grad(o_ref, ref_in, do.float())
            g_tri = torch.autograd.grad(o_tri, tri_in, do)
            errs = {}
            for name, a, b in zip(("o", "dq", "dk", "dv", "dbias"), (o_tri, *g_tri), (o_ref, *g_ref)):
                errs[name] = ((a.float() - b).abs().max() / b.abs().max().clamp(min=1e-6)).item()
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            ok = all(e < tol for e in errs.values())
            rows.append((str(dtype).split(".")[-1], f"B{B}-L{L}-K{K}-V{V}-p{rate}", str(opts), errs, ok))
            print(f"parity {rows[-1][0]} {rows[-1][1]} {opts}: " + " ".join(f"{n}={e:.1e}" for n, e in errs.items())
                  + ("  OK" if ok else "  FAIL"), flush=True)
    return rows


def _bench(fn, device):
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _peak(fn, device):
    if device != "cuda":
        return float("nan")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def speed(device, quick):
    lengths = [64] if quick else [1024, 2048, 4096, 8192, 16384]
    tokens = 128 if quick else 32768
    K, V, window = (16, 32, 8) if quick else (64, 256, 256)
    dtype = torch.float32 if quick else torch.bfloat16
    rows = []
    for L in lengths:
        B = max(tokens // L, 1)
        for rate in (0.5,) if quick else (0.1, 0.5, 1.0):  # --quick: a smoke test of the section, one rate
            q, k, v, active, bias = _inputs(B, L, K, V, rate, dtype, device)
            leaves = [t.requires_grad_() for t in (q, k, v, bias)]
            do = torch.randn_like(v)
            res = {}
            for backend in ("torch", "triton"):
                def fwd():
                    return sparse_local_attention(*leaves[:3], active, leaves[3], window=window, backend=backend)

                def fwd_bwd():
                    torch.autograd.grad(fwd(), leaves, do)

                with torch.no_grad():
                    t_f = _bench(fwd, device)
                res[backend] = (t_f, _bench(fwd_bwd, device), _peak(fwd_bwd, device))
            rows.append((L, B, rate, res))
            (rf, rb, rm), (tf, tb, tm) = res["torch"], res["triton"]
            print(f"speed L{L} B{B} p{rate}: ref fwd {rf:.3f} ms fwd+bwd {rb:.3f} ms peak {rm:.0f} MiB | fused fwd "
                  f"{tf:.3f} ms fwd+bwd {tb:.3f} ms peak {tm:.0f} MiB | speedup {rf / tf:.2f}x / {rb / tb:.2f}x",
                  flush=True)
    return rows


def bandwidth(device, quick):
    """Achieved bandwidth of the paper's compress / extract (bytes of the activated rows read + written) vs a copy."""
    B, L, D = (2, 64, 32) if quick else (8, 8192, 512)
    dtype = torch.float32 if quick else torch.bfloat16
    rows = []
    x = torch.randn(B, L, D, device=device, dtype=dtype)
    t_copy = _bench(lambda: x.clone(), device)
    copy_gbs = 2 * x.numel() * x.element_size() / t_copy / 1e6
    for rate in (0.1, 0.5, 1.0):
        active = torch.rand(B, L, device=device) < rate
        xc = compress_ref(x, active)[0]
        n_act = int(active.sum())
        moved = 2 * n_act * D * x.element_size()  # read the activated rows once, write the packed rows once
        t_c = _bench(lambda: compress_ref(x, active), device)
        t_e = _bench(lambda: extract_ref(xc, active), device)
        moved_e = moved + (B * L - n_act) * D * x.element_size()  # extract also writes the zero rows
        rows.append((rate, moved / t_c / 1e6, moved_e / t_e / 1e6, copy_gbs))
        print(f"bandwidth p{rate}: compress {rows[-1][1]:.0f} GB/s, extract {rows[-1][2]:.0f} GB/s, "
              f"copy {copy_gbs:.0f} GB/s", flush=True)
    return rows


def layer(device, quick):
    """The SeqBoat layer (LRA Text shape: D 128, d_qk 64, d_v 256, w 256, bf16 autocast), forward+backward, with the
    activation rate fixed by a random decision (the configurator still gives the confidences), backend torch vs
    triton (the EMA op follows the backend too)."""
    from longmixer.mixers.seqboat import SeqBoat

    class FixedRate(SeqBoat):
        rate = 1.0

        def decide(self, h, mask):
            g = torch.Generator(device=h.device).manual_seed(0)
            active = torch.rand(h.shape[:2], device=h.device, generator=g) < self.rate
            p_on = self.configurator.probabilities(h)[..., 1]  # [B, L, 1]
            return active[..., None], p_on * active[..., None]

    D, lengths, tokens = (4, [64], 128) if quick else (128, [1024, 4096, 16384], 32768)
    rows = []
    for L in lengths:
        B = max(tokens // L, 1)
        x = torch.randn(B, L, D, device=device, requires_grad=True)
        for rate in (0.5,) if quick else (0.1, 0.5, 1.0):  # --quick: a smoke test of the section, one rate
            res = {}
            for backend in ("torch", "triton"):
                torch.manual_seed(0)
                m = FixedRate(D, d_qk=16 if quick else 64, d_v=2 * D, window=8 if quick else 256,
                              max_len=L, backend=backend).to(device)
                m.rate = rate

                def fwd_bwd():
                    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):  # bf16-mixed
                        y, _ = m(x)
                    y.float().square().mean().backward()

                res[backend] = (_bench(fwd_bwd, device), _peak(fwd_bwd, device))
            rows.append((L, B, rate, res))
            (rt, rm), (tt, tm) = res["torch"], res["triton"]
            print(f"layer L{L} B{B} p{rate}: torch {rt:.2f} ms {rm:.0f} MiB | triton {tt:.2f} ms {tm:.0f} MiB | "
                  f"{rt / tt:.2f}x", flush=True)
    return rows


SECTIONS = ("parity", "speed", "bandwidth", "layer")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU / interpreter smoke test)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                        help="what to run (default: all; the reference's fwd+bwd in `speed` takes about a second a "
                             "call at low activation, so the whole script runs past ten minutes on an H100)")
    args = parser.parse_args()
    if (status := skip_status("seqboat.py", args.quick)) is not None:
        return status
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    print(f"device: {name}, torch {torch.__version__}", flush=True)
    run = {name: fn for name, fn in zip(SECTIONS, (parity, speed, bandwidth, layer)) if name in args.sections}
    results = {name: fn(device, args.quick) for name, fn in run.items()}
    par, spd, bw, lay = (results.get(name, []) for name in SECTIONS)
    if "parity" in results:
        print("\n## SeqBoat sparse_local_attention: parity (max rel. error, Triton vs fp32 reference)\n")
        print("| dtype | shape | opts | o | dq | dk | dv | dbias | ok |\n|---|---|---|---|---|---|---|---|---|")
        for dt, shape, opts, errs, ok in par:
            print(f"| {dt} | {shape} | `{opts}` | " + " | ".join(f"{e:.1e}" for e in errs.values()) + f" | {ok} |")
    if "speed" in results:
        print(f"\n## Fused vs scatter/gather reference ({name}, window 256, K 64, V 256, 32K tokens per batch)\n")
        print("| T | B | act. | ref fwd ms | fused fwd ms | ref f+b ms | fused f+b ms | speedup f / f+b | ref peak MiB "
              "| fused peak MiB |\n|---|---|---|---|---|---|---|---|---|---|")
        for L, B, rate, res in spd:
            (rf, rb, rm), (tf, tb, tm) = res["torch"], res["triton"]
            print(f"| {L} | {B} | {rate:.0%} | {rf:.3f} | {tf:.3f} | {rb:.3f} | {tb:.3f} | {rf / tf:.2f}x / "
                  f"{rb / tb:.2f}x | {rm:.0f} | {tm:.0f} |")
    if "bandwidth" in results:
        print("\n## Reference compress / extract bandwidth (bf16, B8 L8192 D512)\n")
        print("| act. | compress GB/s | extract GB/s | copy GB/s |\n|---|---|---|---|")
        for rate, c, e, cp in bw:
            print(f"| {rate:.0%} | {c:.0f} | {e:.0f} | {cp:.0f} |")
    if "layer" in results:
        print(f"\n## SeqBoat layer forward+backward ({name}, bf16 autocast, D 128, d_qk 64, d_v 256, w 256, 32K "
              "tokens)\n")
        print("| T | B | act. | torch ms | triton ms | speedup | torch peak MiB | triton peak MiB |\n"
              "|---|---|---|---|---|---|---|---|")
        for L, B, rate, res in lay:
            (rt, rm), (tt, tm) = res["torch"], res["triton"]
            print(f"| {L} | {B} | {rate:.0%} | {rt:.2f} | {tt:.2f} | {rt / tt:.2f}x | {rm:.0f} | {tm:.0f} |")
    if not all(row[-1] for row in par):
        raise SystemExit("parity FAILED")


if __name__ == "__main__":
    sys.exit(main())
