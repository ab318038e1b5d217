"""Triton kernels for SeqBoat's compress -> local attention -> extract, fused (SeqBoat, arXiv 2306.11197, eq. 6,
A.1-A.2).

Nothing is packed in memory: a program owns a block of packed query slots, reads their rows straight from the
full-length q/k/v through the slot -> original-position index (compress fused into the loads), attends to the
packed key slots inside the working-memory window, and writes each output row back to its original position
(extract fused into the stores; inactive rows keep the zeros the launcher allocated). Nothing of size L x L or
R x R is built; the backward recomputes scores from the saved log-sum-exp as FlashAttention-2 does.

Except SeqBoat-full's softmax attention over sequences longer than 128 with the bias Toeplitz in packed slots
(`packed_long_span`): that is MEGA's full-length attention on the packed sequence, so it runs ops/local_attention's
long-span kernels on q, k, v gathered into slot order, which write their outputs back through the same slot ->
position index (`rows`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longmixer.ops.backend import triton_interpreter_on
from longmixer.ops.common import DV_PASS_MIN_V
from longmixer.ops.local_attention import kernel as local_kernel
from longmixer.ops.precision import work_dtype

MODE_WINDOW, MODE_CHUNK, MODE_FULL = 0, 1, 2


@triton.jit
def _diag_sums(b_dsT, off, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """Sums of a [BLOCK_N keys, BLOCK_M queries] tile (keys n0 + jj, queries n0 + off + ii) along its diagonals.

    Column ii is rotated up by ii + off (mod BLOCK_N), one gather of the tile's own size, so row jj of the result
    holds the pairs with j - i = jj - k BLOCK_N; the wrap count k is k0 + w, w in {0, 1, 2}, with
    k0 = floor(off / BLOCK_N). Returns the row sums of each w: three [BLOCK_N] vectors and k0."""
    off_mod = off & (BLOCK_N - 1)  # off mod BLOCK_N, also for a negative off (two's complement)
    o_e = tl.arange(0, BLOCK_N)[:, None] + tl.arange(0, BLOCK_M)[None, :] + off_mod  # [BN, BM], in [0, 3 BN)
    b_rot = tl.gather(b_dsT, o_e & (BLOCK_N - 1), axis=0)
    o_w = o_e // BLOCK_N
    b_s0 = tl.sum(tl.where(o_w == 0, b_rot, 0.), 1)
    b_s1 = tl.sum(tl.where(o_w == 1, b_rot, 0.), 1)
    b_s2 = tl.sum(tl.where(o_w == 2, b_rot, 0.), 1)
    return b_s0, b_s1, b_s2, (off - off_mod) // BLOCK_N


@triton.jit
def _store_diag_partials(p_part, row, i_n, m0, b_s0, b_s1, b_s2, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                         PART_W: tl.constexpr):
    """Store one tile's `_diag_sums` (PART_W of the three) as the partial of (row, key block i_n, query block
    m0 // BLOCK_M) in a [rows, key blocks, key blocks * BLOCK_N / BLOCK_M, PART_W, BLOCK_N] buffer: no atomics;
    `fold_diagonal_partials` sums them. The grid's first axis is the key blocks."""
    n_m = tl.num_programs(0) * (BLOCK_N // BLOCK_M)
    p_part += ((row * tl.num_programs(0) + i_n) * n_m + m0 // BLOCK_M) * PART_W * BLOCK_N
    o_jj = tl.arange(0, BLOCK_N)
    tl.store(p_part + o_jj, b_s0)
    tl.store(p_part + BLOCK_N + o_jj, b_s1)
    if PART_W == 3:
        tl.store(p_part + 2 * BLOCK_N + o_jj, b_s2)


def fold_diagonal_partials(part: torch.Tensor, center: int, n_taps: int, ratio: int = 1) -> torch.Tensor:
    """Sum per-tile diagonal sums into a relative-position bias gradient, without atomics.

    part [G, NB, NB * ratio, W, BN]: for key block n (BN keys) and query block m (BN / ratio queries), the W row
    sums `_diag_sums` returns: w holds the pairs with j - i = jj - (k0 + w) BN, k0 = m // ratio - n. Tap
    `center + j - i` of the [G, n_taps] result is the sum over every tile. Deterministic: the diagonals of the
    [NB, NB] block grid are summed through a skewed strided view, not by scattering."""
    G, nb, nbm, W, BN = part.shape
    if ratio > 1:
        part = part.view(G, nb, nb, ratio, W, BN).sum(3)  # query blocks of one key-block-sized super block
    p = part.permute(0, 3, 1, 2, 4)  # [G, W, n, m, BN]
    width = 3 * nb - 2
    p = torch.nn.functional.pad(p, (0, 0, nb - 1, nb - 1)).contiguous()  # p[.., n, c] = part[n, c - (nb - 1)]
    # r[.., n, d] = part[n, n + d - (nb - 1)]: row n shifted left by n (one more element of stride per row)
    r = p.as_strided((G, W, nb, 2 * nb - 1, BN), (W * nb * width * BN, nb * width * BN, (width + 1) * BN, BN, 1))
    flat = r.sum(2).flip(2).reshape(G, W, -1)  # f = e BN + jj with m - n = (nb - 1) - e
    # w = 0: tap = center - (nb - 1) BN + f; each further w is BN taps lower
    span = (2 * nb - 1) * BN
    buf = flat.new_zeros(G, span + (W - 1) * BN)
    for w in range(W):
        buf[:, (W - 1 - w) * BN:(W - 1 - w) * BN + span] += flat[:, w]
    lo = center - (nb - 1) * BN - (W - 1) * BN  # the tap of buf[:, 0]
    out = buf.new_zeros(G, n_taps)
    a, b = max(lo, 0), min(lo + buf.shape[1], n_taps)
    if b > a:
        out[:, a:b] = buf[:, a - lo:b - lo]
    return out


@triton.jit
def _key_range(start, n_b, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LEFT, RIGHT, CHUNK,
               MODE: tl.constexpr, CAUSAL: tl.constexpr):
    """Packed key slots [lo, hi) that queries start .. start+BLOCK_M-1 can see (lo aligned to BLOCK_N)."""
    end = tl.minimum(start + BLOCK_M, n_b)
    if MODE == 0:  # MODE_WINDOW
        lo = tl.maximum(start - LEFT, 0)
        hi = tl.minimum(end + RIGHT, n_b)
    elif MODE == 1:  # MODE_CHUNK
        lo = (start // CHUNK) * CHUNK
        hi = tl.minimum(((end - 1) // CHUNK + 1) * CHUNK, n_b)
    else:
        lo = start * 0  # MODE_FULL; a tensor zero, so both branches have one type
        hi = n_b
        if CAUSAL:
            hi = end
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.where(start < n_b, hi, lo)  # programs past this row's count do nothing
    return lo, hi


@triton.jit
def _query_range(start, n_b, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LEFT, RIGHT, CHUNK,
                 MODE: tl.constexpr, CAUSAL: tl.constexpr):
    """Packed query slots [lo, hi) that see keys start .. start+BLOCK_N-1 (lo aligned to BLOCK_M)."""
    end = tl.minimum(start + BLOCK_N, n_b)
    if MODE == 0:  # MODE_WINDOW
        lo = tl.maximum(start - RIGHT, 0)
        hi = tl.minimum(end + LEFT, n_b)
    elif MODE == 1:  # MODE_CHUNK
        lo = (start // CHUNK) * CHUNK
        hi = tl.minimum(((end - 1) // CHUNK + 1) * CHUNK, n_b)
    else:
        lo = start * 0  # MODE_FULL; a tensor zero, so both branches have one type
        if CAUSAL:
            lo = start
        hi = n_b
    lo = (lo // BLOCK_M) * BLOCK_M
    hi = tl.where(start < n_b, hi, lo)
    return lo, hi


@triton.jit
def _scores(b_q, b_k, o_m, o_n, pos_q, pos_k, n_b, p_bias, scale, LEFT, RIGHT, CHUNK, M_BIAS, NORM,
            MODE: tl.constexpr, CAUSAL: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
            BIAS_ORIG: tl.constexpr, IEEE: tl.constexpr):
    """Logits (SeqBoat eq. 6: q k^T / s + B_rel) of one [BLOCK_M, BLOCK_N] tile, the row scales and the valid mask."""
    if IEEE:
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision="ieee")
    else:
        b_s = tl.dot(b_q, tl.trans(b_k))
    rel_c = o_n[None, :] - o_m[:, None]
    m_s = (o_m[:, None] < n_b) & (o_n[None, :] < n_b)
    if MODE == 0:  # MODE_WINDOW
        m_s = m_s & (rel_c >= -LEFT) & (rel_c <= RIGHT)
    elif MODE == 1:  # MODE_CHUNK
        m_s = m_s & ((o_n[None, :] // CHUNK) == (o_m[:, None] // CHUNK))
    if CAUSAL:
        m_s = m_s & (rel_c <= 0)
    if SOFTMAX:
        b_scale = tl.zeros([o_m.shape[0]], dtype=tl.float32) + scale
    elif MODE != 2:
        b_scale = tl.zeros([o_m.shape[0]], dtype=tl.float32) + 1.0 / NORM  # s = w or the chunk size
    elif CAUSAL:
        b_scale = 1.0 / (o_m + 1).to(tl.float32)  # s = the number of visible keys
    else:
        b_scale = tl.zeros([o_m.shape[0]], dtype=tl.float32) + 1.0 / tl.maximum(n_b, 1).to(tl.float32)  # s = r
    b_s = b_s.to(tl.float32) * b_scale[:, None]
    if HAS_BIAS:
        if BIAS_ORIG:
            rel = pos_k[None, :] - pos_q[:, None]
        else:
            rel = rel_c
        i_bias = tl.minimum(tl.maximum(rel + M_BIAS - 1, 0), 2 * M_BIAS - 2)
        b_s += tl.load(p_bias + i_bias, mask=m_s, other=0.0).to(tl.float32)
    else:
        i_bias = rel_c
    return b_s, b_scale, m_s, i_bias


@triton.jit
def _sparse_local_attention_fwd_kernel(
    q, k, v, idx, cnt, bias, o, lse, L, K, V, scale, LEFT, RIGHT, CHUNK, M_BIAS, NORM,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    MODE: tl.constexpr, CAUSAL: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_ORIG: tl.constexpr, IEEE: tl.constexpr,
):
    i_m, i_v, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n_b = tl.load(cnt + i_b)
    start = i_m * BLOCK_M
    o_m = start + tl.arange(0, BLOCK_M)
    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_m, m_k, m_v = o_m < n_b, o_k < K, o_v < V
    pos_q = tl.load(idx + i_b * L + o_m, mask=m_m, other=0).to(tl.int64)
    b_q = tl.load(q + i_b * L * K + pos_q[:, None] * K + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
    b_m = tl.zeros([BLOCK_M], dtype=tl.float32) - 1e30
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    lo, hi = _key_range(start, n_b, BLOCK_M, BLOCK_N, LEFT, RIGHT, CHUNK, MODE, CAUSAL)
    for n0 in range(lo, hi, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < n_b
        pos_k = tl.load(idx + i_b * L + o_n, mask=m_n, other=0).to(tl.int64)
        b_k = tl.load(k + i_b * L * K + pos_k[:, None] * K + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        b_v = tl.load(v + i_b * L * V + pos_k[:, None] * V + o_v[None, :], mask=m_n[:, None] & m_v[None, :], other=0.0)
        b_s, b_scale, m_s, _ = _scores(b_q, b_k, o_m, o_n, pos_q, pos_k, n_b, bias, scale, LEFT, RIGHT, CHUNK,
                                       M_BIAS, NORM, MODE, CAUSAL, SOFTMAX, HAS_BIAS, BIAS_ORIG, IEEE)
        if SOFTMAX:
            b_s = tl.where(m_s, b_s, -1e30)
            b_mn = tl.maximum(b_m, tl.max(b_s, 1))
            b_p = tl.where(m_s, tl.exp(b_s - b_mn[:, None]), 0.0)
            b_alpha = tl.exp(b_m - b_mn)
            b_l = b_l * b_alpha + tl.sum(b_p, 1)
            b_acc = b_acc * b_alpha[:, None]
            b_m = b_mn
        else:
            b_r = tl.maximum(b_s, 0.0)
            b_p = tl.where(m_s, b_r * b_r, 0.0)
        if IEEE:
            b_acc += tl.dot(b_p.to(b_v.dtype), b_v, input_precision="ieee")
        else:
            b_acc += tl.dot(b_p.to(b_v.dtype), b_v)
    if SOFTMAX:
        b_acc = b_acc / tl.maximum(b_l, 1e-30)[:, None]
        if i_v == 0:
            tl.store(lse + i_b * L + pos_q, b_m + tl.log(tl.maximum(b_l, 1e-30)), mask=m_m)
    tl.store(o + i_b * L * V + pos_q[:, None] * V + o_v[None, :], b_acc.to(o.dtype.element_ty),
             mask=m_m[:, None] & m_v[None, :])


@triton.jit
def _dp_tile(do_rows, v_rows, m_rows_q, m_rows_k, V, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_V: tl.constexpr, IEEE: tl.constexpr):
    """dP = dO V^T over the whole value width, looping over BLOCK_V columns."""
    b_dp = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_v = o_v < V
        b_do = tl.load(do_rows + o_v[None, :], mask=m_rows_q[:, None] & m_v[None, :], other=0.0)
        b_v = tl.load(v_rows + o_v[None, :], mask=m_rows_k[:, None] & m_v[None, :], other=0.0)
        if IEEE:
            b_dp += tl.dot(b_do, tl.trans(b_v), input_precision="ieee")
        else:
            b_dp += tl.dot(b_do, tl.trans(b_v))
    return b_dp


@triton.jit
def _ds_tile(b_s, b_dp, m_s, b_lse, b_delta, SOFTMAX: tl.constexpr):
    """dLogits of one tile: softmax P (dP - delta) or relu^2 2 relu(s) dP."""
    if SOFTMAX:
        b_p = tl.where(m_s, tl.exp(b_s - b_lse[:, None]), 0.0)
        b_ds = b_p * (b_dp - b_delta[:, None])
    else:
        b_r = tl.maximum(b_s, 0.0)
        b_p = tl.where(m_s, b_r * b_r, 0.0)
        b_ds = tl.where(m_s, 2.0 * b_r * b_dp, 0.0)
    return b_p, b_ds


@triton.jit
def _sparse_local_attention_bwd_dq_kernel(
    q, k, v, do, idx, cnt, bias, lse, delta, dq, dbias, L, K, V, scale, LEFT, RIGHT, CHUNK, M_BIAS, NORM,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    MODE: tl.constexpr, CAUSAL: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_ORIG: tl.constexpr, IEEE: tl.constexpr,
):
    i_m, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    n_b = tl.load(cnt + i_b)
    start = i_m * BLOCK_M
    o_m = start + tl.arange(0, BLOCK_M)
    o_k = tl.arange(0, BLOCK_K)
    m_m, m_k = o_m < n_b, o_k < K
    pos_q = tl.load(idx + i_b * L + o_m, mask=m_m, other=0).to(tl.int64)
    b_q = tl.load(q + i_b * L * K + pos_q[:, None] * K + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
    b_lse = tl.load(lse + i_b * L + pos_q, mask=m_m, other=0.0)
    b_delta = tl.load(delta + i_b * L + pos_q, mask=m_m, other=0.0)
    b_dq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    lo, hi = _key_range(start, n_b, BLOCK_M, BLOCK_N, LEFT, RIGHT, CHUNK, MODE, CAUSAL)
    for n0 in range(lo, hi, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        m_n = o_n < n_b
        pos_k = tl.load(idx + i_b * L + o_n, mask=m_n, other=0).to(tl.int64)
        b_k = tl.load(k + i_b * L * K + pos_k[:, None] * K + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        b_s, b_scale, m_s, i_bias = _scores(b_q, b_k, o_m, o_n, pos_q, pos_k, n_b, bias, scale, LEFT, RIGHT, CHUNK,
                                            M_BIAS, NORM, MODE, CAUSAL, SOFTMAX, HAS_BIAS, BIAS_ORIG, IEEE)
        b_dp = _dp_tile(do + i_b * L * V + pos_q[:, None] * V, v + i_b * L * V + pos_k[:, None] * V, m_m, m_n, V,
                        BLOCK_M, BLOCK_N, BLOCK_V, IEEE)
        _, b_ds = _ds_tile(b_s, b_dp, m_s, b_lse, b_delta, SOFTMAX)
        if HAS_BIAS:
            tl.atomic_add(dbias + i_bias, b_ds, mask=m_s)
        b_dsq = (b_ds * b_scale[:, None]).to(b_k.dtype)
        if IEEE:
            b_dq += tl.dot(b_dsq, b_k, input_precision="ieee")
        else:
            b_dq += tl.dot(b_dsq, b_k)
    tl.store(dq + i_b * L * K + pos_q[:, None] * K + o_k[None, :], b_dq.to(dq.dtype.element_ty),
             mask=m_m[:, None] & m_k[None, :])


@triton.jit
def _sparse_local_attention_bwd_dkdv_kernel(
    q, k, v, do, idx, cnt, bias, lse, delta, dk, dv, L, K, V, scale, LEFT, RIGHT, CHUNK, M_BIAS, NORM,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    MODE: tl.constexpr, CAUSAL: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_ORIG: tl.constexpr, IEEE: tl.constexpr, DO_DK: tl.constexpr, DO_DV: tl.constexpr,
):
    i_n, i_v, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    n_b = tl.load(cnt + i_b)
    start = i_n * BLOCK_N
    o_n = start + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    m_n, m_k, m_v = o_n < n_b, o_k < K, o_v < V
    pos_k = tl.load(idx + i_b * L + o_n, mask=m_n, other=0).to(tl.int64)
    b_k = tl.load(k + i_b * L * K + pos_k[:, None] * K + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
    b_dk = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    lo, hi = _query_range(start, n_b, BLOCK_M, BLOCK_N, LEFT, RIGHT, CHUNK, MODE, CAUSAL)
    for m0 in range(lo, hi, BLOCK_M):
        o_m = m0 + tl.arange(0, BLOCK_M)
        m_m = o_m < n_b
        pos_q = tl.load(idx + i_b * L + o_m, mask=m_m, other=0).to(tl.int64)
        b_q = tl.load(q + i_b * L * K + pos_q[:, None] * K + o_k[None, :], mask=m_m[:, None] & m_k[None, :],
                      other=0.0)
        b_lse = tl.load(lse + i_b * L + pos_q, mask=m_m, other=0.0)
        b_delta = tl.load(delta + i_b * L + pos_q, mask=m_m, other=0.0)
        b_s, b_scale, m_s, _ = _scores(b_q, b_k, o_m, o_n, pos_q, pos_k, n_b, bias, scale, LEFT, RIGHT, CHUNK,
                                       M_BIAS, NORM, MODE, CAUSAL, SOFTMAX, HAS_BIAS, BIAS_ORIG, IEEE)
        if DO_DV:
            b_do = tl.load(do + i_b * L * V + pos_q[:, None] * V + o_v[None, :], mask=m_m[:, None] & m_v[None, :],
                           other=0.0)
            if SOFTMAX:
                b_p = tl.where(m_s, tl.exp(b_s - b_lse[:, None]), 0.0)
            else:
                b_r = tl.maximum(b_s, 0.0)
                b_p = tl.where(m_s, b_r * b_r, 0.0)
            if IEEE:
                b_dv += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do, input_precision="ieee")
            else:
                b_dv += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do)
        if DO_DK:
            b_dp = _dp_tile(do + i_b * L * V + pos_q[:, None] * V, v + i_b * L * V + pos_k[:, None] * V, m_m, m_n, V,
                            BLOCK_M, BLOCK_N, BLOCK_V, IEEE)
            _, b_ds = _ds_tile(b_s, b_dp, m_s, b_lse, b_delta, SOFTMAX)
            b_dsq = (b_ds * b_scale[:, None]).to(b_q.dtype)
            if IEEE:
                b_dk += tl.dot(tl.trans(b_dsq), b_q, input_precision="ieee")
            else:
                b_dk += tl.dot(tl.trans(b_dsq), b_q)
    if DO_DV:
        tl.store(dv + i_b * L * V + pos_k[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty),
                 mask=m_n[:, None] & m_v[None, :])
    if DO_DK:
        tl.store(dk + i_b * L * K + pos_k[:, None] * K + o_k[None, :], b_dk.to(dk.dtype.element_ty),
                 mask=m_n[:, None] & m_k[None, :])


@triton.jit
def _sparse_local_attention_bwd_kernel(
    q, k, v, do, idx, cnt, bias, lse, delta, dq, dk, dv, dbias, L, K, V, scale, LEFT, RIGHT, CHUNK, M_BIAS, NORM,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    MODE: tl.constexpr, CAUSAL: tl.constexpr, SOFTMAX: tl.constexpr, HAS_BIAS: tl.constexpr,
    BIAS_ORIG: tl.constexpr, IEEE: tl.constexpr, BIAS_DIAG: tl.constexpr, PART_W: tl.constexpr, DV: tl.constexpr,
):
    # the whole backward of one block of packed key slots, the value row in one block: dk, dv in registers, dq
    # added into a zeroed float32 buffer by atomics (the programs of one row start at different query blocks), the
    # bias gradient by diagonal sums of each ds tile stored as one partial per tile (BIAS_DIAG: the bias is
    # Toeplitz in packed slots and its table covers every distance; the launcher folds them) or by one atomic per
    # score otherwise. Not DV: dv is left to a second pass (`DV_PASS_TILES`).
    i_n, i_b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    n_b = tl.load(cnt + i_b)
    start = i_n * BLOCK_N
    o_n = start + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    o_v = tl.arange(0, BLOCK_V)
    m_n, m_k, m_v = o_n < n_b, o_k < K, o_v < V
    pos_k = tl.load(idx + i_b * L + o_n, mask=m_n, other=0).to(tl.int64)
    b_k = tl.load(k + i_b * L * K + pos_k[:, None] * K + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
    b_v = tl.load(v + i_b * L * V + pos_k[:, None] * V + o_v[None, :], mask=m_n[:, None] & m_v[None, :], other=0.0)
    b_dk = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    lo, hi = _query_range(start, n_b, BLOCK_M, BLOCK_N, LEFT, RIGHT, CHUNK, MODE, CAUSAL)
    n_iter = tl.cdiv(hi - lo, BLOCK_M)
    for it in range(0, n_iter):
        m0 = lo + ((it + i_n) % n_iter) * BLOCK_M
        o_m = m0 + tl.arange(0, BLOCK_M)
        m_m = o_m < n_b
        pos_q = tl.load(idx + i_b * L + o_m, mask=m_m, other=0).to(tl.int64)
        b_q = tl.load(q + i_b * L * K + pos_q[:, None] * K + o_k[None, :], mask=m_m[:, None] & m_k[None, :],
                      other=0.0)
        b_do = tl.load(do + i_b * L * V + pos_q[:, None] * V + o_v[None, :], mask=m_m[:, None] & m_v[None, :],
                       other=0.0)
        b_lse = tl.load(lse + i_b * L + pos_q, mask=m_m, other=0.0)
        b_delta = tl.load(delta + i_b * L + pos_q, mask=m_m, other=0.0)
        b_s, b_scale, m_s, i_bias = _scores(b_q, b_k, o_m, o_n, pos_q, pos_k, n_b, bias, scale, LEFT, RIGHT, CHUNK,
                                            M_BIAS, NORM, MODE, CAUSAL, SOFTMAX, HAS_BIAS, BIAS_ORIG, IEEE)
        if IEEE:
            b_dp = tl.dot(b_do, tl.trans(b_v), input_precision="ieee")
        else:
            b_dp = tl.dot(b_do, tl.trans(b_v))
        b_p, b_ds = _ds_tile(b_s, b_dp, m_s, b_lse, b_delta, SOFTMAX)
        if DV:
            if IEEE:
                b_dv += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do, input_precision="ieee")
            else:
                b_dv += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do)
        if HAS_BIAS:
            if BIAS_DIAG:
                # packed distance j - i = n - m: sums along the tile's diagonals, one partial per tile
                b_s0, b_s1, b_s2, _ = _diag_sums(tl.trans(b_ds), m0 - start, BLOCK_N, BLOCK_M)
                _store_diag_partials(dbias, i_b, i_n, m0, b_s0, b_s1, b_s2, BLOCK_N, BLOCK_M, PART_W)
            else:
                tl.atomic_add(dbias + i_bias, b_ds, mask=m_s, sem="relaxed")
        b_dsq = (b_ds * b_scale[:, None]).to(b_q.dtype)
        if IEEE:
            b_dk += tl.dot(tl.trans(b_dsq), b_q, input_precision="ieee")
            b_dq = tl.dot(b_dsq, b_k, input_precision="ieee")
        else:
            b_dk += tl.dot(tl.trans(b_dsq), b_q)
            b_dq = tl.dot(b_dsq, b_k)
        tl.atomic_add(dq + i_b * L * K + pos_q[:, None] * K + o_k[None, :], b_dq, mask=m_m[:, None] & m_k[None, :],
                      sem="relaxed")
    if DV:
        tl.store(dv + i_b * L * V + pos_k[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty),
                 mask=m_n[:, None] & m_v[None, :])
    tl.store(dk + i_b * L * K + pos_k[:, None] * K + o_k[None, :], b_dk.to(dk.dtype.element_ty),
             mask=m_n[:, None] & m_k[None, :])


def _config(q: torch.Tensor, v: torch.Tensor, window: int | None, chunk: int | None, causal: bool,
            attention: str, rel_pos: str, rel_bias: torch.Tensor | None) -> dict:
    """Block sizes, constexpr flags and the scalar arguments shared by the launchers."""
    small = triton_interpreter_on()
    if window is not None:
        left, right = (window, 0) if causal else (window // 2, window // 2)
        mode = MODE_WINDOW
    else:
        left, right, mode = 0, 0, MODE_CHUNK if chunk is not None else MODE_FULL
    return dict(
        scalars=(q.shape[-1] ** -0.5, left, right, chunk or 1,
                 (rel_bias.shape[0] + 1) // 2 if rel_bias is not None else 1, float(window or chunk or 1)),
        BLOCK_M=16 if small else 64, BLOCK_N=16 if small else 64,
        BLOCK_K=max(triton.next_power_of_2(q.shape[-1]), 16),
        BLOCK_V=min(max(triton.next_power_of_2(v.shape[-1]), 16), 32 if small else 64),
        MODE=mode, CAUSAL=causal, SOFTMAX=attention == "softmax", HAS_BIAS=rel_bias is not None,
        BIAS_ORIG=rel_pos == "original", IEEE=q.dtype == torch.float32,
    )


# Modes whose backward runs one kernel over the whole value row (`_sparse_local_attention_bwd_kernel`, dq by
# atomics; dv in it or in a second pass, below) when the row fits one block; the others use the dq kernel and the
# dk/dv kernels. Full attention (SeqBoat-full) gains most: it would otherwise recompute every score tile once per
# 64-wide value block (docs/benchmarks.md).
FUSED_BWD_MODES = {MODE_FULL}
# With values wider than `DV_PASS_MIN_V` (128) the backward takes two passes: that kernel without dv
# (`FUSED_BWD_TILES`), then dv = p^T do by the dk/dv kernel with dk off and the whole value row per program
# (`DV_PASS_TILES`). Without the [BLOCK_N, V] float32 dv accumulator the first kernel fits 64-query tiles; holding it,
# it takes 32 (`ONE_KERNEL_BWD_TILES`, also what narrower values and `DV_PASS_TILES = None` run). As MEGA's full
# attention (ops/local_attention `LONG_SPAN_K64`).
FUSED_BWD_TILES = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=1)
ONE_KERNEL_BWD_TILES = dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=1)
DV_PASS_TILES: dict | None = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
# Forward tiles of those modes on the GPU: the whole value row per program, so no score tile is recomputed per
# value block (MEGA's full attention uses the same: ops/local_attention `_fwd_config`).
FWD_WIDE_TILES = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)


def _bwd_plan(cfg: dict, V: int, length: int, rel_bias) -> dict | None:
    """Tiles and flags of the one-kernel backward, or None where the split kernels run."""
    if cfg["MODE"] not in FUSED_BWD_MODES or V > 256:
        return None
    small = triton_interpreter_on()
    two_pass = DV_PASS_TILES is not None and (V > DV_PASS_MIN_V or small)  # the interpreter tests both at any V
    tiles = (dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1) if small else
             dict(FUSED_BWD_TILES if two_pass else ONE_KERNEL_BWD_TILES))
    tiles["BLOCK_M"] = min(tiles["BLOCK_M"], tiles["BLOCK_N"])  # the diagonal sums take BLOCK_M | BLOCK_N
    # the bias gradient by diagonal sums where the bias is Toeplitz in packed slots and no distance is clamped
    diag = rel_bias is not None and not cfg["BIAS_ORIG"] and (rel_bias.shape[0] + 1) // 2 >= length
    dv_pass = None
    if two_pass:
        dv_pass = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1) if small else dict(DV_PASS_TILES)
    return dict(tiles, BLOCK_V=max(16, triton.next_power_of_2(V)), BIAS_DIAG=diag,
                PART_W=2 if tiles["BLOCK_M"] == tiles["BLOCK_N"] else 3, DV=dv_pass is None, dv_pass=dv_pass)


# The packed sequence's chunk (C of ops/local_attention) is its length rounded up to the long-span backward's
# 128-key spans (a multiple of every tile), so that every tile lies in the one chunk (tile mode 1) and the forward
# reads its bias from the tile table (`use_bias_table`); slots past the count take no part.
PACK_MULTIPLE = 128
# False sends those calls to the fused sparse kernels too (scripts/bench/long_span.py times both)
PACKED_LONG_SPAN = True


def packed_long_span(q: torch.Tensor, v: torch.Tensor, rel_bias: torch.Tensor | None, *, window, chunk, attention,
                     rel_pos) -> bool:
    """Whether this call runs as MEGA's full-length attention on the packed sequence: full mode, softmax, L > 128
    and K <= 64 (the long-span backward with dq by atomics, `local_kernel._bwd_config`), V <= 256 (the whole value
    row in one block), and a bias, if any, that is Toeplitz in packed slots over every distance (compressed, no
    clamped end). Measured on an H100 at K 64, V 256 (docs/benchmarks.md)."""
    return (PACKED_LONG_SPAN and window is None and chunk is None and attention == "softmax" and q.shape[1] > 128
            and q.shape[-1] <= 64 and v.shape[-1] <= 256
            and (rel_bias is None or (rel_pos != "original" and (rel_bias.shape[0] + 1) // 2 >= q.shape[1])))


def _packed_bias(rel_bias: torch.Tensor, padded: int) -> tuple[torch.Tensor, int, int]:
    """The [1, 2 padded - 1] float32 taps of distances 1 - padded .. padded - 1 from the [2M - 1] table (zeros past
    M - 1, distances no valid pair has, as M >= L), with the padding and the offset that `_packed_bias_grad` undoes."""
    m_bias = (rel_bias.shape[0] + 1) // 2
    pad, start = max(padded - m_bias, 0), max(m_bias - padded, 0)
    taps = torch.nn.functional.pad(rel_bias.float(), (pad, pad))[start:start + 2 * padded - 1]
    return taps.view(1, -1).contiguous(), pad, start


def _packed_bias_grad(dtaps: torch.Tensor, rel_bias: torch.Tensor, pad: int, start: int) -> torch.Tensor:
    grad = dtaps.new_zeros(rel_bias.shape[0] + 2 * pad)
    grad[start:start + dtaps.shape[-1]] = dtaps.view(-1)
    return grad[pad:pad + rel_bias.shape[0]].to(rel_bias.dtype)


def _pack(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """[B, L, D] -> [B, 1, L, D] in slot order (slot j holds position idx[b, j]; slots past the count hold
    position 0, which the kernels leave out): one gather, so that the kernels' inner loops read contiguous rows."""
    return torch.gather(x, 1, idx.long()[..., None].expand(-1, -1, x.shape[-1])).unsqueeze(1)


def _packed_fwd_tiles(padded: int, K: int, V: int) -> dict | None:
    """The forward's tiles on the route: values wider than 128 in one block of up to 256, as the fused forward took
    them (`FWD_WIDE_TILES`: each score tile computed once) and MEGA's takes V 256; narrower values, MEGA's default."""
    return local_kernel._fwd_config(padded, K, 256) if V > 128 else None


def _packed_args(q, idx, cnt, rel_bias, causal):
    """ops/local_attention's bias taps and arguments for the packed sequence (`local_attention_fwd`'s rows)."""
    padded = triton.cdiv(q.shape[1], PACK_MULTIPLE) * PACK_MULTIPLE
    bias, pad, start = _packed_bias(rel_bias, padded) if rel_bias is not None else (None, 0, 0)
    kw = dict(attention="softmax", causal=causal, chunk=padded, scale=q.shape[-1] ** -0.5, rows=(idx, cnt))
    return bias, pad, start, kw


def sparse_local_attention_fwd(q, k, v, idx, cnt, rel_bias, *, window, chunk, causal, attention, rel_pos):
    """Launch the forward. Returns o [B, L, V] (zeros at inactive positions) and lse [B, L] float32."""
    bsz, length, _ = q.shape
    work = work_dtype(v, q, k)
    q, k = q.to(work), k.to(work)
    if packed_long_span(q, v, rel_bias, window=window, chunk=chunk, attention=attention, rel_pos=rel_pos):
        bias, _, _, kw = _packed_args(q, idx, cnt, rel_bias, causal)
        cfg = _packed_fwd_tiles(kw["chunk"], q.shape[-1], v.shape[-1])
        o, stat = local_kernel.local_attention_fwd(*(_pack(t, idx) for t in (q, k, v)), bias, None, cfg=cfg, **kw)
        return o[:, 0], stat[:, 0]  # lse at the original positions, 0 where inactive
    cfg = _config(q, v, window, chunk, causal, attention, rel_pos, rel_bias)
    scalars = cfg.pop("scalars")
    o = torch.zeros_like(v)
    lse = torch.zeros(bsz, length, dtype=torch.float32, device=q.device)
    bias = rel_bias if rel_bias is not None else lse
    cfg = {**cfg, "num_warps": 4, "num_stages": 2}
    if cfg["MODE"] in FUSED_BWD_MODES and not triton_interpreter_on() and q.shape[-1] <= 64 and v.shape[-1] <= 256:
        cfg.update(FWD_WIDE_TILES, BLOCK_V=max(16, triton.next_power_of_2(v.shape[-1])))
    grid = (triton.cdiv(length, cfg["BLOCK_M"]), triton.cdiv(v.shape[-1], cfg["BLOCK_V"]), bsz)
    _sparse_local_attention_fwd_kernel[grid](q, k, v, idx, cnt, bias, o, lse, length, q.shape[-1], v.shape[-1],
                                             *scalars, **cfg)
    return o, lse


def sparse_local_attention_bwd(q, k, v, o, do, idx, cnt, rel_bias, lse, *, window, chunk, causal, attention, rel_pos):
    """Launch the backward. Returns dq, dk, dv (zeros at inactive positions) and dbias ([2M-1] or None)."""
    bsz, length, _ = q.shape
    q_dtype, k_dtype = q.dtype, k.dtype
    work = work_dtype(v, q, k)
    q, k = q.to(work), k.to(work)
    if packed_long_span(q, v, rel_bias, window=window, chunk=chunk, attention=attention, rel_pos=rel_pos):
        bias, pad, start, kw = _packed_args(q, idx, cnt, rel_bias, causal)
        q, k, v, o, do, stat = (_pack(t, idx) for t in (q, k, v, o, do, lse[..., None]))
        dq, dk, dv, dtaps = local_kernel.local_attention_bwd(q, k, v, o, stat[..., 0], do, bias, None, **kw)
        dbias = _packed_bias_grad(dtaps, rel_bias, pad, start) if rel_bias is not None else None
        return dq[:, 0].to(q_dtype), dk[:, 0].to(k_dtype), dv[:, 0], dbias
    cfg = _config(q, v, window, chunk, causal, attention, rel_pos, rel_bias)
    scalars = cfg.pop("scalars")
    delta = (do.float() * o.float()).sum(-1)  # [B, L] rowsum(dO * O) of FlashAttention-2
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    bias = rel_bias if rel_bias is not None else lse
    args = (length, q.shape[-1], v.shape[-1], *scalars)
    plan = _bwd_plan(cfg, v.shape[-1], length, rel_bias)
    diag = plan is not None and plan["BIAS_DIAG"]
    dbias = (torch.zeros(rel_bias.shape[0], dtype=torch.float32, device=q.device)
             if rel_bias is not None and not diag else None)
    if plan is not None:
        dv_pass = plan.pop("dv_pass")
        dq32 = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        n_blocks, ratio = triton.cdiv(length, plan["BLOCK_N"]), plan["BLOCK_N"] // plan["BLOCK_M"]
        part = dbias
        if diag:  # one partial per (key block, query block); tiles never visited stay zero
            part = torch.zeros(bsz, n_blocks, n_blocks * ratio, plan["PART_W"], plan["BLOCK_N"], dtype=torch.float32,
                               device=q.device)
        _sparse_local_attention_bwd_kernel[(n_blocks, bsz)](
            q, k, v, do, idx, cnt, bias, lse, delta, dq32, dk, dv, part if part is not None else lse, *args,
            **{**cfg, **plan})
        if dv_pass is not None:
            _sparse_local_attention_bwd_dkdv_kernel[(triton.cdiv(length, dv_pass["BLOCK_N"]), 1, bsz)](
                q, k, v, do, idx, cnt, bias, lse, delta, dk, dv, *args,
                **{**cfg, **dv_pass, "BLOCK_V": plan["BLOCK_V"]}, DO_DK=False, DO_DV=True)
        if diag:
            m_bias = (rel_bias.shape[0] + 1) // 2
            dbias = fold_diagonal_partials(part.sum(0, keepdim=True), m_bias - 1, 2 * m_bias - 1, ratio)[0]
        return dq32.to(q_dtype), dk.to(k_dtype), dv, dbias.to(rel_bias.dtype) if dbias is not None else None
    dq = torch.zeros_like(q)
    _sparse_local_attention_bwd_dq_kernel[(triton.cdiv(length, cfg["BLOCK_M"]), bsz)](
        q, k, v, do, idx, cnt, bias, lse, delta, dq, dbias if dbias is not None else lse, *args, **cfg,
        num_warps=4, num_stages=2)
    n_v = triton.cdiv(v.shape[-1], cfg["BLOCK_V"])
    grid_n = triton.cdiv(length, cfg["BLOCK_N"])
    _sparse_local_attention_bwd_dkdv_kernel[(grid_n, n_v, bsz)](
        q, k, v, do, idx, cnt, bias, lse, delta, dk, dv, *args, **cfg, DO_DK=n_v == 1, DO_DV=True,
        num_warps=4, num_stages=2)
    if n_v > 1:  # dK needs dP over the whole value width: one more pass that loops over it
        _sparse_local_attention_bwd_dkdv_kernel[(grid_n, 1, bsz)](
            q, k, v, do, idx, cnt, bias, lse, delta, dk, dv, *args, **cfg, DO_DK=True, DO_DV=False,
            num_warps=4, num_stages=2)
    return dq.to(q_dtype), dk.to(k_dtype), dv, dbias.to(rel_bias.dtype) if dbias is not None else None
