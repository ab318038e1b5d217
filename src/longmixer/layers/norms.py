"""Sequence norms over [B, L, D]: LayerNorm, ScaleNorm, RMSNorm and a padding-aware BatchNorm (eps 1e-5 for all,
as MEGA's `SequenceNorm`, models.md section 1.6)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
from torch import nn

NORMS = ("layernorm", "scalenorm", "rmsnorm", "batchnorm", "syncbatchnorm")
EPS = 1e-5


class LayerNorm(nn.LayerNorm):
    def __init__(self, d_model: int, eps: float = EPS, affine: bool = True):
        super().__init__(d_model, eps=eps, elementwise_affine=affine)

    def forward(self, x, mask=None):
        return super().forward(x)


class ScaleNorm(nn.Module):
    """x * g / RMS(x) = x * g * sqrt(D) / ||x|| with one learned scalar g (Nguyen & Salazar 2019, in the
    root-mean-square form of MEGA's scalenorm)."""

    def __init__(self, d_model: int, eps: float = EPS):
        super().__init__()
        self.eps = eps
        self.scalar = nn.Parameter(torch.ones(1))

    def forward(self, x, mask=None):
        mean_square = x.float().pow(2).mean(dim=-1, keepdim=True)
        return (x.float() * torch.rsqrt(mean_square + self.eps)).type_as(x) * self.scalar


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x, mask=None):
        mean_square = x.float().pow(2).mean(dim=-1, keepdim=True)
        return (x.float() * torch.rsqrt(mean_square + self.eps)).type_as(x) * self.weight


class MaskedBatchNorm(nn.Module):
    """BatchNorm over the (B, L) positions of each channel, ignoring padding; `sync` all-reduces the moments
    across DDP ranks (syncbatchnorm)."""

    def __init__(self, d_model: int, eps: float = EPS, momentum: float = 0.1, sync: bool = False):
        super().__init__()
        self.eps, self.momentum, self.sync = eps, momentum, sync
        self.weight = nn.Parameter(torch.ones(d_model))
        self.bias = nn.Parameter(torch.zeros(d_model))
        self.register_buffer("running_mean", torch.zeros(d_model))
        self.register_buffer("running_var", torch.ones(d_model))

    def forward(self, x, mask=None):
        # moments in float32 at least (float64 stays float64); the running statistics keep the module's dtype
        acc = torch.promote_types(x.dtype, torch.float32)
        if self.training:
            xf = x.to(acc)
            w = torch.ones_like(xf[..., :1]) if mask is None else mask.unsqueeze(-1).to(xf.dtype)  # [B, L, 1]
            # two passes: the mean, then the variance about it. The one-pass E[x^2] - E[x]^2 cancels in float32
            # once |mean| / std reaches about 1,000 (the variance comes out 0 and the output is scaled by
            # eps^-1/2), or earlier for a channel whose variance is near eps
            first = self._reduce(torch.cat([(xf * w).sum((0, 1)), w.sum((0, 1))]))  # [D + 1]
            count = first[-1].clamp_min(1.0)
            mean = first[:-1] / count
            var = self._reduce(((xf - mean).pow(2) * w).sum((0, 1))) / count
            with torch.no_grad():
                unbiased = var * count / (count - 1).clamp_min(1.0)
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), self.momentum)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), self.momentum)
        else:
            mean, var = self.running_mean.to(acc), self.running_var.to(acc)
        y = (x.to(acc) - mean) * torch.rsqrt(var + self.eps)
        return (y * self.weight + self.bias).type_as(x)

    def _reduce(self, moments: torch.Tensor) -> torch.Tensor:
        """Sums over the DDP ranks for syncbatchnorm, through the differentiable all-reduce: its backward
        all-reduces the gradient of the moments, so each rank's inputs also get the other ranks' loss terms through
        the shared mean and variance (with an in-place dist.all_reduce they do not, and the DDP gradient is not the
        full-batch one)."""
        if self.sync and dist.is_available() and dist.is_initialized():
            return dist_nn.all_reduce(moments)
        return moments


def build_norm(kind: str, d_model: int, affine: bool = True) -> nn.Module:
    """A norm module over [B, L, D] with `forward(x, mask=None)`; `affine=False` (layernorm only, MEGA's
    `--no-affine-final-norm`) drops the learned scale and shift.

    Raises:
        ValueError: unknown `kind`; the message lists the allowed names.
    """
    if not affine and kind != "layernorm":
        raise ValueError(f"a norm without affine parameters is only defined for layernorm, not norm={kind!r}")
    if kind == "layernorm":
        return LayerNorm(d_model, affine=affine)
    if kind == "scalenorm":
        return ScaleNorm(d_model)
    if kind == "rmsnorm":
        return RMSNorm(d_model)
    if kind in ("batchnorm", "syncbatchnorm"):
        return MaskedBatchNorm(d_model, sync=kind == "syncbatchnorm")
    raise ValueError(f"norm={kind!r} is not one of {NORMS}")
