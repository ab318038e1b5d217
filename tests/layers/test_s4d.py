"""The S4D convolution (layers/s4d.py) beyond the mixer contract."""

from __future__ import annotations

import copy

import pytest
import torch

from longmixer.layers.s4d import S4DConv


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_a_half_precision_module_computes_its_kernel_in_float32(dtype, bidirectional):
    """Bug: a module cast to bfloat16 / float16 (`trainer.precision=bf16-true` or `16-true` with CHELA's
    `conv: s4d` or SeqBoat's `ssm: s4d`) built its complex kernel in that dtype, which torch does not support (a
    RuntimeError for bfloat16, NotImplementedError for complex half), so the first forward failed. The kernel is
    now computed in float32 from the half-precision parameters."""
    torch.manual_seed(0)
    ref = S4DConv(8, 8, bidirectional=bidirectional)
    half = copy.deepcopy(ref).to(dtype)
    x = torch.randn(2, 11, 8)
    y = half(x.to(dtype))
    assert y.dtype == dtype
    assert half.kernel(11).dtype == torch.float32
    ref.load_state_dict({k: v.float() for k, v in half.state_dict().items()})  # the same rounded parameters
    torch.testing.assert_close(y.float(), ref(x.to(dtype).float()), atol=5e-2, rtol=5e-2)
