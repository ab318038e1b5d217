"""Triton backward kernels of LongVQ's blockwise VQ attention (arXiv:2404.11163, eq. 18): one pass per query tile
for dq, the codebook value-sum gradient and the local-bias gradient; one pass per (key tile, value tile) for dv and
dk. Scores are recomputed from q, k and the saved log-sum-exp, as in FlashAttention-2."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from longmixer.ops import common
from longmixer.ops.precision import work_dtype

from longmixer.ops.vq_attention.kernel import (_codewords, _laplace, attention_tiles, dot_precision, row_slices,
                                               row_walk_tiles)

# d/dx of MEGA's laplace: exp(-(x - mu)^2 / (2 sigma^2)) / (sigma sqrt(2 pi)), sigma^2 = 1 / (4 pi).
LAPLACE_MU = tl.constexpr(common.LAPLACE_MU)
LAPLACE_HALF_INV_VAR = tl.constexpr(0.5 / common.LAPLACE_SIGMA ** 2)  # 1 / (2 sigma^2) = 2 pi
LAPLACE_PEAK = tl.constexpr(1.0 / (common.LAPLACE_SIGMA * math.sqrt(2.0 * math.pi)))  # = sqrt(2)


@triton.jit
def _laplace_grad(x):
    return LAPLACE_PEAK * tl.exp(-(x - LAPLACE_MU) * (x - LAPLACE_MU) * LAPLACE_HALF_INV_VAR)


@triton.jit
def _scores_grad(b_s, m_s, b_lse, b_dp, b_delta, LAPLACE: tl.constexpr):
    """Attention weights and d(score) for one tile: softmax p (dp - delta) or laplace f'(s) dp."""
    if LAPLACE:
        b_p = tl.where(m_s, _laplace(b_s), 0.0)
        b_ds = tl.where(m_s, _laplace_grad(b_s) * b_dp, 0.0)
    else:
        b_p = tl.where(m_s, tl.exp(b_s - b_lse[:, None]), 0.0)
        b_ds = b_p * (b_dp - b_delta[:, None])
    return b_p, b_ds


