"""Triton kernels of the untruncated MD-EMA convolution as a chunked state-passing scan (MEGA, arXiv:2209.10655,
eq. 2-3), forward and backward, with no FFT and no (D, N, L) tensor.

Per row (one batch element b, one channel d; rows are the transposed input, [B, D, L] contiguous) and EMA
dimension n, with c = coef_out * coef_in and q = decay, the convolution is y[t] = sum_{s<=t} k[t-s] x[s],
k[a] = sum_n c_n q_n^a. Cut the row into chunks of C steps and blocks of J chunks (one loop iteration). For the
chunk starting at t0, position i:

    y[t0 + i] = sum_{i'<=i} k[i-i'] x[t0 + i']          (intra-chunk: a [C, C] Toeplitz matrix T times X)
              + sum_n c_n q_n^(i+1) h_n(t0)              (earlier chunks through the state entering the chunk)
    h_n(t0 + C) = q_n^C h_n(t0) + sum_i q_n^(C-1-i) x[t0 + i]

The block's [C, J] tile X gives T X, the chunk increments S = W X ([N, C] x [C, J]), the J entering states by a
[N, J, J] weighted sum (decay q^C per chunk), and their contribution G H ([C, N] x [N, J]): four small matmuls on
the tensor cores per C * J positions, one state of N floats carried between blocks. Sweeping time backwards
(`REVERSE`) gives the look-ahead half of the bidirectional EMA and, in the backward, the adjoint.

Backward (one program per channel and batch split, the split's rows of that channel, sweeping time
backwards; `batch_splits`): the adjoint state
A_n(t1) = sum_{t>=t1} q_n^(t-t1) dy[t] gives dx (T^T DY plus the state term) and, with the forward pairs split the
same way, the coefficient gradients of sum_{s<=t} dy[t] x[s] k[t-s]:

    dc_n = sum_{s<=t} dy[t] x[s] q_n^(t-s),    dq_n = c_n sum_{s<t} dy[t] x[s] (t-s) q_n^(t-s-1)

Pairs across chunks come from A (and its q-derivative A') at chunk boundaries; pairs inside a chunk from
P = sum over chunks of DY X^T ([C, C]), reduced by the weights q^(i-i') once at the end. Everything is float32 on
chip; the dot products use TF32 for 16-bit inputs and 3xTF32 (float32-accurate) for float32 inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 32  # C: steps per chunk (the Toeplitz tile is C x C)
BLOCK_J = 32  # J: chunks per loop iteration (>= 16, the minimum dot width)
NUM_WARPS = 1  # C, J and the warps: the fastest of scripts/bench/ema_chunked.py's sweep (C, J 16-64, 1-2 warps), H200
BWD_PROGRAMS = 1024  # the backward's target programs per launch (`batch_splits`)


@triton.jit
def _powers(lq, e):
    """q^e = exp2(e log2 q) for exponents e >= 0 (float32; large e underflows to 0)."""
    return tl.exp2(lq * e)


@triton.jit
def _tf32_split(a):
    """a = hi + lo with hi exact in TF32 (the low 13 mantissa bits cleared)."""
    hi = (a.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return hi, a - hi


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    """float32 a @ b: one TF32 product ("tf32", for 16-bit inputs), or three ("3xtf32": hi*hi + hi*lo + lo*hi,
    float32-accurate; written out because triton 3.6's own "tf32x3" compiled these kernels into code that faults
    on an H200)."""
    if PRECISION == "3xtf32":
        a_hi, a_lo = _tf32_split(a)
        b_hi, b_lo = _tf32_split(b)
        out = tl.dot(a_hi, b_lo, input_precision="tf32")
        out += tl.dot(a_lo, b_hi, input_precision="tf32")
        return out + tl.dot(a_hi, b_hi, input_precision="tf32")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _affine(a1, b1, a2, b2):
    """Compose v -> a1 v + b1, then v -> a2 v + b2 (the scan of h_j = a h_{j-1} + b)."""
    return a1 * a2, b1 * a2 + b2


@triton.jit
def _affine_dq(a1, da1, b1, db1, a2, da2, b2, db2):
    """`_affine` on (h, dh/dq) pairs: h_j = a h_{j-1} + b and its derivative dh_j = a dh_{j-1} + da h_{j-1} + db."""
    return a1 * a2, a2 * da1 + da2 * a1, a2 * b1 + b2, a2 * db1 + da2 * b1 + db2


@triton.jit
def _column(t, o_j, j):
    """Column j of a [N, J] tile as an [N] vector."""
    return tl.sum(tl.where(o_j[None, :] == j, t, 0.), axis=1)


@triton.jit
def _ema_chunk_fwd_kernel(x_ptr, y_ptr, k_ptr, c_ptr, q_ptr, L, D, N, row_off,
                          REVERSE: tl.constexpr, ACCUMULATE: tl.constexpr, C: tl.constexpr, J: tl.constexpr,
                          BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    i_d, i_b = tl.program_id(0), tl.program_id(1)
    p_row = (i_b * D + i_d).to(tl.int64) * L
    o_c = tl.arange(0, C)
    o_j = tl.arange(0, J)
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_coef = (i_d + row_off) * N + o_n  # row_off = D selects the look-ahead coefficients
    b_c = tl.load(c_ptr + o_coef, mask=m_n, other=0.)
    b_lq = tl.log2(tl.load(q_ptr + o_coef, mask=m_n, other=0.5))
    o_a = o_c[:, None] - o_c[None, :]
    b_T = tl.load(k_ptr + (i_d + row_off) * C + o_a, mask=o_a >= 0, other=0.)  # [C, C] T[i, i'] = k[i - i']
    b_G = b_c[None, :] * _powers(b_lq[None, :], o_c[:, None] + 1)  # [C, N]  state -> output, c q^(i+1)
    b_W = _powers(b_lq[:, None], C - 1 - o_c[None, :])  # [N, C]  input -> chunk-end state, q^(C-1-i)
    b_Q = _powers(b_lq, C)  # [N] decay over one chunk
    b_Qt = b_Q[:, None] + tl.zeros([BLOCK_N, J], dtype=tl.float32)
    b_h = tl.zeros([BLOCK_N], dtype=tl.float32)  # state entering the previous block's last chunk
    o_t = o_j[None, :] * C + o_c[:, None]  # [C, J] offsets of the block, chunk by chunk
    for t0 in range(0, L, C * J):
        t = t0 + o_t
        m, m_prev = t < L, (t >= C) & (t - C < L)
        if REVERSE:
            p, p_prev = p_row + (L - 1 - t), p_row + (L - 1 - (t - C))
        else:
            p, p_prev = p_row + t, p_row + (t - C)
        b_x = tl.load(x_ptr + p, mask=m, other=0.).to(tl.float32)
        b_xp = tl.load(x_ptr + p_prev, mask=m_prev, other=0.).to(tl.float32)  # each chunk's previous chunk
        # H_j = Q H_(j-1) + S_(j-1): the states entering the block's chunks, one inclusive scan over J columns
        b_s = _dot(b_W, b_xp, PRECISION)  # [N, J] increment of the chunk before chunk j
        b_s = tl.where(o_j[None, :] == 0, b_s + b_Q[:, None] * b_h[:, None], b_s)
        _, b_H = tl.associative_scan((b_Qt, b_s), axis=1, combine_fn=_affine)
        b_y = _dot(b_T, b_x, PRECISION)
        b_y += _dot(b_G, b_H, PRECISION)
        if ACCUMULATE:
            b_y += tl.load(y_ptr + p, mask=m, other=0.).to(tl.float32)
        tl.store(y_ptr + p, b_y.to(y_ptr.dtype.element_ty), mask=m)
        b_h = _column(b_H, o_j, J - 1)


@triton.jit
def _ema_chunk_bwd_kernel(x_ptr, dy_ptr, dx_ptr, k_ptr, c_ptr, q_ptr, dc_ptr, dq_ptr, B, L, D, N, row_off,
                          n_coef, REVERSE: tl.constexpr, ACCUMULATE: tl.constexpr, C: tl.constexpr, J: tl.constexpr,
                          BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    # one program per channel and batch split, looping over the split's rows (b = i_s, i_s + S, ...); its
    # coefficient gradients go to the split's own partial [S, Dk, N] (at i_s * n_coef), summed after: no atomics
    i_d, i_s = tl.program_id(0), tl.program_id(1)
    o_c = tl.arange(0, C)
    o_j = tl.arange(0, J)
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < N
    o_coef = (i_d + row_off) * N + o_n
    b_c = tl.load(c_ptr + o_coef, mask=m_n, other=0.)
    b_lq = tl.log2(tl.load(q_ptr + o_coef, mask=m_n, other=0.5))
    o_a = o_c[None, :] - o_c[:, None]
    b_Tt = tl.load(k_ptr + (i_d + row_off) * C + o_a, mask=o_a >= 0, other=0.)  # [C, C] T^T[r, s] = k[s - r]
    b_Gx = b_c[None, :] * _powers(b_lq[None, :], C - o_c[:, None])  # [C, N]  adjoint -> dx, c q^(C-i)
    b_Wd = _powers(b_lq[:, None], o_c[None, :])  # [N, C]  dy -> adjoint at the chunk's start, q^i
    b_Wd1 = o_c[None, :] * _powers(b_lq[:, None], tl.maximum(o_c[None, :] - 1, 0))  # its q-derivative
    b_Wx = _powers(b_lq[:, None], C - o_c[None, :])  # [N, C]  x -> pair weight with the adjoint, q^(C-i)
    b_Wx1 = (C - o_c[None, :]) * _powers(b_lq[:, None], C - 1 - o_c[None, :])  # its q-derivative
    b_Q = _powers(b_lq, C)  # [N] decay over one chunk, and its q-derivative
    b_Q1 = C * _powers(b_lq, C - 1)
    b_Qt = b_Q[:, None] + tl.zeros([BLOCK_N, J], dtype=tl.float32)
    b_Qt1 = b_Q1[:, None] + tl.zeros([BLOCK_N, J], dtype=tl.float32)
    b_P = tl.zeros([C, C], dtype=tl.float32)  # sum over chunks of dy[i] x[i'] (pairs inside a chunk)
    b_dc = tl.zeros([BLOCK_N], dtype=tl.float32)
    b_dq = tl.zeros([BLOCK_N], dtype=tl.float32)
    o_t = o_j[None, :] * C + o_c[:, None]
    n_blocks = tl.cdiv(L, C * J)
    for i_b in range(i_s, B, tl.num_programs(1)):
        p_row = (i_b * D + i_d).to(tl.int64) * L
        b_A = tl.zeros([BLOCK_N], dtype=tl.float32)  # adjoint entering the next block's first chunk from the right
        b_A1 = tl.zeros([BLOCK_N], dtype=tl.float32)  # its q-derivative
        for i_blk in range(n_blocks):
            t = (n_blocks - 1 - i_blk) * C * J + o_t
            m, m_next = t < L, t + C < L
            if REVERSE:
                p, p_next = p_row + (L - 1 - t), p_row + (L - 1 - (t + C))
            else:
                p, p_next = p_row + t, p_row + (t + C)
            b_x = tl.load(x_ptr + p, mask=m, other=0.).to(tl.float32)
            b_dy = tl.load(dy_ptr + p, mask=m, other=0.).to(tl.float32)
            b_dyn = tl.load(dy_ptr + p_next, mask=m_next, other=0.).to(tl.float32)  # each chunk's next chunk
            # A_j = Q A_(j+1) + Sn_j (Sn_j: the next chunk's dy weighted q^i), and its q-derivative, by one
            # reverse scan over the J columns; the carry enters through the last column
            b_s = _dot(b_Wd, b_dyn, PRECISION)  # [N, J]
            b_s1 = _dot(b_Wd1, b_dyn, PRECISION)
            last = o_j[None, :] == J - 1
            b_s1 = tl.where(last, b_s1 + b_Q1[:, None] * b_A[:, None] + b_Q[:, None] * b_A1[:, None], b_s1)
            b_s = tl.where(last, b_s + b_Q[:, None] * b_A[:, None], b_s)
            _, _, b_Aj, b_Aj1 = tl.associative_scan((b_Qt, b_Qt1, b_s, b_s1), axis=1, combine_fn=_affine_dq,
                                                    reverse=True)
            b_dx = _dot(b_Tt, b_dy, PRECISION)
            b_dx += _dot(b_Gx, b_Aj, PRECISION)
            if ACCUMULATE:
                b_dx += tl.load(dx_ptr + p, mask=m, other=0.).to(tl.float32)
            tl.store(dx_ptr + p, b_dx.to(dx_ptr.dtype.element_ty), mask=m)
            b_u = _dot(b_Wx, b_x, PRECISION)  # [N, J]
            b_u1 = _dot(b_Wx1, b_x, PRECISION)
            b_dc += tl.sum(b_Aj * b_u, axis=1)
            b_dq += tl.sum(b_Aj1 * b_u + b_Aj * b_u1, axis=1)
            b_P += _dot(b_dy, tl.trans(b_x), PRECISION)
            b_A = _column(b_Aj, o_j, 0)
            b_A1 = _column(b_Aj1, o_j, 0)
    # pairs inside a chunk: lag a = i - i' >= 0 weighs q^a (dc) and a q^(a-1) (dq)
    o_a = o_c[:, None] - o_c[None, :]
    for n in range(N):
        lq = tl.log2(tl.load(q_ptr + (i_d + row_off) * N + n))
        w = tl.where(o_a >= 0, _powers(lq, tl.maximum(o_a, 0)), 0.)
        w1 = tl.where(o_a >= 1, o_a.to(tl.float32) * _powers(lq, tl.maximum(o_a - 1, 0)), 0.)
        b_dc = tl.where(o_n == n, b_dc + tl.sum(b_P * w), b_dc)
        b_dq = tl.where(o_n == n, b_dq + tl.sum(b_P * w1), b_dq)
    tl.store(dc_ptr + i_s * n_coef + o_coef, b_dc, mask=m_n)
    tl.store(dq_ptr + i_s * n_coef + o_coef, b_dq * b_c, mask=m_n)


@triton.jit
def _transpose_kernel(src_ptr, dst_ptr, R_in, R_out, S, src_b, src_r, dst_b, dst_s,
                      BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr):
    # dst[b, s, r] = src[b, r, s] for r < R_in, 0 for R_in <= r < R_out (s < S), cast to dst's dtype; src's s and
    # dst's r are unit-stride, the other strides are arguments (a padded destination, or a source read in part)
    i_s, i_r, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    o_s = i_s * BLOCK_S + tl.arange(0, BLOCK_S)
    m_s = o_s[None, :] < S
    b_t = tl.load(src_ptr + i_b.to(tl.int64) * src_b + o_r[:, None] * src_r + o_s[None, :],
                  mask=(o_r[:, None] < R_in) & m_s, other=0.)
    tl.store(dst_ptr + i_b.to(tl.int64) * dst_b + o_s[None, :] * dst_s + o_r[:, None],
             b_t.to(dst_ptr.dtype.element_ty), mask=(o_r[:, None] < R_out) & m_s)


def transpose_into(src: torch.Tensor, dst: torch.Tensor, R_in: int, R_out: int, S: int, src_r: int,
                   dst_s: int) -> None:
    """One tiled pass of `_transpose_kernel`: src [B, >= R_in rows of stride src_r, S] into dst [B, S rows of stride
    dst_s, R_out], zero past R_in. Both contiguous in their last dimension."""
    grid = (triton.cdiv(S, 64), triton.cdiv(R_out, 64), src.shape[0])
    _transpose_kernel[grid](src, dst, R_in, R_out, S, src.stride(0), src_r, dst.stride(0), dst_s, BLOCK_R=64,
                            BLOCK_S=64, num_warps=4)


def transpose(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, R, S] -> [B, S, R] contiguous in `dtype` (default x's), one tiled pass (torch's transpose + contiguous
    measured 6x slower than a copy at [8, 4096, 1024] bf16 on an H200)."""
    x = x.contiguous()
    B, R, S = x.shape
    out = torch.empty(B, S, R, device=x.device, dtype=dtype or x.dtype)
    transpose_into(x, out, R, R, S, S, R)
    return out


