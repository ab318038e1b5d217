"""Triton kernels of chunked attention (softmax, relu2, laplace; simple relative-position bias; key padding mask;
causal), forward and backward, flash-style: score tiles live on chip and the C x C (or L x L) matrix is never
written. MEGA, arXiv:2209.10655, sections 3.1 and 3.3."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

ATTN_CODES = {"softmax": 0, "relu2": 1, "laplace": 2}
_LAPLACE_MU = math.sqrt(0.5)
_LAPLACE_SIGMA = math.sqrt(0.25 / math.pi)


@triton.jit
def _scores(b_q, b_k, o_m, o_n, i_b, i_h, L, C, n_hi, scale, bias_ptr, inv_n_ptr, mask_ptr,
            ATTN: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_PER_HEAD: tl.constexpr,
            HAS_MASK: tl.constexpr, DOT_PREC: tl.constexpr):
    """Scores s [BM, BN] (float32) and the validity mask of one (query, key) tile."""
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * scale
    m_row = o_m < L
    b_inv = tl.load(inv_n_ptr + i_b * L + o_m, mask=m_row, other=1.)
    if ATTN != 0:
        b_s = b_s * b_inv[:, None]  # element attention divides by the key count before the bias (MEGA code)
    m_valid = m_row[:, None] & (o_n[None, :] < n_hi) & ((o_m // C)[:, None] == (o_n // C)[None, :])
    if CAUSAL:
        m_valid = m_valid & (o_n[None, :] <= o_m[:, None])
    if HAS_MASK:
        b_key = tl.load(mask_ptr + i_b * L + o_n, mask=o_n < L, other=0)
        m_valid = m_valid & (b_key != 0)[None, :]
    if HAS_BIAS:
        o_rel = tl.where(m_valid, (C - 1) + o_n[None, :] - o_m[:, None], 0)
        if BIAS_PER_HEAD:
            o_rel = o_rel + i_h * (2 * C - 1)
        b_s = b_s + tl.load(bias_ptr + o_rel, mask=m_valid, other=0.)
    return b_s, m_valid


@triton.jit
def _dropout_scale(seed, p_drop, i_bh, L, o_m, o_n):
    """keep / (1 - p) for each (query, key) of the tile; Philox numbers indexed by (bh, i, j), so the forward and
    the three backward kernels draw the same mask (the index wraps in int32 past 2^31 pairs: still a fixed draw)."""
    o_rng = (i_bh * L + o_m[:, None]) * L + o_n[None, :]
    return tl.where(tl.rand(seed, o_rng) >= p_drop, 1. / (1. - p_drop), 0.)


@triton.jit
def _activation(b_s, ATTN: tl.constexpr, MU: tl.constexpr, SIGMA: tl.constexpr):
    if ATTN == 1:
        b_r = tl.maximum(b_s, 0.)
        return b_r * b_r
    else:
        return 0.5 * (1. + tl.math.erf((b_s - MU) / (SIGMA * 1.4142135623730951)))


@triton.jit
def _activation_grad(b_s, ATTN: tl.constexpr, MU: tl.constexpr, SIGMA: tl.constexpr):
    if ATTN == 1:
        return 2. * tl.maximum(b_s, 0.)
    else:
        b_z = (b_s - MU) / SIGMA
        return tl.exp(-0.5 * b_z * b_z) / (SIGMA * 2.5066282746310002)


@triton.jit
def _query_range(n0, L, C, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Rows that can see keys [n0, n0 + BLOCK_N): the chunks those keys live in (causal: rows >= n0)."""
    n_last = tl.minimum(n0 + BLOCK_N, L) - 1
    lo = (n0 // C) * C
    hi = tl.minimum((n_last // C + 1) * C, L)
    if CAUSAL:
        lo = n0
    return lo, hi


@triton.jit
def _key_range(m0, L, C, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """Keys that rows [m0, m0 + BLOCK_M) can see: the chunks of those rows (causal: keys <= the last row)."""
    m_last = tl.minimum(m0 + BLOCK_M, L) - 1
    lo = (m0 // C) * C
    hi = tl.minimum((m_last // C + 1) * C, L)
    if CAUSAL:
        hi = m_last + 1
    return lo, hi


@triton.jit
def _local_attention_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, bias_ptr, inv_n_ptr, mask_ptr,
                                H, L, K, V, C, scale, seed, p_drop,
                                ATTN: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                                BIAS_PER_HEAD: tl.constexpr, HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr,
                                DOT_PREC: tl.constexpr, MU: tl.constexpr, SIGMA: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    i_m, i_bh, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    p_q = q_ptr + (i_bh * L + o_m[:, None]) * K + o_k[None, :]
    b_q = tl.load(p_q, mask=(o_m[:, None] < L) & (o_k[None, :] < K), other=0.)
    lo, hi = _key_range(i_m * BLOCK_M, L, C, BLOCK_M, CAUSAL)
    b_acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    b_mx = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        b_k = tl.load(k_ptr + (i_bh * L + o_n[:, None]) * K + o_k[None, :],
                      mask=(o_n[:, None] < hi) & (o_k[None, :] < K), other=0.)
        b_v = tl.load(v_ptr + (i_bh * L + o_n[:, None]) * V + o_v[None, :],
                      mask=(o_n[:, None] < hi) & (o_v[None, :] < V), other=0.)
        b_s, m_valid = _scores(b_q, b_k, o_m, o_n, i_b, i_h, L, C, hi, scale, bias_ptr, inv_n_ptr, mask_ptr,
                               ATTN, CAUSAL, HAS_BIAS, BIAS_PER_HEAD, HAS_MASK, DOT_PREC)
        if ATTN == 0:
            # online softmax; a row with no valid key so far keeps max -inf, guarded to avoid inf - inf
            b_s = tl.where(m_valid, b_s, float("-inf"))
            b_mx_new = tl.maximum(b_mx, tl.max(b_s, 1))
            b_safe = tl.where(b_mx_new == float("-inf"), 0., b_mx_new)
            b_p = tl.exp(b_s - b_safe[:, None])
            b_alpha = tl.exp(b_mx - b_safe)
            b_l = b_l * b_alpha + tl.sum(b_p, 1)
            b_acc = b_acc * b_alpha[:, None]
            b_mx = b_mx_new
        else:
            b_p = tl.where(m_valid, _activation(b_s, ATTN, MU, SIGMA), 0.)
        if DROPOUT:
            b_p = b_p * _dropout_scale(seed, p_drop, i_bh, L, o_m, o_n)  # the softmax sum b_l stays undropped
        b_acc += tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PREC)
    m_row = o_m < L
    if ATTN == 0:
        b_acc = b_acc / tl.where(b_l == 0., 1., b_l)[:, None]
        # rows with no key: lse = +inf so that the backward's exp(s - lse) is 0 there
        b_lse = tl.where(b_l == 0., float("inf"), b_mx + tl.log(tl.where(b_l == 0., 1., b_l)))
        tl.store(lse_ptr + i_bh * L + o_m, b_lse, mask=m_row & (i_v == 0))
    tl.store(o_ptr + (i_bh * L + o_m[:, None]) * V + o_v[None, :], b_acc.to(o_ptr.dtype.element_ty),
             mask=m_row[:, None] & (o_v[None, :] < V))


@triton.jit
def _probs(b_s, m_valid, b_lse, ATTN: tl.constexpr, MU: tl.constexpr, SIGMA: tl.constexpr):
    if ATTN == 0:
        return tl.where(m_valid, tl.exp(b_s - b_lse[:, None]), 0.)
    else:
        return tl.where(m_valid, _activation(b_s, ATTN, MU, SIGMA), 0.)


@triton.jit
def _dscores(b_s, m_valid, b_p, b_dp, b_delta, ATTN: tl.constexpr, MU: tl.constexpr, SIGMA: tl.constexpr):
    """dL/ds from dL/dp: softmax p (dp - rowsum(do o)); element f'(s) dp."""
    if ATTN == 0:
        return b_p * (b_dp - b_delta[:, None])
    else:
        return tl.where(m_valid, _activation_grad(b_s, ATTN, MU, SIGMA) * b_dp, 0.)


@triton.jit
def _dprobs(do_ptr, v_ptr, o_m, o_n, i_bh, L, V, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """dL/dp = do v^T [BM, BN], summed over value blocks."""
    b_dp = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        b_do = tl.load(do_ptr + (i_bh * L + o_m[:, None]) * V + o_v[None, :],
                       mask=(o_m[:, None] < L) & (o_v[None, :] < V), other=0.)
        b_v = tl.load(v_ptr + (i_bh * L + o_n[:, None]) * V + o_v[None, :],
                      mask=(o_n[:, None] < L) & (o_v[None, :] < V), other=0.)
        b_dp += tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)
    return b_dp


@triton.jit
def _bias_grad(b_ds, m_valid, p_scratch, p_dbias, m0, n0, C, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Add the tile's dL/ds into dbias[(C-1) + j - i]: the tile is written skewed (row i shifted by -i) to this
    program's scratch, read back and summed over rows, which gives its BM+BN-1 diagonal sums, then one atomic per
    diagonal instead of one per score."""
    o_i = tl.arange(0, BLOCK_M)
    o_j = tl.arange(0, BLOCK_N)
    o_c = tl.arange(0, 2 * BLOCK_N)
    tl.store(p_scratch + o_i[:, None] * (2 * BLOCK_N) + (o_j[None, :] - o_i[:, None] + BLOCK_M - 1),
             tl.where(m_valid, b_ds, 0.))
    tl.debug_barrier()
    m_written = (o_c[None, :] >= BLOCK_M - 1 - o_i[:, None]) & (o_c[None, :] < BLOCK_M - 1 - o_i[:, None] + BLOCK_N)
    b_skew = tl.load(p_scratch + o_i[:, None] * (2 * BLOCK_N) + o_c[None, :], mask=m_written, other=0.)
    b_diag = tl.sum(b_skew, axis=0)  # [2 BN], entry c holds j - i = c - (BM - 1)
    tl.debug_barrier()  # the next tile overwrites the scratch
    o_bias = (C - 1) + (n0 - m0) + o_c - (BLOCK_M - 1)
    tl.atomic_add(p_dbias + o_bias, b_diag,
                  mask=(o_c < BLOCK_M + BLOCK_N - 1) & (o_bias >= 0) & (o_bias <= 2 * C - 2))


@triton.jit
def _local_attention_bwd_dk_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, bias_ptr, inv_n_ptr,
                                   mask_ptr, dk_ptr, dbias_ptr, scratch_ptr, H, L, K, V, C, scale, seed, p_drop,
                                   ATTN: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                                   BIAS_PER_HEAD: tl.constexpr, HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr,
                                   DOT_PREC: tl.constexpr, MU: tl.constexpr, SIGMA: tl.constexpr, BLOCK_M: tl.constexpr,
                                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    # one key block: dk = sum_i ds_ij (scale / n_i) q_i; the bias gradient (summed along diagonals) by atomics
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    b_k = tl.load(k_ptr + (i_bh * L + o_n[:, None]) * K + o_k[None, :],
                  mask=(o_n[:, None] < L) & (o_k[None, :] < K), other=0.)
    b_dk = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    lo, hi = _query_range(i_n * BLOCK_N, L, C, BLOCK_N, CAUSAL)
    for m0 in range(lo, hi, BLOCK_M):
        o_m = m0 + tl.arange(0, BLOCK_M)
        m_row = o_m < L
        b_q = tl.load(q_ptr + (i_bh * L + o_m[:, None]) * K + o_k[None, :],
                      mask=m_row[:, None] & (o_k[None, :] < K), other=0.)
        b_s, m_valid = _scores(b_q, b_k, o_m, o_n, i_b, i_h, L, C, L, scale, bias_ptr, inv_n_ptr, mask_ptr,
                               ATTN, CAUSAL, HAS_BIAS, BIAS_PER_HEAD, HAS_MASK, DOT_PREC)
        b_lse = tl.zeros([BLOCK_M], dtype=tl.float32)
        b_delta = tl.zeros([BLOCK_M], dtype=tl.float32)
        if ATTN == 0:
            b_lse = tl.load(lse_ptr + i_bh * L + o_m, mask=m_row, other=float("inf"))
            b_delta = tl.load(delta_ptr + i_bh * L + o_m, mask=m_row, other=0.)
        b_p = _probs(b_s, m_valid, b_lse, ATTN, MU, SIGMA)
        b_dp = _dprobs(do_ptr, v_ptr, o_m, o_n, i_bh, L, V, DOT_PREC, BLOCK_M, BLOCK_N, BLOCK_V)
        if DROPOUT:
            b_dp = b_dp * _dropout_scale(seed, p_drop, i_bh, L, o_m, o_n)
        b_ds = _dscores(b_s, m_valid, b_p, b_dp, b_delta, ATTN, MU, SIGMA)
        if HAS_BIAS:
            _bias_grad(b_ds, m_valid, scratch_ptr + (i_bh * tl.num_programs(0) + i_n) * BLOCK_M * 2 * BLOCK_N,
                       dbias_ptr + i_h * (2 * C - 1), m0, i_n * BLOCK_N, C, BLOCK_M, BLOCK_N)
        b_inv = tl.load(inv_n_ptr + i_b * L + o_m, mask=m_row, other=1.)
        b_ds = b_ds * (scale * b_inv)[:, None]
        b_dk += tl.dot(tl.trans(b_ds).to(b_q.dtype), b_q, input_precision=DOT_PREC)
    tl.store(dk_ptr + (i_bh * L + o_n[:, None]) * K + o_k[None, :], b_dk.to(dk_ptr.dtype.element_ty),
             mask=(o_n[:, None] < L) & (o_k[None, :] < K))


@triton.jit
def _local_attention_bwd_dv_kernel(q_ptr, k_ptr, do_ptr, lse_ptr, bias_ptr, inv_n_ptr, mask_ptr, dv_ptr,
                                   H, L, K, V, C, scale, seed, p_drop,
                                   ATTN: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                                   BIAS_PER_HEAD: tl.constexpr, HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr,
                                   DOT_PREC: tl.constexpr, MU: tl.constexpr, SIGMA: tl.constexpr, BLOCK_M: tl.constexpr,
                                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    # one (key block, value block): dv = p^T do
    i_n, i_bh, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    b_k = tl.load(k_ptr + (i_bh * L + o_n[:, None]) * K + o_k[None, :],
                  mask=(o_n[:, None] < L) & (o_k[None, :] < K), other=0.)
    b_dv = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    lo, hi = _query_range(i_n * BLOCK_N, L, C, BLOCK_N, CAUSAL)
    for m0 in range(lo, hi, BLOCK_M):
        o_m = m0 + tl.arange(0, BLOCK_M)
        m_row = o_m < L
        b_q = tl.load(q_ptr + (i_bh * L + o_m[:, None]) * K + o_k[None, :],
                      mask=m_row[:, None] & (o_k[None, :] < K), other=0.)
        b_s, m_valid = _scores(b_q, b_k, o_m, o_n, i_b, i_h, L, C, L, scale, bias_ptr, inv_n_ptr, mask_ptr,
                               ATTN, CAUSAL, HAS_BIAS, BIAS_PER_HEAD, HAS_MASK, DOT_PREC)
        b_lse = tl.zeros([BLOCK_M], dtype=tl.float32)
        if ATTN == 0:
            b_lse = tl.load(lse_ptr + i_bh * L + o_m, mask=m_row, other=float("inf"))
        b_p = _probs(b_s, m_valid, b_lse, ATTN, MU, SIGMA)
        if DROPOUT:
            b_p = b_p * _dropout_scale(seed, p_drop, i_bh, L, o_m, o_n)
        b_do = tl.load(do_ptr + (i_bh * L + o_m[:, None]) * V + o_v[None, :],
                       mask=m_row[:, None] & (o_v[None, :] < V), other=0.)
        b_dv += tl.dot(tl.trans(b_p).to(b_do.dtype), b_do, input_precision=DOT_PREC)
    tl.store(dv_ptr + (i_bh * L + o_n[:, None]) * V + o_v[None, :], b_dv.to(dv_ptr.dtype.element_ty),
             mask=(o_n[:, None] < L) & (o_v[None, :] < V))


@triton.jit
def _local_attention_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, bias_ptr, inv_n_ptr,
                                   mask_ptr, dq_ptr, H, L, K, V, C, scale, seed, p_drop,
                                   ATTN: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                                   BIAS_PER_HEAD: tl.constexpr, HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr,
                                   DOT_PREC: tl.constexpr, MU: tl.constexpr, SIGMA: tl.constexpr, BLOCK_M: tl.constexpr,
                                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    # one query block: dq = sum_j ds_ij (scale / n_i) k_j
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_k = tl.arange(0, BLOCK_K)
    m_row = o_m < L
    b_q = tl.load(q_ptr + (i_bh * L + o_m[:, None]) * K + o_k[None, :],
                  mask=m_row[:, None] & (o_k[None, :] < K), other=0.)
    b_lse = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_delta = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ATTN == 0:
        b_lse = tl.load(lse_ptr + i_bh * L + o_m, mask=m_row, other=float("inf"))
        b_delta = tl.load(delta_ptr + i_bh * L + o_m, mask=m_row, other=0.)
    b_inv = tl.load(inv_n_ptr + i_b * L + o_m, mask=m_row, other=1.)
    b_dq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    lo, hi = _key_range(i_m * BLOCK_M, L, C, BLOCK_M, CAUSAL)
    for n0 in range(lo, hi, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        b_k = tl.load(k_ptr + (i_bh * L + o_n[:, None]) * K + o_k[None, :],
                      mask=(o_n[:, None] < hi) & (o_k[None, :] < K), other=0.)
        b_s, m_valid = _scores(b_q, b_k, o_m, o_n, i_b, i_h, L, C, hi, scale, bias_ptr, inv_n_ptr, mask_ptr,
                               ATTN, CAUSAL, HAS_BIAS, BIAS_PER_HEAD, HAS_MASK, DOT_PREC)
        b_p = _probs(b_s, m_valid, b_lse, ATTN, MU, SIGMA)
        b_dp = _dprobs(do_ptr, v_ptr, o_m, o_n, i_bh, L, V, DOT_PREC, BLOCK_M, BLOCK_N, BLOCK_V)
        if DROPOUT:
            b_dp = b_dp * _dropout_scale(seed, p_drop, i_bh, L, o_m, o_n)
        b_ds = _dscores(b_s, m_valid, b_p, b_dp, b_delta, ATTN, MU, SIGMA) * (scale * b_inv)[:, None]
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=DOT_PREC)
    tl.store(dq_ptr + (i_bh * L + o_m[:, None]) * K + o_k[None, :], b_dq.to(dq_ptr.dtype.element_ty),
             mask=m_row[:, None] & (o_k[None, :] < K))


def _meta(q: torch.Tensor, v: torch.Tensor, attention: str, causal: bool, bias, mask, dropout: float) -> dict:
    K, V = q.shape[-1], v.shape[-1]
    return dict(ATTN=ATTN_CODES[attention], CAUSAL=causal, HAS_BIAS=bias is not None,
                BIAS_PER_HEAD=bias is not None and bias.dim() == 2 and bias.shape[0] > 1,
                HAS_MASK=mask is not None, DROPOUT=dropout > 0, DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32",
                MU=_LAPLACE_MU, SIGMA=_LAPLACE_SIGMA, BLOCK_M=64, BLOCK_N=64,
                BLOCK_K=max(16, triton.next_power_of_2(K)), BLOCK_V=min(128, max(16, triton.next_power_of_2(V))))


def local_attention_fwd(q, k, v, bias, inv_n, mask, *, attention: str, causal: bool, chunk: int, scale: float,
                        dropout: float = 0.0, seed: int = 0):
    """Launch the forward kernel. q, k [B, H, L, K], v [B, H, L, V] contiguous; bias [H or 1, 2C-1] float32 or
    None; inv_n [B, L] float32; mask [B, L] uint8 or None; dropout on the weights with the Philox `seed`.
    Returns o [B, H, L, V] and lse [B, H, L] float32."""
    B, H, L, K = q.shape
    V = v.shape[-1]
    meta = _meta(q, v, attention, causal, bias, mask, dropout)
    o = torch.empty_like(v)
    lse = torch.empty(B, H, L, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(L, meta["BLOCK_M"]), B * H, triton.cdiv(V, meta["BLOCK_V"]))
    _local_attention_fwd_kernel[grid](q, k, v, o, lse, bias if bias is not None else inv_n, inv_n,
                                      mask if mask is not None else inv_n, H, L, K, V, chunk, scale, seed,
                                      dropout, **meta)
    return o, lse


def local_attention_bwd(q, k, v, o, lse, do, bias, inv_n, mask, *, attention: str, causal: bool, chunk: int,
                        scale: float, dropout: float = 0.0, seed: int = 0):
    """Launch the three backward kernels; returns dq, dk, dv (input dtype) and dbias [H, 2C-1] float32 or None."""
    B, H, L, K = q.shape
    V = v.shape[-1]
    meta = _meta(q, v, attention, causal, bias, mask, dropout)
    do = do.contiguous()
    delta = (do.float() * o.float()).sum(-1) if attention == "softmax" else lse  # [B, H, L] rowsum(do o)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dbias = torch.zeros(H, 2 * chunk - 1, device=q.device, dtype=torch.float32) if bias is not None else None
    bias_arg = bias if bias is not None else inv_n
    mask_arg = mask if mask is not None else inv_n
    n_blocks = triton.cdiv(L, meta["BLOCK_N"])
    # per-program scratch for the skewed bias-gradient tile (see `_bias_grad`)
    scratch = (torch.empty(n_blocks * B * H * meta["BLOCK_M"] * 2 * meta["BLOCK_N"], device=q.device,
                           dtype=torch.float32) if bias is not None else inv_n)
    _local_attention_bwd_dk_kernel[(n_blocks, B * H)](
        q, k, v, do, lse, delta, bias_arg, inv_n, mask_arg, dk, dbias if dbias is not None else inv_n, scratch,
        H, L, K, V, chunk, scale, seed, dropout, **meta)
    _local_attention_bwd_dv_kernel[(n_blocks, B * H, triton.cdiv(V, meta["BLOCK_V"]))](
        q, k, do, lse, bias_arg, inv_n, mask_arg, dv, H, L, K, V, chunk, scale, seed, dropout, **meta)
    _local_attention_bwd_dq_kernel[(triton.cdiv(L, meta["BLOCK_M"]), B * H)](
        q, k, v, do, lse, delta, bias_arg, inv_n, mask_arg, dq, H, L, K, V, chunk, scale, seed, dropout, **meta)
    return dq, dk, dv, dbias