@triton.jit
def _vq_attention_bwd_dq_kernel(q, k, v, codebook, codes, n_out, u_out, bias, mask, o, lse, delta, do, dq, dbias,
                                L, S, E, H, C: tl.constexpr, CAUSAL: tl.constexpr, LAPLACE: tl.constexpr,
                                HAS_BIAS: tl.constexpr, GLOBAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                BS: tl.constexpr, BE: tl.constexpr, BH: tl.constexpr, IP: tl.constexpr,
                                G: tl.constexpr):
    """One program: BM queries. delta = rowsum(do * o) (softmax), dq over the window and the codebook, and dbias by
    atomic adds. Every block adds to
    the same [C, 3C] bias gradient, so programs spread over G copies (summed by the launcher) to cut atomic
    contention. GLOBAL: the window's second weight -phi(q.c_{z_j}) (see the forward) sends its gradient to q
    through the codeword."""
    i_m, i_b = tl.program_id(0), tl.program_id(1)
    p_dbias = dbias + ((i_b * tl.num_programs(0) + i_m) % G) * (C * 3 * C)
    NB = L // C
    blk = (i_m * BM) // C
    o_i = i_m * BM + tl.arange(0, BM)
    o_e = tl.arange(0, BE)
    m_e = o_e < E
    m_i = tl.load(mask + i_b * L + o_i) != 0
    b_q = tl.load(q + (i_b * L + o_i[:, None]) * E + o_e[None, :], mask=m_e[None, :], other=0.0)
    b_lse = tl.load(lse + i_b * L + o_i)
    b_delta = tl.zeros([BM], tl.float32)
    if not LAPLACE:  # delta_i = do_i . o_i, stored for the dk/dv kernel
        for h0 in range(0, H, BH):
            o_h = h0 + tl.arange(0, BH)
            p_h = (i_b * L + o_i[:, None]) * H + o_h[None, :]
            b_delta += tl.sum(tl.load(do + p_h, mask=o_h[None, :] < H, other=0.0).to(tl.float32)
                              * tl.load(o + p_h, mask=o_h[None, :] < H, other=0.0).to(tl.float32), axis=1)
        tl.store(delta + i_b * L + o_i, b_delta)
    b_dq = tl.zeros([BM, BE], tl.float32)
    j_lo = tl.maximum(blk - 1, 0) * C
    j_hi = tl.minimum(blk + 1, NB - 1) * C + C
    if CAUSAL:
        j_hi = blk * C + C
    for j0 in range(j_lo, j_hi, BN):
        o_j = j0 + tl.arange(0, BN)
        m_j = tl.load(mask + i_b * L + o_j) != 0
        b_k = tl.load(k + (i_b * L + o_j[:, None]) * E + o_e[None, :], mask=m_e[None, :], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=IP)
        col = o_j - (blk - 1) * C
        if HAS_BIAS:
            b_s += tl.load(bias + (o_i % C)[:, None] * (3 * C) + col[None, :])
        m_s = m_i[:, None] & m_j[None, :]
        if CAUSAL:
            m_s = m_s & (o_j[None, :] <= o_i[:, None])
        b_dp = tl.zeros([BM, BN], tl.float32)
        for h0 in range(0, H, BH):
            o_h = h0 + tl.arange(0, BH)
            b_do = tl.load(do + (i_b * L + o_i[:, None]) * H + o_h[None, :], mask=o_h[None, :] < H, other=0.0)
            b_v = tl.load(v + (i_b * L + o_j[:, None]) * H + o_h[None, :], mask=o_h[None, :] < H, other=0.0)
            b_dp += tl.dot(b_do, tl.trans(b_v), input_precision=IP)
        b_p, b_ds = _scores_grad(b_s, m_s, b_lse, b_dp, b_delta, LAPLACE)
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=IP)
        if GLOBAL:
            b_cj = _codewords(codebook, tl.load(codes + i_b * L + o_j), o_e, m_e, E)
            b_sc = tl.dot(b_q, tl.trans(b_cj), input_precision=IP)
            b_pc, b_dsc = _scores_grad(b_sc, m_s, b_lse, b_dp, b_delta, LAPLACE)
            b_dq -= tl.dot(b_dsc.to(b_cj.dtype), b_cj, input_precision=IP)
        if HAS_BIAS:
            tl.atomic_add(p_dbias + (o_i % C)[:, None] * (3 * C) + col[None, :], b_ds, mask=m_s, sem="relaxed")
    p_stat = i_b * S if GLOBAL else (i_b * NB + blk) * S
    for s0 in range(0, S, BS):
        o_s = s0 + tl.arange(0, BS)
        m_sc = o_s < S
        b_c = tl.load(codebook + o_s[:, None] * E + o_e[None, :], mask=m_sc[:, None] & m_e[None, :], other=0.0)
        b_n = tl.load(n_out + p_stat + o_s, mask=m_sc, other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_c), input_precision=IP)  # [BM, BS]
        m_s = m_i[:, None] & (b_n > 0)[None, :]
        b_dp = tl.zeros([BM, BS], tl.float32)
        for h0 in range(0, H, BH):
            o_h = h0 + tl.arange(0, BH)
            m_uh = m_sc[:, None] & (o_h[None, :] < H)
            b_u = tl.load(u_out + (p_stat + o_s[:, None]) * H + o_h[None, :], mask=m_uh, other=0.0)
            b_do = tl.load(do + (i_b * L + o_i[:, None]) * H + o_h[None, :], mask=o_h[None, :] < H, other=0.0)
            b_dp += tl.dot(b_do.to(b_u.dtype), tl.trans(b_u), input_precision=IP)
        if LAPLACE:
            b_ds = tl.where(m_s, _laplace_grad(b_s) * b_dp, 0.0)
        else:
            b_p = tl.where(m_s, tl.exp(b_s - b_lse[:, None]), 0.0)
            b_ds = b_p * (b_dp - b_n[None, :] * b_delta[:, None])  # code s carries n_s keys in the normalizer
        b_dq += tl.dot(b_ds.to(b_c.dtype), b_c, input_precision=IP)
    tl.store(dq + (i_b * L + o_i[:, None]) * E + o_e[None, :], b_dq.to(dq.dtype.element_ty), mask=m_e[None, :])


@triton.jit
def _code_grad_tile(q, mask, lse, do, b_c, b_n, row0, o_i, o_e, m_e, o_h, m_h, E, H, LAPLACE: tl.constexpr,
                    IP: tl.constexpr):
    """sum over the real queries o_i (row offset row0) of phi'(q_i . c_s) do_i for the codes of b_c [BS, BE] that
    have keys (b_n > 0): a [BS, BH] term of the value-sum gradient."""
    m_i = tl.load(mask + row0 + o_i) != 0
    b_q = tl.load(q + (row0 + o_i[:, None]) * E + o_e[None, :], mask=m_e[None, :], other=0.0)
    b_sT = tl.dot(b_c, tl.trans(b_q), input_precision=IP)  # [BS, BM]
    m_sT = (b_n > 0)[:, None] & m_i[None, :]
    if LAPLACE:
        b_pT = tl.where(m_sT, _laplace(b_sT), 0.0)
    else:
        b_pT = tl.where(m_sT, tl.exp(b_sT - tl.load(lse + row0 + o_i)[None, :]), 0.0)
    b_do = tl.load(do + (row0 + o_i[:, None]) * H + o_h[None, :], mask=m_i[:, None] & m_h[None, :], other=0.0)
    return tl.dot(b_pT.to(b_do.dtype), b_do, input_precision=IP)


