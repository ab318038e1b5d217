"""Triton kernels for LaS attention (arXiv:2311.16620, section 4.1, eq. 3): a fused pass that scales q and k by the
separable decay factors and smooths V, and a flash-style causal attention with the decay applied per tile.

Tensors are [B, H, L, K]; programs run over (tile of L, B * H). Only `function.py` imports this module, and only when
the Triton backend is chosen.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # host side
_LOG2E = tl.constexpr(1.4426950408889634)  # the same constant, readable inside @triton.jit functions


@triton.jit
def _las_prep_kernel(q, k, v, alpha, q_out, k_out, v_out, L, H, center,
                     s_qb, s_qh, s_ql, s_kb, s_kh, s_kl, s_vb, s_vh, s_vl,
                     K: tl.constexpr, V: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr,
                     BLOCK_V: tl.constexpr, P: tl.constexpr, OFF_LO: tl.constexpr, SCALE_QK: tl.constexpr):
    """q_out = q * exp(-alpha (l - center)), k_out = k * exp(alpha (l - center)) (when SCALE_QK), and
    v_out[l] = (1/P) sum_{w < P} v[l + OFF_LO + w] with zero padding. Inputs may be strided (last dim contiguous);
    outputs are contiguous."""
    i_l, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_l = i_l * BLOCK_L + tl.arange(0, BLOCK_L)
    m_l = o_l < L
    if SCALE_QK:
        b_a = tl.load(alpha + i_h).to(tl.float32) * _LOG2E
        t = o_l.to(tl.float32) - center
        o_k = tl.arange(0, BLOCK_K)
        m_qk = m_l[:, None] & (o_k < K)[None, :]
        b_q = tl.load(q + i_b * s_qb + i_h * s_qh + o_l[:, None] * s_ql + o_k[None, :], mask=m_qk, other=0.)
        b_q = b_q.to(tl.float32) * tl.exp2(-b_a * t)[:, None]
        tl.store(q_out + (i_bh * L + o_l[:, None]) * K + o_k[None, :], b_q.to(q_out.dtype.element_ty), mask=m_qk)
        b_k = tl.load(k + i_b * s_kb + i_h * s_kh + o_l[:, None] * s_kl + o_k[None, :], mask=m_qk, other=0.)
        b_k = b_k.to(tl.float32) * tl.exp2(b_a * t)[:, None]
        tl.store(k_out + (i_bh * L + o_l[:, None]) * K + o_k[None, :], b_k.to(k_out.dtype.element_ty), mask=m_qk)
    o_v = tl.arange(0, BLOCK_V)
    m_v = o_v < V
    b_acc = tl.zeros([BLOCK_L, BLOCK_V], dtype=tl.float32)
    for w in tl.static_range(P):
        o_src = o_l + OFF_LO + w
        m_src = (o_src >= 0) & (o_src < L)
        p_v = v + i_b * s_vb + i_h * s_vh + o_src[:, None] * s_vl + o_v[None, :]
        b_acc += tl.load(p_v, mask=m_src[:, None] & m_v[None, :], other=0.).to(tl.float32)
    tl.store(v_out + (i_bh * L + o_l[:, None]) * V + o_v[None, :], (b_acc / P).to(v_out.dtype.element_ty),
             mask=m_l[:, None] & m_v[None, :])


def las_prep(q: torch.Tensor | None, k: torch.Tensor | None, v: torch.Tensor, alpha: torch.Tensor, pool_size: int,
             offset: int) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Launch `_las_prep_kernel`. q, k: [B, H, L, K] or both None (smoothing only); v: [B, H, L, V]; alpha: [H]
    float32; offset: first window offset (-(P-1)//2 centred, -(P-1) causal, 0 for the causal window's transpose).
    Returns contiguous (q', k', v'), with None where q, k were None."""
    B, H, L, V = v.shape
    scale_qk = q is not None
    K = q.shape[-1] if scale_qk else 16
    if v.stride(-1) != 1:
        v = v.contiguous()
    v_out = torch.empty(B, H, L, V, dtype=v.dtype, device=v.device)
    if scale_qk:
        q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
        q_out = torch.empty(B, H, L, K, dtype=q.dtype, device=q.device)
        k_out = torch.empty(B, H, L, K, dtype=k.dtype, device=k.device)
    else:
        q = k = q_out = k_out = v  # placeholders: the kernel never touches them when SCALE_QK is False
    BLOCK_L = 64 if v.is_cuda else 16
    grid = (triton.cdiv(L, BLOCK_L), B * H)
    _las_prep_kernel[grid](q, k, v, alpha, q_out, k_out, v_out, L, H, (L - 1) / 2,
                           q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                           v.stride(0), v.stride(1), v.stride(2),
                           K=K, V=V, BLOCK_L=BLOCK_L, BLOCK_K=max(16, triton.next_power_of_2(K)),
                           BLOCK_V=max(16, triton.next_power_of_2(V)), P=pool_size, OFF_LO=offset, SCALE_QK=scale_qk)
    return (q_out, k_out, v_out) if scale_qk else (None, None, v_out)