def _precision(dtype: torch.dtype) -> str:
    """TF32 for 16-bit inputs (its 10-bit mantissa is below their rounding), 3xTF32 for float32 (`_dot`; "ieee",
    plain float32 FMAs, measured 36x slower in the backward)."""
    return "3xtf32" if dtype in (torch.float32, torch.float64) else "tf32"


def _block_n(N: int) -> int:
    return max(16, triton.next_power_of_2(N))  # tl.dot needs every dimension >= 16; padded rows have c = 0


def ema_chunk_fwd(xt: torch.Tensor, k: torch.Tensor, c: torch.Tensor, q: torch.Tensor, bidirectional: bool, *,
                  out_dtype: torch.dtype, block_j: int = BLOCK_J, num_warps: int = NUM_WARPS,
                  precision: str | None = None) -> torch.Tensor:
    """yt [B, D, L] from xt [B, D, L] (contiguous); k [Dk, C] (the kernel's first C taps: C is the chunk length),
    c and q [Dk, N] float32 contiguous, Dk = 2D if bidirectional. Bidirectional adds the time-reversed sweep with
    the last D coefficient rows (its first tap included: the centre counted twice, as the official code)."""
    B, D, L = xt.shape
    N = c.shape[1]
    prec = precision or _precision(xt.dtype)
    yt = torch.empty(B, D, L, device=xt.device, dtype=torch.float32 if bidirectional else out_dtype)
    meta = dict(C=k.shape[1], J=block_j, BLOCK_N=_block_n(N), PRECISION=prec, num_warps=num_warps)
    _ema_chunk_fwd_kernel[(D, B)](xt, yt, k, c, q, L, D, N, 0, REVERSE=False, ACCUMULATE=False, **meta)
    if bidirectional:
        _ema_chunk_fwd_kernel[(D, B)](xt, yt, k, c, q, L, D, N, D, REVERSE=True, ACCUMULATE=True, **meta)
    return yt


