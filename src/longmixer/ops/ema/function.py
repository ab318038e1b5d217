"""Public, dispatching MD-EMA ops: `ema_kernel` (Triton kernel generation, no (D, N, L) tensor) and `ema` (kernel
generation + FFT long convolution through cuFFT). MEGA, arXiv:2209.10655, section 2.2."""

from __future__ import annotations

import torch

from longmixer.ops.backend import resolve_backend
from longmixer.ops.ema.reference import ema_conv, ema_kernel_ref


class EMAKernelFunction(torch.autograd.Function):
    """k[d, t] = sum_n c[d, n] q[d, n]^t by the Triton kernels of `kernel.py`."""

    @staticmethod
    def forward(ctx, c: torch.Tensor, q: torch.Tensor, length: int) -> torch.Tensor:
        from longmixer.ops.ema import kernel  # lazy: Triton is imported only when the triton backend runs

        c32, q32 = c.float().contiguous(), q.float().contiguous()
        ctx.save_for_backward(c32, q32)
        ctx.dtype = c.dtype
        return kernel.ema_kernel_fwd(c32, q32, length).to(c.dtype)

    @staticmethod
    def backward(ctx, dk: torch.Tensor):
        from longmixer.ops.ema import kernel

        c32, q32 = ctx.saved_tensors
        dc, dq = kernel.ema_kernel_bwd(c32, q32, dk.float())
        # gradients for (c, q, length)
        return dc.to(ctx.dtype), dq.to(ctx.dtype), None


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
    return EMAKernelFunction.apply(coef_in * coef_out, decay, length)


def ema(x: torch.Tensor, coef_in: torch.Tensor, decay: torch.Tensor, coef_out: torch.Tensor, *,
        bidirectional: bool = False, truncation: int | None = None, backend: str = "auto") -> torch.Tensor:
    """MD-EMA long convolution without the omega residual; same signature and result as `ema_ref`.

    Args:
        x: [B, L, D] float, zero at padded positions.
        coef_in, decay, coef_out: [Dk, N], Dk = 2D if bidirectional else D.
        bidirectional: two-sided kernel (first D rows look back, last D rows look ahead; centre tap counted twice).
        truncation: cap on the kernel length K = min(truncation, L); None means L.
        backend: auto | torch | triton. Triton generates the kernel without the (Dk, N, K) Vandermonde tensor;
            the convolution itself runs through torch.fft (cuFFT) in float32 on both backends.

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
    kernel = ema_kernel(coef_in, decay, coef_out, K, backend=backend)  # [Dk, K]
    return ema_conv(x, kernel, bidirectional).to(x.dtype)
