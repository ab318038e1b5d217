"""Triton kernels for LongVQ's VQ attention (arXiv:2404.11163, section 4): the fused nearest-codeword search with
per-code statistics, and the forward pass of the blockwise VQ attention. The backward kernels are in
`kernel_bwd.py`. The launchers here allocate outputs and pick tiles; autograd lives in `function.py`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from longmixer.ops import common
from longmixer.ops.precision import work_dtype

# MEGA's laplace attention function: 0.5 * (1 + erf((x - mu) / (sigma sqrt 2))), mu = sqrt(1/2), sigma = (4 pi)^-1/2.
LAPLACE_MU = tl.constexpr(common.LAPLACE_MU)
LAPLACE_INV_SIGMA_SQRT2 = tl.constexpr(1.0 / (common.LAPLACE_SIGMA * math.sqrt(2.0)))  # = sqrt(2 pi)


@triton.jit
def _laplace(x):
    return 0.5 * (1.0 + tl.math.erf((x - LAPLACE_MU) * LAPLACE_INV_SIGMA_SQRT2))


@triton.jit
def _vq_search_kernel(k, codebook, c_sq, mask, codes, counts, sums, N, S, E,
                      HAS_MASK: tl.constexpr, WITH_STATS: tl.constexpr,
                      BN: tl.constexpr, BS: tl.constexpr, BE: tl.constexpr, IP: tl.constexpr):
    """One program: BN keys against the whole codebook, tile by tile, keeping a running argmin (LongVQ eq. 5).

    The [BN, BS] distance tile lives in registers only; ||k||^2 is dropped (same for every code)."""
    i_n = tl.program_id(0)
    o_n = i_n * BN + tl.arange(0, BN)
    o_e = tl.arange(0, BE)
    m_n, m_e = o_n < N, o_e < E
    b_k = tl.load(k + o_n[:, None] * E + o_e[None, :], mask=m_n[:, None] & m_e[None, :], other=0.0)  # [BN, BE]
    b_best = tl.full([BN], float("inf"), tl.float32)
    b_code = tl.zeros([BN], tl.int32)
    for s0 in range(0, S, BS):
        o_s = s0 + tl.arange(0, BS)
        m_s = o_s < S
        b_c = tl.load(codebook + o_s[:, None] * E + o_e[None, :], mask=m_s[:, None] & m_e[None, :], other=0.0)
        b_csq = tl.load(c_sq + o_s, mask=m_s, other=float("inf"))  # [BS]
        b_d = b_csq[None, :] - 2.0 * tl.dot(b_k, tl.trans(b_c.to(b_k.dtype)), input_precision=IP)  # [BN, BS]
        b_min = tl.min(b_d, axis=1)
        b_arg = tl.argmin(b_d, axis=1).to(tl.int32) + s0
        better = b_min < b_best  # strict: the first minimal code wins, as torch.argmin
        b_code = tl.where(better, b_arg, b_code)
        b_best = tl.where(better, b_min, b_best)
    tl.store(codes + o_n, b_code, mask=m_n)
    if WITH_STATS:
        m_real = m_n
        if HAS_MASK:
            m_real = m_real & (tl.load(mask + o_n, mask=m_n, other=0) != 0)
        # relaxed: the adds need no ordering among themselves, and acq_rel atomics cost several times more
        tl.atomic_add(counts + b_code, tl.full([BN], 1.0, tl.float32), mask=m_real, sem="relaxed")
        tl.atomic_add(sums + b_code[:, None] * E + o_e[None, :], b_k.to(tl.float32),
                      mask=m_real[:, None] & m_e[None, :], sem="relaxed")


def vq_search_fwd(k: torch.Tensor, codebook: torch.Tensor, mask: torch.Tensor | None, with_stats: bool = True):
    """Launcher: k [N, E], codebook [S, E], mask [N] bool or None -> codes [N] int64, counts [S], sums [S, E]."""
    N, E = k.shape
    S = codebook.shape[0]
    k = k.contiguous()
    codebook = codebook.to(k.dtype).contiguous()
    c_sq = (codebook.float() ** 2).sum(-1).contiguous()
    codes = torch.empty(N, dtype=torch.int32, device=k.device)
    counts = torch.zeros(S, dtype=torch.float32, device=k.device)
    sums = torch.zeros(S, E, dtype=torch.float32, device=k.device)
    BE = max(16, triton.next_power_of_2(E))
    BN = 64 if BE <= 128 else 32
    BS = min(128, max(16, triton.next_power_of_2(S)))
    mask_arg = mask.contiguous() if mask is not None else codes
    # tf32 distances on the GPU: only near ties can resolve differently from an exact search.
    search_precision = "ieee" if k.dtype == torch.float64 else "tf32"
    _vq_search_kernel[(triton.cdiv(N, BN),)](k, codebook, c_sq, mask_arg, codes, counts, sums, N, S, E,
                                             HAS_MASK=mask is not None, WITH_STATS=with_stats,
                                             BN=BN, BS=BS, BE=BE, IP=search_precision)
    return codes.long(), counts, sums


@triton.jit
def _vq_attention_fwd_kernel(q, k, v, codebook, n_out, u_out, bias, mask, o, lse, L, S, E, H,
                             C: tl.constexpr, CAUSAL: tl.constexpr, LAPLACE: tl.constexpr, HAS_BIAS: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr, BE: tl.constexpr,
                             BH: tl.constexpr, IP: tl.constexpr):
    """One program: BM queries of one block, BH value columns. Scores against the local window tile by tile,
    then against the codebook with the outside-window counts and value sums (LongVQ eq. 18; one online softmax
    over both parts for softmax, plain sums for laplace). L here is the padded length, a multiple of C."""
    i_m, i_b, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NB = L // C
    blk = (i_m * BM) // C
    o_i = i_m * BM + tl.arange(0, BM)
    o_e = tl.arange(0, BE)
    o_h = i_h * BH + tl.arange(0, BH)
    m_e, m_h = o_e < E, o_h < H
    m_i = tl.load(mask + i_b * L + o_i) != 0  # [BM]
    b_q = tl.load(q + (i_b * L + o_i[:, None]) * E + o_e[None, :], mask=m_e[None, :], other=0.0)  # [BM, BE]
    b_m = tl.full([BM], float("-inf"), tl.float32)
    b_l = tl.zeros([BM], tl.float32)
    b_acc = tl.zeros([BM, BH], tl.float32)
    j_lo = tl.maximum(blk - 1, 0) * C
    j_hi = tl.minimum(blk + 1, NB - 1) * C + C
    if CAUSAL:
        j_hi = blk * C + C
    for j0 in range(j_lo, j_hi, BN):
        o_j = j0 + tl.arange(0, BN)
        m_j = tl.load(mask + i_b * L + o_j) != 0
        b_k = tl.load(k + (i_b * L + o_j[:, None]) * E + o_e[None, :], mask=m_e[None, :], other=0.0)
        b_v = tl.load(v + (i_b * L + o_j[:, None]) * H + o_h[None, :], mask=m_h[None, :], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=IP)  # [BM, BN]
        if HAS_BIAS:
            col = o_j - (blk - 1) * C
            b_s += tl.load(bias + (o_i % C)[:, None] * (3 * C) + col[None, :])
        m_s = m_i[:, None] & m_j[None, :]
        if CAUSAL:
            m_s = m_s & (o_j[None, :] <= o_i[:, None])
        if LAPLACE:
            b_w = tl.where(m_s, _laplace(b_s), 0.0)
            b_acc += tl.dot(b_w.to(b_v.dtype), b_v, input_precision=IP)
        else:
            b_s = tl.where(m_s, b_s, float("-inf"))
            b_mn = tl.maximum(b_m, tl.max(b_s, axis=1))
            b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)
            b_p = tl.exp(b_s - b_ms[:, None])
            b_alpha = tl.exp(b_m - b_ms)
            b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
            b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=IP)
            b_m = b_mn
    p_stat = (i_b * NB + blk) * S
    for s0 in range(0, S, BS):
        o_s = s0 + tl.arange(0, BS)
        m_sc = o_s < S
        b_c = tl.load(codebook + o_s[:, None] * E + o_e[None, :], mask=m_sc[:, None] & m_e[None, :], other=0.0)
        b_n = tl.load(n_out + p_stat + o_s, mask=m_sc, other=0.0)  # [BS]
        b_u = tl.load(u_out + (p_stat + o_s[:, None]) * H + o_h[None, :], mask=m_sc[:, None] & m_h[None, :],
                      other=0.0)  # [BS, BH] float32
        b_s = tl.dot(b_q, tl.trans(b_c.to(b_q.dtype)), input_precision=IP)  # [BM, BS]
        m_s = m_i[:, None] & (b_n > 0)[None, :]
        if LAPLACE:
            b_w = tl.where(m_s, _laplace(b_s), 0.0)
            b_acc += tl.dot(b_w, b_u, input_precision=IP)
        else:
            b_s = tl.where(m_s, b_s, float("-inf"))
            b_mn = tl.maximum(b_m, tl.max(b_s, axis=1))
            b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)
            b_p = tl.exp(b_s - b_ms[:, None])
            b_alpha = tl.exp(b_m - b_ms)
            b_l = b_l * b_alpha + tl.sum(b_p * b_n[None, :], axis=1)  # code s stands for n_s keys
            b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p, b_u, input_precision=IP)
            b_m = b_mn
    if not LAPLACE:
        b_lpos = tl.where(b_l > 0, b_l, 1.0)
        b_acc = b_acc / b_lpos[:, None]
        if i_h == 0:
            b_lse = tl.where(b_l > 0, tl.where(b_m == float("-inf"), 0.0, b_m) + tl.log(b_lpos), 0.0)
            tl.store(lse + i_b * L + o_i, b_lse)
    b_acc = tl.where(m_i[:, None], b_acc, 0.0)
    tl.store(o + (i_b * L + o_i[:, None]) * H + o_h[None, :], b_acc.to(o.dtype.element_ty), mask=m_h[None, :])


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs keep full precision (parity with the reference); half inputs use tensor cores anyway."""
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def attention_tiles(block_size: int, E: int, H: int) -> dict[str, int]:
    """Tile sizes shared by the forward and backward launchers (BM and BN divide the block size C)."""
    BE = max(16, triton.next_power_of_2(E))
    return dict(BM=min(64, block_size), BN=min(64, block_size), BS=64, BE=BE,
                BH=min(64, max(16, triton.next_power_of_2(H))))


