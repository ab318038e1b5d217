"""Shared by several ops: MEGA's laplace attention function (MEGA section 3.3, eq. 17), used by the chunked attention
(MEGA, MEGA-chunk), the VQ attention (LongVQ's laplace ablation) and CHELA's laplace feature map; and the GPU's SM
count, which launchers use to split work until the programs fill the GPU; the value width above which the
full-length attention backwards (MEGA's, SeqBoat-full's) leave dv to a second pass; and the diagonal sums of a
Toeplitz bias's gradient (LongVQ's window bias, the chunked attention's ds tiles)."""

from __future__ import annotations

import functools
import math

import torch
from torch.nn import functional as F

LAPLACE_MU = math.sqrt(0.5)
LAPLACE_SIGMA = math.sqrt(0.25 / math.pi)  # sigma^2 = 1 / (4 pi)
# Values wider than this take the two-pass long-span backward (ops/local_attention `LONG_SPAN_K64`,
# ops/sparse_local_attention `DV_PASS_TILES`): the [64, V] float32 dv accumulator is what kept one pass in 32-query
# tiles, and the two passes were timed at V 256 only (docs/benchmarks.md, "Two-pass long-span backward").
DV_PASS_MIN_V = 128


def laplace(s: torch.Tensor) -> torch.Tensor:
    """0.5 * (1 + erf((s - mu) / (sigma sqrt 2))), the Gaussian CDF with mu = sqrt(1/2), sigma = (4 pi)^-1/2."""
    return 0.5 * (1.0 + torch.erf((s - LAPLACE_MU) / (LAPLACE_SIGMA * math.sqrt(2.0))))


def diagonal_sums(x: torch.Tensor) -> torch.Tensor:
    """[..., R, W] -> [..., W + R - 1]: out[t] = the sum of x[i, c] over c - i + R - 1 = t, the gradient of a Toeplitz
    bias gathered into an [R, W] block. With the rows reversed (i' = R-1-i) and each padded to W + R, the flat entry
    i' (W + R) + c sits at row i', column i' + c = t of an [R, W + R - 1] view: no index scatter."""
    *lead, R, W = x.shape
    n = W + R - 1
    skewed = F.pad(x.flip(-2), (0, R)).flatten(-2)[..., :R * n]
    return skewed.view(*lead, R, n).sum(-2)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached per device: launchers ask on every call)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
