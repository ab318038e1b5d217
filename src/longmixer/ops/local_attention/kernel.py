"""Triton kernels of chunked attention (softmax, relu2, laplace; simple relative-position bias; key padding mask;
causal), forward and backward, flash-style: score tiles live on chip and the C x C (or L x L) matrix is never
written. MEGA, arXiv:2209.10655, sections 3.1 and 3.3.

Forward: one program per query tile. Chunks of 256 or more read each tile's bias as one contiguous block of a
per-call table of the chunk's Toeplitz tiles (`bias_table`); shorter chunks gather it from the bias. Backward: where
a chunk fits one key tile (C <= the span of `_bwd_config`), one program per span of whole chunks does the span's
entire backward (dq, dk, dv, rowsum(do o) and the bias gradient as a per-program partial) with no atomics.
Full-length attention longer than a span with K <= 64 (MEGA) runs one pass per key span over the whole value row
with dq by atomics, and with values wider than 128 leaves dv to a second kernel (`_local_attention_bwd_dv_kernel`,
`LONG_SPAN_K64`), which reads its bias from the forward's table, each tile transposed; other longer chunks use a dq
kernel (which also writes rowsum(do o)) and a dk/dv kernel, or, with K and V <= 64, the one-pass kernel with dq by
atomics. Where dq is added by atomics over square tiles (or spans of whole query tiles that ask for it), the bias
gradient is the ds tiles themselves, added into one query-tile-sized slot per tile diagonal and summed along
diagonals afterwards (`fold_ds_tiles`); elsewhere it goes to a partial per program where the spans tile each chunk
or one chunk holds the sequence (`fold_span_partials`), else by atomics, each tile's diagonals summed in the loop
after permuting each key row's queries (`_query_rotated`). The ops README describes the layout; docs/benchmarks.md
(kernel measurement records) has the measurements behind the tile table.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from longmixer.ops.common import DV_PASS_MIN_V, LAPLACE_MU, LAPLACE_SIGMA, diagonal_sums

ATTN_CODES = {"softmax": 0, "relu2": 1, "laplace": 2}


@triton.jit
def _bias_and_mask(b_s, o_i, o_j, i_b, i_h, L, C, i_hi, j_hi, bias_ptr, mask_ptr, CAUSAL: tl.constexpr,
                   HAS_BIAS: tl.constexpr, BIAS_PER_HEAD: tl.constexpr, HAS_MASK: tl.constexpr,
                   ALIGNED: tl.constexpr):
    """Add b[(C-1) + j - i] to a score tile and return it with its validity mask; o_i (queries) and o_j (keys) are
    [M, 1] and [1, N] or [1, M] and [N, 1], so the same code serves both tile orientations. ALIGNED (`tile_mode`):
    1, the launcher has checked that every tile lies inside one chunk, so no pair needs the chunk test and
    (C-1) + j - i is in [0, 2C-2] for every pair, valid or not: the bias loads without an index select or mask.
    2, also every pair of every tile is valid (whole chunks, no causal or key mask): the mask is a constant, which
    the compiler folds out of the kernels' selects."""
    if ALIGNED == 2:
        m_valid = tl.full(b_s.shape, 1, tl.int1)
    elif ALIGNED:
        m_valid = (o_i < i_hi) & (o_j < j_hi)
    else:
        m_valid = (o_i < i_hi) & (o_j < j_hi) & ((o_i // C) == (o_j // C))
    if CAUSAL:
        m_valid = m_valid & (o_j <= o_i)
    if HAS_MASK:
        b_key = tl.load(mask_ptr + i_b * L + o_j, mask=o_j < j_hi, other=0)
        m_valid = m_valid & (b_key != 0)
    if HAS_BIAS:
        p_bias = bias_ptr + (i_h * (2 * C - 1) if BIAS_PER_HEAD else 0) + (C - 1)
        if ALIGNED:
            b_s = b_s + tl.load(p_bias + (o_j - o_i))
        else:
            b_s = b_s + tl.load(p_bias + tl.where(m_valid, o_j - o_i, 0), mask=m_valid, other=0.)
    return b_s, m_valid


@triton.jit
def _dropout_scale(seed_ptr, p_drop, i_bh, L, o_i, o_j):
    """keep / (1 - p) for each (query, key) of the tile; Philox numbers indexed by (bh, i, j), so the forward and
    the backward kernels draw the same mask (the index wraps in int32 past 2^31 pairs: still a fixed draw). The
    seed is read from device memory, so a CUDA graph replay draws the seed its own replay wrote there."""
    o_rng = (i_bh * L + o_i) * L + o_j
    return tl.where(tl.rand(tl.load(seed_ptr), o_rng) >= p_drop, 1. / (1. - p_drop), 0.)


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
def _inv_count(o_m, i_b, L, C, lo, hi, mask_ptr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """1/n of element attention for rows o_m, as `reference.row_norm`: causal, the position in the chunk + 1;
    else the number of real keys of the row's chunk (keys [lo, hi) cover it), at least 1."""
    if CAUSAL:
        b_n = (o_m % C + 1).to(tl.float32)
    elif HAS_MASK:
        b_n = tl.zeros([BLOCK_M], dtype=tl.float32)
        for n0 in range(lo, hi, BLOCK_N):
            o_n = n0 + tl.arange(0, BLOCK_N)
            b_key = tl.load(mask_ptr + i_b * L + o_n, mask=o_n < hi, other=0)
            m_same = ((o_m // C)[:, None] == (o_n // C)[None, :]) & (b_key != 0)[None, :]
            b_n += tl.sum(m_same.to(tl.float32), 1)
        b_n = tl.maximum(b_n, 1.)
    else:
        o_start = (o_m // C) * C
        b_n = tl.maximum((tl.minimum(o_start + C, L) - o_start).to(tl.float32), 1.)  # rows past L: any n > 0
    return 1. / b_n


@triton.jit
def _bias_table_kernel(bias_ptr, tab_ptr, C, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       TRANSPOSED: tl.constexpr):
    # tile d of head h: b[(C-1) + (d - (C / BLOCK_N - 1)) BLOCK_N + c - r] for r < BLOCK_M, c < BLOCK_N, stored as
    # [r, c] or (TRANSPOSED) [c, r]
    i_d, i_h = tl.program_id(0), tl.program_id(1)
    o_r, o_c = tl.arange(0, BLOCK_M)[:, None], tl.arange(0, BLOCK_N)[None, :]
    o_b = (C - 1) + (i_d - (C // BLOCK_N - 1)) * BLOCK_N + o_c - o_r
    o_t = o_c * BLOCK_M + o_r if TRANSPOSED else o_r * BLOCK_N + o_c
    tl.store(tab_ptr + (i_h * tl.num_programs(0) + i_d) * BLOCK_M * BLOCK_N + o_t,
             tl.load(bias_ptr + i_h * (2 * C - 1) + o_b))


def bias_table(bias: torch.Tensor, C: int, BLOCK_M: int, BLOCK_N: int, transposed: bool = False) -> torch.Tensor:
    """The Toeplitz bias b[(C-1) + j - i] cut into the [BLOCK_M, BLOCK_N] tiles of one chunk: [H or 1, 2 C / BLOCK_N
    - 1, BLOCK_M, BLOCK_N] float32, tile d holding key tiles d - (C / BLOCK_N - 1) tiles right of their query tile;
    transposed, each tile as [BLOCK_N keys, BLOCK_M queries] (the backward kernels' layout).
    For tiles inside one chunk (`tiles_in_one_chunk`) with BLOCK_M == BLOCK_N."""
    n_d = 2 * (C // BLOCK_N) - 1
    shape = (BLOCK_N, BLOCK_M) if transposed else (BLOCK_M, BLOCK_N)
    tab = torch.empty(bias.shape[0], n_d, *shape, device=bias.device, dtype=torch.float32)
    _bias_table_kernel[(n_d, bias.shape[0])](bias, tab, C, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, TRANSPOSED=transposed)
    return tab


def use_bias_table(C: int, BLOCK_M: int, BLOCK_N: int) -> bool:
    """Whether the forward reads its bias tiles from `bias_table`: aligned square tiles and chunks of at least 256.
    A tile's bias then loads as one contiguous block instead of a gather of BLOCK_M x BLOCK_N single values.
    On an H100 (docs/benchmarks.md) that made the forward faster at C 256 and 1024. At C 128 it was slower: every
    program reads the same three tiles."""
    return C >= 256 and BLOCK_M == BLOCK_N and tiles_in_one_chunk(C, BLOCK_M, BLOCK_N)


@triton.jit
def _row_offsets(idx_ptr, i_b, L, o, m, PACKED: tl.constexpr):
    """Where the outputs of slots o of row b go: o, or (PACKED) the positions idx[b, o] of SeqBoat's packed sequence
    (slots outside m read position 0; the stores there are masked)."""
    if PACKED:
        return tl.load(idx_ptr + i_b * L + o, mask=m, other=0)
    return o


@triton.jit
def _local_attention_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, stat_ptr, bias_ptr, mask_ptr, idx_ptr, lens_ptr,
                                H, L, K, V, C, scale, seed_ptr, p_drop,
                                ATTN: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                                BIAS_PER_HEAD: tl.constexpr, HAS_MASK: tl.constexpr, PACKED: tl.constexpr,
                                DROPOUT: tl.constexpr,
                                DOT_PREC: tl.constexpr, MU: tl.constexpr, SIGMA: tl.constexpr, ALIGNED: tl.constexpr,
                                TABLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    # one (query block, value block); stat = log-sum-exp (softmax) or 1/n (element attention) for the backward
    i_m, i_bh, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    lo, hi = _key_range(i_m * BLOCK_M, L, C, BLOCK_M, CAUSAL)
    r_hi = L
    if PACKED:  # slots at or past the row's count take no part (`local_attention_fwd`'s rows)
        r_hi = tl.load(lens_ptr + i_b)
        hi = tl.where(i_m * BLOCK_M < r_hi, tl.minimum(hi, r_hi), 0)
    m_row = o_m < r_hi
    b_q = tl.load(q_ptr + (i_bh * L + o_m[:, None]) * K + o_k[None, :], mask=m_row[:, None] & (o_k[None, :] < K),
                  other=0.)
    b_inv = tl.full([BLOCK_M], 1., dtype=tl.float32)
    if ATTN != 0:
        b_inv = _inv_count(o_m, i_b, L, C, lo, hi, mask_ptr, CAUSAL, HAS_MASK, BLOCK_M, BLOCK_N)
    b_acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    b_mx = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    # TABLE: bias_ptr is `bias_table`; p_tab is this head's tile of key tiles starting at the query tile's start
    n_d = 2 * (C // BLOCK_N) - 1
    p_tab = (bias_ptr + ((i_h * n_d if BIAS_PER_HEAD else 0) + C // BLOCK_N - 1 - i_m) * (BLOCK_M * BLOCK_N)
             + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :])
    for n0 in range(lo, hi, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        b_k = tl.load(k_ptr + (i_bh * L + o_n[:, None]) * K + o_k[None, :],
                      mask=(o_n[:, None] < hi) & (o_k[None, :] < K), other=0.)
        b_v = tl.load(v_ptr + (i_bh * L + o_n[:, None]) * V + o_v[None, :],
                      mask=(o_n[:, None] < hi) & (o_v[None, :] < V), other=0.)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * scale
        if ATTN != 0:
            b_s = b_s * b_inv[:, None]  # element attention divides by the key count before the bias (MEGA code)
        if HAS_BIAS and TABLE:  # key tile n0 / BLOCK_N - i_m tiles right of the query tile (BLOCK_M == BLOCK_N)
            b_s = b_s + tl.load(p_tab + (n0 // BLOCK_N) * (BLOCK_M * BLOCK_N))
        b_s, m_valid = _bias_and_mask(b_s, o_m[:, None], o_n[None, :], i_b, i_h, L, C, r_hi, hi, bias_ptr,
                                      mask_ptr, CAUSAL, HAS_BIAS and not TABLE, BIAS_PER_HEAD, HAS_MASK, ALIGNED)
        if PACKED and ALIGNED == 2:  # the tile holding the row's count: its keys past it (`packed_tile_mode`)
            if n0 + BLOCK_N > hi:
                b_s = tl.where(o_n[None, :] < hi, b_s, float("-inf"))
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
            b_p = b_p * _dropout_scale(seed_ptr, p_drop, i_bh, L, o_m[:, None], o_n[None, :])  # b_l stays undropped
        b_acc += tl.dot(b_p.to(b_v.dtype), b_v, input_precision=DOT_PREC)
    b_stat = b_inv
    if ATTN == 0:
        b_acc = b_acc / tl.where(b_l == 0., 1., b_l)[:, None]
        # rows with no key: lse = +inf so that the backward's exp(s - lse) is 0 there
        b_stat = tl.where(b_l == 0., float("inf"), b_mx + tl.log(tl.where(b_l == 0., 1., b_l)))
    r_m = _row_offsets(idx_ptr, i_b, L, o_m, m_row, PACKED)
    tl.store(stat_ptr + i_bh * L + r_m, b_stat, mask=m_row & (i_v == 0))
    tl.store(o_ptr + (i_bh * L + r_m[:, None]) * V + o_v[None, :], b_acc.to(o_ptr.dtype.element_ty),
             mask=m_row[:, None] & (o_v[None, :] < V))


@triton.jit
def _query_rotated(b_dsT, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """A [BLOCK_N keys, BLOCK_M queries] tile with each key row's queries permuted so that column c holds, in row jj,
    the query ii = (jj - c) mod BLOCK_M: then j - i = c + BLOCK_M w - (m0 - n0), with w = floor((jj - c) / BLOCK_M)
    in [-1, BLOCK_N / BLOCK_M - 1], so each column's sum over the rows of one w is one diagonal's. The permutation
    stays inside a row, whose values live in one warp of the dot's layout (the rows are spread over the warps), so
    the gather needs no shared-memory round trip. Returns the permuted tile and w + 1 per element."""
    o_d = tl.arange(0, BLOCK_N)[:, None] - tl.arange(0, BLOCK_M)[None, :] + BLOCK_M  # jj - c + BLOCK_M >= 1
    return tl.gather(b_dsT, o_d & (BLOCK_M - 1), axis=1), o_d // BLOCK_M


@triton.jit
def _put_diagonals(p_diag, o_d, b_sum, d_lo, d_hi, MODE: tl.constexpr):
    """Put the sums b_sum of diagonals j - i = o_d (d_lo < o_d < d_hi) at p_diag + o_d: MODE 0 by atomics (a buffer
    every program adds into), 1 by a store (each diagonal put once), 2 added in place (a program's own partial)."""
    m_d = (o_d > d_lo) & (o_d < d_hi)
    if MODE == 0:
        tl.atomic_add(p_diag + o_d, b_sum, mask=m_d)
    elif MODE == 1:
        tl.store(p_diag + o_d, b_sum, mask=m_d)
    else:
        tl.store(p_diag + o_d, tl.load(p_diag + o_d, mask=m_d, other=0.) + b_sum, mask=m_d)


@triton.jit
def _dvalues(v_ptr, do_ptr, o_ptr, o_m, o_n, i_bh, L, V, m_rows, m_keys, ATTN: tl.constexpr, FUSED: tl.constexpr,
             DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr):
    """dP^T = v do^T [BN, BM] over every value block and (softmax, FUSED) delta = rowsum(do o) [BM]."""
    b_dpT = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    b_delta = tl.zeros([BLOCK_M], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_v = o_v < V
        b_v = tl.load(v_ptr + (i_bh * L + o_n[:, None]) * V + o_v[None, :], mask=m_keys[:, None] & m_v[None, :],
                      other=0.)
        b_do = tl.load(do_ptr + (i_bh * L + o_m[:, None]) * V + o_v[None, :], mask=m_rows[:, None] & m_v[None, :],
                       other=0.)
        b_dpT += tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PREC)
        if ATTN == 0 and FUSED:
            b_o = tl.load(o_ptr + (i_bh * L + o_m[:, None]) * V + o_v[None, :], mask=m_rows[:, None] & m_v[None, :],
                          other=0.)
            b_delta += tl.sum(b_do.to(tl.float32) * b_o.to(tl.float32), 1)
    return b_dpT, b_delta


@triton.jit
def _weights_T(q_ptr, do_ptr, stat_ptr, bias_ptr, mask_ptr, b_k, o_m, o_n, o_k, o_v, m_k, m_v, i_b, i_h, i_bh, L, K, V,
               C, hi, k_hi, scale, ATTN: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
               BIAS_PER_HEAD: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PREC: tl.constexpr, MU: tl.constexpr,
               SIGMA: tl.constexpr, ALIGNED: tl.constexpr, b_tabT, TABLE: tl.constexpr):
    """The backward's view of one tile, keys o_n (k_hi their bound, b_k loaded) against rows o_m (< hi): q, do and
    the saved stat of the rows, then the scores and the weights recomputed, transposed ([keys, queries]), with
    their validity mask. Returns q, do, stat, s^T (scaled, biased), the mask and p^T (softmax: exp(s - lse)).
    TABLE: the bias is b_tabT, the tile's [keys, queries] block of the transposed `bias_table`, not gathered."""
    m_rows = o_m < hi
    b_q = tl.load(q_ptr + (i_bh * L + o_m[:, None]) * K + o_k[None, :], mask=m_rows[:, None] & m_k[None, :], other=0.)
    b_do = tl.load(do_ptr + (i_bh * L + o_m[:, None]) * V + o_v[None, :], mask=m_rows[:, None] & m_v[None, :],
                   other=0.)
    b_stat = tl.load(stat_ptr + i_bh * L + o_m, mask=m_rows, other=float("inf") if ATTN == 0 else 1.)
    b_sT = tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PREC) * scale  # [BN, BM]
    if ATTN != 0:
        b_sT = b_sT * b_stat[None, :]
    if HAS_BIAS and TABLE:
        b_sT = b_sT + b_tabT
    b_sT, m_valid = _bias_and_mask(b_sT, o_m[None, :], o_n[:, None], i_b, i_h, L, C, hi, k_hi, bias_ptr, mask_ptr,
                                   CAUSAL, HAS_BIAS and not TABLE, BIAS_PER_HEAD, HAS_MASK, ALIGNED)
    if ATTN == 0:
        b_pT = tl.where(m_valid, tl.exp(b_sT - b_stat[None, :]), 0.)
    else:
        b_pT = tl.where(m_valid, _activation(b_sT, ATTN, MU, SIGMA), 0.)
    return b_q, b_do, b_stat, b_sT, m_valid, b_pT


@triton.jit
def _local_attention_bwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, stat_ptr, delta_ptr, bias_ptr, mask_ptr,
                                idx_ptr, lens_ptr, dq_ptr, dk_ptr, dv_ptr, dbias_ptr, H, L, K, V, C, SPAN, N_PIECES,
                                PIECE, scale, seed_ptr, p_drop, ATTN: tl.constexpr, CAUSAL: tl.constexpr,
                                HAS_BIAS: tl.constexpr,
                                BIAS_PER_HEAD: tl.constexpr, HAS_MASK: tl.constexpr, PACKED: tl.constexpr,
                                DROPOUT: tl.constexpr,
                                FUSED: tl.constexpr, DOT_PREC: tl.constexpr, MU: tl.constexpr, SIGMA: tl.constexpr,
                                ALIGNED: tl.constexpr, BIAS_GRAD: tl.constexpr, DQ_ATOMIC: tl.constexpr,
                                SPAN_PART: tl.constexpr, CARRY: tl.constexpr, DS_TILES: tl.constexpr,
                                DV: tl.constexpr, DK_ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                                ONE_V: tl.constexpr, STAGGER: tl.constexpr):
    # one key span [n0, n0 + SPAN) and one value block, tiles kept transposed ([keys, queries]) so that
    # dv += p^T do and dk += ds^T q take their left operand from registers. Every program adds its value block of
    # dv; the value-block-0 program also does dk, the bias gradient and, FUSED (the span holds whole chunks, so
    # its queries see no other key), dq and delta = rowsum(do o) in place. DQ_ATOMIC (long spans): dq is added
    # into a zeroed float32 buffer by atomics, and the programs of one row start at different query blocks so
    # that they do not all add into the same rows at once: key span i_n starts at query block i_n * STAGGER. With
    # DS_TILES, STAGGER = SPAN / BLOCK_M + 1 (the launcher's default) also keeps them off one slot (a tile's slot is
    # its key block less its query block, in query tiles, which STAGGER = SPAN / BLOCK_M makes the same for every
    # program at each step): with spans of 64, STAGGER 2 against 1 took MEGA's backward from 0.986 to 0.957 ms at B8
    # L4096 and from 3.66 to 3.58 ms at B2 L16384 on an H200 (docs/benchmarks.md); CARRY's first carried block
    # assumes STAGGER 1.
    # Not DV: dv is left to `_local_attention_bwd_dv_kernel` (one program per key span then takes every value
    # block: the grid has one).
    # Pieces (N_PIECES > 1, DQ_ATOMIC with the ds tiles or no bias gradient, dv left to the dv pass): a program
    # takes one piece of PIECE query tiles of its key span's range and adds its dk by atomics (DK_ATOMIC) into a
    # zeroed float32 buffer. Short programs keep the SMs evenly loaded where a packed row's count leaves a few long
    # ones for the last wave (`PACKED_PIECE_QUERIES`).
    i_s, i_bh, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_p = i_s // N_PIECES, i_s % N_PIECES
    i_b, i_h = i_bh // H, i_bh % H
    n0 = i_n * SPAN
    o_n = n0 + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    k_hi = tl.minimum(n0 + SPAN, L)
    r_hi = L
    if PACKED:  # not FUSED (the launcher checks): slots past the row's count take no part
        r_hi = tl.load(lens_ptr + i_b)
        k_hi = tl.minimum(k_hi, r_hi)
    m_keys = o_n < k_hi
    m_k, m_v = o_k < K, o_v < V
    b_k = tl.load(k_ptr + (i_bh * L + o_n[:, None]) * K + o_k[None, :], mask=m_keys[:, None] & m_k[None, :], other=0.)
    b_v = tl.load(v_ptr + (i_bh * L + o_n[:, None]) * V + o_v[None, :], mask=m_keys[:, None] & m_v[None, :], other=0.)
    b_dk = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    # Where the bias gradient's diagonal sums go: p_diag + (j - i), for d_lo < j - i < d_hi.
    # FUSED: this program's [2 BLOCK_N] partial, zeroed here. SPAN_PART (spans that tile each chunk, or one chunk
    # holding the sequence): this program's row of C + BLOCK_N in a zeroed [B H, chunks x spans per chunk,
    # C + BLOCK_N] buffer, the diagonal at (C - 1) - n0 % C + (j - i) (`fold_span_partials`). Else the
    # [H or 1, 2C-1] gradient, by atomics.
    if FUSED:
        p_diag = dbias_ptr + (i_bh * (tl.num_programs(0) // N_PIECES) + i_n) * 2 * BLOCK_N + BLOCK_N
        d_lo, d_hi = -BLOCK_N, BLOCK_N
        if BIAS_GRAD and (ONE_V or i_v == 0):
            tl.store(p_diag - BLOCK_N + tl.arange(0, 2 * BLOCK_N), tl.zeros([2 * BLOCK_N], dtype=tl.float32))
            tl.debug_barrier()
    elif SPAN_PART:
        n_rows = tl.cdiv(L, C) * tl.cdiv(tl.minimum(C, L), SPAN)
        p_diag = dbias_ptr + (i_bh * n_rows + i_n) * (C + BLOCK_N) + (C - 1) - n0 % C
        d_lo, d_hi = n0 % C - C, n0 % C + BLOCK_N
    else:
        p_diag = dbias_ptr + (i_h * (2 * C - 1) if BIAS_PER_HEAD else 0) + (C - 1)
        d_lo, d_hi = -C, C
    # partials added to in place by each tile (ADD_MODE 2) or atomics into the shared gradient (0)
    ADD_MODE: tl.constexpr = 2 if FUSED or SPAN_PART else 0
    if FUSED:
        lo, hi = n0, k_hi
    else:
        lo, hi = _query_range(n0, L, C, BLOCK_N, CAUSAL)
        if PACKED:
            hi = tl.where(n0 < r_hi, tl.minimum(hi, r_hi), lo)
    n_iter = tl.cdiv(hi - lo, BLOCK_M)
    t_lo = tl.minimum(i_p * PIECE, n_iter)  # this piece: query tiles t_lo .. t_lo + n_p - 1 of the range
    n_p = tl.minimum(n_iter - t_lo, PIECE)
    # CARRY (BLOCK_N == BLOCK_M, split paths): each tile's wrap classes are w = 0 (jj >= c) and w = -1 (jj < c), and
    # class 0 of a tile holds the same diagonals, column by column, as class -1 of the tile BLOCK_M queries below.
    # So the rotated tile before (b_prev, queries prev_m0) is carried and one column sum of the two gives this
    # block's diagonals complete: one reduction and one put per tile instead of two.
    o_c = tl.arange(0, BLOCK_M)
    b_cls0 = tl.arange(0, BLOCK_N)[:, None] >= o_c[None, :]
    b_prev = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    if DQ_ATOMIC:
        prev_m0 = lo + (t_lo + (i_n % tl.maximum(n_p, 1)) - 1) * BLOCK_M  # n_p is 0 for spans past a row's count
    else:
        prev_m0 = lo - BLOCK_M
    for it in range(0, n_p):
        if DQ_ATOMIC:
            m0 = lo + (t_lo + (it + i_n * STAGGER) % n_p) * BLOCK_M
        else:
            m0 = lo + (t_lo + it) * BLOCK_M
        o_m = m0 + tl.arange(0, BLOCK_M)
        m_rows = o_m < hi
        b_q, b_do, b_stat, b_sT, m_valid, b_pT = _weights_T(
            q_ptr, do_ptr, stat_ptr, bias_ptr, mask_ptr, b_k, o_m, o_n, o_k, o_v, m_k, m_v, i_b, i_h, i_bh, L, K, V,
            C, hi, k_hi, scale, ATTN, CAUSAL, HAS_BIAS, BIAS_PER_HEAD, HAS_MASK, DOT_PREC, MU, SIGMA, ALIGNED, 0.,
            False)
        if DROPOUT:
            b_keep = _dropout_scale(seed_ptr, p_drop, i_bh, L, o_m[None, :], o_n[:, None])
            if DV:
                b_dv += tl.dot((b_pT * b_keep).to(b_do.dtype), b_do, input_precision=DOT_PREC)
        elif DV:
            b_dv += tl.dot(b_pT.to(b_do.dtype), b_do, input_precision=DOT_PREC)
        if ONE_V or i_v == 0:
            if ONE_V:
                b_dpT = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PREC)
                b_delta = tl.zeros([BLOCK_M], dtype=tl.float32)
                if ATTN == 0 and FUSED:
                    b_o = tl.load(o_ptr + (i_bh * L + o_m[:, None]) * V + o_v[None, :],
                                  mask=m_rows[:, None] & m_v[None, :], other=0.)
                    b_delta = tl.sum(b_do.to(tl.float32) * b_o.to(tl.float32), 1)
            else:
                b_dpT, b_delta = _dvalues(v_ptr, do_ptr, o_ptr, o_m, o_n, i_bh, L, V, m_rows, m_keys, ATTN, FUSED,
                                          DOT_PREC, BLOCK_M, BLOCK_N, BLOCK_V)
            if DROPOUT:
                b_dpT = b_dpT * b_keep
            if ATTN == 0:
                if not FUSED:
                    b_delta = tl.load(delta_ptr + i_bh * L + o_m, mask=m_rows, other=0.)
                b_dsT = b_pT * (b_dpT - b_delta[None, :])  # softmax: ds = p (dp - rowsum(do o))
            else:
                b_dsT = tl.where(m_valid, _activation_grad(b_sT, ATTN, MU, SIGMA) * b_dpT, 0.)
            if PACKED and ALIGNED == 2 and BIAS_GRAD:  # keys past the row's count, unmasked (`packed_tile_mode`)
                if n0 + BLOCK_N > k_hi:
                    b_dsT = tl.where(m_keys[:, None], b_dsT, 0.)
            if BIAS_GRAD and DS_TILES:  # the tile as it is, into its tile diagonal's slot (`fold_ds_tiles`)
                # [BLOCK_M, BLOCK_M] slots one after another, T = cdiv(C, BLOCK_M) tiles a chunk: a key span of
                # several query tiles' width adds its rows past the first BLOCK_M into the next slots, those of
                # their own tile diagonals
                n_t = tl.cdiv(C, BLOCK_M)
                p_slot = dbias_ptr + (i_bh * (2 * n_t - 1) + (n0 - m0) // BLOCK_M + n_t - 1) * (BLOCK_M * BLOCK_M)
                tl.atomic_add(p_slot + tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + o_c[None, :], b_dsT, sem="relaxed")
            elif BIAS_GRAD and CARRY:
                b_rot, _ = _query_rotated(b_dsT, BLOCK_N, BLOCK_M)
                if m0 != prev_m0 + BLOCK_M:  # DQ_ATOMIC's rotated order wrapped: put the carried tile's class -1
                    _put_diagonals(p_diag, o_c - BLOCK_M - (prev_m0 - n0), tl.sum(tl.where(b_cls0, 0., b_prev), 0),
                                   d_lo, d_hi, ADD_MODE)
                    b_prev = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                # complete diagonals, each put once (a partial takes a store), except the first tile's block in
                # DQ_ATOMIC's order, which the last tile's class -1 completes after the loop
                _put_diagonals(p_diag, o_c - (m0 - n0), tl.sum(tl.where(b_cls0, b_rot, b_prev), 0), d_lo, d_hi,
                               1 if SPAN_PART else 0)
                b_prev = b_rot
                prev_m0 = m0
            elif BIAS_GRAD:
                b_rot, b_w1 = _query_rotated(b_dsT, BLOCK_N, BLOCK_M)
                for w1 in tl.static_range((BLOCK_N - 1) // BLOCK_M + 2):  # w = w1 - 1: the diagonals j - i = d
                    _put_diagonals(p_diag, o_c + BLOCK_M * (w1 - 1) - (m0 - n0),
                                   tl.sum(tl.where(b_w1 == w1, b_rot, 0.), 0), d_lo, d_hi, ADD_MODE)
                if ADD_MODE == 2:
                    tl.debug_barrier()  # the next tile reads what this one added
            if ATTN == 0:
                b_dsT = b_dsT * scale
            else:
                b_dsT = b_dsT * (scale * b_stat)[None, :]
            b_dk += tl.dot(b_dsT.to(b_q.dtype), b_q, input_precision=DOT_PREC)
            if FUSED:
                b_dq = tl.dot(tl.trans(b_dsT).to(b_k.dtype), b_k, input_precision=DOT_PREC)
                tl.store(dq_ptr + (i_bh * L + o_m[:, None]) * K + o_k[None, :], b_dq.to(dq_ptr.dtype.element_ty),
                         mask=m_rows[:, None] & m_k[None, :])
            elif DQ_ATOMIC:
                b_dq = tl.dot(tl.trans(b_dsT).to(b_k.dtype), b_k, input_precision=DOT_PREC)
                r_m = _row_offsets(idx_ptr, i_b, L, o_m, m_rows, PACKED)
                tl.atomic_add(dq_ptr + (i_bh * L + r_m[:, None]) * K + o_k[None, :], b_dq,
                              mask=m_rows[:, None] & m_k[None, :], sem="relaxed")
    if BIAS_GRAD and CARRY and (ONE_V or i_v == 0):  # the last tile's class -1
        tl.debug_barrier()  # a partial's first put may share these diagonals
        _put_diagonals(p_diag, o_c - BLOCK_M - (prev_m0 - n0), tl.sum(tl.where(b_cls0, 0., b_prev), 0), d_lo, d_hi,
                       ADD_MODE)
    r_n = _row_offsets(idx_ptr, i_b, L, o_n, m_keys, PACKED)
    if DV:
        tl.store(dv_ptr + (i_bh * L + r_n[:, None]) * V + o_v[None, :], b_dv.to(dv_ptr.dtype.element_ty),
                 mask=m_keys[:, None] & m_v[None, :])
    if DK_ATOMIC:
        tl.atomic_add(dk_ptr + (i_bh * L + r_n[:, None]) * K + o_k[None, :], b_dk,
                      mask=m_keys[:, None] & m_k[None, :] & (n_p > 0), sem="relaxed")
    elif ONE_V or i_v == 0:
        tl.store(dk_ptr + (i_bh * L + r_n[:, None]) * K + o_k[None, :], b_dk.to(dk_ptr.dtype.element_ty),
                 mask=m_keys[:, None] & m_k[None, :])


@triton.jit
def _local_attention_bwd_dv_kernel(q_ptr, k_ptr, do_ptr, stat_ptr, bias_ptr, mask_ptr, idx_ptr, lens_ptr, dv_ptr, H,
                                   L, K, V, C, N_PIECES, PIECE, scale, seed_ptr, p_drop, ATTN: tl.constexpr,
                                   CAUSAL: tl.constexpr,
                                   HAS_BIAS: tl.constexpr, BIAS_PER_HEAD: tl.constexpr, HAS_MASK: tl.constexpr,
                                   PACKED: tl.constexpr, DROPOUT: tl.constexpr, DOT_PREC: tl.constexpr,
                                   MU: tl.constexpr, SIGMA: tl.constexpr, ALIGNED: tl.constexpr, TABLE: tl.constexpr,
                                   DV_ATOMIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    # dv = p^T do for one key tile and one value block, the weights recomputed from q, k and the saved stat: the
    # second pass of the two-pass long-span backward (`dv_pass`), whose first pass does the rest without the
    # [keys, V] dv accumulator. Tiles transposed ([keys, queries]) as in `_local_attention_bwd_kernel`. TABLE:
    # bias_ptr is `bias_table` with each tile transposed, read as one contiguous block a tile, as the forward does.
    # Pieces as the first pass's: PIECE query tiles a program, dv added by atomics (DV_ATOMIC) into float32 zeros.
    i_s, i_bh, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_p = i_s // N_PIECES, i_s % N_PIECES
    i_b, i_h = i_bh // H, i_bh % H
    n0 = i_n * BLOCK_N
    o_n = n0 + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    o_v = i_v * BLOCK_V + tl.arange(0, BLOCK_V)
    k_hi = tl.minimum(n0 + BLOCK_N, L)
    if PACKED:
        r_hi = tl.load(lens_ptr + i_b)
        k_hi = tl.minimum(k_hi, r_hi)
    m_keys = o_n < k_hi
    m_k, m_v = o_k < K, o_v < V
    b_k = tl.load(k_ptr + (i_bh * L + o_n[:, None]) * K + o_k[None, :], mask=m_keys[:, None] & m_k[None, :], other=0.)
    b_dv = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    lo, hi = _query_range(n0, L, C, BLOCK_N, CAUSAL)
    if PACKED:
        hi = tl.where(n0 < r_hi, tl.minimum(hi, r_hi), 0)
    # query tiles at multiples of BLOCK_M, which the compiler can use in the rows' index arithmetic; the rows before
    # lo fail the causal test (a causal range starts at n0) or, with tiles across chunks (tile mode 0), the chunk
    # test
    # TABLE: tile (C / BLOCK_N - 1) + i_n - m0 / BLOCK_M of this head holds key tile i_n against query tile m0
    n_d = 2 * (C // BLOCK_N) - 1
    p_tab = (bias_ptr + ((i_h * n_d if BIAS_PER_HEAD else 0) + C // BLOCK_N - 1 + i_n) * (BLOCK_M * BLOCK_N)
             + tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :])
    m_lo = lo // BLOCK_M * BLOCK_M + i_p * PIECE * BLOCK_M
    m_hi = tl.minimum(m_lo + PIECE * BLOCK_M, hi)
    for m0 in range(m_lo, m_hi, BLOCK_M):
        o_m = m0 + tl.arange(0, BLOCK_M)
        b_tabT = 0.
        if HAS_BIAS and TABLE:
            b_tabT = tl.load(p_tab - (m0 // BLOCK_M) * (BLOCK_M * BLOCK_N))
        _, b_do, _, _, _, b_pT = _weights_T(
            q_ptr, do_ptr, stat_ptr, bias_ptr, mask_ptr, b_k, o_m, o_n, o_k, o_v, m_k, m_v, i_b, i_h, i_bh, L, K, V,
            C, hi, k_hi, scale, ATTN, CAUSAL, HAS_BIAS, BIAS_PER_HEAD, HAS_MASK, DOT_PREC, MU, SIGMA, ALIGNED, b_tabT,
            TABLE)
        if DROPOUT:
            b_pT = b_pT * _dropout_scale(seed_ptr, p_drop, i_bh, L, o_m[None, :], o_n[:, None])
        b_dv += tl.dot(b_pT.to(b_do.dtype), b_do, input_precision=DOT_PREC)
    r_n = _row_offsets(idx_ptr, i_b, L, o_n, m_keys, PACKED)
    if DV_ATOMIC:
        tl.atomic_add(dv_ptr + (i_bh * L + r_n[:, None]) * V + o_v[None, :], b_dv,
                      mask=m_keys[:, None] & m_v[None, :] & (m_lo < m_hi), sem="relaxed")
    else:
        tl.store(dv_ptr + (i_bh * L + r_n[:, None]) * V + o_v[None, :], b_dv.to(dv_ptr.dtype.element_ty),
                 mask=m_keys[:, None] & m_v[None, :])


@triton.jit
def _delta_kernel(o_ptr, do_ptr, delta_ptr, R, V, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    # delta = rowsum(do o) over R = B H L rows, for the softmax backward of the DQ_ATOMIC path
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    b_delta = tl.zeros([BLOCK_R], dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m = (o_r[:, None] < R) & (o_v[None, :] < V)
        p = o_r[:, None] * V + o_v[None, :]
        b_delta += tl.sum(tl.load(do_ptr + p, mask=m, other=0.).to(tl.float32)
                          * tl.load(o_ptr + p, mask=m, other=0.).to(tl.float32), 1)
    tl.store(delta_ptr + o_r, b_delta, mask=o_r < R)


@triton.jit
def _local_attention_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, stat_ptr, delta_ptr, bias_ptr, mask_ptr,
                                   dq_ptr, H, L, K, V, C, scale, seed_ptr, p_drop,
                                   ATTN: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                                   BIAS_PER_HEAD: tl.constexpr, HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr,
                                   DOT_PREC: tl.constexpr, MU: tl.constexpr, SIGMA: tl.constexpr,
                                   ALIGNED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    # one query block (chunks longer than a key tile): dq = sum_j ds_ij (scale / n_i) k_j; writes delta first
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_k = tl.arange(0, BLOCK_K)
    m_rows, m_k = o_m < L, o_k < K
    b_q = tl.load(q_ptr + (i_bh * L + o_m[:, None]) * K + o_k[None, :], mask=m_rows[:, None] & m_k[None, :], other=0.)
    b_stat = tl.load(stat_ptr + i_bh * L + o_m, mask=m_rows, other=float("inf") if ATTN == 0 else 1.)
    b_delta = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ATTN == 0:
        for v0 in range(0, V, BLOCK_V):
            o_v = v0 + tl.arange(0, BLOCK_V)
            p_mv = (i_bh * L + o_m[:, None]) * V + o_v[None, :]
            m_mv = m_rows[:, None] & (o_v[None, :] < V)
            b_delta += tl.sum(tl.load(do_ptr + p_mv, mask=m_mv, other=0.).to(tl.float32)
                              * tl.load(o_ptr + p_mv, mask=m_mv, other=0.).to(tl.float32), 1)
        tl.store(delta_ptr + i_bh * L + o_m, b_delta, mask=m_rows)
    b_dq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    lo, hi = _key_range(i_m * BLOCK_M, L, C, BLOCK_M, CAUSAL)
    for n0 in range(lo, hi, BLOCK_N):
        o_n = n0 + tl.arange(0, BLOCK_N)
        b_k = tl.load(k_ptr + (i_bh * L + o_n[:, None]) * K + o_k[None, :], mask=(o_n[:, None] < hi) & m_k[None, :],
                      other=0.)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PREC) * scale
        if ATTN != 0:
            b_s = b_s * b_stat[:, None]
        b_s, m_valid = _bias_and_mask(b_s, o_m[:, None], o_n[None, :], i_b, i_h, L, C, L, hi, bias_ptr, mask_ptr,
                                      CAUSAL, HAS_BIAS, BIAS_PER_HEAD, HAS_MASK, ALIGNED)
        b_dp = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # do v^T over the value blocks
        for v0 in range(0, V, BLOCK_V):
            o_v = v0 + tl.arange(0, BLOCK_V)
            b_do = tl.load(do_ptr + (i_bh * L + o_m[:, None]) * V + o_v[None, :],
                           mask=m_rows[:, None] & (o_v[None, :] < V), other=0.)
            b_v = tl.load(v_ptr + (i_bh * L + o_n[:, None]) * V + o_v[None, :],
                          mask=(o_n[:, None] < hi) & (o_v[None, :] < V), other=0.)
            b_dp += tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PREC)
        if DROPOUT:
            b_dp = b_dp * _dropout_scale(seed_ptr, p_drop, i_bh, L, o_m[:, None], o_n[None, :])
        if ATTN == 0:
            b_ds = tl.where(m_valid, tl.exp(b_s - b_stat[:, None]), 0.) * (b_dp - b_delta[:, None]) * scale
        else:
            b_ds = tl.where(m_valid, _activation_grad(b_s, ATTN, MU, SIGMA) * b_dp, 0.) * (scale * b_stat)[:, None]
        b_dq += tl.dot(b_ds.to(b_k.dtype), b_k, input_precision=DOT_PREC)
    tl.store(dq_ptr + (i_bh * L + o_m[:, None]) * K + o_k[None, :], b_dq.to(dq_ptr.dtype.element_ty),
             mask=m_rows[:, None] & m_k[None, :])


def fold_span_partials(part: torch.Tensor, batch: int, n_chunks: int, per_head: bool, chunk: int,
                       span: int) -> torch.Tensor:
    """Sum the split backward's per-program diagonal partials into the [H or 1, 2C-1] bias gradient, without atomics.

    part [B H, chunks x R, C + span], R spans per chunk (C / span, or every span when one chunk holds the
    sequence): the row of the program whose keys start at n0 holds diagonal j - i at (C - 1) - n0 % C + (j - i),
    so its tap (C - 1) + (j - i) is the row index plus r span, r = (n0 % C) / span. Rows of one r are summed over
    the batch (and the heads, for a shared bias) and the chunks, then each r is shifted by r span through a strided
    view of a zeroed buffer and the r are summed: deterministic."""
    W = chunk + span
    R = part.shape[1] // n_chunks
    p = part.view(batch, -1, n_chunks, R, W)  # [B, H, chunks, R, W]
    p = p.sum((0, 2)) if per_head else p.sum((0, 1, 2)).unsqueeze(0)  # [G, R, W]
    G, width = p.shape[0], max(R * span + W, 2 * chunk)
    buf = p.new_zeros(G, R, width)
    # (g, r, x) -> row r, column r span + x: the row stride grows by span; r span + x < width for x < W
    buf.as_strided((G, R, W), (R * width, width + span, 1)).copy_(p)
    return buf.sum(1)[:, :2 * chunk - 1]


def fold_ds_tiles(tiles: torch.Tensor, batch: int, per_head: bool) -> torch.Tensor:
    """The bias gradient from the first pass's ds tiles summed by tile diagonal (`DS_TILES`): tiles [B H, 2 T - 1,
    S, S], slot d holding the sum of the [keys, queries] tiles whose key tile starts (d - (T - 1)) S right of their
    query tile, T = C / S tiles a chunk. The bias is Toeplitz, so an element (c, r) of slot d is tap
    (C - 1) + (d - (T - 1)) S + c - r = d S + (S - 1) + c - r. Each slot's diagonals are summed by skewing its
    [queries, keys] views (`diagonal_sums`), then the slots' 2S - 1 sums are added at stride S. Deterministic, a
    few passes over the slots: [H or 1, 2C-1]."""
    BH, n_d, S, _ = tiles.shape
    t = tiles.view(batch, BH // batch, n_d, S, S)
    t = t.sum(0) if per_head else t.sum((0, 1)).unsqueeze(0)  # [G, 2T-1, S, S]
    G = t.shape[0]
    diag = diagonal_sums(t.transpose(-1, -2))  # [G, 2T-1, 2S-1]: index s holds c - r = s - (S - 1), its tap d S + s
    out = torch.zeros(G, n_d + 1, S, device=tiles.device, dtype=tiles.dtype)
    out[:, :n_d] += diag[..., :S]
    out[:, 1:, :S - 1] += diag[..., S:]
    return out.view(G, -1)[:, :n_d * S + S - 1]


def tiles_in_one_chunk(C: int, BLOCK_M: int, BLOCK_N: int, span: int | None = None) -> bool:
    """Whether every [BLOCK_M queries, BLOCK_N keys] tile of a launch lies inside one chunk: query tiles start at
    chunk starts (or at multiples of BLOCK_M) and key tiles at chunk starts or multiples of `span` (the backward's
    key span), so both tile sizes must divide C. Then the kernels skip the per-pair chunk test and read the bias
    without an index select (`_bias_and_mask`)."""
    return C % BLOCK_M == 0 and C % BLOCK_N == 0 and (span is None or span % BLOCK_N == 0)


def packed_tile_mode(C: int, causal: bool, BLOCK_M: int, BLOCK_N: int, span: int | None = None) -> int:
    """`tile_mode` for a packed sequence (`local_attention_fwd`'s rows): 2 where not causal and every tile lies in
    the one chunk, though a row's count need not end on a tile. No score is masked then. The rows past the count
    are zero-weighted in the backward by their stat (+inf, the rows' loads being masked), and the forward
    does not store them. Of the keys past the count, those the forward reads sit in the one tile holding the
    count, which masks them (a branch on the tile, taken once a row). In the backward their dk and dv are not
    stored, their k (0) adds nothing to dq, and the tile holding the count zeroes their ds before the bias gradient.
    With every slot active the masked route took 1.21x (forward) and 1.14x (backward) of MEGA's time at B2 L16384
    on an H200; without the masks its forward went from 1.185 to 1.056 ms (docs/benchmarks.md)."""
    if not tiles_in_one_chunk(C, BLOCK_M, BLOCK_N, span):
        return 0
    return 1 if causal else 2


def _tile_mode(C: int, L: int, causal: bool, mask, rows, BLOCK_M: int, BLOCK_N: int, span: int | None = None) -> int:
    """The launchers' tile mode: `packed_tile_mode` for a packed sequence, else `tile_mode`."""
    if rows is not None:
        return packed_tile_mode(C, causal, BLOCK_M, BLOCK_N, span)
    return tile_mode(C, L, causal, mask is not None, BLOCK_M, BLOCK_N, span)


def tile_mode(C: int, L: int, causal: bool, has_mask: bool, BLOCK_M: int, BLOCK_N: int,
              span: int | None = None) -> int:
    """The kernels' ALIGNED flag: 0, tiles may straddle chunks; 1, every tile lies inside one chunk
    (`tiles_in_one_chunk`); 2, also every pair in every tile is valid, so no score needs masking: the sequence is
    whole chunks (L a multiple of C, which makes every key and query range end on a tile boundary), attention is not
    causal and no key is masked."""
    if not tiles_in_one_chunk(C, BLOCK_M, BLOCK_N, span):
        return 0
    return 2 if L % C == 0 and not causal and not has_mask else 1


@functools.lru_cache(maxsize=None)
def _flags(attention: str, causal: bool, has_bias: bool, per_head: bool, has_mask: bool, packed: bool,
           dropout: bool, fp32: bool) -> dict:
    return dict(ATTN=ATTN_CODES[attention], CAUSAL=causal, HAS_BIAS=has_bias, BIAS_PER_HEAD=per_head,
                HAS_MASK=has_mask, PACKED=packed, DROPOUT=dropout, DOT_PREC="ieee" if fp32 else "tf32",
                MU=LAPLACE_MU, SIGMA=LAPLACE_SIGMA)


def _fwd_config(C: int, K: int, V: int) -> dict:
    """Forward tiles: 64 x 64 score tiles, values in blocks of up to 128 (the best or within 8% of it for K, V in
    64-256 at C = 128 on the H200, docs/benchmarks.md). Long spans with wide values (MEGA's full attention, K 64,
    V 256) take 64 queries and the whole value row per program: 0.40 vs 0.68 ms at B8 L4096 on an H100 (128 queries
    with 8 warps took 0.407 ms against 0.366, docs/benchmarks.md, "Long-span attention backward")."""
    if C > 128 and K <= 64 and V >= 256:
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=max(16, triton.next_power_of_2(K)), BLOCK_V=256, num_warps=4,
                    num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=max(16, triton.next_power_of_2(K)),
                BLOCK_V=min(128, max(16, triton.next_power_of_2(V))), num_warps=4, num_stages=2)


# The backward of long spans with K <= 64 and values wider than 128 (MEGA's full attention, K 64, V 160-256), in
# two passes. The first goes once over each key span with the whole value row (no score tile recomputed per value
# block, no dq kernel recomputing dp): dk, dq added by atomics, the bias gradient by ds tiles (`DS_TILES_MAX_BYTES`).
# The second, `dv_pass`, recomputes the weights from q, k and the saved stat and sums dv = p^T do. Without the
# [keys, 256] float32 dv accumulator the first pass fits 64-query tiles, which take the ds tiles (or the bias
# gradient's carried tile); holding it, one pass needs 32-query tiles (`LONG_SPAN_K64_ONE_PASS`). H100 sweep at K 64,
# V 256 (docs/benchmarks.md, "Two-pass long-span backward"): 1.142 against 1.314 ms for one pass at B8 L4096, 4.270
# against 5.019 ms at B2 L16384. The first pass's key spans of 128 with 8 warps (two warp groups of 64 keys sharing
# each query tile's loads and dq atomics) against 64 with 4, with the ds tiles, on an H200: 0.961 -> 0.911 ms at B8
# L4096 and 3.58 -> 3.39 ms at B2 L16384 (2 stages, 32-query tiles or 4 warps slower; 256 keys exceed shared memory).
# Where dq is added by atomics, the first pass adds its ds tiles by atomics into one [64, 64] slot per tile diagonal
# and `fold_ds_tiles` sums their diagonals afterwards, in place of the rotated, carried tile (`CARRY`), up to this
# many bytes of slots (16 MB at B2 L16384 or B8 L4096, one head). H200 (docs/benchmarks.md): MEGA's backward 1.070 ->
# 0.987 ms at B8 L4096, 4.10 -> 3.65 ms at B2 L16384.
DS_TILES_MAX_BYTES = 1 << 26
# A packed sequence (SeqBoat-full's rows) runs both backward passes in pieces of this many queries a program.
PACKED_PIECE_QUERIES = 2048
LONG_SPAN_K64 = dict(span=128, BLOCK_M=64, BLOCK_V_MAX=256, num_warps=8, num_stages=1, dq_atomic=True,
                     ds_tiles=True, dv_pass=dict(BLOCK_M=64, BLOCK_N=64, BLOCK_V_MAX=256, num_warps=4, num_stages=2))
# Spans of 64 with 4 warps, the tiles before: for float32 inputs, whose 128-key tiles need 256 KB of shared memory
# (an H200 has 227 KB), and where the bias gradient's ds slots would pass `DS_TILES_MAX_BYTES`, whose fallback (the
# carried tile, square tiles) was measured at these tiles only
LONG_SPAN_K64_SPAN64 = dict(LONG_SPAN_K64, span=64, num_warps=4)
# Values of at most `DV_PASS_MIN_V` (128) keep dv in the one pass, with 32-query tiles.
LONG_SPAN_K64_ONE_PASS = dict(span=64, BLOCK_M=32, BLOCK_V_MAX=256, num_warps=4, num_stages=1, dq_atomic=True)
# Chunks longer than a span but shorter than the sequence (MEGA-chunk with C > 128) keep the dq kernel and the bias
# atomics, as measured before the one-pass path existed (docs/benchmarks.md); the one-pass path was timed at full
# length only.
SPLIT_SPAN_K64 = dict(span=64, BLOCK_M=64, BLOCK_V_MAX=128, num_warps=4, num_stages=1)
# ... except with narrow values (V <= 64, MEGA-chunk's and the anchors' D 64), where the one-pass kernel with 64
# queries per tile (dq by atomics, the bias gradient by atomics as the chunk is shorter than the sequence) is faster:
# backward 0.342 vs 0.388 ms at B8 H4 L4096 C256 and 1.101 vs 1.317 ms at B8 H1 L16384 C1024 (H100, bf16).
SPLIT_SPAN_K64_NARROW = dict(span=64, BLOCK_M=64, BLOCK_V_MAX=256, num_warps=4, num_stages=1, dq_atomic=True)


def _bwd_config(C: int, K: int, V: int) -> dict:
    """Backward tiles, from the H200 and H100 sweeps in docs/benchmarks.md. `span` is the key span a program owns:
    the largest multiple of C up to it when C <= span (one fused kernel), else the span itself (dq + dk/dv kernels,
    or one pass with dq by atomics where `dq_atomic`)."""
    if C <= 128 and K <= 64 and V <= 64:  # H100 sweep at C 128 D 64: 49.0 us against 57.1 for 32 x 4 warps x 2 stages
        return dict(span=128, BLOCK_M=64, BLOCK_V_MAX=128, num_warps=8, num_stages=1)
    if C <= 128 and K <= 128 and V <= 128:
        return dict(span=128, BLOCK_M=32, BLOCK_V_MAX=128, num_warps=8, num_stages=2)
    if C <= 128 and K <= 64 and V <= 256:
        return dict(span=128, BLOCK_M=32, BLOCK_V_MAX=256, num_warps=8, num_stages=2)
    if K <= 64:  # long spans (MEGA's full attention); docs/benchmarks.md has the sweep
        if V <= DV_PASS_MIN_V:
            return dict(LONG_SPAN_K64_ONE_PASS)
        return dict(LONG_SPAN_K64, dv_pass=dict(LONG_SPAN_K64["dv_pass"]))
    return dict(span=64, BLOCK_M=64 if max(K, V) <= 64 else 32, BLOCK_V_MAX=128, num_warps=4, num_stages=2)


def _ds_slot_bytes(bh: int, C: int, BLOCK_M: int) -> int:
    """The bias gradient's ds slots of `bh` rows: [2 T - 1, BLOCK_M, BLOCK_M] float32 each, T = cdiv(C, BLOCK_M)."""
    return bh * (2 * triton.cdiv(C, BLOCK_M) - 1) * BLOCK_M * BLOCK_M * 4


def _default_bwd_tiles(C: int, L: int, K: int, V: int, dtype: torch.dtype, bh: int = 1,
                       bias_grad: bool = False) -> dict:
    """The backward's tiles when the caller gives none: `_bwd_config`'s, with the long-span tiles of full attention
    kept for one chunk holding the sequence (shorter chunks take the split tiles), and their spans of 64 for float32
    and for a bias gradient whose ds slots (bh rows of [2 T - 1, 64, 64] float32) pass `DS_TILES_MAX_BYTES`."""
    cfg = _bwd_config(C, K, V)
    if cfg in (LONG_SPAN_K64, LONG_SPAN_K64_ONE_PASS) and C < L:
        return dict(SPLIT_SPAN_K64_NARROW if V <= 64 else SPLIT_SPAN_K64)
    if cfg == LONG_SPAN_K64:
        slots = _ds_slot_bytes(bh, C, LONG_SPAN_K64["BLOCK_M"])
        if dtype == torch.float32 or (bias_grad and slots > DS_TILES_MAX_BYTES):
            return dict(LONG_SPAN_K64_SPAN64, dv_pass=dict(LONG_SPAN_K64_SPAN64["dv_pass"]))
    return cfg


def _query_pieces(L: int, block: int, piece_queries: int | None) -> tuple[int, int]:
    """The backward kernels' N_PIECES and PIECE over L's query tiles of `block`: pieces of `piece_queries` queries
    (at least one tile), or where it is None one piece of every tile, with one to spare for a range that starts on
    the tile below its first row (the dv pass rounds it down)."""
    tiles = triton.cdiv(L, block)
    if piece_queries is None:
        return 1, tiles + 1
    piece = max(1, piece_queries // block)
    return triton.cdiv(tiles, piece), piece


def _flag_args(q, v, attention, causal, bias, mask, rows, dropout) -> dict:
    return _flags(attention, causal, bias is not None, bias is not None and bias.shape[0] > 1, mask is not None,
                  rows is not None, dropout > 0, q.dtype == torch.float32)


def _check_rows(rows, attention: str, chunk: int, q: torch.Tensor, mask, dropout: float) -> tuple:
    """The kernels' idx and count arguments: `rows` (SeqBoat-full's packed sequence, ops/sparse_local_attention) or
    placeholders. Packed rows are for one head's full-length softmax attention without a key mask or dropout."""
    B, H, L, _ = q.shape
    if rows is None:
        return None, None
    idx, count = rows
    if attention != "softmax" or chunk < L or H != 1 or mask is not None or dropout > 0:
        raise ValueError(f"rows (a packed sequence) needs one head's full-length softmax attention without a key "
                         f"mask or dropout; got attention={attention!r}, chunk={chunk} for L={L}, H={H}, "
                         f"mask={mask is not None}, dropout={dropout}")
    for name, t, shape in (("idx", idx, (B, L)), ("count", count, (B,))):
        if t.shape != shape or t.dtype != torch.int32 or t.device != q.device or not t.is_contiguous():
            raise ValueError(f"rows' {name} must be a contiguous int32 {list(shape)} tensor on {q.device}; got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
    return idx, count


def _seed_arg(seed: torch.Tensor | None, dropout: float, placeholder: torch.Tensor) -> torch.Tensor:
    """The seed pointer the kernels take: `seed` with dropout (which needs one), else any tensor (never read)."""
    if dropout > 0 and (seed is None or seed.device != placeholder.device or seed.numel() != 1):
        raise ValueError(f"attention dropout={dropout} needs its Philox seed as a one-element tensor on "
                         f"{placeholder.device}; got {None if seed is None else (tuple(seed.shape), seed.device)}")
    return seed if dropout > 0 else placeholder


def local_attention_fwd(q, k, v, bias, mask, *, attention: str, causal: bool, chunk: int, scale: float,
                        dropout: float = 0.0, seed: torch.Tensor | None = None, cfg: dict | None = None,
                        rows: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Launch the forward kernel. q, k [B, H, L, K], v [B, H, L, V] contiguous; bias [H or 1, 2C-1] float32 or
    None; mask [B, L] uint8 or None; dropout on the weights with the Philox `seed` (an int64 [1] tensor on q's
    device, read by the kernels; required when dropout > 0); cfg overrides `_fwd_config`. rows: None, or (idx
    [B, L], count [B]) int32 for one head's full-length softmax attention over a packed sequence (SeqBoat-full,
    ops/sparse_local_attention): q, k, v hold row b's sequence in slots 0 .. count[b] - 1 (the bias is by slot
    distance; later slots take no part, and no program computes a tile past them), and the output of slot j is
    written at position idx[b, j] of o and stat, which are zeros elsewhere.
    Returns o [B, H, L, V] and stat [B, H, L] float32 (log-sum-exp for softmax, 1/n for relu2 / laplace)."""
    B, H, L, K = q.shape
    V = v.shape[-1]
    idx, count = _check_rows(rows, attention, chunk, q, mask, dropout)
    cfg = cfg or _fwd_config(chunk, K, V)
    o = torch.empty_like(v) if rows is None else torch.zeros_like(v)
    stat = (torch.empty if rows is None else torch.zeros)(B, H, L, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(L, cfg["BLOCK_M"]), B * H, triton.cdiv(V, cfg["BLOCK_V"]))
    flags = _flag_args(q, v, attention, causal, bias, mask, rows, dropout)  # from the bias itself, before any table
    table = bias is not None and use_bias_table(chunk, cfg["BLOCK_M"], cfg["BLOCK_N"])
    if table:
        bias = bias_table(bias, chunk, cfg["BLOCK_M"], cfg["BLOCK_N"])
    _local_attention_fwd_kernel[grid](q, k, v, o, stat, bias if bias is not None else stat,
                                      mask if mask is not None else stat, idx if idx is not None else stat,
                                      count if count is not None else stat, H, L, K, V, chunk, scale,
                                      _seed_arg(seed, dropout, stat), dropout, **flags,
                                      ALIGNED=_tile_mode(chunk, L, causal, mask, rows, cfg["BLOCK_M"],
                                                         cfg["BLOCK_N"]), TABLE=table,
                                      **cfg)
    return o, stat


def local_attention_bwd(q, k, v, o, stat, do, bias, mask, *, attention: str, causal: bool, chunk: int,
                        scale: float, dropout: float = 0.0, seed: torch.Tensor | None = None, bias_grad: bool = True,
                        cfg: dict | None = None, rows: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Launch the backward: one kernel when a key span holds whole chunks; else the dq kernel then the dk/dv
    kernel, or (`dq_atomic`) one pass over each key span with dq by atomics, followed by the dv kernel where the
    config has a `dv_pass`; cfg overrides `_bwd_config`. rows as `local_attention_fwd`'s (on the one pass with dq
    by atomics only): q, k, v, o, stat and do in slot order, dq, dk, dv written at the positions idx[b, j] and zero
    elsewhere, dq left in float32 for the caller's one cast. A `dv_pass` entry's `table=False` makes the dv pass
    gather its bias as the first pass does, and with the ds tiles a config's `stagger` (default span / BLOCK_M + 1)
    makes key span i start its walk over the query blocks at block stagger x i (the A/Bs of docs/benchmarks.md).
    A config's `piece_queries` (by default `PACKED_PIECE_QUERIES` with rows, else None: the whole range) runs both
    passes of the one-chunk, two-pass path in pieces of that many queries a program, dk and dv then by float32
    atomics (with the ds tiles or no bias gradient); a `dv_pass` entry's own `piece_queries` sets the dv pass's.
    Returns dq, dk, dv (input dtype) and dbias [H or 1, 2C-1] float32 (None without a bias, or when bias_grad is
    False)."""
    B, H, L, K = q.shape
    V = v.shape[-1]
    idx, count = _check_rows(rows, attention, chunk, q, mask, dropout)
    cfg = cfg or _default_bwd_tiles(chunk, L, K, V, q.dtype, B * H, bias is not None and bias_grad)
    flags = _flag_args(q, v, attention, causal, bias, mask, rows, dropout)
    seed_arg = _seed_arg(seed, dropout, stat)
    fused = chunk <= cfg["span"]
    if rows is not None and (fused or not cfg.get("dq_atomic", False)):
        raise ValueError(f"rows (a packed sequence) run on the long-span backward with dq by atomics; the tiles "
                         f"{cfg} for C={chunk} take another path")
    span = chunk * (cfg["span"] // chunk) if fused else cfg["span"]
    BLOCK_N, BLOCK_K = triton.next_power_of_2(span), max(16, triton.next_power_of_2(K))
    BLOCK_V = min(cfg["BLOCK_V_MAX"], max(16, triton.next_power_of_2(V)))
    BLOCK_M = cfg["BLOCK_M"]
    n_spans = triton.cdiv(L, span)
    bias_grad = bias is not None and bias_grad
    dq_atomic = not fused and cfg.get("dq_atomic", False)
    # two passes (dq_atomic paths with a `dv_pass` entry): dv by its own kernel, the rest without it
    dv_cfg = cfg.get("dv_pass") if dq_atomic else None
    # dq_atomic: dq is summed in float32 by atomics, then cast
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if dq_atomic else torch.empty_like(q)
    # split paths: a partial per program where the spans tile every chunk or one chunk holds the sequence (else
    # atomics), and where query and key tiles are of one size the ds tiles (dq by atomics, `fold_ds_tiles`) or else
    # the carried tile (`_local_attention_bwd_kernel`)
    square = bias_grad and not fused and BLOCK_N == BLOCK_M
    # the ds tiles: square tiles, or key spans of whole query tiles where the tiles ask for them (`ds_tiles=True`, as
    # `LONG_SPAN_K64`: only those were measured), over spans that tile each chunk or one chunk holding the sequence
    # (its tiles past L hold zeros: masked pairs have ds = 0); slots of [BLOCK_M, BLOCK_M], n_t a chunk
    n_t = triton.cdiv(chunk, BLOCK_M)
    asked = cfg.get("ds_tiles")  # True, None (square tiles only) or False (never)
    ds_tiles = (bias_grad and not fused and dq_atomic and BLOCK_N == span and asked is not False
                and (BLOCK_N == BLOCK_M or (asked and BLOCK_N % BLOCK_M == 0))
                and (chunk % BLOCK_N == 0 or chunk >= L)
                and _ds_slot_bytes(B * H, chunk, BLOCK_M) <= DS_TILES_MAX_BYTES)
    carry = square and not ds_tiles
    # pieces of the query range (full length, both passes, dk and dv by atomics): `piece_queries` in the config, by
    # default `PACKED_PIECE_QUERIES` for a packed sequence and none otherwise
    piece_q = cfg.get("piece_queries", PACKED_PIECE_QUERIES if rows is not None else None)
    n_pieces, piece = _query_pieces(L, BLOCK_M, piece_q)
    pieces = n_pieces > 1 and dq_atomic and dv_cfg is not None and chunk >= L and (ds_tiles or not bias_grad)
    if pieces:
        dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
        dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
    else:
        n_pieces, piece = _query_pieces(L, BLOCK_M, None)
        dk, dv = ((torch.empty_like(k), torch.empty_like(v)) if rows is None
                  else (torch.zeros_like(k), torch.zeros_like(v)))
    span_part = (bias_grad and not fused and not ds_tiles and BLOCK_N == span
                 and (chunk % span == 0 or chunk >= L))
    dbias = None
    if bias_grad:
        # fused: one partial per program, indexed by (j - i) + BLOCK_N; ds_tiles: ds tiles summed by tile
        # diagonal; span_part: one partial per program, C + BLOCK_N wide; else atomics into a zeroed [H or 1, 2C-1]
        if ds_tiles:
            dbias = torch.zeros(B * H, 2 * n_t - 1, BLOCK_M, BLOCK_M, device=q.device, dtype=torch.float32)
        elif fused:
            dbias = torch.empty(B * H * n_spans, 2 * BLOCK_N, device=q.device, dtype=torch.float32)
        elif span_part:
            dbias = torch.zeros(B * H, triton.cdiv(L, chunk) * triton.cdiv(min(chunk, L), span), chunk + BLOCK_N,
                                device=q.device, dtype=torch.float32)
        else:
            dbias = torch.zeros(bias.shape, device=q.device, dtype=torch.float32)
    bias_arg = bias if bias is not None else stat
    mask_arg = mask if mask is not None else stat
    rows_args = (idx, count) if rows is not None else (stat, stat)
    delta = stat
    if not fused:
        delta = torch.empty_like(stat) if attention == "softmax" else stat
    if dq_atomic:
        if attention == "softmax":
            _delta_kernel[(triton.cdiv(B * H * L, 64),)](o, do, delta, B * H * L, V, BLOCK_R=64,
                                                        BLOCK_V=min(128, max(16, triton.next_power_of_2(V))))
    elif not fused:
        _local_attention_bwd_dq_kernel[(triton.cdiv(L, BLOCK_M), B * H)](
            q, k, v, o, do, stat, delta, bias_arg, mask_arg, dq, H, L, K, V, chunk, scale, seed_arg, dropout,
            **{f: x for f, x in flags.items() if f != "PACKED"},  # never packed (refused above)
            ALIGNED=_tile_mode(chunk, L, causal, mask, rows, BLOCK_M, BLOCK_N), BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    _local_attention_bwd_kernel[(n_spans * n_pieces, B * H, 1 if dv_cfg is not None else triton.cdiv(V, BLOCK_V))](
        q, k, v, o, do, stat, delta, bias_arg, mask_arg, *rows_args, dq, dk, dv, dbias if dbias is not None else stat,
        H, L, K, V, chunk, span, n_pieces, piece, scale, seed_arg, dropout, **flags, FUSED=fused,
        ALIGNED=_tile_mode(chunk, L, causal, mask, rows, BLOCK_M, BLOCK_N, span), BIAS_GRAD=bias_grad,
        DQ_ATOMIC=dq_atomic, SPAN_PART=span_part, CARRY=carry, DS_TILES=ds_tiles, DV=dv_cfg is None,
        DK_ATOMIC=pieces, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V, ONE_V=V <= BLOCK_V,
        STAGGER=cfg.get("stagger", BLOCK_N // BLOCK_M + 1) if ds_tiles else 1, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    if dv_cfg is not None:
        BM2, BN2 = dv_cfg["BLOCK_M"], dv_cfg["BLOCK_N"]
        BV2 = min(dv_cfg["BLOCK_V_MAX"], max(16, triton.next_power_of_2(V)))
        # the forward-shaped dv pass reads its bias tiles from the table as the forward does, each tile transposed
        # to the kernel's [keys, queries]: MEGA's backward 5-6% faster at B8 L4096 and B2 L16384 on an H200
        # (docs/benchmarks.md); the one-pass and dk/dv kernels gained nothing from it
        table = bias is not None and use_bias_table(chunk, BM2, BN2) and dv_cfg.get("table", True)
        dv_bias = bias_table(bias, chunk, BM2, BN2, transposed=True) if table else bias_arg
        # pieces of the query range (where the first pass has them), in this pass's query tiles: the dv pass's own
        # `piece_queries` (None: the whole range), else the first pass's
        n_pieces2, piece2 = _query_pieces(L, BM2, dv_cfg.get("piece_queries", piece_q) if pieces else None)
        _local_attention_bwd_dv_kernel[(triton.cdiv(L, BN2) * n_pieces2, B * H, triton.cdiv(V, BV2))](
            q, k, do, stat, dv_bias, mask_arg, *rows_args, dv, H, L, K, V, chunk, n_pieces2, piece2, scale, seed_arg,
            dropout, **flags, ALIGNED=_tile_mode(chunk, L, causal, mask, rows, BM2, BN2), TABLE=table,
            DV_ATOMIC=n_pieces2 > 1, BLOCK_M=BM2, BLOCK_N=BN2,
            BLOCK_K=BLOCK_K, BLOCK_V=BV2, num_warps=dv_cfg["num_warps"], num_stages=dv_cfg["num_stages"])
    if dq_atomic and rows is None:
        dq = dq.to(q.dtype)
    if pieces:
        dk, dv = dk.to(k.dtype), dv.to(v.dtype)
    if ds_tiles:  # the taps of a chunk of n_t whole tiles; C's are the middle 2C - 1
        dbias = fold_ds_tiles(dbias, B, bias.shape[0] > 1)[:, n_t * BLOCK_M - chunk:n_t * BLOCK_M + chunk - 1]
    if span_part:
        dbias = fold_span_partials(dbias, B, triton.cdiv(L, chunk), bias.shape[0] > 1, chunk, span)
    if bias_grad and fused:
        part = dbias.view(B, H, n_spans, 2 * BLOCK_N)[..., BLOCK_N - (chunk - 1):BLOCK_N + chunk]  # j - i = 1-C..C-1
        dbias = part.sum((0, 2)) if bias.shape[0] > 1 else part.sum((0, 1, 2)).view(1, -1)
    return dq, dk, dv, dbias
