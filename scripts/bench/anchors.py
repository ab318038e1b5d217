"""The op-level speed targets of the attention ops against PyTorch's fused attention (the anchors), on the GPU.

1. `vq`: LongVQ's VQ attention (the Triton kernel, `backend=triton`, what `auto` runs on CUDA) against full
   quadratic SDPA over the same quantized keys. Parity against the float64 blockwise reference first (fp32 and
   bf16, bidirectional and causal, a padded tail), then forward+backward times at B8 L4096 and B2 L16384 (E 64,
   H 256, S 256, C 128: the LongVQ Text recipe's attention).
2. `chunk`: MEGA-chunk's chunked attention (`local_attention`, with its relative-position bias and that bias's
   gradient; softmax, laplace and relu2) against SDPA on the sequence reshaped into chunks ([B L/C, H, C, D], no
   bias: FlashAttention / cuDNN pick themselves), at the shapes of the speed issue.
3. `full`: MEGA's full-length attention (K 64, V 256, one head, the simple relative-position bias) as
   `local_attention` runs it, against SDPA with the Toeplitz bias materialized as a float mask (its gradient
   reduced back to the 2L - 1 taps by autograd) and against bias-free SDPA with V split into four 64-wide heads (the
   Transformer's attention cost, the lower bound of what a bias costs).

Times are `triton.testing.do_bench` means (wall, with the host's launches) and, where the call can be captured,
`do_bench_cudagraph` (GPU time alone); bf16. A CSV of every row goes to --csv.

GPU:  PYTHONUNBUFFERED=1 PYTHONPATH=src python3 scripts/bench/anchors.py [--only vq chunk full] [--csv rows.csv]
"""

from __future__ import annotations

import argparse
import csv
import math
import sys

import torch
import torch.nn.functional as F

from longmixer.ops.local_attention import local_attention
from longmixer.ops.vq_attention import vq_attention, vq_search_ref, window_bias

from _common import fwd_bwd  # scripts/bench/_common.py (this folder is sys.path[0])

ROWS: list[dict] = []


def timed(fn) -> tuple[float, float]:
    """(wall ms, graph-replay ms) means; nan where the call cannot be captured in a CUDA graph."""
    from triton.testing import do_bench, do_bench_cudagraph

    wall = do_bench(fn, warmup=10, rep=60)
    try:
        graph = do_bench_cudagraph(fn, rep=60)
    except Exception as exc:  # noqa: BLE001 - a benchmark row, not a failure of the op
        print(f"  (no CUDA-graph time: {type(exc).__name__}: {str(exc)[:120]})")
        graph = math.nan
    return wall, graph


def record(group: str, shape: str, name: str, fn, leaves, baseline: str | None = None) -> None:
    try:
        wall, graph = timed(fwd_bwd(fn, leaves))
    except Exception as exc:  # noqa: BLE001
        print(f"{group} {shape} {name}: failed: {type(exc).__name__}: {str(exc)[:200]}")
        return
    ROWS.append(dict(group=group, shape=shape, name=name, wall_ms=wall, graph_ms=graph, baseline=baseline))
    print(f"{group:5s} {shape:34s} {name:40s} wall {wall:8.3f} ms  graph {graph:8.3f} ms", flush=True)


def rel_err(ref: torch.Tensor, out: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-12)).item()


# ---------------------------------------------------------------- VQ attention -----------------------------------

def vq_inputs(B, L, E, H, S, C, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, L, E, generator=g) * E ** -0.5
    k, v, cb = torch.randn(B, L, E, generator=g), torch.randn(B, L, H, generator=g), torch.randn(S, E, generator=g)
    table = 0.3 * torch.randn(4 * C - 1, generator=g)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[-1, L - L // 7:] = False
    codes = vq_search_ref(k.flatten(0, 1), cb)[0].view(B, L)
    return [t.to(device) for t in (q, k, v, cb, table, mask, codes)]


def vq_call(ins, C, causal, dtype, backend):
    q, k, v, cb, table, mask, codes = ins
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, table)]
    cbd = cb.to(dtype)

    def fn():
        k_hat = leaves[1] + (cbd[codes] - leaves[1]).detach()
        return vq_attention(leaves[0], k_hat, leaves[2], cbd, codes, mask, window_bias(leaves[3], C), block_size=C,
                            causal=causal, attention="softmax", backend=backend)
    return fn, leaves


