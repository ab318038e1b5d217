"""Public, dispatching MD-EMA ops: `ema_kernel` (Triton kernel generation, no (D, N, L) tensor) and `ema` (the long
convolution: chunked state-passing Triton kernels for untruncated kernels, kernel generation + cuFFT for truncated
ones; see README.md). The Triton paths are registered custom ops (`longmixer::ema_*`, see ops/README.md).
MEGA, arXiv:2209.10655, section 2.2."""

from __future__ import annotations

import torch
from torch import Tensor

from longmixer.ops.backend import resolve_backend
from longmixer.ops.custom import backward_call, call, define, no_gradient_for, register_autograd
from longmixer.ops.ema.reference import ema_kernel_ref, ema_ref


@define("longmixer::ema_kernel_fwd")
def ema_kernel_fwd_op(c: Tensor, q: Tensor, length: int) -> Tensor:
    """k[d, t] = sum_n c[d, n] q[d, n]^t by the Triton kernel of `kernel.py`, in c's dtype."""
    from longmixer.ops.ema import kernel  # lazy: Triton is imported only when the triton backend runs

    return kernel.ema_kernel_fwd(c.float().contiguous(), q.float().contiguous(), length).to(c.dtype)


@ema_kernel_fwd_op.register_fake
def _(c, q, length):
    return c.new_empty(c.shape[0], length)


@define("longmixer::ema_kernel_bwd")
def ema_kernel_bwd_op(c: Tensor, q: Tensor, dk: Tensor) -> list[Tensor]:
    """[dc, dq] in c's dtype for the kernel gradient dk."""
    from longmixer.ops.ema import kernel

    dc, dq = kernel.ema_kernel_bwd(c.float().contiguous(), q.float().contiguous(), dk.float())
    return [dc.to(c.dtype), dq.to(c.dtype)]


@ema_kernel_bwd_op.register_fake
def _(c, q, dk):
    return [torch.empty_like(c, memory_format=torch.contiguous_format), torch.empty_like(c, memory_format=torch.contiguous_format)]


def _ema_kernel_setup(ctx, inputs, output):
    c, q, _ = inputs
    ctx.save_for_backward(c, q)


def _ema_kernel_backward(ctx, dk):
    c, q = ctx.saved_tensors
    dc, dq = backward_call(ctx, ema_kernel_bwd_op, c, q, dk)
    return dc, dq.to(q.dtype), None  # c, q, length


register_autograd(ema_kernel_fwd_op, _ema_kernel_backward, _ema_kernel_setup)


def _chunk_work_dtype(x: Tensor) -> torch.dtype:
    """The dtype the chunked kernels read x in: float64 runs in float32, like the FFT path."""
    return torch.float32 if x.dtype == torch.float64 else x.dtype


@define("longmixer::ema_chunk_fwd")
def ema_chunk_fwd_op(x: Tensor, c: Tensor, q: Tensor, bidirectional: bool) -> list[Tensor]:
    """The untruncated EMA convolution (causal or two-sided) by the chunked state-passing kernels of `chunked.py`:
    no FFT and no (D, N, L) tensor. Returns [y in x's dtype, xt [B, D, L] and the first CHUNK kernel taps k], the
    last two kept for the backward."""
    from longmixer.ops.ema import chunked, kernel  # lazy: Triton is imported only when the triton backend runs

    xt = chunked.transpose(x, _chunk_work_dtype(x))  # [B, D, L]: the kernels read rows of the transposed input
    c32, q32 = c.float().contiguous(), q.float().contiguous()
    k = kernel.ema_kernel_fwd(c32, q32, chunked.CHUNK)  # the first CHUNK taps: the intra-chunk Toeplitz tile
    yt = chunked.ema_chunk_fwd(xt, k, c32, q32, bidirectional, out_dtype=xt.dtype)
    return [chunked.transpose(yt, x.dtype), xt, k]


@ema_chunk_fwd_op.register_fake
def _(x, c, q, bidirectional):
    from longmixer.ops.ema import chunked

    B, L, D = x.shape
    return [torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(B, D, L, dtype=_chunk_work_dtype(x)),
            c.new_empty(c.shape[0], chunked.CHUNK, dtype=torch.float32)]


@define("longmixer::ema_chunk_bwd")
def ema_chunk_bwd_op(xt: Tensor, k: Tensor, c: Tensor, q: Tensor, dy: Tensor, bidirectional: bool,
                     x_dtype: torch.dtype) -> list[Tensor]:
    """[dx in x_dtype, dc, dq in c's dtype] for the output gradient dy."""
    from longmixer.ops.ema import chunked

    dxt, dc, dq = chunked.ema_chunk_bwd(xt, chunked.transpose(dy, xt.dtype), k, c.float().contiguous(),
                                        q.float().contiguous(), bidirectional)
    return [chunked.transpose(dxt, x_dtype), dc.to(c.dtype), dq.to(c.dtype)]


