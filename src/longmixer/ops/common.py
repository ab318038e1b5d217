"""Shared by several ops: MEGA's laplace attention function (MEGA section 3.3, eq. 17), used by the chunked attention
(MEGA, MEGA-chunk), the VQ attention (LongVQ's laplace ablation) and CHELA's laplace feature map; and the GPU's SM
count, which launchers use to split work until the programs fill the GPU."""

from __future__ import annotations

import functools
import math

import torch

LAPLACE_MU = math.sqrt(0.5)
LAPLACE_SIGMA = math.sqrt(0.25 / math.pi)  # sigma^2 = 1 / (4 pi)


def laplace(s: torch.Tensor) -> torch.Tensor:
    """0.5 * (1 + erf((s - mu) / (sigma sqrt 2))), the Gaussian CDF with mu = sqrt(1/2), sigma = (4 pi)^-1/2."""
    return 0.5 * (1.0 + torch.erf((s - LAPLACE_MU) / (LAPLACE_SIGMA * math.sqrt(2.0))))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached per device: launchers ask on every call)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
