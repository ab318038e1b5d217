"""The long-span attention backward (MEGA's full attention, SeqBoat-full) against the split kernels it replaced.

1. Parity on the GPU against the float64 references: MEGA's full-length `local_attention` (K 64, V 256, softmax and
   laplace, bidirectional and causal, a padded row) and SeqBoat's `sparse_local_attention` in full mode (70% of the
   tokens active, compressed and original bias), float32 and bf16, o and every gradient; those of the ops in --ops.
2. Times (bf16, `triton.testing.do_bench` means, which include the host's launches; SeqBoat-full also the GPU
   kernels' time, from torch.profiler) at B8 L4096 and B2 L16384:
   - MEGA: the forward and the backward launchers with the default tiles (two passes: dk, dq by atomics and the
     bias gradient's ds tiles over 128-key spans, then dv by its own kernel), with the one-pass backward they
     replaced (`ONE_PASS_BWD`: dv in the same kernel, 32-query tiles) and with the split path before that
     (`SPLIT_BWD` / `SPLIT_FWD`: a dq kernel and a dk/dv kernel per 128-wide value block, the bias gradient by
     atomics), the bias gradient on and off;
   - SeqBoat-full (K 64, V 256, the compressed bias): forward and forward + backward of the op with all tokens
     active and with 78% (what SeqBoat-full Text's router activated at 16K from seed 0): the default (MEGA's
     full-length kernels on the packed sequence, `PACKED_LONG_SPAN`, the backward in pieces of the query range
     without per-score masks), that route with its scores masked one by one (`packed_tile_mode` giving tile mode 1)
     and the whole query range a program (`PACKED_PIECE_QUERIES = None`) as before the pieces ("packed-masked"), or
     in pieces with the masks ("pieces-masked"), the fused sparse kernels it replaced (the one-kernel backward
     without dv, then a dv pass), their one-pass backward (`DV_PASS_TILES = None`) and the split path
     (`FUSED_BWD_MODES` emptied, which also restores the 64-wide forward).

GPU:  PYTHONUNBUFFERED=1 PYTHONPATH=src python3 scripts/bench/long_span.py [--csv rows.csv] [--skip-parity]
          [--ops mega seqboat-full]
"""

from __future__ import annotations

import argparse
import csv
import itertools
import sys

import torch

from longmixer.ops.local_attention import kernel as local_kernel
from longmixer.ops.local_attention import local_attention, local_attention_ref
from longmixer.ops.sparse_local_attention import kernel as sparse_kernel
from longmixer.ops.sparse_local_attention import sparse_local_attention, sparse_local_attention_ref

ROWS: list[dict] = []
# the split path's tiles before the one-pass backward (forward: 128 queries, 8 warps)
SPLIT_BWD = dict(local_kernel.SPLIT_SPAN_K64)
SPLIT_FWD = dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, BLOCK_V=256, num_warps=8, num_stages=2)
# the one-pass backward without the dv pass: dv accumulated beside dk in the same kernel, 32-query tiles (what
# values of at most 128 run)
ONE_PASS_BWD = dict(local_kernel.LONG_SPAN_K64_ONE_PASS)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()


def check(name: str, got: list, ref: list, dtype) -> bool:
    errs = [rel(a, b) for a, b in zip(got, ref)]
    ok = max(errs) < (2e-5 if dtype == torch.float32 else 2e-2)
    print(f"parity {name:44s} {str(dtype)[6:]:8s} o/dq/dk/dv/dbias " + " ".join(f"{e:.1e}" for e in errs)
          + ("  ok" if ok else "  FAIL"), flush=True)
    return ok


# MEGA's parity cases (L, attention, causal): L 1000, which 64 does not divide (tile mode 0, the bias gradient by ds
# tiles whose tiles past L add zeros), and 1024 (whole tiles: tile mode 2 or 1), at fewer cases as each takes about
# 25 s on an H200
MEGA_PARITY = [(1000, a, c) for a, c in itertools.product(("softmax", "laplace"), (False, True))] + [
    (1024, "softmax", False), (1024, "laplace", True)]


def _mega_inputs(B: int, L: int, K: int, V: int) -> tuple:
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(B, 1, L, K, generator=g) for _ in range(2))
    v, table = torch.randn(B, 1, L, V, generator=g), 0.3 * torch.randn(2 * L - 1, generator=g)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 700:] = False
    return q, k, v, table, mask