@triton.jit
def _vq_attention_bwd_du_kernel(q, codebook, n_out, mask, lse, do, du, L, S, E, H, R,
                                LAPLACE: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr,
                                BE: tl.constexpr, BH: tl.constexpr, IP: tl.constexpr):
    """Bidirectional: one program is BS codes x BH value columns of the row's value-sum gradient
    dU = sum_i phi'_is do_i over the R query rows of slice g, written to du[b, g] (the launcher sums the slices).
    No atomics: each program owns its output tile."""
    i_s, i_h, i_bg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NG = L // R
    i_b, g = i_bg // NG, i_bg % NG
    o_s = i_s * BS + tl.arange(0, BS)
    o_h = i_h * BH + tl.arange(0, BH)
    o_e = tl.arange(0, BE)
    m_s, m_h, m_e = o_s < S, o_h < H, o_e < E
    b_c = tl.load(codebook + o_s[:, None] * E + o_e[None, :], mask=m_s[:, None] & m_e[None, :], other=0.0)
    b_n = tl.load(n_out + i_b * S + o_s, mask=m_s, other=0.0)
    b_du = tl.zeros([BS, BH], tl.float32)
    for i0 in range(g * R, g * R + R, BM):
        b_du += _code_grad_tile(q, mask, lse, do, b_c, b_n, i_b * L, i0 + tl.arange(0, BM), o_e, m_e, o_h, m_h, E, H,
                                LAPLACE, IP)
    tl.store(du + ((i_b * NG + g) * S + o_s[:, None]) * H + o_h[None, :], b_du, mask=m_s[:, None] & m_h[None, :])


@triton.jit
def _vq_attention_bwd_du_suffix_kernel(q, codebook, n_out, mask, lse, do, du, L, S, E, H, C: tl.constexpr,
                                       LAPLACE: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr, BE: tl.constexpr,
                                       BH: tl.constexpr, IP: tl.constexpr):
    """Causal: du[b, blk] = sum over query blocks b' >= blk of dU_{b'} (the gradient of block b''s cache), so that a
    key of block c, which is in the caches of blocks c+2.., takes its value gradient from du[b, c + 2, z_j]. One
    program per (code tile, value tile, row) walks the blocks from the last."""
    i_s, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NB = L // C
    o_s = i_s * BS + tl.arange(0, BS)
    o_h = i_h * BH + tl.arange(0, BH)
    o_e = tl.arange(0, BE)
    m_s, m_h, m_e = o_s < S, o_h < H, o_e < E
    b_c = tl.load(codebook + o_s[:, None] * E + o_e[None, :], mask=m_s[:, None] & m_e[None, :], other=0.0)
    b_du = tl.zeros([BS, BH], tl.float32)
    for r in range(0, NB):
        blk = NB - 1 - r
        b_n = tl.load(n_out + (i_b * NB + blk) * S + o_s, mask=m_s, other=0.0)
        for i0 in range(blk * C, blk * C + C, BM):
            b_du += _code_grad_tile(q, mask, lse, do, b_c, b_n, i_b * L, i0 + tl.arange(0, BM), o_e, m_e, o_h, m_h,
                                    E, H, LAPLACE, IP)
        tl.store(du + ((i_b * NB + blk) * S + o_s[:, None]) * H + o_h[None, :], b_du,
                 mask=m_s[:, None] & m_h[None, :])


