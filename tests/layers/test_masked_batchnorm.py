"""MaskedBatchNorm's batch statistics against torch's BatchNorm in float64, where float32 one-pass moments fail."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longmixer.layers.norms import MaskedBatchNorm


def _reference(x: torch.Tensor, norm: MaskedBatchNorm) -> torch.Tensor:
    """torch's training-mode batch norm over the (B, L) positions, in float64."""
    xd = x.double().transpose(1, 2)  # [B, D, L]
    y = F.batch_norm(xd, None, None, norm.weight.double(), norm.bias.double(), training=True, eps=norm.eps)
    return y.transpose(1, 2)


@pytest.mark.parametrize("mean,std", [(0.0, 1.0), (3000.0, 1.0), (10.0, 1e-3)])
def test_batch_statistics_hold_for_channels_far_from_zero(mean, std):
    """A channel whose mean is 3,000 standard deviations from zero (or whose variance is near eps) gets the float64
    normalization: the one-pass E[x^2] - E[x]^2 returned a variance of 0 there and outputs of std 158."""
    torch.manual_seed(0)
    x = (torch.randn(8, 500, 4) * std + mean).requires_grad_()
    norm = MaskedBatchNorm(4).train()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    y = norm(x)
    ref = _reference(x, norm)
    assert torch.allclose(y.double(), ref, atol=2e-3), (y.double() - ref).abs().max()
    g = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, g)
    (dx_ref,) = torch.autograd.grad(ref, x, g.double())
    assert torch.allclose(dx, dx_ref, rtol=1e-2, atol=1e-3 * dx_ref.abs().max().item())
    unbiased = x.detach().double().var((0, 1))  # the running variance takes the unbiased estimate
    assert torch.allclose(norm.running_var.double(), 0.9 + 0.1 * unbiased, rtol=1e-3)
    assert torch.allclose(norm.running_mean.double(), 0.1 * x.detach().double().mean((0, 1)), rtol=1e-4)


def test_padding_leaves_the_statistics_alone_in_both_passes():
    """The variance pass ignores padding too: the statistics of a padded batch are those of its valid positions."""
    torch.manual_seed(1)
    x = torch.randn(3, 7, 5) + 50.0
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[0, 4:] = False
    mask[2, 2:] = False
    garbage = x.clone()
    garbage[~mask] = 1e4
    norm = MaskedBatchNorm(5).train()
    y = norm(garbage, mask)
    valid = x[mask]  # [N, D]
    expect = (valid - valid.mean(0)) / torch.sqrt(valid.var(0, unbiased=False) + norm.eps)
    assert torch.allclose(y[mask], expect, atol=1e-4)
    assert torch.allclose(norm.running_var, 0.9 + 0.1 * valid.var(0), rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_a_model_in_another_dtype_trains(dtype):
    """Bug: the batch moments were float32 whatever the module's dtype, and `running_mean.lerp_` refused them, so a
    model cast to bfloat16 / float16 / float64 (`trainer.precision=bf16-true`, `16-true`, `64-true`) with
    `norm=batchnorm` failed at its first training step. The running statistics now stay in the module's dtype."""
    torch.manual_seed(2)
    x = torch.randn(3, 7, 5) * 2.0 + 1.0
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[1, 3:] = False
    ref = MaskedBatchNorm(5).train()
    y_ref = ref(x, mask)
    norm = MaskedBatchNorm(5).to(dtype).train()
    y = norm(x.to(dtype), mask)
    assert y.dtype == dtype and norm.running_mean.dtype == dtype and norm.running_var.dtype == dtype
    tol = 5e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5
    assert torch.allclose(y[mask].float(), y_ref[mask], atol=tol)
    assert torch.allclose(norm.running_var.float(), ref.running_var, rtol=tol)
    assert torch.allclose(norm.running_mean.float(), ref.running_mean, atol=tol)