def parity(device, ops: list[str]) -> bool:
    g = torch.Generator().manual_seed(0)
    B, L, K, V = 2, 1000, 64, 256
    q, k = (torch.randn(B, 1, L, K, generator=g) for _ in range(2))
    v = torch.randn(B, 1, L, V, generator=g)
    table = 0.3 * torch.randn(2 * L - 1, generator=g)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[1, 700:] = False
    ok = True
    mega_inputs = {L: (q, k, v, table, mask), 1024: _mega_inputs(B, 1024, K, V)}
    for n, attention, causal in MEGA_PARITY if "mega" in ops else ():
        q_n, k_n, v_n, table_n, mask_n = mega_inputs[n]
        leaves = [t.double().to(device).requires_grad_() for t in (q_n, k_n, v_n, table_n)]
        kw = dict(attention=attention, causal=causal, mask=mask_n.to(device))
        ref = local_attention_ref(*leaves[:3], chunk_size=n, bias=leaves[3], **kw)
        go = torch.randn_like(ref)
        ref.backward(go)
        for dtype in (torch.float32, torch.bfloat16):
            ls = [t.detach().to(dtype).requires_grad_() for t in leaves[:3]] + [
                leaves[3].detach().float().requires_grad_()]
            o = local_attention(*ls[:3], bias=ls[3], **kw)
            o.backward(go.to(dtype))
            ok &= check(f"mega L{n} {attention} causal={causal}", [o] + [x.grad for x in ls],
                        [ref] + [x.grad for x in leaves], dtype)
    qs, ks = (t[:, 0] for t in (q, k))
    vs = v[:, 0]
    active = torch.rand(B, L, generator=g) < 0.7
    for rel_pos in ("compressed", "original") if "seqboat-full" in ops else ():
        for causal in (False, True):
            leaves = [t.double().to(device).requires_grad_() for t in (qs, ks, vs, table)]
            kw = dict(window=None, causal=causal, rel_pos=rel_pos)
            ref = sparse_local_attention_ref(*leaves[:3], active.to(device), leaves[3], **kw)
            go = torch.randn_like(ref)
            ref.backward(go)
            for dtype in (torch.float32, torch.bfloat16):
                ls = [t.detach().to(dtype).requires_grad_() for t in leaves[:3]] + [
                    leaves[3].detach().float().requires_grad_()]
                o = sparse_local_attention(*ls[:3], active.to(device), ls[3], **kw)
                o.backward(go.to(dtype))
                ok &= check(f"seqboat-full {rel_pos} causal={causal}", [o] + [x.grad for x in ls],
                            [ref] + [x.grad for x in leaves], dtype)
    return ok


def add(op: str, shape: str, path: str, what: str, ms: float) -> None:
    ROWS.append(dict(op=op, shape=shape, path=path, what=what, ms=ms))
    print(f"{op:12s} {shape:10s} {path:9s} {what:34s} {ms:8.3f} ms", flush=True)


def mega(device, B: int, L: int) -> None:
    from triton.testing import do_bench

    g = torch.Generator().manual_seed(1)
    K, V = 64, 256
    q, k = (torch.randn(B, 1, L, K, generator=g).to(device, torch.bfloat16) for _ in range(2))
    v = torch.randn(B, 1, L, V, generator=g).to(device, torch.bfloat16)
    table = (0.1 * torch.randn(1, 2 * L - 1, generator=g)).to(device)
    kw = dict(attention="softmax", causal=False, chunk=L, scale=K ** -0.5)
    shape = f"B{B} L{L}"
    for path, fwd_cfg, bwd_cfg in (("split", SPLIT_FWD, SPLIT_BWD), ("one-pass", None, ONE_PASS_BWD),
                                   ("default", None, None)):
        o, stat = local_kernel.local_attention_fwd(q, k, v, table, None, cfg=fwd_cfg, **kw)
        do = torch.randn_like(o)
        add("mega", shape, path, "forward",
            do_bench(lambda c=fwd_cfg: local_kernel.local_attention_fwd(q, k, v, table, None, cfg=c, **kw)))
        for bias_grad in (True, False):
            add("mega", shape, path, f"backward, bias gradient {'on' if bias_grad else 'off'}",
                do_bench(lambda c=bwd_cfg, bg=bias_grad: local_kernel.local_attention_bwd(
                    q, k, v, o, stat, do, table, None, bias_grad=bg, cfg=c, **kw)))


