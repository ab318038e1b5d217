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
from longmixer.ops.common import sm_count
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
def _codewords(codebook, b_z, o_e, m_e, E):
    """The codewords [BN, BE] of codes b_z [BN], gathered from the codebook."""
    return tl.load(codebook + b_z[:, None] * E + o_e[None, :], mask=m_e[None, :], other=0.0)


@triton.jit
def _code_scores(b_q, codebook, codes, rows, o_e, m_e, E, IP: tl.constexpr):
    """q . c_{z_j} for the keys at `rows` (flat [B L] indices): their codewords gathered from the codebook."""
    b_c = _codewords(codebook, tl.load(codes + rows), o_e, m_e, E)
    return tl.dot(b_q, tl.trans(b_c), input_precision=IP)


@triton.jit
def _vq_attention_fwd_kernel(q, k, v, codebook, codes, n_out, u_out, bias, mask, o, lse, L, S, E, H,
                             C: tl.constexpr, CAUSAL: tl.constexpr, LAPLACE: tl.constexpr, HAS_BIAS: tl.constexpr,
                             GLOBAL: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BS: tl.constexpr,
                             BE: tl.constexpr, BH: tl.constexpr, IP: tl.constexpr):
    """One program: BM queries of one block, BH value columns. Scores against the local window tile by tile,
    then against the codebook with the code counts and value sums (LongVQ eq. 18; one online softmax over both
    parts for softmax, plain sums for laplace). L here is the padded length, a multiple of C.

    GLOBAL (bidirectional): the statistics are the whole row's, [B, 1, S(, H)], so each window key is counted
    twice, once as itself and once in its code's sums; the window tile removes the second by weighting key j with
    phi(q.k_j + bias) - phi(q.c_{z_j}) (the window loop below). Otherwise the statistics are per block, of the keys
    outside that block's window (causal: Transformer-VQ's cache)."""
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
        b_sc = b_s
        if GLOBAL:
            b_sc = _code_scores(b_q, codebook, codes, i_b * L + o_j, o_e, m_e, E, IP)
        if LAPLACE:
            b_w = tl.where(m_s, _laplace(b_s), 0.0)
            if GLOBAL:
                b_w -= tl.where(m_s, _laplace(b_sc), 0.0)
            b_acc += tl.dot(b_w.to(b_v.dtype), b_v, input_precision=IP)
        else:
            b_s = tl.where(m_s, b_s, float("-inf"))
            b_mn = tl.maximum(b_m, tl.max(b_s, axis=1))
            if GLOBAL:
                b_sc = tl.where(m_s, b_sc, float("-inf"))
                b_mn = tl.maximum(b_mn, tl.max(b_sc, axis=1))
            b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)
            b_p = tl.exp(b_s - b_ms[:, None])
            if GLOBAL:
                b_p -= tl.exp(b_sc - b_ms[:, None])
            b_alpha = tl.exp(b_m - b_ms)
            b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
            b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=IP)
            b_m = b_mn
    p_stat = i_b * S if GLOBAL else (i_b * NB + blk) * S
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


# Per-kernel tile overrides of `attention_tiles` (each value is capped by the block size, the key width and the
# value width). Chosen on an H100 at the LongVQ Text shape (E 64, H 256, S 256, C 128; docs/benchmarks.md).
# Forward: 32 queries with the whole value row (H <= 256) computes each score tile once (fwd + bwd 0.869 vs 0.936
# ms for 64 queries x 64 values at B8 L4096), codebook tiles of 32 (0.719 vs 0.799 ms for 64 at B2 L16384); 128
# value columns for the dU and statistics kernels. The backward kernels' defaults won every alternative tried.
TILES: dict[str, dict[str, int]] = {"fwd": dict(BM=32, BH=256, BS=32), "dq": {}, "dkv": {}, "du": dict(BH=128),
                                    "sums": dict(BH=128), "prefix": dict(BS=32, BN=128), "du_suffix": dict(BS=32)}


def attention_tiles(block_size: int, E: int, H: int, kernel: str = "fwd") -> dict[str, int]:
    """Tiles and warps of one kernel (a key of `TILES`): BM queries and BN keys per tile (powers
    of two dividing the block size C), BS codes, BE key columns, BH value columns, num_warps."""
    BE = max(16, triton.next_power_of_2(E))
    HP = max(16, triton.next_power_of_2(H))
    t = dict(BM=64, BN=64, BS=64, BE=BE, BH=64, num_warps=4)
    t.update(TILES[kernel])
    t["BM"], t["BN"], t["BH"] = min(t["BM"], block_size), min(t["BN"], block_size), min(t["BH"], HP)
    return t


