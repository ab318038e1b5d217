"""GPU parity and speed of MEGA's chunked attention (`longmixer.ops.local_attention`) against its torch reference,
FlexAttention and chunked SDPA; `--only ema` runs the MD-EMA bench of `ema_chunked.py` (parity and speed of
`longmixer.ops.ema` against the official torch path), which `make bench` also runs on its own.

Run on the GPU:  PYTHONUNBUFFERED=1 PYTHONPATH=src python3 scripts/bench/mega.py
Smoke test here: TRITON_INTERPRET=1 PYTHONPATH=src python scripts/bench/mega.py --quick
"""

from __future__ import annotations

import argparse
import sys

import torch

from longmixer.ops.local_attention import local_attention, local_attention_ref

# scripts/bench/_common.py (this folder is sys.path[0])
from _common import ROWS, bench, fwd_bwd, out_of_bound, parity_status, peak_mem, rel, row, skip_status

# parity bounds (relative L2 error against float64, worst over o and every gradient): scripts/bench/parity.py's.
# Recorded on GPUs: float32 <= 9.8e-7, bfloat16 <= 3.4e-3 (ops/local_attention/README.md)
PARITY_BOUND = {"float32": 1e-4, "16-bit": 2e-2}


# ---------------------------------------------------------------- attention -----------------------------------

def attn_inputs(B, H, L, K, V, C, device, dtype):
    g = torch.Generator(device="cpu").manual_seed(L + K)
    q, k = ((torch.randn(B, H, L, K, generator=g)).to(device, dtype).requires_grad_() for _ in range(2))
    v = torch.randn(B, H, L, V, generator=g).to(device, dtype).requires_grad_()
    bias = (torch.randn(2 * C - 1, generator=g) * 0.1).to(device).requires_grad_()
    return q, k, v, bias


def attn_parity_cases(quick, subset=False):
    """((B, H, L, K, V, C), attentions) pairs for `attn_parity`."""
    shapes = [(1, 1, 40, 16, 16, 16)] if quick else [(2, 1, 1000, 64, 160, 128), (1, 2, 777, 32, 64, 100),
                                                    (2, 1, 300, 96, 320, None)]
    cases = [(shape, ("softmax", "relu2", "laplace")) for shape in shapes]
    if subset:
        cases = [(shapes[0], ("softmax", "laplace"))]
    if not quick:
        # MEGA's full-length (non-chunk) element attention, ragged batch: the split backward (dq + dk/dv kernels)
        cases.append(((2, 1, 1000, 64, 64, None), ("laplace", "relu2")))
    return cases