def kernel_ms(fn, calls: int = 3) -> float:
    """GPU kernel time of one call (torch.profiler, summed over the kernels of `calls` calls): the op's wall time
    at 4K is its launcher's and autograd's host time, which a model's CUDA graphs do not pay."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    # only CUDA activity is recorded, so every averaged entry is a kernel (or a memset / copy) on the GPU
    return sum(e.device_time_total for e in prof.key_averages()) / calls / 1e3


def seqboat_full(device, B: int, L: int, share: float, backend: str = "auto", K: int = 64, V: int = 256) -> None:
    from triton.testing import do_bench

    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(B, L, K, generator=g).to(device, torch.bfloat16).requires_grad_() for _ in range(2))
    v = torch.randn(B, L, V, generator=g).to(device, torch.bfloat16).requires_grad_()
    active = (torch.rand(B, L, generator=g) < share).to(device)
    bias = (0.1 * torch.randn(2 * L - 1, generator=g)).to(device).requires_grad_()
    shape = f"B{B} L{L} {share:.0%}"

    def fwd():
        return sparse_local_attention(q, k, v, active, bias, window=None, rel_pos="compressed", backend=backend)

    def step():
        out = fwd()
        out.backward(torch.ones_like(out))
        for t in (q, k, v, bias):
            t.grad = None
    modes = set(sparse_kernel.FUSED_BWD_MODES)
    dv_pass, packed_default = sparse_kernel.DV_PASS_TILES, sparse_kernel.PACKED_LONG_SPAN
    pieces, tile_mode = local_kernel.PACKED_PIECE_QUERIES, local_kernel.packed_tile_mode

    def masked(C, causal, BLOCK_M, BLOCK_N, span=None):  # tile mode 1: every score tested against the bounds
        return min(tile_mode(C, causal, BLOCK_M, BLOCK_N, span), 1)

    paths = (("split", set(), dv_pass, False, pieces, tile_mode), ("one-pass", modes, None, False, pieces, tile_mode),
             ("fused", modes, dv_pass, False, pieces, tile_mode), ("packed-masked", modes, dv_pass, True, None, masked),
             ("pieces-masked", modes, dv_pass, True, pieces, masked),
             ("default", modes, dv_pass, True, pieces, tile_mode))
    try:
        for path, fused, second, packed, piece_queries, packed_mode in paths:
            sparse_kernel.FUSED_BWD_MODES.clear()
            sparse_kernel.FUSED_BWD_MODES.update(fused)
            sparse_kernel.DV_PASS_TILES = second
            sparse_kernel.PACKED_LONG_SPAN = packed
            local_kernel.PACKED_PIECE_QUERIES, local_kernel.packed_tile_mode = piece_queries, packed_mode
            with torch.no_grad():
                add("seqboat-full", shape, path, "forward", do_bench(fwd))
            add("seqboat-full", shape, path, "forward + backward", do_bench(step))
            add("seqboat-full", shape, path, "forward + backward, GPU kernels", kernel_ms(step))
    finally:
        sparse_kernel.FUSED_BWD_MODES.clear()
        sparse_kernel.FUSED_BWD_MODES.update(modes)
        sparse_kernel.DV_PASS_TILES = dv_pass
        sparse_kernel.PACKED_LONG_SPAN = packed_default
        local_kernel.PACKED_PIECE_QUERIES, local_kernel.packed_tile_mode = pieces, tile_mode


def markdown(rows: list[dict]) -> str:
    """A table per op, a line per (shape, what): each path's ms and its time over the default's."""
    tables = []
    for op in dict.fromkeys(r["op"] for r in rows):
        mine = [r for r in rows if r["op"] == op]
        paths = [p for p in dict.fromkeys(r["path"] for r in mine) if p != "default"] + ["default"]
        others = paths[:-1]
        lines = ["| op | shape | what | " + " | ".join(f"{p} ms" for p in paths) + " | "
                 + " | ".join(f"{p} / default" for p in others) + " |",
                 "|" + "---|" * (3 + len(paths) + len(others))]
        for shape, what in dict.fromkeys((r["shape"], r["what"]) for r in mine):
            ms = {r["path"]: r["ms"] for r in mine if (r["shape"], r["what"]) == (shape, what)}
            cells = [f"{ms[p]:.3f}" if ms.get(p) else "-" for p in paths]
            ratios = [f"{ms[p] / ms['default']:.2f}x" if ms.get(p) and ms.get("default") else "-" for p in others]
            lines.append("| " + " | ".join([op, shape, what, *cells, *ratios]) + " |")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", default=None, help="write every timing row here")
    parser.add_argument("--skip-parity", action="store_true",
                        help="timings only (the parity cases take about 200 s on an H200)")
    parser.add_argument("--ops", nargs="+", choices=("mega", "seqboat-full"), default=["mega", "seqboat-full"],
                        help="which ops to check and time (default: both)")
    parser.add_argument("--active", nargs="+", type=float, default=[1.0, 0.78],
                        help="SeqBoat-full's shares of active tokens to time (default: 1.0 0.78)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("long_span.py times GPU kernels: it needs a CUDA GPU (skipped)")
        return 0
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    ok = True if args.skip_parity else parity(device, args.ops)
    for B, L in ((8, 4096), (2, 16384)):
        if "mega" in args.ops:
            mega(device, B, L)
        if "seqboat-full" in args.ops:
            for share in args.active:
                seqboat_full(device, B, L, share)
    print(markdown(ROWS))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(ROWS[0]))
            w.writeheader()
            w.writerows(ROWS)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