@triton.jit
def _onehot_sums(v, codes, mask, row0, o_j, o_s, o_h, m_h, H, IP: tl.constexpr):
    """Value sums [BS, BH] and counts [BS] of the real keys o_j (row offset row0) per code o_s: the product of the
    keys' one-hot code tile with their values, exact in any dtype, accumulated in float32."""
    b_z = tl.load(codes + row0 + o_j)
    m_j = tl.load(mask + row0 + o_j) != 0
    b_v = tl.load(v + (row0 + o_j[:, None]) * H + o_h[None, :], mask=m_h[None, :], other=0.0)
    hot = (b_z[None, :] == o_s[:, None]) & m_j[None, :]  # [BS, BN]
    return tl.dot(hot.to(b_v.dtype), b_v, input_precision=IP), tl.sum(hot.to(tl.float32), axis=1)


@triton.jit
def _code_value_sums_kernel(v, codes, mask, u, n, L, S, H, R, BS: tl.constexpr, BN: tl.constexpr,
                            BH: tl.constexpr, IP: tl.constexpr):
    """One program: BS codes x BH value columns of one row's R-key slice g: u[b, g, s] = sum of the real keys' values
    with code s, n[b, g, s] their count. The sum is a product with the [BS, BN] one-hot tile of the keys' codes
    (exact in any dtype), so it runs on tensor cores with float32 accumulation and needs no atomics."""
    i_s, i_h, i_bg = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NG = L // R
    i_b, g = i_bg // NG, i_bg % NG
    o_s = i_s * BS + tl.arange(0, BS)
    o_h = i_h * BH + tl.arange(0, BH)
    m_s, m_h = o_s < S, o_h < H
    b_u = tl.zeros([BS, BH], tl.float32)
    b_n = tl.zeros([BS], tl.float32)
    for j0 in range(g * R, g * R + R, BN):
        b_du, b_dn = _onehot_sums(v, codes, mask, i_b * L, j0 + tl.arange(0, BN), o_s, o_h, m_h, H, IP)
        b_u += b_du
        b_n += b_dn
    p_out = (i_b * NG + g) * S + o_s
    tl.store(u + p_out[:, None] * H + o_h[None, :], b_u, mask=m_s[:, None] & m_h[None, :])
    if i_h == 0:
        tl.store(n + p_out, b_n, mask=m_s)


def _sms(device: torch.device) -> int:
    """The GPU's SM count; 4 under the interpreter, so that the CPU tests take the split paths."""
    return sm_count(device) if device.type == "cuda" else 4


def row_slices(B: int, L: int, block_size: int, tiles: int, device: torch.device) -> int:
    """Rows per slice when one program per (tile, batch row) would leave SMs idle: slices of whole blocks that
    divide L, enough for about two programs per SM (decided from sizes alone)."""
    NB = L // block_size
    slices = max(1, min(NB, triton.cdiv(2 * _sms(device), tiles * B)))
    rows = triton.cdiv(NB, slices) * block_size
    while L % rows:
        rows += block_size
    return rows