@ema_chunk_bwd_op.register_fake
def _(xt, k, c, q, dy, bidirectional, x_dtype):
    B, D, L = xt.shape
    return [xt.new_empty(B, L, D, dtype=x_dtype), torch.empty_like(c, memory_format=torch.contiguous_format), torch.empty_like(c, memory_format=torch.contiguous_format)]


def _ema_chunk_setup(ctx, inputs, output):
    x, c, q, bidirectional = inputs
    _, xt, k = output
    no_gradient_for(ctx, xt, k)
    ctx.save_for_backward(xt, k, c, q)
    ctx.bidirectional, ctx.x_dtype = bidirectional, x.dtype


def _ema_chunk_backward(ctx, grads):
    xt, k, c, q = ctx.saved_tensors
    dx, dc, dq = backward_call(ctx, ema_chunk_bwd_op, xt, k, c, q, grads[0], ctx.bidirectional, ctx.x_dtype)
    return dx, dc, dq.to(q.dtype), None  # x, c, q, bidirectional


register_autograd(ema_chunk_fwd_op, _ema_chunk_backward, _ema_chunk_setup)


def fft_length(n: int) -> int:
    """The smallest 2^a 3^b 5^c >= n (fast cuFFT sizes)."""
    best = 1 << (n - 1).bit_length()
    p5 = 1
    while p5 < best:
        p35 = p5
        while p35 < best:
            m = p35
            while m < n:
                m *= 2
            best = min(best, m)
            p35 *= 3
        p5 *= 5
    return best


@define("longmixer::ema_fft_conv")
def ema_fft_conv_op(x: Tensor, kernel: Tensor, bidirectional: bool) -> list[Tensor]:
    """The EMA convolution of x [B, L, D] with the kernel taps [Dk, K] by cuFFT (`fft.py`): [y in x's dtype,
    X and Kf, the input's and the kernel's spectra, kept for the backward]."""
    from longmixer.ops.ema import fft  # lazy: Triton is imported only when the triton backend runs

    L, K = x.shape[1], kernel.shape[1]
    return list(fft.conv_fwd(x, kernel, bidirectional, fft_length(L + K - 1)))


@ema_fft_conv_op.register_fake
def _(x, kernel, bidirectional):
    B, L, D = x.shape
    m = fft_length(L + kernel.shape[1] - 1) // 2 + 1
    return [x.new_empty(B, L, D), x.new_empty(B, D, m, dtype=torch.complex64),
            x.new_empty(D, m, dtype=torch.complex64)]


@define("longmixer::ema_fft_conv_bwd")
def ema_fft_conv_bwd_op(dy: Tensor, xf: Tensor, kf: Tensor, K: int, bidirectional: bool,
                        x_dtype: torch.dtype) -> list[Tensor]:
    """[dx in x_dtype, dkernel [Dk, K] float32] for the output gradient dy."""
    from longmixer.ops.ema import fft

    dx, dk = fft.conv_bwd(dy, xf, kf, K, bidirectional, fft_length(dy.shape[1] + K - 1), x_dtype)
    return [dx, dk]


@ema_fft_conv_bwd_op.register_fake
def _(dy, xf, kf, K, bidirectional, x_dtype):
    B, L, D = dy.shape
    return [dy.new_empty(B, L, D, dtype=x_dtype), dy.new_empty(2 * D if bidirectional else D, K, dtype=torch.float32)]


def _ema_fft_conv_setup(ctx, inputs, output):
    x, kernel, bidirectional = inputs
    _, xf, kf = output
    no_gradient_for(ctx, xf, kf)
    ctx.save_for_backward(xf, kf)
    ctx.K, ctx.bidirectional, ctx.x_dtype, ctx.k_dtype = kernel.shape[1], bidirectional, x.dtype, kernel.dtype


def _ema_fft_conv_backward(ctx, grads):
    xf, kf = ctx.saved_tensors
    if grads[0] is None:
        return None, None, None
    dx, dk = backward_call(ctx, ema_fft_conv_bwd_op, grads[0], xf, kf, ctx.K, ctx.bidirectional, ctx.x_dtype)
    return dx, dk.to(ctx.k_dtype), None  # x, kernel, bidirectional


register_autograd(ema_fft_conv_op, _ema_fft_conv_backward, _ema_fft_conv_setup)


