"""Triton kernels generating the MD-EMA kernel k[d, t] = sum_n c[d, n] q[d, n]^t and its gradients tile by tile,
so that the (D, N, L) Vandermonde tensor of the reference never exists (MEGA, arXiv:2209.10655, eq. 3)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ema_kernel_fwd_kernel(c_ptr, q_ptr, k_ptr, Dk, N, K,
                           BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    i_d, i_k = tl.program_id(0), tl.program_id(1)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    o_n = tl.arange(0, BLOCK_N)
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_dn = (o_d[:, None] < Dk) & (o_n[None, :] < N)
    b_c = tl.load(c_ptr + o_d[:, None] * N + o_n[None, :], mask=m_dn, other=0.).to(tl.float32)  # [BD, BN]
    b_q = tl.load(q_ptr + o_d[:, None] * N + o_n[None, :], mask=m_dn, other=0.5).to(tl.float32)
    # q^t = exp2(t log2 q): log2 q < 0, so large t underflows to 0 instead of overflowing
    b_lq = tl.log2(b_q)
    b_pow = tl.exp2(o_k[None, None, :].to(tl.float32) * b_lq[:, :, None])  # [BD, BN, BK]
    b_k = tl.sum(b_c[:, :, None] * b_pow, axis=1)  # [BD, BK]
    m_dk = (o_d[:, None] < Dk) & (o_k[None, :] < K)
    tl.store(k_ptr + o_d[:, None] * K + o_k[None, :], b_k, mask=m_dk)


@triton.jit
def _ema_kernel_bwd_kernel(c_ptr, q_ptr, dk_ptr, dc_ptr, dq_ptr, Dk, N, K,
                           BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # partial sums over one tile of t, written to dc/dq[i_k]; the host sums over the tiles
    i_d, i_k = tl.program_id(0), tl.program_id(1)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    o_n = tl.arange(0, BLOCK_N)
    o_k = i_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_dn = (o_d[:, None] < Dk) & (o_n[None, :] < N)
    b_c = tl.load(c_ptr + o_d[:, None] * N + o_n[None, :], mask=m_dn, other=0.).to(tl.float32)
    b_q = tl.load(q_ptr + o_d[:, None] * N + o_n[None, :], mask=m_dn, other=0.5).to(tl.float32)
    m_dk = (o_d[:, None] < Dk) & (o_k[None, :] < K)
    b_dk = tl.load(dk_ptr + o_d[:, None] * K + o_k[None, :], mask=m_dk, other=0.).to(tl.float32)  # [BD, BK]
    b_lq = tl.log2(b_q)
    b_t = o_k[None, None, :].to(tl.float32)
    b_pow = tl.exp2(b_t * b_lq[:, :, None])  # [BD, BN, BK]  q^t
    # d q^t / dq = t q^(t-1), written without dividing by q (q may be tiny); zero at t = 0
    b_dpow = tl.where(b_t > 0, b_t * tl.exp2((b_t - 1.) * b_lq[:, :, None]), 0.)
    b_dc = tl.sum(b_dk[:, None, :] * b_pow, axis=2)  # [BD, BN]
    b_dq = tl.sum(b_dk[:, None, :] * b_dpow, axis=2) * b_c
    o_out = i_k * Dk * N + o_d[:, None] * N + o_n[None, :]
    tl.store(dc_ptr + o_out, b_dc, mask=m_dn)
    tl.store(dq_ptr + o_out, b_dq, mask=m_dn)


def _blocks(N: int) -> tuple[int, int, int]:
    BLOCK_N = triton.next_power_of_2(N)
    BLOCK_D = max(1, min(16, 1024 // (BLOCK_N * 8)))  # keep the [BD, BN, BK] tile near 8K elements
    return BLOCK_D, BLOCK_N, 64 if BLOCK_N <= 16 else 32


def ema_kernel_fwd(c: torch.Tensor, q: torch.Tensor, length: int) -> torch.Tensor:
    """k [Dk, K] float32 from c = coef_out * coef_in and q, both [Dk, N] contiguous."""
    Dk, N = c.shape
    BLOCK_D, BLOCK_N, BLOCK_K = _blocks(N)
    k = torch.empty(Dk, length, device=c.device, dtype=torch.float32)
    grid = (triton.cdiv(Dk, BLOCK_D), triton.cdiv(length, BLOCK_K))
    _ema_kernel_fwd_kernel[grid](c, q, k, Dk, N, length, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return k


def ema_kernel_bwd(c: torch.Tensor, q: torch.Tensor, dk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients (dc, dq) [Dk, N] float32 of sum(dk * k) with k = ema_kernel_fwd(c, q, K)."""
    Dk, N = c.shape
    K = dk.shape[-1]
    BLOCK_D, BLOCK_N, BLOCK_K = _blocks(N)
    n_k = triton.cdiv(K, BLOCK_K)
    dc = torch.empty(n_k, Dk, N, device=c.device, dtype=torch.float32)
    dq = torch.empty(n_k, Dk, N, device=c.device, dtype=torch.float32)
    grid = (triton.cdiv(Dk, BLOCK_D), n_k)
    _ema_kernel_bwd_kernel[grid](c, q, dk.contiguous(), dc, dq, Dk, N, K,
                                 BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return dc.sum(0), dq.sum(0)