@triton.jit
def _vq_attention_bwd_dkv_kernel(q, k, v, codebook, codes, du, bias, mask, lse, delta, do, dk, dv, L, S, E, H,
                                 C: tl.constexpr, CAUSAL: tl.constexpr, LAPLACE: tl.constexpr,
                                 HAS_BIAS: tl.constexpr, GLOBAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                                 BE: tl.constexpr, BH: tl.constexpr, IP: tl.constexpr):
    """One program: BN keys and BH value columns. Loops over the query tiles whose window holds the keys (blocks
    b-1..b+1, or b..b+1 causal). dv of its columns stays in registers; dp needs all H columns, so it is recomputed
    per value tile, and the first value tile also accumulates dk. GLOBAL: dv takes the window weight
    phi(q.k_j + bias) - phi(q.c_{z_j}) (see the forward). Every real key's dv also takes the gradient that reaches
    its value through its code's sums: dU[b, z_j] (GLOBAL) or the suffix sum du[b, blk + 2, z_j] (causal); dk only
    the first part (the codebook is a buffer)."""
    i_n, i_b, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NB = L // C
    blk = (i_n * BN) // C
    o_j = i_n * BN + tl.arange(0, BN)
    o_e = tl.arange(0, BE)
    o_hv = i_h * BH + tl.arange(0, BH)
    m_e, m_hv = o_e < E, o_hv < H
    m_j = tl.load(mask + i_b * L + o_j) != 0
    b_k = tl.load(k + (i_b * L + o_j[:, None]) * E + o_e[None, :], mask=m_e[None, :], other=0.0)
    b_z = tl.load(codes + i_b * L + o_j)
    b_cj = b_k
    if GLOBAL:
        b_cj = _codewords(codebook, b_z, o_e, m_e, E)
    b_dk = tl.zeros([BN, BE], tl.float32)
    b_dv = tl.zeros([BN, BH], tl.float32)
    i_lo = tl.maximum(blk - 1, 0) * C
    if CAUSAL:
        i_lo = blk * C
    i_hi = tl.minimum(blk + 1, NB - 1) * C + C
    for i0 in range(i_lo, i_hi, BM):
        o_i = i0 + tl.arange(0, BM)
        qblk = i0 // C
        m_i = tl.load(mask + i_b * L + o_i) != 0
        b_q = tl.load(q + (i_b * L + o_i[:, None]) * E + o_e[None, :], mask=m_e[None, :], other=0.0)
        b_lse = tl.load(lse + i_b * L + o_i)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=IP)  # [BM, BN]
        if HAS_BIAS:
            b_s += tl.load(bias + (o_i % C)[:, None] * (3 * C) + (o_j - (qblk - 1) * C)[None, :])
        m_s = m_i[:, None] & m_j[None, :]
        if CAUSAL:
            m_s = m_s & (o_j[None, :] <= o_i[:, None])
        if LAPLACE:
            b_p = tl.where(m_s, _laplace(b_s), 0.0)
        else:
            b_p = tl.where(m_s, tl.exp(b_s - b_lse[:, None]), 0.0)
        b_w = b_p
        if GLOBAL:
            b_sc = tl.dot(b_q, tl.trans(b_cj), input_precision=IP)
            if LAPLACE:
                b_w -= tl.where(m_s, _laplace(b_sc), 0.0)
            else:
                b_w -= tl.where(m_s, tl.exp(b_sc - b_lse[:, None]), 0.0)
        b_do = tl.load(do + (i_b * L + o_i[:, None]) * H + o_hv[None, :], mask=m_hv[None, :], other=0.0)
        b_dv += tl.dot(tl.trans(b_w.to(b_do.dtype)), b_do, input_precision=IP)  # [BN, BH]
        if i_h == 0:
            b_delta = tl.load(delta + i_b * L + o_i)
            b_dp = tl.zeros([BM, BN], tl.float32)
            for h0 in range(0, H, BH):
                o_h = h0 + tl.arange(0, BH)
                m_h = o_h < H
                b_doh = tl.load(do + (i_b * L + o_i[:, None]) * H + o_h[None, :], mask=m_h[None, :], other=0.0)
                b_v = tl.load(v + (i_b * L + o_j[:, None]) * H + o_h[None, :], mask=m_h[None, :], other=0.0)
                b_dp += tl.dot(b_doh, tl.trans(b_v), input_precision=IP)
            b_p, b_ds = _scores_grad(b_s, m_s, b_lse, b_dp, b_delta, LAPLACE)
            b_dk += tl.dot(tl.trans(b_ds.to(b_q.dtype)), b_q, input_precision=IP)
    if GLOBAL:  # the row's sums hold every real key
        b_dv += tl.load(du + (i_b * S + b_z[:, None]) * H + o_hv[None, :], mask=m_j[:, None] & m_hv[None, :],
                        other=0.0)
    elif blk + 2 < NB:  # the caches of blocks blk+2.. hold this block's keys
        b_dv += tl.load(du + ((i_b * NB + blk + 2) * S + b_z[:, None]) * H + o_hv[None, :],
                        mask=m_j[:, None] & m_hv[None, :], other=0.0)
    tl.store(dv + (i_b * L + o_j[:, None]) * H + o_hv[None, :], b_dv.to(dv.dtype.element_ty), mask=m_hv[None, :])
    if i_h == 0:
        tl.store(dk + (i_b * L + o_j[:, None]) * E + o_e[None, :], b_dk.to(dk.dtype.element_ty),
                 mask=m_e[None, :])