@triton.jit
def _decayed_scores(q_blk, k_blk, o_i, o_j, j_ref, b_na, qk_scale, DIAG: tl.constexpr, DECAY: tl.constexpr,
                    PRECISION: tl.constexpr):
    """scale * exp(-alpha (i - j)) * q_i . k_j for one tile, in log2 units (qk_scale = scale * log2 e). Off the
    diagonal (every i > every j) the decay is rebased on j_ref = j0 + BLOCK_N - 1 into row and column factors that
    are both <= 1, so no alpha can overflow them; on the diagonal it is computed per element and future keys get
    -inf. b_na = -alpha * log2 e. Returns the logits and the factor d(logit)/d(q.k) (both [BM, BN], float32).
    Without DECAY (q and k already carry the separable factors) the logits are scale * q_i . k_j and the factor is
    the scalar qk_scale."""
    b_s = tl.dot(q_blk, k_blk, input_precision=PRECISION)  # [BM, BN]
    if not DECAY:
        b_g = qk_scale
        b_s = b_s * b_g
        if DIAG:
            b_s = tl.where(o_i[:, None] >= o_j[None, :], b_s, float("-inf"))
    elif DIAG:
        d = o_i[:, None] - o_j[None, :]
        b_g = tl.exp2(b_na * tl.maximum(d, 0).to(tl.float32)) * qk_scale
        b_s = tl.where(d >= 0, b_s * b_g, float("-inf"))
    else:
        b_r = tl.exp2(b_na * (o_i - j_ref).to(tl.float32)) * qk_scale
        b_c = tl.exp2(b_na * (j_ref - o_j).to(tl.float32))
        b_g = b_r[:, None] * b_c[None, :]
        b_s = b_s * b_g
    return b_s, b_g


@triton.jit
def _online_softmax_step(b_s, b_v, b_m, b_l, b_o, PRECISION: tl.constexpr):
    """Fold one tile of log2-domain logits b_s [BM, BN] and values b_v [BN, BV] into the running max, sum, output."""
    b_mn = tl.maximum(b_m, tl.max(b_s, 1))
    b_p = tl.exp2(b_s - b_mn[:, None])
    b_c = tl.exp2(b_m - b_mn)
    b_l = b_l * b_c + tl.sum(b_p, 1)
    b_o = b_o * b_c[:, None] + tl.dot(b_p.to(b_v.dtype), b_v, input_precision=PRECISION)
    return b_mn, b_l, b_o


