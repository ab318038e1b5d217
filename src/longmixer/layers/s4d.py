"""S4D diagonal state-space convolution kernel (Gu et al. 2022, "On the parameterization and initialization of
diagonal state space models", arXiv:2206.11893), for CHELA's Table 6 ablation and SeqBoat's S4D variant."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from longmixer.layers.longconv import fft_conv
from longmixer.utils.optim import set_optim_hparams


class S4DKernel(nn.Module):
    """K[d, l] = 2 Re( sum_n C_dn B_n (exp(dt_d A_dn) - 1) / A_dn * exp(dt_d A_dn l) ), ZOH discretization
    (S4D eq. for the Vandermonde kernel), S4D-Lin init A_n = -1/2 + i pi n, B = 1, C ~ CN(0, 1),
    log dt ~ U[log dt_min, log dt_max]. A and dt get lr_scale `ssm_lr_scale` and no weight decay, as S4 does.

    Args:
        d_model: D (channels; `channels` kernels per channel).
        d_state: N complex modes per channel (N/2 conjugate pairs are implied by the 2 Re(.)).
        channels: kernels per channel (2 for a two-sided convolution).
        dt_min, dt_max: the step-size init range.
        ssm_lr_scale: learning-rate scale of A and dt (S4 uses lr 0.001 against 0.01 elsewhere).
    """

    def __init__(self, d_model: int, d_state: int = 64, *, channels: int = 1, dt_min: float = 1e-3,
                 dt_max: float = 1e-1, ssm_lr_scale: float = 0.1):
        super().__init__()
        if d_state < 2 or d_state % 2:
            raise ValueError(f"S4DKernel d_state={d_state} must be an even number >= 2 (conjugate pairs)")
        n = d_state // 2
        log_dt = torch.rand(channels, d_model) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
        self.log_dt = set_optim_hparams(nn.Parameter(log_dt), lr_scale=ssm_lr_scale, weight_decay=0.0)
        self.log_neg_re_a = set_optim_hparams(nn.Parameter(torch.full((channels, d_model, n), math.log(0.5))),
                                              lr_scale=ssm_lr_scale, weight_decay=0.0)
        self.im_a = set_optim_hparams(nn.Parameter(math.pi * torch.arange(n).float().expand(channels, d_model, n)
                                                   .clone()), lr_scale=ssm_lr_scale, weight_decay=0.0)
        self.c = nn.Parameter(torch.randn(channels, d_model, n, 2) * 0.5 ** 0.5)  # complex C as (re, im)

    def forward(self, length: int) -> Tensor:
        """The kernel [channels, D, length], float32 (float64 for float64 parameters)."""
        # torch has no bfloat16 complex and few complex-half ops: half-precision parameters are read in float32
        acc = torch.promote_types(self.c.dtype, torch.float32)
        dt = self.log_dt.to(acc).exp().unsqueeze(-1)  # [c, D, 1]
        a = torch.complex(-self.log_neg_re_a.to(acc).exp(), self.im_a.to(acc))  # [c, D, n]
        dta = a * dt
        c = torch.view_as_complex(self.c.to(acc)) * (dta.exp() - 1.0) / a  # ZOH: C B (exp(dt A) - 1) / A
        l = torch.arange(length, device=dt.device, dtype=torch.float32)
        vandermonde = torch.exp(dta.unsqueeze(-1) * l)  # [c, D, n, L]
        return 2.0 * torch.einsum("cdn,cdnl->cdl", c, vandermonde).real


class S4DConv(nn.Module):
    """y = K_S4D * u + D u: the S4D convolution as a drop-in for the long convolution (CHELA Table 6).

    Args:
        d_model: D.
        d_state: N (see `S4DKernel`).
        bidirectional: two-sided kernel (one S4D kernel per direction) instead of a causal one.
    """

    def __init__(self, d_model: int, d_state: int = 64, *, bidirectional: bool):
        super().__init__()
        self.bidirectional = bidirectional
        self.kernel = S4DKernel(d_model, d_state, channels=2 if bidirectional else 1)
        self.skip = nn.Parameter(torch.randn(d_model))

    def forward(self, u: Tensor, mask: Tensor | None = None) -> Tensor:
        """u [B, L, D], mask [B, L] bool -> [B, L, D]; padded inputs are zeroed first."""
        if mask is not None:
            u = u.masked_fill(~mask.unsqueeze(-1), 0.0)
        k = self.kernel(u.shape[1])  # [c, D, L]
        return fft_conv(u, k if self.bidirectional else k[0], bidirectional=self.bidirectional) + u * self.skip
