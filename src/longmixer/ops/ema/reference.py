"""Torch reference of the MD-EMA long convolution, computed as the official MEGA code does (facebookresearch/mega,
`fairseq/modules/exponential_moving_average.py`): a (D, N, L) Vandermonde tensor, a sum over N, then rfft/irfft in
float32. It is the oracle of the Triton kernel and the CPU path."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def ema_kernel_ref(coef_in: torch.Tensor, decay: torch.Tensor, coef_out: torch.Tensor, length: int) -> torch.Tensor:
    """EMA kernel k[d, t] = sum_n coef_out[d, n] * coef_in[d, n] * decay[d, n]^t for t < length (MEGA eq. 3 unrolled).

    Args:
        coef_in: [Dk, N] float, p * beta (input weight of each EMA dimension).
        decay: [Dk, N] float in (0, 1), q = 1 - p * alpha.
        coef_out: [Dk, N] float, gamma * scale (output projection over the N dimensions).
        length: kernel length K.

    Returns:
        [Dk, K] in the coefficients' dtype.
    """
    t = torch.arange(length, device=decay.device, dtype=decay.dtype)
    vander = torch.exp(t * torch.log(decay)[..., None])  # [Dk, N, K]
    return torch.einsum("dnk,dn->dk", coef_in[..., None] * vander, coef_out)  # [Dk, K]


def ema_conv(x: torch.Tensor, kernel: torch.Tensor, bidirectional: bool) -> torch.Tensor:
    """Long convolution of x with the EMA kernel by FFT in float32 (cuFFT on GPU).

    Causal: y[i] = sum_{j<=i, i-j<K} k[i-j] x[j] (rfft size 2L, output slice [0, L)).
    Bidirectional: the kernel's first D rows look back, the last D rows look ahead,
    y[i] = sum_{0<=a<K} k1[a] x[i-a] + k2[a] x[i+a]; the centre tap k1[0] + k2[0] counts the current token twice,
    as the official code does (two-sided kernel of length 2K-1, x left-padded by K-1, rfft size 2(L+K-1), output
    slice [2K-2, 2K-2+L)).

    Args:
        x: [B, L, D] (padding already zeroed).
        kernel: [D, K] (causal) or [2D, K] (bidirectional), K <= L.
        bidirectional: see above.

    Returns:
        [B, L, D] float32 (float64 for float64 inputs).
    """
    B, L, D = x.shape
    K = kernel.shape[-1]
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32  # float64 only for the parity oracle
    xt = x.to(dtype).transpose(1, 2)  # [B, D, L]
    kernel = kernel.to(dtype)
    if bidirectional:
        k1, k2 = kernel[:D], kernel[D:]
        kernel = F.pad(k1, (K - 1, 0)) + F.pad(k2.flip(-1), (0, K - 1))  # [D, 2K-1]
        xt = F.pad(xt, (K - 1, 0))  # [B, D, L+K-1]
        n_fft, start = 2 * (L + K - 1), 2 * K - 2
    else:
        n_fft, start = 2 * L, 0
    k_f = torch.fft.rfft(kernel, n=n_fft)
    x_f = torch.fft.rfft(xt, n=n_fft)
    y = torch.fft.irfft(x_f * k_f, n=n_fft)[..., start:start + L]  # [B, D, L]
    return y.transpose(1, 2)  # [B, L, D]


def ema_ref(x: torch.Tensor, coef_in: torch.Tensor, decay: torch.Tensor, coef_out: torch.Tensor, *,
            bidirectional: bool = False, truncation: int | None = None) -> torch.Tensor:
    """MD-EMA convolution without the omega residual: kernel of length K = min(truncation, L), then FFT convolution.

    Args:
        x: [B, L, D] float (zero at padded positions).
        coef_in, decay, coef_out: [Dk, N] with Dk = 2D if bidirectional else D (see `ema_kernel_ref`).
        bidirectional: two-sided kernel (see `ema_conv`).
        truncation: cap on the kernel length; None means L.

    Returns:
        [B, L, D] in x's dtype (computed in float32, or float64 for float64 inputs).
    """
    L = x.shape[1]
    K = L if truncation is None else min(truncation, L)
    kernel = ema_kernel_ref(coef_in, decay, coef_out, K)
    return ema_conv(x, kernel, bidirectional).to(x.dtype)


def ema_scan_ref(x: torch.Tensor, coef_in: torch.Tensor, decay: torch.Tensor, coef_out: torch.Tensor) -> torch.Tensor:
    """Causal, untruncated MD-EMA as the plain recurrence (MEGA eq. 2), one step at a time: an oracle of the chunked
    state-passing kernels independent of the FFT.

    h_t[b, d, n] = decay[d, n] h_{t-1}[b, d, n] + coef_in[d, n] x_t[b, d];  y_t[b, d] = sum_n coef_out[d, n] h_t.
    Equal to `ema_ref(..., bidirectional=False, truncation=None)`. O(L) Python steps: small inputs only.

    Args:
        x: [B, L, D] float (zero at padded positions); coef_in, decay, coef_out: [D, N].

    Returns:
        [B, L, D] in x's dtype, computed in the promoted dtype of x and the coefficients (float64 stays float64).
    """
    B, L, D = x.shape
    out_dtype, dtype = x.dtype, torch.promote_types(x.dtype, coef_in.dtype)
    x, coef_in, decay, coef_out = (t.to(dtype) for t in (x, coef_in, decay, coef_out))
    h = x.new_zeros(B, D, coef_in.shape[-1])
    ys = []
    for t in range(L):
        h = decay * h + coef_in * x[:, t, :, None]
        ys.append(torch.einsum("bdn,dn->bd", h, coef_out))
    return torch.stack(ys, dim=1).to(out_dtype)
