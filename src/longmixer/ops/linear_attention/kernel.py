"""Triton kernels for tiled linear attention with fused output normalization and gate (CHELA section 4.1,
arXiv:2406.08128; tiling after GLA, Yang et al. 2024, and FLA's 64 x 64 state tiles).

Layout follows FLA: q, k [B, L, H, K], v, g, o [B, L, H, V], contiguous. The forward and the three backward
products share one chunk walk, `_linear_attention_chunk_kernel`:

    out = scale * (a S + ((a b^T) ⊙ M) c),   S = sum of b^T c over the chunks before (reverse: after) this one

| product | a | b | c (tiled) | walk | S |
| --- | --- | --- | --- | --- | --- |
| o  | q  | k  | v  | forward | sum k^T v |
| dq | dp | v  | k  | forward | (sum k^T v)^T |
| dv | k  | q  | dp | reverse | sum q^T dp |
| dk | v  | dp | q  | reverse | (sum q^T dp)^T |

(dp = dL/d(raw output): the dq walk computes it from dL/do, the gate and the raw output that the forward saved,
and stores it for the two reverse walks.) One program owns one (column tile of c, batch*head, segment): its
[width(a), BC] float32 state lives in registers, so tiling c's columns (FLA keeps 64 x 64 state tiles) cuts
register pressure and multiplies the programs. When batch*heads is small the sequence is cut into segments (a
two-level scan): `_linear_attention_state_kernel` sums b^T c per segment, `_linear_attention_scan_kernel` turns
the sums into each segment's starting state (exclusive prefix, or suffix for the reverse walks), and the segments
run in parallel. `_split` picks tiles and segments from shapes and the SM count; no host syncs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longmixer.ops.common import sm_count


@triton.jit(do_not_specialize=["L", "NCH", "NS", "S0", "H"])  # one compile for every length and head count
def _linear_attention_state_kernel(b, c, s, L, NCH, NS, S0, H, DA: tl.constexpr, DC: tl.constexpr,
                                   C: tl.constexpr, BA: tl.constexpr, BC: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """s[bh, seg] = sum over the segment's chunks of b^T c (float32, [DA, DC]), one BA x BC tile per program;
    program (., ., i) covers segment S0 + i of NS."""
    i_ac, i_bh, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2) + S0
    n_c = tl.cdiv(DC, BC)
    i_a, i_c = i_ac // n_c, i_ac % n_c
    i_b, i_h = i_bh // H, i_bh % H
    b_s = tl.zeros([BA, BC], dtype=tl.float32)
    for i in range(NCH):
        t0 = (i_s * NCH + i) * C
        p_b = tl.make_block_ptr(b + (i_b * L * H + i_h) * DA, (L, DA), (H * DA, 1), (t0, i_a * BA), (C, BA), (1, 0))
        p_c = tl.make_block_ptr(c + (i_b * L * H + i_h) * DC, (L, DC), (H * DC, 1), (t0, i_c * BC), (C, BC), (1, 0))
        b_s += tl.dot(tl.trans(tl.load(p_b, boundary_check=(0, 1))), tl.load(p_c, boundary_check=(0, 1)),
                      input_precision=DOT_PRECISION)
    r_a = i_a * BA + tl.arange(0, BA)
    r_c = i_c * BC + tl.arange(0, BC)
    p_s = s + (i_bh * NS + i_s) * DA * DC + r_a[:, None] * DC + r_c[None, :]
    tl.store(p_s, b_s, mask=(r_a[:, None] < DA) & (r_c[None, :] < DC))


@triton.jit
def _linear_attention_scan_kernel(s, NS, N: tl.constexpr, BLOCK: tl.constexpr, REVERSE: tl.constexpr,
                                  TOTAL: tl.constexpr):
    """In place over s [BH, NS, N]: each segment's slot gets the sum of the segments before it (REVERSE: after
    it); TOTAL: slot 0 gets the sum of all segments (the non-causal state). Without TOTAL the last segment's sum
    (REVERSE: the first's) feeds no other segment: it is neither read nor needed."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    r_n = i_n * BLOCK + tl.arange(0, BLOCK)
    m_n = r_n < N
    b_acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(NS):
        if REVERSE:
            i_s = NS - 1 - i
        else:
            i_s = i
        p_s = s + (i_bh * NS + i_s) * N + r_n
        if TOTAL:
            b_acc += tl.load(p_s, mask=m_n, other=0.0)
        else:
            b_x = tl.load(p_s, mask=m_n & (i < NS - 1), other=0.0)
            tl.store(p_s, b_acc, mask=m_n)
            b_acc += b_x
    if TOTAL:
        tl.store(s + i_bh * NS * N + r_n, b_acc, mask=m_n)


@triton.jit(do_not_specialize=["L", "NCH", "H"])
def _linear_attention_chunk_kernel(a, b, c, o, h, s_hb, s_hs, s_ha, s_hc, x, xs, y, raw, g, dg, scale, eps, L,
                                   NCH, H, DA: tl.constexpr, DC: tl.constexpr, C: tl.constexpr, BA: tl.constexpr,
                                   BC: tl.constexpr, CAUSAL: tl.constexpr, REVERSE: tl.constexpr,
                                   LOAD_H: tl.constexpr, SUM_X: tl.constexpr, DP_IN: tl.constexpr,
                                   NORMALIZE: tl.constexpr, USE_GATE: tl.constexpr, SAVE_RAW: tl.constexpr,
                                   DOT_PRECISION: tl.constexpr):
    """One BC-wide column tile of out = scale (a S + ((a b^T) ⊙ M) c) over one segment (see the module table).

    a, b [B, L, H, DA]; c, o [B, L, H, DC]; h: the segment's starting state, element (i, j) at
    h + bh s_hb + seg s_hs + i s_ha + j s_hc (strides let dq and dk read a transposed state).
    SUM_X: also sum x^T a over the segment (x [B, L, H, DC]) into xs [BH, NS, DC, DA] (dq's pass gives the
    segment sums of q^T dp that the reverse walks start from).
    DP_IN (dq only): a = dp is computed here from y = dL/do, the saved raw output, g (norm and gate backward),
    and the column tile 0 program stores dp into `a` and dL/dg into dg.
    Forward epilogue (c = v in one tile): NORMALIZE (CHELA eq. 9 Norm), USE_GATE (* G_a), SAVE_RAW (raw -> raw).
    """
    i_c, i_bh, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_a = (i_b * L * H + i_h) * DA
    o_c = (i_b * L * H + i_h) * DC
    r_a = tl.arange(0, BA)
    r_c = i_c * BC + tl.arange(0, BC)
    if LOAD_H:
        p_h = h + i_bh * s_hb + i_s * s_hs + r_a[:, None] * s_ha + r_c[None, :] * s_hc
        b_h = tl.load(p_h, mask=(r_a[:, None] < DA) & (r_c[None, :] < DC), other=0.0)
    else:
        b_h = tl.zeros([BA, BC], dtype=tl.float32)
    b_x = tl.zeros([BC, BA], dtype=tl.float32)
    r_t = tl.arange(0, C)
    if REVERSE:  # key row j sees query column i when j <= i
        m_t = r_t[:, None] <= r_t[None, :]
    else:
        m_t = r_t[:, None] >= r_t[None, :]
    for i in range(NCH):
        if REVERSE:
            t0 = (i_s * NCH + NCH - 1 - i) * C
        else:
            t0 = (i_s * NCH + i) * C
        p_a = tl.make_block_ptr(a + o_a, (L, DA), (H * DA, 1), (t0, 0), (C, BA), (1, 0))
        if DP_IN:  # back through CHELA eq. 9: o = Norm(raw) * g
            p_y = tl.make_block_ptr(y + o_a, (L, DA), (H * DA, 1), (t0, 0), (C, BA), (1, 0))
            b_y = tl.load(p_y, boundary_check=(0, 1)).to(tl.float32)
            p_raw = tl.make_block_ptr(raw + o_a, (L, DA), (H * DA, 1), (t0, 0), (C, BA), (1, 0))
            b_n = tl.load(p_raw, boundary_check=(0, 1)).to(tl.float32)
            if NORMALIZE:
                b_r = tl.rsqrt(tl.sum(b_n * b_n, axis=1) / DA + eps)
                b_n = b_n * b_r[:, None]
            if USE_GATE:
                p_g = tl.make_block_ptr(g + o_a, (L, DA), (H * DA, 1), (t0, 0), (C, BA), (1, 0))
                if i_c == 0:
                    p_dg = tl.make_block_ptr(dg + o_a, (L, DA), (H * DA, 1), (t0, 0), (C, BA), (1, 0))
                    tl.store(p_dg, (b_y * b_n).to(dg.dtype.element_ty), boundary_check=(0, 1))
                b_y = b_y * tl.load(p_g, boundary_check=(0, 1)).to(tl.float32)
            if NORMALIZE:  # d/dx of x rsqrt(mean(x^2) + eps)
                b_y = b_r[:, None] * (b_y - b_n * (tl.sum(b_y * b_n, axis=1) / DA)[:, None])
            b_a = b_y.to(a.dtype.element_ty)
            if i_c == 0:
                tl.store(p_a, b_a, boundary_check=(0, 1))
        else:
            b_a = tl.load(p_a, boundary_check=(0, 1))
        b_o = tl.dot(b_a, b_h.to(b_a.dtype), input_precision=DOT_PRECISION)  # across chunks: a S
        if CAUSAL:
            p_b = tl.make_block_ptr(b + o_a, (L, DA), (H * DA, 1), (t0, 0), (C, BA), (1, 0))
            p_c = tl.make_block_ptr(c + o_c, (L, DC), (H * DC, 1), (t0, i_c * BC), (C, BC), (1, 0))
            b_b = tl.load(p_b, boundary_check=(0, 1))
            b_cc = tl.load(p_c, boundary_check=(0, 1))
            b_A = tl.where(m_t, tl.dot(b_a, tl.trans(b_b), input_precision=DOT_PRECISION), 0.0)
            b_o += tl.dot(b_A.to(b_cc.dtype), b_cc, input_precision=DOT_PRECISION)  # inside the chunk, masked
            b_h += tl.dot(tl.trans(b_b), b_cc, input_precision=DOT_PRECISION)
        if SUM_X:
            p_x = tl.make_block_ptr(x + o_c, (L, DC), (H * DC, 1), (t0, i_c * BC), (C, BC), (1, 0))
            b_x += tl.dot(tl.trans(tl.load(p_x, boundary_check=(0, 1))), b_a, input_precision=DOT_PRECISION)
        b_o = b_o * scale
        if SAVE_RAW:
            p_raw = tl.make_block_ptr(raw + o_c, (L, DC), (H * DC, 1), (t0, i_c * BC), (C, BC), (1, 0))
            tl.store(p_raw, b_o.to(raw.dtype.element_ty), boundary_check=(0, 1))
        if NORMALIZE and not DP_IN:  # CHELA eq. 9, Norm: RMS over the head's DC real columns (padding is zero)
            b_o = b_o * tl.rsqrt(tl.sum(b_o * b_o, axis=1) / DC + eps)[:, None]
        if USE_GATE and not DP_IN:  # CHELA eq. 9: * G_a
            p_g = tl.make_block_ptr(g + o_c, (L, DC), (H * DC, 1), (t0, i_c * BC), (C, BC), (1, 0))
            b_o = b_o * tl.load(p_g, boundary_check=(0, 1)).to(tl.float32)
        p_o = tl.make_block_ptr(o + o_c, (L, DC), (H * DC, 1), (t0, i_c * BC), (C, BC), (1, 0))
        tl.store(p_o, b_o.to(o.dtype.element_ty), boundary_check=(0, 1))
    if SUM_X:
        p_xs = xs + (i_bh * tl.num_programs(2) + i_s) * DC * DA + r_c[:, None] * DA + r_a[None, :]
        tl.store(p_xs, b_x, mask=(r_c[:, None] < DC) & (r_a[None, :] < DA))


# Measured on the H200 (docs/benchmarks.md, kernel measurement records): 64-wide column tiles, four warps and
# four pipeline stages won at every width and length of the B8 grid once the programs fill the SMs;
# `_split` decides how to add programs where batch*heads is small.
_BLOCK, _WARPS, _STAGES = 64, 4, 4


def _split(programs: int, n_chunks: int, sms: int) -> tuple[int, int]:
    """(column tile, segments) for `programs` = batch*heads*(64-wide tiles). Enough programs (~3/4 of the SMs): as
    is. Short sequences (<= 64 chunks): halve the column tile (q, k are re-read, mostly from L2). Long ones: cut the
    sequence into one segment per idle SM share (>= 16 chunks each); the state pass over k and v pays for itself
    only there."""
    if 4 * programs >= 3 * sms:
        return _BLOCK, 1
    if n_chunks <= 64:
        return _BLOCK // 2, 1
    return _BLOCK, max(1, min(n_chunks // 16, sms // programs))


def _plan(q: torch.Tensor, v: torch.Tensor, chunk_size: int, tune: dict | None) -> dict:
    """Tiles, warps, pipelining depth and the sequence split for one call; `tune` overrides any of them
    (segments, block, warps, stages, fuse_sums)."""
    tune = tune or {}
    B, L, H, K = q.shape
    V = v.shape[-1]
    n_chunks = triton.cdiv(L, chunk_size)
    sms = sm_count(q.device) if q.is_cuda else 1
    block, segments = _split(B * H * triton.cdiv(max(K, V), _BLOCK), n_chunks, sms)
    block, segments = tune.get("block", block), tune.get("segments", segments)
    segments = min(max(1, segments), n_chunks)
    NCH = triton.cdiv(n_chunks, segments)
    return dict(NS=triton.cdiv(n_chunks, NCH), NCH=NCH, BH=B * H, H=H, K=K, V=V, L=L, C=chunk_size, block=block,
                warps=tune.get("warps", _WARPS), stages=tune.get("stages", _STAGES),
                fuse_sums=tune.get("fuse_sums", True), precision="ieee" if q.dtype == torch.float32 else "tf32")


def _stages(p: dict, esize: int, n_wide: int, n_tile: int, BA: int, BC: int) -> int:
    """Software-pipelining depth (at most p["stages"]) that keeps the staged [C, BA] / [C, BC] input tiles within
    ~200 KB of shared memory (the H100/H200 limit is 227 KB)."""
    per_stage = p["C"] * esize * (n_wide * BA + n_tile * BC)
    return max(1, min(p["stages"], (200 * 1024) // per_stage))


def _states(b, c, p: dict, DA: int, DC: int, skip: str | None) -> torch.Tensor:
    """Per-segment sums of b^T c, [BH, NS, DA, DC] float32; skip "last" / "first" leaves out the segment whose
    sum no other segment starts from (causal prefix / suffix), so the pass reads (NS - 1) / NS of b and c."""
    BA = min(64, max(16, triton.next_power_of_2(DA)))
    BC = min(64, max(16, triton.next_power_of_2(DC)))
    NS = p["NS"]
    s = b.new_empty(p["BH"], NS, DA, DC, dtype=torch.float32)
    grid = (triton.cdiv(DA, BA) * triton.cdiv(DC, BC), p["BH"], NS - (skip is not None))
    _linear_attention_state_kernel[grid](b, c, s, p["L"], p["NCH"], NS, int(skip == "first"), p["H"], DA=DA, DC=DC,
                                         C=p["C"], BA=BA, BC=BC, DOT_PRECISION=p["precision"], num_warps=4,
                                         num_stages=_stages(p, b.element_size(), 1, 1, BA, BC))
    return s


def _scan(s: torch.Tensor, reverse: bool, total: bool) -> torch.Tensor:
    """Segment sums -> starting states, in place (see `_linear_attention_scan_kernel`)."""
    BH, NS, DA, DC = s.shape
    BLOCK = 1024
    grid = (triton.cdiv(DA * DC, BLOCK), BH)
    _linear_attention_scan_kernel[grid](s, NS, N=DA * DC, BLOCK=BLOCK, REVERSE=reverse, TOTAL=total, num_warps=4)
    return s


def _walk(a, b, c, o, p: dict, *, causal: bool, reverse: bool, scale: float, h=None, h_strides=(0, 0, 0, 0),
          x=None, xs=None, dp_in=None, eps: float = 0.0, normalize: bool = False, gate=None, raw=None,
          one_tile: bool = False) -> None:
    """Launch `_linear_attention_chunk_kernel` over (column tiles of c, batch*heads, segments)."""
    DA, DC = a.shape[-1], c.shape[-1]
    BA = max(16, triton.next_power_of_2(DA))
    BC = max(16, triton.next_power_of_2(DC)) if one_tile else min(p["block"], max(16, triton.next_power_of_2(DC)))
    y, dg = (dp_in if dp_in is not None else (None, None))
    n_wide = (1 + causal) + (2 + (gate is not None) if dp_in is not None else 0)
    n_tile = causal + (x is not None) + (gate is not None and dp_in is None) + 1
    grid = (triton.cdiv(DC, BC), p["BH"], p["NS"])
    warps = max(p["warps"], 8) if BA * BC > 64 * 128 else p["warps"]  # a 128 x 128 float32 state spills at 4 warps
    dummy = a  # pointer for operands a launch does not use (never dereferenced: their constexpr flags are off)
    _linear_attention_chunk_kernel[grid](
        a, b, c, o, h if h is not None else dummy, *h_strides, x if x is not None else dummy,
        xs if xs is not None else dummy, y if y is not None else dummy, raw if raw is not None else dummy,
        gate if gate is not None else dummy, dg if dg is not None else dummy, scale, eps, p["L"], p["NCH"], p["H"],
        DA=DA, DC=DC, C=p["C"], BA=BA, BC=BC, CAUSAL=causal, REVERSE=reverse, LOAD_H=h is not None,
        SUM_X=x is not None, DP_IN=dp_in is not None, NORMALIZE=normalize, USE_GATE=gate is not None,
        SAVE_RAW=raw is not None and dp_in is None, DOT_PRECISION=p["precision"], num_warps=warps,
        num_stages=_stages(p, a.element_size(), n_wide, n_tile, BA, BC))


def linear_attention_fwd(q, k, v, g, *, causal: bool, scale: float, normalize: bool, eps: float,
                         chunk_size: int, save_raw: bool, tune: dict | None = None):
    """Launch the forward. Returns o [B, L, H, V], the segment starting states [BH, NS, K, V] float32 (None when
    there are none) and, with save_raw, the raw output before norm and gate (the backward's input to them)."""
    p = _plan(q, v, chunk_size, tune)
    K, V = p["K"], p["V"]
    h = None
    if not causal or p["NS"] > 1:
        h = _states(k, v, p, K, V, skip="last" if causal else None)
        if p["NS"] > 1:
            _scan(h, reverse=False, total=not causal)
    o = torch.empty_like(v)
    raw = torch.empty_like(v) if save_raw and (normalize or g is not None) else None
    _walk(q, k, v, o, p, causal=causal, reverse=False, scale=scale, h=h,
          h_strides=(p["NS"] * K * V, K * V if causal else 0, V, 1), eps=eps, normalize=normalize, gate=g,
          raw=raw, one_tile=normalize)
    return o, h, raw


def linear_attention_bwd(q, k, v, g, do, h, raw, *, causal: bool, scale: float, normalize: bool, eps: float,
                         chunk_size: int, tune: dict | None = None):
    """Launch the backward (dq walk, segment sums of q^T dp, dv and dk reverse walks). Returns dq, dk, dv, dg."""
    p = _plan(q, v, chunk_size, tune)
    K, V, NS = p["K"], p["V"], p["NS"]
    do = do.contiguous()
    through_epilogue = normalize or g is not None
    dp = torch.empty_like(v) if through_epilogue else do  # dL/d(raw output)
    dg = torch.empty_like(g) if g is not None else None
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    need_p = not causal or NS > 1
    fuse = need_p and p["fuse_sums"]
    sums = q.new_empty(p["BH"], NS, K, V, dtype=torch.float32) if fuse else None
    hs = (NS * K * V, K * V if causal else 0, 1, V)  # the forward's [K, V] states read as [V, K]
    _walk(dp, v, k, dq, p, causal=causal, reverse=False, scale=scale, h=h, h_strides=hs, x=q if fuse else None,
          xs=sums, dp_in=(do, dg) if through_epilogue else None, eps=eps, normalize=normalize, gate=g, raw=raw)
    if need_p:
        if not fuse:
            sums = _states(q, dp, p, K, V, skip="first" if causal else None)
        if NS > 1:
            _scan(sums, reverse=True, total=not causal)
    ps = (NS * K * V, K * V if causal else 0, V, 1)
    _walk(k, q, dp, dv, p, causal=causal, reverse=True, scale=scale, h=sums, h_strides=ps)
    _walk(v, dp, q, dk, p, causal=causal, reverse=True, scale=scale, h=sums, h_strides=(ps[0], ps[1], 1, V))
    return dq, dk, dv, dg