def vq(device) -> None:
    for B, L, E, H, S, C in [(2, 1000, 64, 256, 256, 128), (1, 4133, 64, 100, 300, 64)]:
        ins = vq_inputs(B, L, E, H, S, C, device)
        for causal in (False, True):
            fn, leaves = vq_call(ins, C, causal, torch.float64, "torch")
            o = fn()
            do = torch.randn_like(o)
            ref = [o] + list(torch.autograd.grad(o, leaves, do))
            for dtype in (torch.float32, torch.bfloat16):
                fn, leaves = vq_call(ins, C, causal, dtype, "triton")
                o = fn()
                got = [o] + list(torch.autograd.grad(o, leaves, do.to(o.dtype)))
                errs = [rel_err(r, t) for r, t in zip(ref, got)]
                print(f"vq parity B{B} L{L} H{H} S{S} C{C} {'causal' if causal else 'bidir'} {str(dtype)[6:]}: "
                      "o/dq/dk/dv/dtable " + " ".join(f"{e:.1e}" for e in errs))
                ROWS.append(dict(group="vq-parity", shape=f"B{B} L{L} H{H} S{S} C{C} causal={causal}",
                                 name=str(dtype)[6:], wall_ms=max(errs), graph_ms=math.nan, baseline=None))
    for B, L in [(8, 4096), (2, 16384)]:
        E, H, S, C = 64, 256, 256, 128
        ins = vq_inputs(B, L, E, H, S, C, device)
        shape = f"B{B} L{L} E{E} H{H} S{S} C{C}"
        for causal in (False, True):
            tag = " causal" if causal else ""
            fn, leaves = vq_call(ins, C, causal, torch.bfloat16, "triton")
            record("vq", shape, "ours: Triton kernel" + tag, fn, leaves, baseline="full SDPA" + tag)
            q, k, v = (ins[i].to(torch.bfloat16).requires_grad_() for i in range(3))
            record("vq", shape, "full SDPA" + tag,
                   lambda q=q, k=k, v=v, c=causal: F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None],
                                                                                  is_causal=c), [q, k, v])


# ---------------------------------------------------------------- chunked attention ------------------------------

def chunk(device) -> None:
    g = torch.Generator(device="cpu").manual_seed(0)
    for B, H, L, D, C in [(8, 1, 4096, 64, 128), (8, 1, 4096, 128, 128), (8, 4, 4096, 64, 256),
                          (8, 1, 16384, 64, 1024)]:
        shape = f"B{B} H{H} L{L} D{D} C{C}"
        q, k, v = (torch.randn(B, H, L, D, generator=g).to(device, torch.bfloat16).requires_grad_() for _ in range(3))
        bias = (0.1 * torch.randn(2 * C - 1, generator=g)).to(device).requires_grad_()
        # the anchor's inputs are laid out [B L/C, H, C, D] already (a view of [B, L, H, D] activations)
        chunks = [torch.randn(B * (L // C), H, C, D, generator=g).to(device, torch.bfloat16).requires_grad_()
                  for _ in range(3)]
        record("chunk", shape, "anchor: reshaped SDPA, no bias", lambda: F.scaled_dot_product_attention(*chunks),
               chunks)
        for attention in ("softmax", "laplace", "relu2"):
            record("chunk", shape, f"ours: {attention} + bias (+ its grad)",
                   lambda a=attention: local_attention(q, k, v, chunk_size=C, attention=a, bias=bias),
                   [q, k, v, bias], baseline="anchor: reshaped SDPA, no bias")


# ---------------------------------------------------------------- full-length MEGA attention ---------------------

def toeplitz_sdpa(q, k, v, table):
    """SDPA with the [L, L] relative-position bias table[(L - 1) + j - i] as a float mask."""
    L = q.shape[-2]
    pos = torch.arange(L, device=q.device)
    mask = table.to(q.dtype)[(L - 1) + pos[None, :] - pos[:, None]]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])


def full(device) -> None:
    g = torch.Generator(device="cpu").manual_seed(1)
    for B, L in [(8, 4096), (2, 16384)]:
        K, V = 64, 256
        shape = f"B{B} H1 L{L} K{K} V{V}"
        q, k = (torch.randn(B, 1, L, K, generator=g).to(device, torch.bfloat16).requires_grad_() for _ in range(2))
        v = torch.randn(B, 1, L, V, generator=g).to(device, torch.bfloat16).requires_grad_()
        table = (0.1 * torch.randn(2 * L - 1, generator=g)).to(device).requires_grad_()
        base = "bias-free SDPA, V as 4 heads of 64"
        record("full", shape, base,
               lambda: F.scaled_dot_product_attention(q.expand(B, 4, L, K), k.expand(B, 4, L, K),
                                                      v.view(B, L, 4, K).transpose(1, 2)), [q, k, v])
        record("full", shape, "ours: local_attention softmax + bias", lambda: local_attention(q, k, v, bias=table),
               [q, k, v, table], baseline=base)
        record("full", shape, "SDPA + materialized Toeplitz bias", lambda: toeplitz_sdpa(q, k, v, table),
               [q, k, v, table], baseline=base)


def summary() -> None:
    print("\n| group | shape | name | wall ms | graph ms | vs baseline (graph) |\n|---|---|---|---|---|---|")
    for r in ROWS:
        if r["group"] == "vq-parity":
            continue
        base = next((b for b in ROWS if b["group"] == r["group"] and b["shape"] == r["shape"]
                     and b["name"] == r["baseline"]), None)
        ratio = f"{base['graph_ms'] / r['graph_ms']:.2f}x" if base else ""
        print(f"| {r['group']} | {r['shape']} | {r['name']} | {r['wall_ms']:.3f} | {r['graph_ms']:.3f} | {ratio} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=["vq", "chunk", "full"], choices=["vq", "chunk", "full"])
    parser.add_argument("--csv", default=None, help="write every row here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("anchors.py measures fused GPU attention kernels: it needs a CUDA GPU (skipped)")
        return 0
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    for name in args.only:
        {"vq": vq, "chunk": chunk, "full": full}[name](device)
    summary()
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(ROWS[0]))
            w.writeheader()
            w.writerows(ROWS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
