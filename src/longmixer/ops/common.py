"""Numerics shared by several ops: MEGA's laplace attention function (MEGA section 3.3, eq. 17), used by the chunked
attention (MEGA, MEGA-chunk), the VQ attention (LongVQ's laplace ablation) and CHELA's laplace feature map."""

from __future__ import annotations

import math

import torch

LAPLACE_MU = math.sqrt(0.5)
LAPLACE_SIGMA = math.sqrt(0.25 / math.pi)  # sigma^2 = 1 / (4 pi)


def laplace(s: torch.Tensor) -> torch.Tensor:
    """0.5 * (1 + erf((s - mu) / (sigma sqrt 2))), the Gaussian CDF with mu = sqrt(1/2), sigma = (4 pi)^-1/2."""
    return 0.5 * (1.0 + torch.erf((s - LAPLACE_MU) / (LAPLACE_SIGMA * math.sqrt(2.0))))