def vq_attention_fwd(q, k, v, codebook, n_out, u_out, bias, mask, block_size: int, causal: bool, laplace: bool):
    """Launcher. q, k [B, L, E]; v [B, L, H]; codebook [S, E]; n_out [B, NB, S] float32; u_out [B, NB, S, H]
    float32; bias [C, 3C] float32 or None; mask [B, L] bool; L a multiple of block_size.

    Returns o [B, L, H] (v's dtype) and lse [B, L] float32 (softmax only; zeros for laplace)."""
    B, L, E = q.shape
    H, S = v.shape[-1], codebook.shape[0]
    work = work_dtype(v, q, k)
    q, k = q.to(work), k.to(work)
    t = attention_tiles(block_size, E, H)
    o = torch.empty_like(v)
    lse = torch.zeros(B, L, dtype=torch.float32, device=q.device)
    grid = (L // t["BM"], B, triton.cdiv(H, t["BH"]))
    _vq_attention_fwd_kernel[grid](q, k, v, codebook.to(q.dtype).contiguous(), n_out, u_out,
                                   bias if bias is not None else lse, mask, o, lse, L, S, E, H,
                                   C=block_size, CAUSAL=causal, LAPLACE=laplace, HAS_BIAS=bias is not None,
                                   IP=dot_precision(q.dtype), **t)
    return o, lse
