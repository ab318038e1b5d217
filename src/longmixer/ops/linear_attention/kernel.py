"""Triton kernels for tiled linear attention with fused output normalization and gate (CHELA section 4.1,
arXiv:2406.08128; tiling after GLA, Yang et al. 2024).

Layout follows FLA: q, k [B, L, H, K], v, g, o [B, L, H, V], contiguous. Each program owns one (batch*head,
segment) pair and walks its segment chunk by chunk (chunk length C), keeping the K x V state in float32
registers: left products (Q K^T masked) V inside a chunk, right products Q S across chunks. When batch*heads is
too small to fill the GPU the sequence is split into segments: a first kernel sums k^T v per segment, a torch
cumsum turns the sums into each segment's starting state, and the segments then run in parallel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _linear_attention_state_kernel(a, b, h, L, NC, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                                   C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                                   DOT_PRECISION: tl.constexpr):
    """h[bh, s] = sum over the chunks of segment s of a_c^T b_c (float32), a [B, L, H, K], b [B, L, H, V]."""
    i_bh, i_s = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    n_s = tl.num_programs(1)
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    for i_c in range(NC):
        t0 = (i_s * NC + i_c) * C
        p_a = tl.make_block_ptr(a + i_b * L * H * K + i_h * K, (L, K), (H * K, 1), (t0, 0), (C, BK), (1, 0))
        p_b = tl.make_block_ptr(b + i_b * L * H * V + i_h * V, (L, V), (H * V, 1), (t0, 0), (C, BV), (1, 0))
        b_a = tl.load(p_a, boundary_check=(0, 1))
        b_b = tl.load(p_b, boundary_check=(0, 1))
        b_h += tl.dot(tl.trans(b_a), b_b, input_precision=DOT_PRECISION)
    p_h = tl.make_block_ptr(h + (i_bh * n_s + i_s) * K * V, (K, V), (V, 1), (0, 0), (BK, BV), (1, 0))
    tl.store(p_h, b_h, boundary_check=(0, 1))


@triton.jit
def _linear_attention_fwd_kernel(q, k, v, g, o, h, s_hbh, s_hs, scale, eps, L, NC, H: tl.constexpr,
                                 K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                                 BV: tl.constexpr, CAUSAL: tl.constexpr, NORMALIZE: tl.constexpr,
                                 USE_GATE: tl.constexpr, LOAD_H: tl.constexpr, DOT_PRECISION: tl.constexpr):
    i_bh, i_s = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    if LOAD_H:
        p_h = tl.make_block_ptr(h + i_bh * s_hbh + i_s * s_hs, (K, V), (V, 1), (0, 0), (BK, BV), (1, 0))
        b_h = tl.load(p_h, boundary_check=(0, 1)).to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    o_c = tl.arange(0, C)
    m_c = o_c[:, None] >= o_c[None, :]
    for i_c in range(NC):
        t0 = (i_s * NC + i_c) * C
        p_q = tl.make_block_ptr(q + i_b * L * H * K + i_h * K, (L, K), (H * K, 1), (t0, 0), (C, BK), (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1))
        b_q = (b_q * scale).to(b_q.dtype)
        b_o = tl.dot(b_q, b_h.to(b_q.dtype), input_precision=DOT_PRECISION)  # inter-chunk: Q_c S
        if CAUSAL:
            p_k = tl.make_block_ptr(k + i_b * L * H * K + i_h * K, (L, K), (H * K, 1), (t0, 0), (C, BK), (1, 0))
            p_v = tl.make_block_ptr(v + i_b * L * H * V + i_h * V, (L, V), (H * V, 1), (t0, 0), (C, BV), (1, 0))
            b_k = tl.load(p_k, boundary_check=(0, 1))
            b_v = tl.load(p_v, boundary_check=(0, 1))
            b_A = tl.where(m_c, tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION), 0.0)
            b_o += tl.dot(b_A.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)  # intra-chunk, masked
            b_h += tl.dot(tl.trans(b_k), b_v, input_precision=DOT_PRECISION)
        if NORMALIZE:  # CHELA eq. 9, Norm: RMS over the head's V real columns (padded columns are zero)
            b_r = tl.rsqrt(tl.sum(b_o * b_o, axis=1) / V + eps)
            b_o = b_o * b_r[:, None]
        if USE_GATE:  # CHELA eq. 9: * G_a
            p_g = tl.make_block_ptr(g + i_b * L * H * V + i_h * V, (L, V), (H * V, 1), (t0, 0), (C, BV), (1, 0))
            b_o = b_o * tl.load(p_g, boundary_check=(0, 1)).to(tl.float32)
        p_o = tl.make_block_ptr(o + i_b * L * H * V + i_h * V, (L, V), (H * V, 1), (t0, 0), (C, BV), (1, 0))
        tl.store(p_o, b_o.to(o.dtype.element_ty), boundary_check=(0, 1))


@triton.jit
def _linear_attention_bwd_dq_kernel(q, k, v, g, do, h, s_hbh, s_hs, dq, dg, dp, p, scale, eps, L, NC,
                                    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
                                    BK: tl.constexpr, BV: tl.constexpr, CAUSAL: tl.constexpr,
                                    NORMALIZE: tl.constexpr, USE_GATE: tl.constexpr, LOAD_H: tl.constexpr,
                                    STORE_P: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Forward walk of the backward: recompute o, back through gate and norm (-> dg and dp = dL/do_raw), dq, and
    the per-segment sum of q^T dp that the dk/dv walk starts from."""
    i_bh, i_s = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    n_s = tl.num_programs(1)
    if LOAD_H:
        p_h = tl.make_block_ptr(h + i_bh * s_hbh + i_s * s_hs, (K, V), (V, 1), (0, 0), (BK, BV), (1, 0))
        b_h = tl.load(p_h, boundary_check=(0, 1)).to(tl.float32)
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    b_p = tl.zeros([BK, BV], dtype=tl.float32)
    o_c = tl.arange(0, C)
    m_c = o_c[:, None] >= o_c[None, :]
    for i_c in range(NC):
        t0 = (i_s * NC + i_c) * C
        o_qk = i_b * L * H * K + i_h * K
        o_v = i_b * L * H * V + i_h * V
        p_q = tl.make_block_ptr(q + o_qk, (L, K), (H * K, 1), (t0, 0), (C, BK), (1, 0))
        p_v = tl.make_block_ptr(v + o_v, (L, V), (H * V, 1), (t0, 0), (C, BV), (1, 0))
        p_do = tl.make_block_ptr(do + o_v, (L, V), (H * V, 1), (t0, 0), (C, BV), (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1))
        b_q = (b_q * scale).to(b_q.dtype)
        b_v = tl.load(p_v, boundary_check=(0, 1))
        b_o = tl.dot(b_q, b_h.to(b_q.dtype), input_precision=DOT_PRECISION)
        if CAUSAL:
            p_k = tl.make_block_ptr(k + o_qk, (L, K), (H * K, 1), (t0, 0), (C, BK), (1, 0))
            b_k = tl.load(p_k, boundary_check=(0, 1))
            b_A = tl.where(m_c, tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION), 0.0)
            b_o += tl.dot(b_A.to(b_v.dtype), b_v, input_precision=DOT_PRECISION)
        b_do = tl.load(p_do, boundary_check=(0, 1)).to(tl.float32)
        if NORMALIZE:
            b_r = tl.rsqrt(tl.sum(b_o * b_o, axis=1) / V + eps)
            b_n = b_o * b_r[:, None]
        else:
            b_n = b_o
        if USE_GATE:
            p_g = tl.make_block_ptr(g + o_v, (L, V), (H * V, 1), (t0, 0), (C, BV), (1, 0))
            p_dg = tl.make_block_ptr(dg + o_v, (L, V), (H * V, 1), (t0, 0), (C, BV), (1, 0))
            tl.store(p_dg, (b_do * b_n).to(dg.dtype.element_ty), boundary_check=(0, 1))
            b_dn = b_do * tl.load(p_g, boundary_check=(0, 1)).to(tl.float32)
        else:
            b_dn = b_do
        if NORMALIZE:  # d/dx of x * rsqrt(mean(x^2) + eps)
            b_dp = b_r[:, None] * (b_dn - b_n * (tl.sum(b_dn * b_n, axis=1) / V)[:, None])
        else:
            b_dp = b_dn
        b_dp = b_dp.to(b_q.dtype)
        p_dp = tl.make_block_ptr(dp + o_v, (L, V), (H * V, 1), (t0, 0), (C, BV), (1, 0))
        tl.store(p_dp, b_dp.to(dp.dtype.element_ty), boundary_check=(0, 1))
        b_dq = tl.dot(b_dp, tl.trans(b_h.to(b_q.dtype)), input_precision=DOT_PRECISION)  # [C, K]
        if CAUSAL:
            b_dA = tl.where(m_c, tl.dot(b_dp, tl.trans(b_v), input_precision=DOT_PRECISION), 0.0)
            b_dq += tl.dot(b_dA.to(b_k.dtype), b_k, input_precision=DOT_PRECISION)
            b_h += tl.dot(tl.trans(b_k), b_v, input_precision=DOT_PRECISION)
        p_dq = tl.make_block_ptr(dq + o_qk, (L, K), (H * K, 1), (t0, 0), (C, BK), (1, 0))
        tl.store(p_dq, (b_dq * scale).to(dq.dtype.element_ty), boundary_check=(0, 1))
        if STORE_P:
            b_p += tl.dot(tl.trans(b_q), b_dp, input_precision=DOT_PRECISION)
    if STORE_P:
        p_p = tl.make_block_ptr(p + (i_bh * n_s + i_s) * K * V, (K, V), (V, 1), (0, 0), (BK, BV), (1, 0))
        tl.store(p_p, b_p, boundary_check=(0, 1))


