"""Every op's public entry point on the Triton path (the torch.library custom ops) against its torch reference, on
the GPU: forward and every gradient in float32 against the float64 reference, eagerly and under
`torch.compile(fullgraph=True)`, plus the mixed-dtype case autocast produces (float32 q/k, bf16 values).

GPU:  PYTHONUNBUFFERED=1 PYTHONPATH=src python3 scripts/bench/parity.py
CPU:  TRITON_INTERPRET=1 PYTHONPATH=src python scripts/bench/parity.py --quick   (tiny sizes: checks the script)

Prints one row per case (max error relative to the largest reference value, over the output and every gradient) and
exits 1 when a case exceeds its tolerance: fp32 1e-4 (tf32 is not used for float32 inputs), mixed 2e-2.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from longmixer.ops.ema import ema
from longmixer.ops.las_attention import las_attention
from longmixer.ops.linear_attention import linear_attention
from longmixer.ops.local_attention import local_attention
from longmixer.ops.sparse_local_attention import sparse_local_attention
from longmixer.ops.vq_attention import vq_attention, vq_search_ref, window_bias

TOL = {"fp32": 1e-4, "mixed": 2e-2}


def cases(quick: bool, device: str):
    """(name, op, float inputs, fixed kwargs, dtypes per input for the mixed case or None)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    L = 70 if quick else 1000
    B = 2

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    D, N = (8, 4) if quick else (64, 16)
    for bidi in (False, True):
        dk = 2 * D if bidi else D
        yield (f"ema bidirectional={bidi}", ema,
               [rnd(B, L, D), rnd(dk, N, scale=0.5), torch.rand(dk, N, generator=g).to(device) * 0.9 + 0.05,
                rnd(dk, N, scale=0.5)], dict(bidirectional=bidi), None)
    H, K, V, C = (2, 16, 24, 16) if quick else (2, 64, 96, 128)
    mask = torch.ones(B, L, dtype=torch.bool, device=device)
    mask[-1, L - L // 5:] = False
    def local(q, k, v, bias, **kw):
        return local_attention(q, k, v, bias=bias, **kw)

    for attention in ("softmax", "laplace"):
        for chunk in (C, None):
            span = C if chunk else L
            yield (f"local_attention {attention} chunk={chunk}", local,
                   [rnd(B, H, L, K, scale=0.5), rnd(B, H, L, K, scale=0.5), rnd(B, H, L, V),
                    rnd(2 * span - 1, scale=0.1)],
                   dict(chunk_size=chunk, attention=attention, mask=mask), None)
    for causal in (False, True):
        yield (f"linear_attention causal={causal}", linear_attention,
               [rnd(B, L, H, K, scale=0.3), rnd(B, L, H, K, scale=0.3), rnd(B, L, H, K), torch.sigmoid(rnd(B, L, H, K))],
               dict(causal=causal), None)
    alpha = torch.rand(H, generator=g).to(device) * 0.01  # LaS's decays are fixed: no gradient

    def las(q, k, v, **kw):
        return las_attention(q, k, v, alpha.to(q.dtype), **kw)

    # with max_alpha (a host float, as the LaS mixer passes it) the small rates take the separable path; without
    # it the op runs the flash kernel, reading nothing of alpha
    for path, bound in (("separable", dict(max_alpha=float(alpha.max()))), ("flash", {})):
        yield (f"las_attention pool=3 {path}", las,
               [rnd(B, H, L, K, scale=0.5), rnd(B, H, L, K, scale=0.5), rnd(B, H, L, V)],
               dict(pool_size=3, causal_pool=True, **bound), None)
    active = torch.rand(B, L, generator=g).to(device) < 0.6

    def sparse(q, k, v, rel_bias, **kw):
        return sparse_local_attention(q, k, v, active, rel_bias, **kw)

    for window in (32 if quick else 256, None):
        yield (f"sparse_local_attention window={window}", sparse,
               [rnd(B, L, K, scale=0.5), rnd(B, L, K, scale=0.5), rnd(B, L, V), rnd(2 * L - 1, scale=0.1)],
               dict(window=window), ("fp32", "fp32", "bf16", "fp32"))
    E, S, Cq = (16, 12, 16) if quick else (64, 256, 128)
    k = rnd(B, L, E)
    cb = rnd(S, E)
    codes = vq_search_ref(k.flatten(0, 1), cb)[0].view(B, L)

    def vq(q, k_hat, v, table, **kw):
        return vq_attention(q, k_hat, v, cb.to(q.dtype), codes, kw.pop("mask"), window_bias(table, Cq), **kw)

    yield ("vq_attention", vq, [rnd(B, L, E, scale=E ** -0.5), cb[codes], rnd(B, L, V), rnd(4 * Cq - 1, scale=0.3)],
           dict(block_size=Cq, mask=mask), ("fp32", "fp32", "bf16", "fp32"))


def run(op, inputs, kwargs, dtypes, backend, compiled):
    leaves = [x.detach().to(d).requires_grad_(x.is_floating_point()) for x, d in zip(inputs, dtypes)]
    def call(*a):
        return op(*a, **kwargs, backend=backend)

    if compiled:
        torch._dynamo.reset()  # one compiled function per case: no recompile limit across cases
        call = torch.compile(call, fullgraph=True, dynamic=False)
    out = call(*leaves)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device, out.dtype)
    grads = torch.autograd.grad((out * w).sum(), [x for x in leaves if x.requires_grad], allow_unused=True)
    return [out] + [gr for gr in grads if gr is not None]


def rel_err(ref, out) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max().clamp_min(1e-12)).item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU interpreter)")
    ap.add_argument("--no-compile", action="store_true", help="eager only")
    ap.add_argument("--cases", nargs="+", default=None, metavar="TEXT",
                    help="only the cases whose name contains one of these (e.g. vq_attention 'causal=True')")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("parity.py: no CUDA GPU (set TRITON_INTERPRET=1 with --quick to run the kernels in the interpreter)")
        return 0
    rows, failed = [], 0
    names = {"fp32": torch.float32, "bf16": torch.bfloat16}
    for name, op, inputs, kwargs, mixed in cases(args.quick, device):
        if args.cases and not any(text in name for text in args.cases):
            continue
        ref = run(op, inputs, dict(kwargs), [torch.float64] * len(inputs), "torch", False)
        variants = [("fp32", [torch.float32] * len(inputs), False)]
        if not args.no_compile:
            variants.append(("fp32", [torch.float32] * len(inputs), True))
        if mixed is not None and device == "cuda":
            variants.append(("mixed", [names[m] for m in mixed], False))
        for kind, dtypes, compiled in variants:
            try:
                got = run(op, inputs, dict(kwargs), dtypes, "triton", compiled)
                err = max(rel_err(r, o) for r, o in zip(ref, got))
                ok = len(got) == len(ref) and err <= TOL[kind]
                status = f"{err:.2e}"
            except Exception as e:  # reported as a failed case; the table goes on
                ok, status = False, f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            failed += not ok
            rows.append(f"| {name} | {kind} | {'compiled' if compiled else 'eager'} | {status} | "
                        f"{'ok' if ok else 'FAIL'} |")
            print(rows[-1], flush=True)
    print("\n| op case | dtypes | mode | max rel. error (out + grads) | |\n|---|---|---|---|---|")
    print("\n".join(rows))
    print(f"\n{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