def batch_splits(B: int, D: int) -> int:
    """Programs per channel in the backward: the batch's rows are split between them so that a launch has about
    BWD_PROGRAMS programs, each split summing its own coefficient-gradient partial. One program per channel
    suffices at D = 1024, where the kernels were tuned; at D = 128 (the LRA recipes) its 128 one-warp programs
    left the H100 idle: 0.30 -> 0.165 ms a launch with 8 splits at B8 L4096 (docs/benchmarks.md)."""
    return max(1, min(B, triton.cdiv(BWD_PROGRAMS, D)))


def ema_chunk_bwd(xt: torch.Tensor, dyt: torch.Tensor, k: torch.Tensor, c: torch.Tensor, q: torch.Tensor,
                  bidirectional: bool, *, block_j: int = BLOCK_J, num_warps: int = NUM_WARPS,
                  precision: str | None = None,
                  splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dxt [B, D, L] (float32 if bidirectional, else xt's dtype), dc [Dk, N], dq [Dk, N] float32) for
    `ema_chunk_fwd`'s output gradient dyt. `splits`: programs per channel (default `batch_splits`)."""
    B, D, L = xt.shape
    N = c.shape[1]
    prec = precision or _precision(xt.dtype)
    S = splits or batch_splits(B, D)
    dxt = torch.empty(B, D, L, device=xt.device, dtype=torch.float32 if bidirectional else xt.dtype)
    dc, dq = c.new_empty(S, *c.shape), c.new_empty(S, *c.shape)  # one partial per split
    meta = dict(C=k.shape[1], J=block_j, BLOCK_N=_block_n(N), PRECISION=prec, num_warps=num_warps)
    # the causal half's adjoint runs backwards in time; the look-ahead half's runs forwards
    _ema_chunk_bwd_kernel[(D, S)](xt, dyt, dxt, k, c, q, dc, dq, B, L, D, N, 0, c.numel(), REVERSE=False,
                                  ACCUMULATE=False, **meta)
    if bidirectional:
        _ema_chunk_bwd_kernel[(D, S)](xt, dyt, dxt, k, c, q, dc, dq, B, L, D, N, D, c.numel(), REVERSE=True,
                                      ACCUMULATE=True, **meta)
    return dxt, dc.sum(0), dq.sum(0)