@triton.jit
def _linear_attention_bwd_dkdv_kernel(q, k, v, dp, p, s_pbh, s_ps, dk, dv, scale, L, NC, H: tl.constexpr,
                                      K: tl.constexpr, V: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                                      BV: tl.constexpr, CAUSAL: tl.constexpr, LOAD_P: tl.constexpr,
                                      DOT_PRECISION: tl.constexpr):
    """Reverse walk with P = sum_{later i} q_i^T dp_i: dk = V P^T + (masked V dp^T) Q, dv = K P + (masked K Q^T) dp."""
    i_bh, i_s = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    if LOAD_P:
        p_p = tl.make_block_ptr(p + i_bh * s_pbh + i_s * s_ps, (K, V), (V, 1), (0, 0), (BK, BV), (1, 0))
        b_p = tl.load(p_p, boundary_check=(0, 1)).to(tl.float32)
    else:
        b_p = tl.zeros([BK, BV], dtype=tl.float32)
    o_c = tl.arange(0, C)
    m_t = o_c[:, None] <= o_c[None, :]  # [j, i]: key j sees query i when j <= i
    for i_r in range(NC):
        t0 = (i_s * NC + NC - 1 - i_r) * C
        o_qk = i_b * L * H * K + i_h * K
        o_v = i_b * L * H * V + i_h * V
        p_q = tl.make_block_ptr(q + o_qk, (L, K), (H * K, 1), (t0, 0), (C, BK), (1, 0))
        p_k = tl.make_block_ptr(k + o_qk, (L, K), (H * K, 1), (t0, 0), (C, BK), (1, 0))
        p_v = tl.make_block_ptr(v + o_v, (L, V), (H * V, 1), (t0, 0), (C, BV), (1, 0))
        p_dp = tl.make_block_ptr(dp + o_v, (L, V), (H * V, 1), (t0, 0), (C, BV), (1, 0))
        b_q = tl.load(p_q, boundary_check=(0, 1))
        b_q = (b_q * scale).to(b_q.dtype)
        b_k = tl.load(p_k, boundary_check=(0, 1))
        b_v = tl.load(p_v, boundary_check=(0, 1))
        b_dp = tl.load(p_dp, boundary_check=(0, 1)).to(b_q.dtype)
        b_pc = b_p.to(b_q.dtype)
        b_dk = tl.dot(b_v, tl.trans(b_pc), input_precision=DOT_PRECISION)  # [C, K]
        b_dv = tl.dot(b_k, b_pc, input_precision=DOT_PRECISION)  # [C, V]
        if CAUSAL:
            b_At = tl.where(m_t, tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PRECISION), 0.0)
            b_dv += tl.dot(b_At.to(b_dp.dtype), b_dp, input_precision=DOT_PRECISION)
            b_dAt = tl.where(m_t, tl.dot(b_v, tl.trans(b_dp), input_precision=DOT_PRECISION), 0.0)
            b_dk += tl.dot(b_dAt.to(b_q.dtype), b_q, input_precision=DOT_PRECISION)
            b_p += tl.dot(tl.trans(b_q), b_dp, input_precision=DOT_PRECISION)
        p_dk = tl.make_block_ptr(dk + o_qk, (L, K), (H * K, 1), (t0, 0), (C, BK), (1, 0))
        p_dv = tl.make_block_ptr(dv + o_v, (L, V), (H * V, 1), (t0, 0), (C, BV), (1, 0))
        tl.store(p_dk, b_dk.to(dk.dtype.element_ty), boundary_check=(0, 1))
        tl.store(p_dv, b_dv.to(dv.dtype.element_ty), boundary_check=(0, 1))