@triton.jit
def _las_attention_fwd_kernel(q, k, v, alpha, o, lse, L, H, qk_scale,
                              K: tl.constexpr, V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DECAY: tl.constexpr,
                              PRECISION: tl.constexpr):
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    b_na = -tl.load(alpha + i_bh % H).to(tl.float32) * _LOG2E
    i0 = i_m * BLOCK_M
    o_i = i0 + tl.arange(0, BLOCK_M)
    o_k, o_v = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    m_k, m_v = o_k < K, o_v < V
    q += i_bh * L * K
    k += i_bh * L * K
    v += i_bh * L * V
    b_q = tl.load(q + o_i[:, None] * K + o_k[None, :], mask=(o_i < L)[:, None] & m_k[None, :], other=0.)
    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_o = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    for j0 in range(0, i0, BLOCK_N):  # key tiles wholly before the query tile: no mask, rebased decay
        o_j = j0 + tl.arange(0, BLOCK_N)
        b_k = tl.load(k + o_j[None, :] * K + o_k[:, None], mask=m_k[:, None], other=0.)  # [BK, BN]
        b_v = tl.load(v + o_j[:, None] * V + o_v[None, :], mask=m_v[None, :], other=0.)  # [BN, BV]
        b_s, _ = _decayed_scores(b_q, b_k, o_i, o_j, j0 + BLOCK_N - 1, b_na, qk_scale, False, DECAY, PRECISION)
        b_m, b_l, b_o = _online_softmax_step(b_s, b_v, b_m, b_l, b_o, PRECISION)
    for j0 in range(i0, i0 + BLOCK_M, BLOCK_N):  # key tiles on the diagonal: per-element decay, causal mask
        o_j = j0 + tl.arange(0, BLOCK_N)
        m_j = o_j < L
        b_k = tl.load(k + o_j[None, :] * K + o_k[:, None], mask=m_j[None, :] & m_k[:, None], other=0.)
        b_v = tl.load(v + o_j[:, None] * V + o_v[None, :], mask=m_j[:, None] & m_v[None, :], other=0.)
        b_s, _ = _decayed_scores(b_q, b_k, o_i, o_j, j0 + BLOCK_N - 1, b_na, qk_scale, True, DECAY, PRECISION)
        b_s = tl.where(m_j[None, :], b_s, float("-inf"))
        b_m, b_l, b_o = _online_softmax_step(b_s, b_v, b_m, b_l, b_o, PRECISION)
    m_i = o_i < L
    b_o = b_o / b_l[:, None]
    tl.store(o + (i_bh * L + o_i[:, None]) * V + o_v[None, :], b_o.to(o.dtype.element_ty),
             mask=m_i[:, None] & m_v[None, :])
    tl.store(lse + i_bh * L + o_i, b_m + tl.log2(b_l), mask=m_i)  # log2-domain logsumexp


@triton.jit
def _dkdv_step(q, do, lse, delta, dq, b_kt, b_vt, b_dk, b_dv, i0, o_j, j_ref, b_na, qk_scale, L,
               K: tl.constexpr, V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_V: tl.constexpr, DIAG: tl.constexpr, DECAY: tl.constexpr, ONE_PASS: tl.constexpr,
               PRECISION: tl.constexpr):
    """Accumulate one query tile's contribution to dk, dv of a key tile (FlashAttention-2 backward); with ONE_PASS
    also add the tile's share of dq into the float32 buffer `dq` by atomics."""
    o_i = i0 + tl.arange(0, BLOCK_M)
    o_k, o_v = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    m_i = o_i < L
    b_q = tl.load(q + o_i[:, None] * K + o_k[None, :], mask=m_i[:, None] & (o_k < K)[None, :], other=0.)
    b_do = tl.load(do + o_i[:, None] * V + o_v[None, :], mask=m_i[:, None] & (o_v < V)[None, :], other=0.)
    b_lse = tl.load(lse + o_i, mask=m_i, other=float("inf"))
    b_delta = tl.load(delta + o_i, mask=m_i, other=0.)
    b_s, b_g = _decayed_scores(b_q, b_kt, o_i, o_j, j_ref, b_na, qk_scale, DIAG, DECAY, PRECISION)
    b_p = tl.exp2(b_s - b_lse[:, None])  # [BM, BN]; 0 on rows past L (lse = inf) and on future keys (s = -inf)
    b_dv += tl.dot(tl.trans(b_p.to(b_do.dtype)), b_do, input_precision=PRECISION)
    b_dp = tl.dot(b_do, b_vt, input_precision=PRECISION)
    # d(q.k) = P (dP - delta) scale exp(-alpha (i - j)); b_g carries scale log2(e), hence the division
    b_du = (b_p * (b_dp - b_delta[:, None]) * (b_g / _LOG2E)).to(b_q.dtype)
    b_dk += tl.dot(tl.trans(b_du), b_q, input_precision=PRECISION)
    if ONE_PASS:
        b_dq = tl.dot(b_du, tl.trans(b_kt), input_precision=PRECISION)  # [BM, BK]
        tl.atomic_add(dq + o_i[:, None] * K + o_k[None, :], b_dq, mask=m_i[:, None] & (o_k < K)[None, :],
                      sem="relaxed")
    return b_dk, b_dv