def _check(coef_in: torch.Tensor, decay: torch.Tensor, coef_out: torch.Tensor, length: int) -> None:
    if coef_in.dim() != 2 or coef_in.shape != decay.shape or coef_in.shape != coef_out.shape:
        raise ValueError(f"ema coefficients must all be [Dk, N]; got coef_in {tuple(coef_in.shape)}, "
                         f"decay {tuple(decay.shape)}, coef_out {tuple(coef_out.shape)}")
    if length < 1:
        raise ValueError(f"ema kernel length={length} must be >= 1")


def ema_kernel(coef_in: torch.Tensor, decay: torch.Tensor, coef_out: torch.Tensor, length: int, *,
               backend: str = "auto") -> torch.Tensor:
    """EMA kernel k[d, t] = sum_n coef_out[d, n] coef_in[d, n] decay[d, n]^t, t < length (MEGA eq. 3 unrolled).

    Args:
        coef_in: [Dk, N], p * beta.
        decay: [Dk, N] in (0, 1), q = 1 - p * alpha.
        coef_out: [Dk, N], gamma * scale.
        length: K.
        backend: auto | torch | triton (see `longmixer.ops.backend`).

    Returns:
        [Dk, K] in the coefficients' dtype (the Triton kernel accumulates in float32).

    Example:
        >>> c = torch.rand(4, 16); ema_kernel(c, torch.rand(4, 16) * 0.9, c, 32, backend="torch").shape
        torch.Size([4, 32])
    """
    _check(coef_in, decay, coef_out, length)
    if resolve_backend("ema_kernel", backend, coef_in, decay, coef_out) == "torch":
        return ema_kernel_ref(coef_in, decay, coef_out, length)
    return call(ema_kernel_fwd_op, coef_in * coef_out, decay, length)


def ema(x: torch.Tensor, coef_in: torch.Tensor, decay: torch.Tensor, coef_out: torch.Tensor, *,
        bidirectional: bool = False, truncation: int | None = None, backend: str = "auto") -> torch.Tensor:
    """MD-EMA long convolution without the omega residual; same signature and result as `ema_ref`.

    Args:
        x: [B, L, D] float, zero at padded positions.
        coef_in, decay, coef_out: [Dk, N], Dk = 2D if bidirectional else D.
        bidirectional: two-sided kernel (first D rows look back, last D rows look ahead; centre tap counted twice).
        truncation: cap on the kernel length K = min(truncation, L); None means L.
        backend: auto | torch | triton. torch is the official computation (`ema_ref`). Triton runs the untruncated
            convolution (K = L, the default) by the chunked state-passing kernels of `chunked.py` (no FFT, no
            (Dk, N, L) tensor), and a truncated one (K < L) by `ema_fft` (kernel generation in Triton, cuFFT at
            the smallest safe size).

    Returns:
        [B, L, D] in x's dtype.

    Raises:
        ValueError: mismatched shapes or a non-positive truncation.
    """
    B, L, D = x.shape
    if truncation is not None and truncation < 1:
        raise ValueError(f"ema truncation={truncation} must be >= 1 or None (no truncation)")
    if coef_in.shape[0] != (2 * D if bidirectional else D):
        raise ValueError(f"ema coefficients have {coef_in.shape[0]} rows; expected "
                         f"{2 * D if bidirectional else D} for D={D}, bidirectional={bidirectional}")
    K = L if truncation is None else min(truncation, L)
    if resolve_backend("ema", backend, x, coef_in) == "torch":
        return ema_ref(x, coef_in, decay, coef_out, bidirectional=bidirectional, truncation=truncation)
    _check(coef_in, decay, coef_out, K)
    if K == L:
        return call(ema_chunk_fwd_op, x, coef_in * coef_out, decay, bidirectional)[0]
    return ema_fft(x, coef_in, decay, coef_out, bidirectional=bidirectional, truncation=K)


def ema_fft(x: torch.Tensor, coef_in: torch.Tensor, decay: torch.Tensor, coef_out: torch.Tensor, *,
            bidirectional: bool = False, truncation: int | None = None) -> torch.Tensor:
    """The Triton path for any truncation: the kernel generated in Triton (no (Dk, N, K) tensor), the convolution
    by cuFFT at the smallest safe size with its backward written out (`ema_fft_conv_op`, fft.py). `ema` takes it
    for truncated kernels (K < L), where the chunked state-passing kernels do not apply."""
    L = x.shape[1]
    K = L if truncation is None else min(truncation, L)
    kernel = call(ema_kernel_fwd_op, coef_in * coef_out, decay, K)  # [Dk, K]
    return call(ema_fft_conv_op, x, kernel, bidirectional)[0]