def _plan(q: torch.Tensor, v: torch.Tensor, chunk_size: int, num_segments: int | None) -> dict:
    """Block sizes, warps and the sequence split: segments are added until batch*heads*segments fills ~2 waves."""
    B, L, H, K = q.shape
    V = v.shape[-1]
    n_chunks = triton.cdiv(L, chunk_size)
    if num_segments is None:
        target = 2 * torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        num_segments = max(1, target // (B * H))
    num_segments = min(max(1, num_segments), n_chunks)
    NC = triton.cdiv(n_chunks, num_segments)
    BK, BV = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    return dict(NS=triton.cdiv(n_chunks, NC), NC=NC, BK=BK, BV=BV, K=K, V=V, H=H, L=L, BH=B * H, C=chunk_size,
                num_warps=8 if BK * BV >= 128 * 128 else 4,
                precision="ieee" if q.dtype == torch.float32 else "tf32")


def _stages(c: dict, esize: int, n_k_tiles: int, n_v_tiles: int) -> int:
    """Software-pipelining depth that keeps the staged [C, BK] / [C, BV] input tiles within ~200 KB of shared memory
    (the H100/H200 limit is 227 KB): the gated causal dq kernel at K = V = 128 in bf16 needs 240 KB at 3 stages."""
    per_stage = c["C"] * esize * (n_k_tiles * c["BK"] + n_v_tiles * c["BV"])
    return max(1, min(3, (200 * 1024) // per_stage))


def _exclusive_cumsum(x: torch.Tensor, reverse: bool) -> torch.Tensor:
    """Segment starting states from per-segment sums along dim 1 (forward: prefix; reverse: suffix)."""
    if reverse:
        x = x.flip(1)
    out = torch.cat([torch.zeros_like(x[:, :1]), x.cumsum(1)[:, :-1]], dim=1)
    return out.flip(1) if reverse else out


def linear_attention_fwd(q, k, v, g, *, causal: bool, scale: float, normalize: bool, eps: float,
                         chunk_size: int, num_segments: int | None):
    """Launch the forward. Returns o [B, L, H, V] and the segment starting states (float32, for the backward)."""
    c = _plan(q, v, chunk_size, num_segments)
    meta = dict(H=c["H"], K=c["K"], V=c["V"], C=chunk_size, BK=c["BK"], BV=c["BV"],
                DOT_PRECISION=c["precision"], num_warps=c["num_warps"])
    grid = (c["BH"], c["NS"])
    es = q.element_size()
    h, s_hbh, s_hs, load_h = q, 0, 0, False
    if not causal or c["NS"] > 1:
        sums = q.new_empty(c["BH"], c["NS"], c["K"], c["V"], dtype=torch.float32)  # [B*H, NS, K, V]
        _linear_attention_state_kernel[grid](k, v, sums, c["L"], c["NC"], num_stages=_stages(c, es, 1, 1), **meta)
        h = _exclusive_cumsum(sums, reverse=False) if causal else sums.sum(1, keepdim=True)
        s_hbh, s_hs, load_h = h.shape[1] * c["K"] * c["V"], (c["K"] * c["V"] if causal else 0), True
    o = torch.empty_like(v)
    _linear_attention_fwd_kernel[grid](q, k, v, g if g is not None else v, o, h, s_hbh, s_hs, scale, eps, c["L"],
                                       c["NC"], CAUSAL=causal, NORMALIZE=normalize, USE_GATE=g is not None,
                                       LOAD_H=load_h, num_stages=_stages(c, es, 1 + causal, causal + (g is not None)),
                                       **meta)
    return o, (h if load_h else None)


def linear_attention_bwd(q, k, v, g, do, h, *, causal: bool, scale: float, normalize: bool, eps: float,
                         chunk_size: int, num_segments: int | None):
    """Launch the backward. Returns dq, dk, dv, dg (dg is None without a gate)."""
    c = _plan(q, v, chunk_size, num_segments)
    meta = dict(H=c["H"], K=c["K"], V=c["V"], C=chunk_size, BK=c["BK"], BV=c["BV"],
                DOT_PRECISION=c["precision"], num_warps=c["num_warps"])
    grid = (c["BH"], c["NS"])
    es = q.element_size()
    KV = c["K"] * c["V"]
    s_hbh, s_hs = (0, 0) if h is None else (h.shape[1] * KV, KV if causal else 0)
    store_p = not causal or c["NS"] > 1
    # a second K x V float32 accumulator beside the state spills registers for wide heads: sum q^T dp in its own pass
    fuse_p = store_p and c["BK"] * c["BV"] <= 64 * 64
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dg = torch.empty_like(g) if g is not None else None
    dp = torch.empty_like(v)  # dL/d(raw attention output), before norm and gate
    sums = q.new_empty(c["BH"], c["NS"], c["K"], c["V"], dtype=torch.float32) if store_p else q
    _linear_attention_bwd_dq_kernel[grid](q, k, v, g if g is not None else v, do.contiguous(),
                                          h if h is not None else q, s_hbh, s_hs, dq,
                                          dg if dg is not None else dq, dp, sums, scale, eps, c["L"], c["NC"],
                                          CAUSAL=causal, NORMALIZE=normalize, USE_GATE=g is not None,
                                          LOAD_H=h is not None, STORE_P=fuse_p,
                                          num_stages=_stages(c, es, 1 + causal, 2 + (g is not None)), **meta)
    if store_p and not fuse_p:
        _linear_attention_state_kernel[grid](q, dp, sums, c["L"], c["NC"], num_stages=_stages(c, es, 1, 1), **meta)
        sums = sums * scale
    p, s_pbh, s_ps = q, 0, 0
    if store_p:
        p = _exclusive_cumsum(sums, reverse=True) if causal else sums.sum(1, keepdim=True)
        s_pbh, s_ps = p.shape[1] * KV, (KV if causal else 0)
    _linear_attention_bwd_dkdv_kernel[grid](q, k, v, dp, p, s_pbh, s_ps, dk, dv, scale, c["L"], c["NC"],
                                            CAUSAL=causal, LOAD_P=store_p, num_stages=_stages(c, es, 2, 2), **meta)
    return dq, dk, dv, dg