@triton.jit
def _las_attention_bwd_dkdv_kernel(q, k, v, alpha, do, lse, delta, dk, dv, dq, L, H, qk_scale,
                                   K: tl.constexpr, V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                   BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DECAY: tl.constexpr,
                                   ONE_PASS: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of keys (BLOCK_N) against every later query tile (BLOCK_M; BLOCK_N a multiple of BLOCK_M). With
    ONE_PASS it also adds dq ([B, H, L, K] float32, zeroed) by atomics, and `_las_attention_bwd_dq_kernel` is not
    run: each score tile is computed once instead of twice."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1)
    b_na = -tl.load(alpha + i_bh % H).to(tl.float32) * _LOG2E
    j0 = i_n * BLOCK_N
    o_j = j0 + tl.arange(0, BLOCK_N)
    o_k, o_v = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    m_j, m_k, m_v = o_j < L, o_k < K, o_v < V
    q += i_bh * L * K
    do += i_bh * L * V
    lse += i_bh * L
    delta += i_bh * L
    dq += i_bh * L * K
    b_kt = tl.load(k + i_bh * L * K + o_j[None, :] * K + o_k[:, None], mask=m_j[None, :] & m_k[:, None], other=0.)
    b_vt = tl.load(v + i_bh * L * V + o_j[None, :] * V + o_v[:, None], mask=m_j[None, :] & m_v[:, None], other=0.)
    b_dk = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    j_ref = j0 + BLOCK_N - 1
    for i0 in range(j0, j0 + BLOCK_N, BLOCK_M):  # query tiles on the diagonal
        b_dk, b_dv = _dkdv_step(q, do, lse, delta, dq, b_kt, b_vt, b_dk, b_dv, i0, o_j, j_ref, b_na, qk_scale, L,
                                K, V, BLOCK_M, BLOCK_K, BLOCK_V, True, DECAY, ONE_PASS, PRECISION)
    for i0 in range(j0 + BLOCK_N, L, BLOCK_M):  # query tiles wholly after the key tile
        b_dk, b_dv = _dkdv_step(q, do, lse, delta, dq, b_kt, b_vt, b_dk, b_dv, i0, o_j, j_ref, b_na, qk_scale, L,
                                K, V, BLOCK_M, BLOCK_K, BLOCK_V, False, DECAY, ONE_PASS, PRECISION)
    tl.store(dk + (i_bh * L + o_j[:, None]) * K + o_k[None, :], b_dk.to(dk.dtype.element_ty),
             mask=m_j[:, None] & m_k[None, :])
    tl.store(dv + (i_bh * L + o_j[:, None]) * V + o_v[None, :], b_dv.to(dv.dtype.element_ty),
             mask=m_j[:, None] & m_v[None, :])


@triton.jit
def _dq_step(k, v, b_q, b_do, b_lse, b_delta, b_dq, j0, o_i, b_na, qk_scale, L,
             K: tl.constexpr, V: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             BLOCK_V: tl.constexpr, DIAG: tl.constexpr, DECAY: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate one key tile's contribution to dq of a query tile."""
    o_j = j0 + tl.arange(0, BLOCK_N)
    o_k, o_v = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    m_j = o_j < L
    b_kt = tl.load(k + o_j[None, :] * K + o_k[:, None], mask=m_j[None, :] & (o_k < K)[:, None], other=0.)
    b_vt = tl.load(v + o_j[None, :] * V + o_v[:, None], mask=m_j[None, :] & (o_v < V)[:, None], other=0.)
    b_s, b_g = _decayed_scores(b_q, b_kt, o_i, o_j, j0 + BLOCK_N - 1, b_na, qk_scale, DIAG, DECAY, PRECISION)
    if DIAG:
        b_s = tl.where(m_j[None, :], b_s, float("-inf"))
    b_p = tl.exp2(b_s - b_lse[:, None])
    b_dp = tl.dot(b_do, b_vt, input_precision=PRECISION)
    b_du = b_p * (b_dp - b_delta[:, None]) * (b_g / _LOG2E)
    b_dq += tl.dot(b_du.to(b_kt.dtype), tl.trans(b_kt), input_precision=PRECISION)
    return b_dq


@triton.jit
def _las_attention_bwd_dq_kernel(q, k, v, alpha, do, lse, delta, dq, L, H, qk_scale,
                                 K: tl.constexpr, V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, DECAY: tl.constexpr,
                                 PRECISION: tl.constexpr):
    """One tile of queries (BLOCK_M) against every earlier key tile (BLOCK_N; BLOCK_M a multiple of BLOCK_N)."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1)
    b_na = -tl.load(alpha + i_bh % H).to(tl.float32) * _LOG2E
    i0 = i_m * BLOCK_M
    o_i = i0 + tl.arange(0, BLOCK_M)
    o_k, o_v = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_V)
    m_i, m_k, m_v = o_i < L, o_k < K, o_v < V
    k += i_bh * L * K
    v += i_bh * L * V
    b_q = tl.load(q + (i_bh * L + o_i[:, None]) * K + o_k[None, :], mask=m_i[:, None] & m_k[None, :], other=0.)
    b_do = tl.load(do + (i_bh * L + o_i[:, None]) * V + o_v[None, :], mask=m_i[:, None] & m_v[None, :], other=0.)
    b_lse = tl.load(lse + i_bh * L + o_i, mask=m_i, other=float("inf"))
    b_delta = tl.load(delta + i_bh * L + o_i, mask=m_i, other=0.)
    b_dq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for j0 in range(0, i0, BLOCK_N):  # key tiles wholly before the query tile
        b_dq = _dq_step(k, v, b_q, b_do, b_lse, b_delta, b_dq, j0, o_i, b_na, qk_scale, L,
                        K, V, BLOCK_N, BLOCK_K, BLOCK_V, False, DECAY, PRECISION)
    for j0 in range(i0, i0 + BLOCK_M, BLOCK_N):  # key tiles on the diagonal
        b_dq = _dq_step(k, v, b_q, b_do, b_lse, b_delta, b_dq, j0, o_i, b_na, qk_scale, L,
                        K, V, BLOCK_N, BLOCK_K, BLOCK_V, True, DECAY, PRECISION)
    tl.store(dq + (i_bh * L + o_i[:, None]) * K + o_k[None, :], b_dq.to(dq.dtype.element_ty),
             mask=m_i[:, None] & m_k[None, :])


# Largest head width for which the backward adds dq by atomics in the dk/dv kernel (`las_attention_bwd`): the atomics
# move [tile, K] float32 a tile pair, which is cheap against recomputing the scores while K is small. On an H100 the
# one-pass backward won in bfloat16 at K 8, 16 and 32 and lost at 64, and lost in float32 (its full-precision dots
# in one kernel) at K 8 (docs/benchmarks.md, LaS records, "narrow heads"): float32 keeps the dq kernel.
ONE_PASS_MAX_K = 32


def _backward_tiles(q: torch.Tensor) -> tuple[int, int, int, int]:
    """Default (outer tile, inner tile, num_warps, num_stages) of the backward kernels. On an H100 (docs/benchmarks.md,
    LaS records): 64 x 64 with 4 warps was the fastest in 16-bit at K 8, 16 and 64 and in float32 at K 8 and 16; in
    float32 with wider heads its tiles spill (K 32: 52.5 ms against 12.0 ms for 64 x 32 at B16 L2048; K 64: 150.8
    against 23.1 ms), so those take 64 x 32 tiles and one stage."""
    if not q.is_cuda:
        return 32, 16, 4, 1
    if q.dtype == torch.float32 and q.shape[-1] > 16:
        return 64, 32, 4, 1
    return 64, 64, 4, 2


def _check_tiles(outer: int, inner: int) -> None:
    """The kernels walk the diagonal in inner tiles of one outer tile, so the outer must be a multiple of the inner
    (else scores on the diagonal would be counted twice or skipped)."""
    if outer % inner:
        raise ValueError(f"LaS attention tiles: the outer tile ({outer}) must be a multiple of the inner ({inner})")


def one_pass_backward(K: int, dtype: torch.dtype) -> bool:
    """Whether `las_attention_bwd` takes dq by atomics from the dk/dv kernel: 16-bit inputs with heads up to
    ONE_PASS_MAX_K wide, unless torch's deterministic algorithms are on (float atomics add in a varying order)."""
    return (K <= ONE_PASS_MAX_K and dtype in (torch.float16, torch.bfloat16)
            and not torch.are_deterministic_algorithms_enabled())


def _launch_args(q: torch.Tensor, v: torch.Tensor) -> dict:
    K, V = q.shape[-1], v.shape[-1]
    return dict(K=K, V=V, BLOCK_K=max(16, triton.next_power_of_2(K)), BLOCK_V=max(16, triton.next_power_of_2(V)),
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32")


def las_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, scale: float,
                      decay: bool = True, config: tuple[int, int, int, int] | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash-style forward. q, k: [B, H, L, K], v: [B, H, L, V] (contiguous), alpha: [H] float32 (read only with
    `decay`; without it the op is plain causal softmax attention). config: (query tile, key tile, num_warps,
    num_stages), the query tile a multiple of the key tile; None picks the device's default. Returns o [B, H, L, V]
    and the log2-domain logsumexp [B, H, L] (float32)."""
    B, H, L, _ = q.shape
    o = torch.empty(B, H, L, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, L, dtype=torch.float32, device=q.device)
    # 64 x 64 tiles, 4 warps: the fastest of a sweep on an H100 at K 8, 16 and 64 (docs/benchmarks.md, LaS records)
    BLOCK_M, BLOCK_N, warps, stages = config or ((64, 64, 4, 3) if q.is_cuda else (32, 16, 4, 1))
    _check_tiles(BLOCK_M, BLOCK_N)
    grid = (triton.cdiv(L, BLOCK_M), B * H)
    _las_attention_fwd_kernel[grid](q, k, v, alpha, o, lse, L, H, scale * LOG2E, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                    DECAY=decay, num_warps=warps, num_stages=stages, **_launch_args(q, v))
    return o, lse


def las_attention_bwd(q, k, v, alpha, o, lse, do, scale: float, decay: bool = True,
                      config: tuple[int, int, int, int] | None = None, one_pass: bool | None = None):
    """Flash-style backward: returns dq, dk, dv (shapes of q, k, v). `delta = rowsum(o * do)` is formed here.
    config: (outer tile, inner tile, num_warps, num_stages) of both kernels; None picks the default for the device
    (scripts/bench/las_attention.py sweeps the alternatives). one_pass: dq by atomics from the dk/dv kernel (each
    score tile computed once) instead of a second kernel that recomputes the scores; None: `one_pass_backward`."""
    B, H, L, K = q.shape
    do = do.contiguous()
    delta = (o.float() * do.float()).sum(-1)  # [B, H, L]
    if one_pass is None:
        one_pass = one_pass_backward(K, q.dtype)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if one_pass else torch.empty_like(q)
    args = dict(_launch_args(q, v), DECAY=decay)
    big, small, warps, stages = config or _backward_tiles(q)
    _check_tiles(big, small)
    _las_attention_bwd_dkdv_kernel[(triton.cdiv(L, big), B * H)](
        q, k, v, alpha, do, lse, delta, dk, dv, dq, L, H, scale * LOG2E, BLOCK_M=small, BLOCK_N=big,
        ONE_PASS=one_pass, num_warps=warps, num_stages=stages, **args)
    if one_pass:
        return dq.to(q.dtype), dk, dv
    _las_attention_bwd_dq_kernel[(triton.cdiv(L, big), B * H)](
        q, k, v, alpha, do, lse, delta, dq, L, H, scale * LOG2E, BLOCK_M=big, BLOCK_N=small,
        num_warps=warps, num_stages=stages, **args)
    return dq, dk, dv
