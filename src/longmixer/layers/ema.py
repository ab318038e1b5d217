"""Multi-dimensional damped EMA (MD-EMA) of MEGA (Ma et al., arXiv:2209.10655, section 2.2, eqs. 2-3), with the
parameter names, initialization and FFT slices of the official code (facebookresearch/mega,
`fairseq/modules/exponential_moving_average.py`). Shared by MEGA, SeqBoat and LongVQ."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from longmixer.ops.ema import ema


class MultiHeadEMA(nn.Module):
    """MD-EMA: y = SiLU(EMA(x) + omega * x), EMA(x)[d] = sum_n gamma_dn * h_dn, h_t = p*beta*x_t + (1 - p*a) h_{t-1}.

    Parameter names follow the official code, where the roles are swapped against the paper: `delta` gives the
    paper's alpha (input weight p = sigmoid(delta)) and `alpha` gives the paper's delta (damping
    a = sigmoid(alpha)); the decay is q = 1 - p * a (MEGA eq. 3). Shapes: delta, alpha, beta [Dk, N, 1],
    gamma [Dk, N], omega [D], with Dk = 2D when bidirectional (separate forward and backward coefficients, shared
    omega). The output projection is gamma * N^-1/2 (the official `scale`).

    Args:
        d_model: D.
        ndim: N, the EMA dimension per channel (16 in every MEGA recipe).
        bidirectional: two-sided kernel (the centre tap is counted by both directions, as the official code does).
        truncation: cap on the kernel length, min(truncation, L); None means the full length.
        silu: apply the SiLU inside (MEGA); False returns EMA(x) + omega * x (SeqBoat applies SiLU outside).
        backend: auto | torch | triton for the convolution (`longmixer.ops.ema.ema`).
    """

    def __init__(self, d_model: int, ndim: int = 16, *, bidirectional: bool = False,
                 truncation: int | None = None, silu: bool = True, backend: str = "auto"):
        super().__init__()
        if ndim < 1:
            raise ValueError(f"MultiHeadEMA ndim={ndim} must be >= 1 (MEGA uses 16)")
        if truncation is not None and truncation < 1:
            raise ValueError(f"MultiHeadEMA truncation={truncation} must be >= 1, or None for the full length")
        self.d_model, self.ndim = d_model, ndim
        self.bidirectional, self.truncation, self.silu, self.backend = bidirectional, truncation, silu, backend
        kdim = 2 * d_model if bidirectional else d_model
        self.scale = math.sqrt(1.0 / ndim)
        self.delta = nn.Parameter(torch.empty(kdim, ndim, 1))
        self.alpha = nn.Parameter(torch.empty(kdim, ndim, 1))
        self.beta = nn.Parameter(torch.empty(kdim, ndim, 1))
        self.gamma = nn.Parameter(torch.empty(kdim, ndim))
        self.omega = nn.Parameter(torch.empty(d_model))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Official init: delta, alpha ~ N(0, 0.2); beta ~ N(0, 0.02) + [1, -1, 1, ...] along N (the official
        comment: alternating signs "seem more stable"); gamma, omega ~ N(0, 1)."""
        nn.init.normal_(self.delta, mean=0.0, std=0.2)
        nn.init.normal_(self.alpha, mean=0.0, std=0.2)
        sign = torch.ones(self.ndim, 1)
        sign[1::2] = -1.0
        self.beta.normal_(mean=0.0, std=0.02).add_(sign)
        nn.init.normal_(self.gamma, mean=0.0, std=1.0)
        nn.init.normal_(self.omega, mean=0.0, std=1.0)

    def coeffs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(coef_in, decay, coef_out), each [Dk, N]: p * beta, q = 1 - p * a, gamma * scale (MEGA eq. 3)."""
        p = torch.sigmoid(self.delta).squeeze(-1)
        a = torch.sigmoid(self.alpha).squeeze(-1)
        return p * self.beta.squeeze(-1), 1.0 - p * a, self.gamma * self.scale

    def kernel(self, length: int) -> torch.Tensor:
        """The EMA kernel k [Dk, K], K = min(truncation, length)."""
        from longmixer.ops.ema import ema_kernel

        K = length if self.truncation is None else min(self.truncation, length)
        return ema_kernel(*self.coeffs(), K, backend=self.backend)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B, L, D], mask [B, L] bool (True = real) -> [B, L, D]. Padded inputs are zeroed before the
        convolution, so they never reach real positions."""
        residual = x * self.omega
        if mask is not None:
            x = x.masked_fill(~mask[..., None], 0.0)
        out = ema(x, *self.coeffs(), bidirectional=self.bidirectional, truncation=self.truncation,
                  backend=self.backend) + residual
        return F.silu(out) if self.silu else out

    def step(self, x_t: torch.Tensor, state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One causal step of the recurrence (MEGA eq. 2), O(1) in the length: x_t [B, D] -> (y_t [B, D],
        state [B, D, N]). Untruncated: with `truncation` set, it equals `forward` only for positions < truncation.

        Raises:
            ValueError: on a bidirectional EMA, which has no recurrent form.
        """
        if self.bidirectional:
            raise ValueError("MultiHeadEMA.step needs a causal EMA; this one has bidirectional=True")
        coef_in, decay, coef_out = self.coeffs()
        h = coef_in * x_t[..., None]  # [B, D, N]
        if state is not None:
            h = h + decay * state
        out = torch.einsum("bdn,dn->bd", h, coef_out) + self.omega * x_t
        return (F.silu(out) if self.silu else out), h