def code_value_sums(v: torch.Tensor, codes: torch.Tensor, mask: torch.Tensor, S: int, block_size: int):
    """The whole row's code statistics: n [B, 1, S] and u [B, 1, S, H] float32 (real keys only)."""
    B, L, H = v.shape
    t = attention_tiles(block_size, 16, H, "sums")
    tiles = triton.cdiv(S, t["BS"]) * triton.cdiv(H, t["BH"])
    rows = row_slices(B, L, block_size, tiles, v.device)
    u = torch.empty(B, L // rows, S, H, dtype=torch.float32, device=v.device)
    n = torch.empty(B, L // rows, S, dtype=torch.float32, device=v.device)
    _code_value_sums_kernel[(triton.cdiv(S, t["BS"]), triton.cdiv(H, t["BH"]), B * (L // rows))](
        v, codes, mask, u, n, L, S, H, rows, BS=t["BS"], BN=t["BN"], BH=t["BH"], IP=dot_precision(v.dtype),
        num_warps=t["num_warps"])
    if L // rows == 1:
        return n, u
    return n.sum(1, keepdim=True), u.sum(1, keepdim=True)


@triton.jit
def _code_value_prefix_kernel(v, codes, mask, u, n, L, S, H, C: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                              BH: tl.constexpr, IP: tl.constexpr):
    """Causal statistics, Transformer-VQ's cache: u[b, blk, s] = sum of the real keys' values with code s in blocks
    0..blk-2, n the count. One program per (code tile, value tile, row) walks the blocks in order, keeping the sums
    through the previous block and through the one before it; one-hot products as in `_code_value_sums_kernel`."""
    i_s, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NB = L // C
    o_s = i_s * BS + tl.arange(0, BS)
    o_h = i_h * BH + tl.arange(0, BH)
    m_s, m_h = o_s < S, o_h < H
    b_u, b_u_lag = tl.zeros([BS, BH], tl.float32), tl.zeros([BS, BH], tl.float32)
    b_n, b_n_lag = tl.zeros([BS], tl.float32), tl.zeros([BS], tl.float32)
    for blk in range(0, NB):
        p_out = (i_b * NB + blk) * S + o_s
        tl.store(u + p_out[:, None] * H + o_h[None, :], b_u_lag, mask=m_s[:, None] & m_h[None, :])
        if i_h == 0:
            tl.store(n + p_out, b_n_lag, mask=m_s)
        b_u_lag, b_n_lag = b_u, b_n
        for j0 in range(blk * C, blk * C + C, BN):
            b_du, b_dn = _onehot_sums(v, codes, mask, i_b * L, j0 + tl.arange(0, BN), o_s, o_h, m_h, H, IP)
            b_u += b_du
            b_n += b_dn


def row_walk_tiles(block_size: int, E: int, H: int, kernel: str, B: int, S: int, device: torch.device) -> dict:
    """Tiles of a kernel with one program per (code tile, value tile, batch row) that walks the row's blocks in
    order: half the code tile when that leaves fewer programs than SMs (B2 L16384: 1.21 vs 1.36 ms causal fwd + bwd
    for the backward's walk; B8 L4096 keeps 32 codes, 0.76 ms either way, H100)."""
    t = attention_tiles(block_size, E, H, kernel)
    if triton.cdiv(S, t["BS"]) * triton.cdiv(H, t["BH"]) * B < _sms(device):
        t["BS"] = max(16, t["BS"] // 2)
    return t


def code_value_prefix(v: torch.Tensor, codes: torch.Tensor, mask: torch.Tensor, S: int, block_size: int):
    """Causal statistics per block (keys of blocks 0..b-2): n [B, NB, S] and u [B, NB, S, H] float32."""
    B, L, H = v.shape
    t = row_walk_tiles(block_size, 16, H, "prefix", B, S, v.device)
    NB = L // block_size
    u = torch.empty(B, NB, S, H, dtype=torch.float32, device=v.device)
    n = torch.empty(B, NB, S, dtype=torch.float32, device=v.device)
    _code_value_prefix_kernel[(triton.cdiv(S, t["BS"]), triton.cdiv(H, t["BH"]), B)](
        v, codes, mask, u, n, L, S, H, C=block_size, BS=t["BS"], BN=t["BN"], BH=t["BH"], IP=dot_precision(v.dtype),
        num_warps=t["num_warps"])
    return n, u


def vq_attention_fwd(q, k, v, codebook, codes, bias, mask, block_size: int, causal: bool, laplace: bool):
    """Launcher. q, k [B, L, E]; v [B, L, H]; codebook [S, E]; codes [B, L] int64; bias [C, 3C] float32 or None;
    mask [B, L] bool; L a multiple of block_size.

    Returns o [B, L, H] (v's dtype), lse [B, L] float32 (softmax only; zeros for laplace) and the code statistics
    the kernel read, kept for the backward: n [B, NS, S], u [B, NS, S, H] float32, the whole row's (NS = 1,
    bidirectional, `code_value_sums`) or per block, of blocks 0..b-2 (NS = NB, causal, `code_value_prefix`)."""
    B, L, E = q.shape
    H, S = v.shape[-1], codebook.shape[0]
    stats = code_value_prefix if causal else code_value_sums
    n_out, u_out = stats(v, codes, mask, S, block_size)
    work = work_dtype(v, q, k)
    q, k = q.to(work), k.to(work)
    t = attention_tiles(block_size, E, H)
    o = torch.empty_like(v)
    lse = torch.zeros(B, L, dtype=torch.float32, device=q.device)
    grid = (L // t["BM"], B, triton.cdiv(H, t["BH"]))
    _vq_attention_fwd_kernel[grid](q, k, v, codebook.to(q.dtype).contiguous(), codes, n_out, u_out,
                                   bias if bias is not None else lse, mask, o, lse, L, S, E, H,
                                   C=block_size, CAUSAL=causal, LAPLACE=laplace, HAS_BIAS=bias is not None,
                                   GLOBAL=not causal, IP=dot_precision(q.dtype), **t)
    return o, lse, n_out, u_out
