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

from longmixer.ops.vq_attention.kernel import _laplace, attention_tiles, dot_precision

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
def _vq_attention_bwd_dq_kernel(q, k, v, codebook, n_out, u_out, bias, mask, lse, delta, do, dq, du, dbias,
                                L, S, E, H, C: tl.constexpr, CAUSAL: tl.constexpr, LAPLACE: tl.constexpr,
                                HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr,
                                BE: tl.constexpr, BH: tl.constexpr, IP: tl.constexpr, G: tl.constexpr):
    """One program: BM queries. dq over the window and the codebook; du (outside-window value sums of this block)
    and dbias by atomic adds, since the BM-row tiles of one block share them. Every block adds to the same [C, 3C]
    bias gradient, so programs spread over G copies (summed by the launcher) to cut atomic contention."""
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
    b_delta = tl.load(delta + i_b * L + o_i)
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
        if HAS_BIAS:
            tl.atomic_add(p_dbias + (o_i % C)[:, None] * (3 * C) + col[None, :], b_ds, mask=m_s, sem="relaxed")
    p_stat = (i_b * NB + blk) * S
    for s0 in range(0, S, BS):
        o_s = s0 + tl.arange(0, BS)
        m_sc = o_s < S
        b_c = tl.load(codebook + o_s[:, None] * E + o_e[None, :], mask=m_sc[:, None] & m_e[None, :], other=0.0)
        b_n = tl.load(n_out + p_stat + o_s, mask=m_sc, other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_c), input_precision=IP)  # [BM, BS]
        m_s = m_i[:, None] & (b_n > 0)[None, :]
        if LAPLACE:
            b_p = tl.where(m_s, _laplace(b_s), 0.0)
        else:
            b_p = tl.where(m_s, tl.exp(b_s - b_lse[:, None]), 0.0)
        b_dp = tl.zeros([BM, BS], tl.float32)
        for h0 in range(0, H, BH):
            o_h = h0 + tl.arange(0, BH)
            m_uh = m_sc[:, None] & (o_h[None, :] < H)
            b_u = tl.load(u_out + (p_stat + o_s[:, None]) * H + o_h[None, :], mask=m_uh, other=0.0)
            b_do = tl.load(do + (i_b * L + o_i[:, None]) * H + o_h[None, :], mask=o_h[None, :] < H, other=0.0)
            b_do = tl.where(m_i[:, None], b_do, 0.0).to(b_u.dtype)
            b_dp += tl.dot(b_do, tl.trans(b_u), input_precision=IP)
            b_du = tl.dot(tl.trans(b_p.to(b_u.dtype)), b_do, input_precision=IP)  # [BS, BH]
            tl.atomic_add(du + (p_stat + o_s[:, None]) * H + o_h[None, :], b_du, mask=m_uh, sem="relaxed")
        if LAPLACE:
            b_ds = tl.where(m_s, _laplace_grad(b_s) * b_dp, 0.0)
        else:
            b_ds = b_p * (b_dp - b_n[None, :] * b_delta[:, None])  # code s carries n_s keys in the normalizer
        b_dq += tl.dot(b_ds.to(b_c.dtype), b_c, input_precision=IP)
    tl.store(dq + (i_b * L + o_i[:, None]) * E + o_e[None, :], b_dq.to(dq.dtype.element_ty), mask=m_e[None, :])


@triton.jit
def _vq_attention_bwd_dkv_kernel(q, k, v, bias, mask, lse, delta, do, dk, dv, L, E, H,
                                 C: tl.constexpr, CAUSAL: tl.constexpr, LAPLACE: tl.constexpr,
                                 HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BE: tl.constexpr,
                                 BH: tl.constexpr, IP: tl.constexpr):
    """One program: BN keys and BH value columns. Loops over the query tiles whose window holds the keys (blocks
    b-1..b+1, or b..b+1 causal). dv of its columns stays in registers; dp needs all H columns, so it is recomputed
    per value tile, and the first value tile also accumulates dk."""
    i_n, i_b, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NB = L // C
    blk = (i_n * BN) // C
    o_j = i_n * BN + tl.arange(0, BN)
    o_e = tl.arange(0, BE)
    o_hv = i_h * BH + tl.arange(0, BH)
    m_e, m_hv = o_e < E, o_hv < H
    m_j = tl.load(mask + i_b * L + o_j) != 0
    b_k = tl.load(k + (i_b * L + o_j[:, None]) * E + o_e[None, :], mask=m_e[None, :], other=0.0)
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
        b_do = tl.load(do + (i_b * L + o_i[:, None]) * H + o_hv[None, :], mask=m_hv[None, :], other=0.0)
        b_dv += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do, input_precision=IP)  # [BN, BH]
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
    tl.store(dv + (i_b * L + o_j[:, None]) * H + o_hv[None, :], b_dv.to(dv.dtype.element_ty), mask=m_hv[None, :])
    if i_h == 0:
        tl.store(dk + (i_b * L + o_j[:, None]) * E + o_e[None, :], b_dk.to(dk.dtype.element_ty),
                 mask=m_e[None, :])


def vq_attention_bwd(q, k, v, codebook, n_out, u_out, bias, mask, o, lse, do, block_size: int, causal: bool,
                     laplace: bool):
    """Launcher. Same inputs as `vq_attention_fwd` plus o, lse and do [B, L, H].

    Returns dq, dk [B, L, E] (q's dtype), dv [B, L, H] (v's dtype), du [B, NB, S, H] float32, dbias [C, 3C]
    float32 or None."""
    B, L, E = q.shape
    H, S = v.shape[-1], codebook.shape[0]
    q_dtype, k_dtype = q.dtype, k.dtype
    work = work_dtype(v, q, k)
    q, k = q.to(work), k.to(work)
    t = attention_tiles(block_size, E, H)
    do = do.contiguous()
    delta = (do.float() * o.float()).sum(-1).contiguous() if not laplace else lse  # [B, L]; unused by laplace
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dv = torch.empty_like(v)
    du = torch.zeros_like(u_out)
    G = 16  # copies of the bias gradient, see the dq kernel
    dbias = torch.zeros(G, block_size, 3 * block_size, dtype=torch.float32, device=q.device) if bias is not None \
        else None
    codebook = codebook.to(q.dtype).contiguous()
    flags = dict(C=block_size, CAUSAL=causal, LAPLACE=laplace, HAS_BIAS=bias is not None, IP=dot_precision(q.dtype))
    _vq_attention_bwd_dq_kernel[(L // t["BM"], B)](q, k, v, codebook, n_out, u_out,
                                                   bias if bias is not None else lse, mask, lse, delta, do, dq, du,
                                                   dbias if bias is not None else lse, L, S, E, H, **flags, **t,
                                                   G=G)
    grid_kv = (L // t["BN"], B, triton.cdiv(H, t["BH"]))
    _vq_attention_bwd_dkv_kernel[grid_kv](q, k, v, bias if bias is not None else lse, mask, lse, delta, do, dk, dv,
                                          L, E, H, **flags, BM=t["BM"], BN=t["BN"], BE=t["BE"], BH=t["BH"])
    return dq.to(q_dtype), dk.to(k_dtype), dv, du, None if dbias is None else dbias.sum(0)
