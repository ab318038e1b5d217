"""The truncated EMA convolution by cuFFT, forward and backward written out (the registered ops are in
function.py: `ema_fft_conv_op`, `ema_fft_conv_bwd_op`).

y = irfft(X Kf)[:L] with X = rfft of x zero-padded to n and Kf = rfft of the kernel laid out circularly
(`circular_kernel`); n = `fft_length(L + K - 1)` keeps the L outputs free of wrap-around. Its adjoint is the
circular correlation, so with G = rfft of dy zero-padded to n:

    dx = irfft(G conj(Kf))[:L],    dkc = irfft(sum_b G conj(X)),

and the kernel taps' gradient is read back from dkc's circular layout (`kernel_grad`). Every transform is a real
one (r2c / c2r). Autograd through `torch.fft` instead runs the backward of each r2c as a complex transform of
size n over a zero-padded copy, and the transposes between [B, L, D] and the [B, D, n] rows cuFFT transforms were
torch copies of strided tensors: at MEGA's Text shape (B8 L4096 D128 K1024) those took more GPU time than the
transforms (docs/benchmarks.md). Here one pass of the chunked EMA's transpose kernel moves x into the zero-padded
rows, casting to float32 (`pad_rows`), and one moves the first L columns back, casting to the output dtype
(`unpad_rows`).
"""

from __future__ import annotations

import torch

from longmixer.ops.ema.chunked import transpose_into


def pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [B, L, D] -> [B, D, n] float32: row (b, d) is x[b, :, d] followed by n - L zeros."""
    x = x.contiguous()
    B, L, D = x.shape
    out = torch.empty(B, D, n, device=x.device, dtype=torch.float32)
    transpose_into(x, out, L, n, D, D, n)
    return out


def unpad_rows(y: torch.Tensor, L: int, dtype: torch.dtype) -> torch.Tensor:
    """y [B, D, n] (contiguous) -> [B, L, D] in dtype: the first L columns of every row, transposed back."""
    B, D, n = y.shape
    out = torch.empty(B, L, D, device=y.device, dtype=dtype)
    transpose_into(y.contiguous(), out, D, D, L, n, D)
    return out


def circular_kernel(kernel: torch.Tensor, D: int, n: int, bidirectional: bool) -> torch.Tensor:
    """The kernel taps [Dk, K] as [D, n] float32 rows of a circular convolution: lag a >= 0 at index a, look-ahead
    lag -a at index n - a, the centre tap counted by both directions (the official code). n >= 2K - 1, so the two
    halves never overlap."""
    K = kernel.shape[-1]
    kernel = kernel.float()
    kc = kernel.new_zeros(D, n)
    kc[:, :K] = kernel[:D]
    if bidirectional:
        kc[:, 0] += kernel[D:, 0]
        if K > 1:
            kc[:, n - K + 1:] = kernel[D:, 1:].flip(-1)
    return kc


def kernel_grad(dkc: torch.Tensor, K: int, bidirectional: bool) -> torch.Tensor:
    """The taps' gradient [Dk, K] from the circular layout's gradient dkc [D, n] (the adjoint of `circular_kernel`)."""
    if not bidirectional:
        return dkc[:, :K].contiguous()
    ahead = torch.cat([dkc[:, :1], dkc[:, dkc.shape[1] - K + 1:].flip(-1)], dim=1)
    return torch.cat([dkc[:, :K], ahead], dim=0)


def conv_fwd(x: torch.Tensor, kernel: torch.Tensor, bidirectional: bool, n: int):
    """(y [B, L, D] in x's dtype, X = rfft(x rows), Kf = rfft(kernel rows)); X and Kf are kept for the backward."""
    B, L, D = x.shape
    xf = torch.fft.rfft(pad_rows(x, n))  # [B, D, n // 2 + 1]
    kf = torch.fft.rfft(circular_kernel(kernel, D, n, bidirectional))  # [D, n // 2 + 1]
    return unpad_rows(torch.fft.irfft(xf * kf, n=n), L, x.dtype), xf, kf


def conv_bwd(dy: torch.Tensor, xf: torch.Tensor, kf: torch.Tensor, K: int, bidirectional: bool, n: int,
             x_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [B, L, D] in x_dtype, dkernel [Dk, K] float32) for the output gradient dy [B, L, D]."""
    L = dy.shape[1]
    gf = torch.fft.rfft(pad_rows(dy, n))
    dx = unpad_rows(torch.fft.irfft(gf * kf.conj(), n=n), L, x_dtype)
    dkc = torch.fft.irfft((gf * xf.conj()).sum(0), n=n)  # [D, n]
    return dx, kernel_grad(dkc, K, bidirectional)
