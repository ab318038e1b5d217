"""Triton kernels of the causal, untruncated MD-EMA as a sequential scan (MEGA, arXiv:2209.10655, eq. 2):

    h_t[d, n] = q[d, n] h_{t-1}[d, n] + pb[d, n] x_t[d],    y_t[d] = sum_n g[d, n] h_t[d, n]

with pb = p * beta (coef_in), q = 1 - p * alpha (decay), g = gamma * N^-1/2 (coef_out). It equals the causal
convolution y = k * x with k[d, t] = sum_n g pb q^t (`reference.ema_kernel_ref`) and needs no FFT.

One program owns (batch b, a block of BLOCK_D channels) and walks t with the [N, BLOCK_D] states in registers;
x and y rows ([B, L, D] layout) are contiguous over the channel block. The forward saves the state entering every
chunk of CHUNK steps ([B, L / CHUNK, N, D] float32). The backward walks the chunks in reverse: it recomputes the
chunk's states from the saved one into a per-program scratch of CHUNK + 1 states (never a (B, L, D, N) tensor),
then runs the adjoint scan backwards over it:

    dh_t = q dh_{t+1} + g dy_t,   dx_t = sum_n pb dh_t,
    dpb = sum_t dh_t x_t,   dq = sum_t dh_t h_{t-1},   dg = sum_t dy_t h_t

The parameter gradients are per-batch partials summed on the host (no atomics).

Measured on an H200 (docs/notes/mega.md) it is latency-bound, ~0.5 us per time step per program, and slower than
kernel generation + cuFFT, so `function.ema` does not dispatch to it; `function.ema_scan` exposes it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 64  # steps between saved states: [B, L/64, N, D] fp32 saved, a [65, N, BLOCK_D] scratch per program


@triton.jit
def _ema_scan_fwd_kernel(x_ptr, pb_ptr, q_ptr, g_ptr, y_ptr, s_ptr, L, D, N, n_chunks,
                         CHUNK: tl.constexpr, SAVE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         STAGES: tl.constexpr):
    i_b, i_d = tl.program_id(0), tl.program_id(1)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    o_n = tl.arange(0, BLOCK_N)
    m_d = o_d < D
    m_nd = (o_n[:, None] < N) & m_d[None, :]
    o_nd = o_n[:, None] * D + o_d[None, :]  # coefficients come transposed, [N, D], contiguous over channels
    b_pb = tl.load(pb_ptr + o_nd, mask=m_nd, other=0.)
    b_q = tl.load(q_ptr + o_nd, mask=m_nd, other=0.)
    b_g = tl.load(g_ptr + o_nd, mask=m_nd, other=0.)
    b_h = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    p_x = x_ptr + i_b.to(tl.int64) * L * D + o_d
    p_y = y_ptr + i_b.to(tl.int64) * L * D + o_d
    p_s = s_ptr + i_b.to(tl.int64) * n_chunks * N * D + o_nd
    for t in tl.range(0, L, num_stages=STAGES):
        if SAVE:
            # the state entering chunk t // CHUNK (h_{t-1}), kept for the backward's recomputation
            tl.store(p_s + (t // CHUNK) * N * D, b_h, mask=m_nd & (t % CHUNK == 0))
        b_x = tl.load(p_x + t * D, mask=m_d, other=0.).to(tl.float32)
        b_h = b_q * b_h + b_pb * b_x[None, :]  # MEGA eq. 2
        b_y = tl.sum(b_g * b_h, axis=0)
        tl.store(p_y + t * D, b_y.to(y_ptr.dtype.element_ty), mask=m_d)


@triton.jit
def _ema_scan_bwd_kernel(x_ptr, dy_ptr, pb_ptr, q_ptr, g_ptr, s_ptr, w_ptr, dx_ptr, dpb_ptr, dq_ptr, dg_ptr,
                         L, D, N, n_chunks,
                         CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    i_b, i_d = tl.program_id(0), tl.program_id(1)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    o_n = tl.arange(0, BLOCK_N)
    m_d = o_d < D
    m_nd = (o_n[:, None] < N) & m_d[None, :]
    o_nd = o_n[:, None] * D + o_d[None, :]
    b_pb = tl.load(pb_ptr + o_nd, mask=m_nd, other=0.)
    b_q = tl.load(q_ptr + o_nd, mask=m_nd, other=0.)
    b_g = tl.load(g_ptr + o_nd, mask=m_nd, other=0.)
    p_x = x_ptr + i_b.to(tl.int64) * L * D + o_d
    p_dy = dy_ptr + i_b.to(tl.int64) * L * D + o_d
    p_dx = dx_ptr + i_b.to(tl.int64) * L * D + o_d
    p_s = s_ptr + i_b.to(tl.int64) * n_chunks * N * D + o_nd
    # this program's scratch: slot 0 holds the state entering the chunk, slot i + 1 the state after step i
    o_w = o_n[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
    p_w = w_ptr + (i_b * tl.num_programs(1) + i_d).to(tl.int64) * (CHUNK + 1) * BLOCK_N * BLOCK_D + o_w
    b_dh = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    b_dpb = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    b_dq = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    b_dg = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for c in range(n_chunks):
        t0 = (n_chunks - 1 - c) * CHUNK
        b_h = tl.load(p_s + (t0 // CHUNK) * N * D, mask=m_nd, other=0.)
        tl.store(p_w, b_h)
        for i in tl.range(0, CHUNK, num_stages=STAGES):  # recompute the chunk's states
            b_x = tl.load(p_x + (t0 + i) * D, mask=m_d & (t0 + i < L), other=0.).to(tl.float32)
            b_h = b_q * b_h + b_pb * b_x[None, :]
            tl.store(p_w + (i + 1) * BLOCK_N * BLOCK_D, b_h)
        tl.debug_barrier()
        # b_h = h_t at the chunk's last step; steps past L have x = dy = 0 and leave dh = 0
        for i in tl.range(0, CHUNK, num_stages=STAGES):
            j = CHUNK - 1 - i
            m_t = m_d & (t0 + j < L)
            b_dy = tl.load(p_dy + (t0 + j) * D, mask=m_t, other=0.).to(tl.float32)
            b_x = tl.load(p_x + (t0 + j) * D, mask=m_t, other=0.).to(tl.float32)
            b_hp = tl.load(p_w + j * BLOCK_N * BLOCK_D)  # h_{t-1}
            b_dh = b_q * b_dh + b_g * b_dy[None, :]
            b_dx = tl.sum(b_pb * b_dh, axis=0)
            tl.store(p_dx + (t0 + j) * D, b_dx.to(dx_ptr.dtype.element_ty), mask=m_t)
            b_dpb += b_dh * b_x[None, :]
            b_dq += b_dh * b_hp
            b_dg += b_h * b_dy[None, :]
            b_h = b_hp
        tl.debug_barrier()  # the next chunk overwrites the scratch
    o_p = i_b.to(tl.int64) * N * D + o_nd
    tl.store(dpb_ptr + o_p, b_dpb, mask=m_nd)
    tl.store(dq_ptr + o_p, b_dq, mask=m_nd)
    tl.store(dg_ptr + o_p, b_dg, mask=m_nd)


def _config(N: int, block_d: int | None, num_warps: int | None) -> tuple[int, int, int]:
    """(BLOCK_D, BLOCK_N, num_warps): 32 channels x N states per program, one warp for N <= 16."""
    BLOCK_N = triton.next_power_of_2(N)
    if block_d is None:
        block_d = 32 if BLOCK_N <= 16 else 16
    if num_warps is None:
        num_warps = max(1, min(4, block_d * BLOCK_N // 512))
    return block_d, BLOCK_N, num_warps


def ema_scan_fwd(x: torch.Tensor, pb: torch.Tensor, q: torch.Tensor, g: torch.Tensor, save: bool, *,
                 block_d: int | None = None, num_warps: int | None = None, stages: int = 2
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y [B, L, D] in x's dtype, and the chunk-entry states [B, ceil(L / CHUNK), N, D] float32 when `save`.

    x is [B, L, D] contiguous; pb, q, g are [N, D] float32 contiguous (transposed coefficients).
    """
    B, L, D = x.shape
    N = pb.shape[0]
    BLOCK_D, BLOCK_N, warps = _config(N, block_d, num_warps)
    n_chunks = triton.cdiv(L, CHUNK)
    y = torch.empty_like(x)
    states = torch.empty(B, n_chunks, N, D, device=x.device, dtype=torch.float32) if save else y
    grid = (B, triton.cdiv(D, BLOCK_D))
    _ema_scan_fwd_kernel[grid](x, pb, q, g, y, states, L, D, N, n_chunks, CHUNK=CHUNK, SAVE=save,
                               BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, STAGES=stages, num_warps=warps)
    return y, (states if save else None)