def attn_parity(device, quick, subset=False, cases=None):
    cases = attn_parity_cases(quick, subset) if cases is None else cases
    worst = {}
    for (B, H, L, K, V, C), attentions in cases:
        for attention in attentions:
            for causal in (False, True):
                # the CPU interpreter mishandles bfloat16 (float16 runs there instead)
                for dtype in (torch.float32, torch.bfloat16 if device.type == "cuda" else torch.float16):
                    CC = L if C is None else C
                    q, k, v, bias = attn_inputs(B, H, L, K, V, CC, device, dtype)
                    mask = torch.ones(B, L, dtype=torch.bool, device=device)
                    mask[0, L - L // 7:] = False
                    kw = dict(chunk_size=C, attention=attention, causal=causal, mask=mask)
                    ins64 = [t.detach().double().requires_grad_() for t in (q, k, v, bias)]
                    o = local_attention(q, k, v, bias=bias, backend="triton", **kw)
                    o64 = local_attention_ref(*ins64[:3], bias=ins64[3], **kw)
                    g = torch.randn_like(o64)
                    grads = torch.autograd.grad(o, [q, k, v, bias], g.to(dtype))
                    grads64 = torch.autograd.grad(o64, ins64, g)
                    errs = [rel(o, o64)] + [rel(a, b) for a, b in zip(grads, grads64)]
                    key = str(dtype).split(".")[-1]
                    worst[key] = max(worst.get(key, 0.0), *errs)
                    print(f"attn parity {key} B{B} H{H} L{L} K{K} V{V} C{C} {attention} causal={causal}: "
                          "o/dq/dk/dv/dbias rel err " + " ".join(f"{e:.1e}" for e in errs))
    print("attn parity worst rel err vs fp64 reference: " + ", ".join(f"{k} {v:.2e}" for k, v in worst.items()))
    return worst


# FlexAttention's default tiles ask for more shared memory than the H200 has at these shapes (seen on the first
# run: "out of resource ... Required: 262144 Hardware limit: 232448"), so smaller tiles are tried in turn.
FLEX_OPTIONS = [None, {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2, "BLOCK_M1": 32, "BLOCK_N1": 64,
                       "BLOCK_M2": 64, "BLOCK_N2": 32},
                {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 1, "BLOCK_M1": 32, "BLOCK_N1": 32,
                 "BLOCK_M2": 32, "BLOCK_N2": 32}]


def flex_fn(q, k, v, bias, C, causal, options):
    """FlexAttention (compiled) for chunked softmax with the relative bias as a score_mod."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    L = q.shape[2]

    def score_mod(score, b, h, q_idx, kv_idx):
        # Flex evaluates score_mod on every pair of a non-empty block, masked ones included: clamp the index
        return score + bias[torch.clamp((C - 1) + kv_idx - q_idx, 0, 2 * C - 2)]

    def mask_mod(b, h, q_idx, kv_idx):
        same = (q_idx // C) == (kv_idx // C)
        return same & (kv_idx <= q_idx) if causal else same

    block_mask = create_block_mask(mask_mod, None, None, L, L, device=q.device)
    # each shape and tile option recompiles flex_attention (twice: no_grad, then grad); past dynamo's recompile
    # limit (8) it falls back to an eager path that materializes L x L, so every configuration starts afresh
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    scale = q.shape[-1] ** -0.5
    return lambda: compiled(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                            kernel_options=options)


def sdpa_fn(q, k, v, bias, C, causal):
    """Reshape into chunks and run SDPA with the [C, C] bias (+ causal -inf) as a float mask."""
    B, H, L, K = q.shape
    nc = L // C
    pos = torch.arange(C, device=q.device)

    def run():
        bm = bias[(C - 1) + pos[None, :] - pos[:, None]].to(q.dtype)
        if causal:
            bm = bm.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        qc, kc, vc = (t.reshape(B, H, nc, C, -1) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, attn_mask=bm)
        return o.reshape(B, H, L, -1)
    return run


def lazy(factory, *args):
    """A callable that builds `factory(*args)` on its first call (inside the try of the timing loop)."""
    built = []

    def run():
        if not built:
            built.append(factory(*args))
        return built[0]()
    return run


def attn_speed(device, quick):
    cuda = device.type == "cuda"
    shapes = [(1, 1, 64, 16, 16, 32)] if quick else [
        (8, 1, 4096, 64, 64, 128), (8, 1, 4096, 128, 128, 128), (4, 1, 8192, 128, 128, 1024),
        (8, 1, 4096, 64, 256, 128)]
    dtype = torch.bfloat16 if cuda else torch.float32
    for B, H, L, K, V, C in shapes:
        for attention in ("softmax", "laplace", "relu2"):
            causal = C >= 1024  # the LM shapes are causal, the LRA ones bidirectional
            q, k, v, bias = attn_inputs(B, H, L, K, V, C, device, dtype)
            ins = [q, k, v, bias]
            cands = [("torch reference", lambda: local_attention_ref(q, k, v, chunk_size=C, attention=attention,
                                                                      causal=causal, bias=bias)),
                     ("triton", lambda: local_attention(q, k, v, chunk_size=C, attention=attention, causal=causal,
                                                        bias=bias, backend="triton"))]
            if attention == "softmax" and cuda:
                cands.append(("chunked SDPA + bias mask", sdpa_fn(q, k, v, bias, C, causal)))
                if K == V:
                    for i, options in enumerate(FLEX_OPTIONS):
                        cands.append((f"FlexAttention (compiled, tiles #{i})", lazy(flex_fn, q, k, v, bias, C, causal,
                                                                                    options)))
            res = {}
            for name, fn in cands:
                if name.startswith("FlexAttention") and any(n.startswith("FlexAttention") for n in res):
                    continue  # one working Flex configuration is enough
                try:
                    with torch.no_grad():
                        f_ms = bench(fn, quick)
                    fb = fwd_bwd(fn, ins)
                    fb_ms = bench(fb, quick)
                    res[name] = (f_ms, fb_ms, peak_mem(fb, device))
                except Exception as exc:
                    print(f"{name} failed at B{B} L{L} K{K} V{V} C{C}: {type(exc).__name__}: {exc}")
            tri = res.get("triton")
            for name, (f_ms, fb_ms, mem) in res.items():
                ratio = f"{fb_ms / tri[1]:.2f}x" if tri else "n/a"
                row(f"| attn {attention}{' causal' if causal else ''} | B{B} H{H} L{L} K{K} V{V} C{C} "
                    f"{str(dtype).split('.')[-1]} | {name} | {f_ms:.3f} | {fb_ms:.3f} | {ratio} | {mem:.2f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU, TRITON_INTERPRET=1)")
    parser.add_argument("--only", choices=("ema", "attn"), default="attn",
                        help="attn (default) or ema (the tables of ema_chunked.py, without its tile sweep)")
    parser.add_argument("--no-parity", action="store_true", help="timings only")
    parser.add_argument("--parity-subset", action="store_true", help="attention parity on one shape only")
    args = parser.parse_args()
    if (status := skip_status("mega.py", args.quick)) is not None:
        return status
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; torch {torch.__version__}")
    import triton
    print(f"triton {triton.__version__}")
    failures = []
    if args.only == "ema":
        import ema_chunked  # this folder is sys.path[0]

        worst = {} if args.no_parity else ema_chunked.parity(device, args.quick)
        ema_chunked.speed(device, args.quick, torch.bfloat16 if device.type == "cuda" else torch.float32)
        bounds = ema_chunked.PARITY_BOUND
    else:
        worst = {} if args.no_parity else attn_parity(device, args.quick, subset=args.parity_subset)
        attn_speed(device, args.quick)
        bounds = PARITY_BOUND
    for key, err in worst.items():
        out_of_bound(failures, f"worst {key}", err, bounds["float32" if "float32" in key else "16-bit"])
    print("\n| op | shape | implementation | fwd ms | fwd+bwd ms | speedup (ema: fwd / fwd+bwd vs the official "
          "path; attn: others' fwd+bwd time / triton) | peak GiB (fwd+bwd) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(ROWS))
    return parity_status("mega.py", failures)


if __name__ == "__main__":
    sys.exit(main())
