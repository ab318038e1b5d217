"""The arithmetic dtype of an attention kernel whose inputs arrive in mixed dtypes.

Under bf16 autocast a mixer's matmul outputs are bf16 while elementwise products with float32 parameters (scale
and offset, a float32 codebook buffer) stay float32. Feeding such float32 operands to a kernel makes it run its
score dots in exact float32 ("ieee", no tensor cores), tens of times slower than the bf16 dots autocast asked for.
The kernels therefore compute in the 16-bit dtype whenever any floating input is 16-bit; all-float32 inputs keep
exact float32 dots, which the parity tests against the float64 reference rely on.
"""

from __future__ import annotations

import torch

HALF = (torch.bfloat16, torch.float16)


def work_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """The first 16-bit floating dtype among `tensors`, else the first tensor's dtype."""
    present = [t for t in tensors if t is not None]
    for t in present:
        if t.dtype in HALF:
            return t.dtype
    return present[0].dtype