def vq_attention_bwd(q, k, v, codebook, codes, n_out, u_out, bias, mask, o, lse, do, block_size: int, causal: bool,
                     laplace: bool):
    """Launcher. Same inputs as `vq_attention_fwd` plus its statistics n_out, u_out, and o, lse, do [B, L, H].

    Returns dq, dk [B, L, E] (q's dtype), dv [B, L, H] (v's dtype, with the gradient through the statistics) and
    dbias [C, 3C] float32 or None."""
    B, L, E = q.shape
    H, S = v.shape[-1], codebook.shape[0]
    q_dtype, k_dtype = q.dtype, k.dtype
    glob = not causal
    work = work_dtype(v, q, k)
    q, k = q.to(work), k.to(work)
    do = do.contiguous()
    delta = torch.empty_like(lse) if not laplace else lse  # [B, L], written by the dq kernel; unused by laplace
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dv = torch.empty_like(v)
    G = 16  # copies of the bias gradient, see the dq kernel
    dbias = torch.zeros(G, block_size, 3 * block_size, dtype=torch.float32, device=q.device) if bias is not None \
        else None
    codebook = codebook.to(q.dtype).contiguous()
    flags = dict(C=block_size, CAUSAL=causal, LAPLACE=laplace, HAS_BIAS=bias is not None, GLOBAL=glob,
                 IP=dot_precision(q.dtype))
    t = attention_tiles(block_size, E, H, "dq")
    _vq_attention_bwd_dq_kernel[(L // t["BM"], B)](q, k, v, codebook, codes, n_out, u_out,
                                                   bias if bias is not None else lse, mask, o, lse, delta, do, dq,
                                                   dbias if bias is not None else lse, L, S, E, H, **flags, **t,
                                                   G=G)
    du = _value_sums_grad(q, codebook, n_out, mask, lse, do, block_size, laplace, glob)
    t = attention_tiles(block_size, E, H, "dkv")
    t.pop("BS")
    grid_kv = (L // t["BN"], B, triton.cdiv(H, t["BH"]))
    _vq_attention_bwd_dkv_kernel[grid_kv](q, k, v, codebook, codes, du, bias if bias is not None else lse, mask, lse,
                                          delta, do, dk, dv, L, S, E, H, **flags, **t)
    return dq.to(q_dtype), dk.to(k_dtype), dv, None if dbias is None else dbias.sum(0)


def _value_sums_grad(q, codebook, n_out, mask, lse, do, block_size, laplace, glob):
    """The statistics' gradient as the dk/dv kernel reads it, float32: the whole row's dU [B, 1, S, H] (glob; the
    row cut into slices of whole blocks, `row_slices`, whose partial sums are added here), or the causal caches'
    suffix sums [B, NB, S, H]."""
    B, L, E = q.shape
    H, S = do.shape[-1], codebook.shape[0]
    if not glob:
        t = row_walk_tiles(block_size, E, H, "du_suffix", B, S, q.device)
        t.pop("BN")
        du = torch.empty(B, L // block_size, S, H, dtype=torch.float32, device=q.device)
        _vq_attention_bwd_du_suffix_kernel[(triton.cdiv(S, t["BS"]), triton.cdiv(H, t["BH"]), B)](
            q, codebook, n_out, mask, lse, do, du, L, S, E, H, C=block_size, LAPLACE=laplace,
            IP=dot_precision(q.dtype), **t)
        return du
    t = attention_tiles(block_size, E, H, "du")
    t.pop("BN")
    rows = row_slices(B, L, block_size, triton.cdiv(S, t["BS"]) * triton.cdiv(H, t["BH"]), q.device)
    du = torch.empty(B, L // rows, S, H, dtype=torch.float32, device=q.device)
    _vq_attention_bwd_du_kernel[(triton.cdiv(S, t["BS"]), triton.cdiv(H, t["BH"]), B * (L // rows))](
        q, codebook, n_out, mask, lse, do, du, L, S, E, H, rows, LAPLACE=laplace, IP=dot_precision(q.dtype), **t)
    return du.sum(1, keepdim=True) if L // rows > 1 else du