def ema_scan_bwd(x: torch.Tensor, dy: torch.Tensor, pb: torch.Tensor, q: torch.Tensor, g: torch.Tensor,
                 states: torch.Tensor, *, block_d: int | None = None, num_warps: int | None = None,
                 stages: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [B, L, D] in x's dtype, dpb, dq, dg [N, D] float32) for the scan of `ema_scan_fwd`."""
    B, L, D = x.shape
    N = pb.shape[0]
    BLOCK_D, BLOCK_N, warps = _config(N, block_d, num_warps)
    n_chunks = states.shape[1]
    n_blocks = triton.cdiv(D, BLOCK_D)
    scratch = torch.empty(B * n_blocks * (CHUNK + 1) * BLOCK_N * BLOCK_D, device=x.device, dtype=torch.float32)
    dx = torch.empty_like(x)
    dpb, dq, dg = (torch.empty(B, N, D, device=x.device, dtype=torch.float32) for _ in range(3))
    _ema_scan_bwd_kernel[(B, n_blocks)](x, dy.contiguous(), pb, q, g, states, scratch, dx, dpb, dq, dg,
                                        L, D, N, n_chunks, CHUNK=CHUNK, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
                                        STAGES=stages, num_warps=warps)
    return dx, dpb.sum(0), dq.sum(0), dg.sum(0)
