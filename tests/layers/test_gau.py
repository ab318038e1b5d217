"""Gated-attention-unit parts (longmixer.layers.gau): relative biases, scale-offset heads, gate projection."""

import math

import pytest
import torch
from torch.nn import functional as F

from longmixer.layers.gau import (GateProjection, RotaryRelativePositionalBias, ScaleOffset,
                                  SimpleRelativePositionalBias, bias_matrix)


def _official_simple_bias(w, M, n):
    """The official tiling trick (fairseq SimpleRelativePositionalBias.forward), written out independently."""
    b = w[M - n:M + n - 1]
    t = F.pad(b, (0, n)).repeat(n)[:-n].view(n, 3 * n - 2)
    r = (2 * n - 1) // 2
    return t[:, r:t.shape[1] - r]


@pytest.mark.parametrize("n", [1, 4, 7])
def test_simple_bias_matches_official_tiling(n):
    torch.manual_seed(0)
    rel = SimpleRelativePositionalBias(7)
    torch.testing.assert_close(bias_matrix(rel(n), n), _official_simple_bias(rel.weight.detach(), 7, n))


def test_simple_bias_rejects_long_sequences():
    with pytest.raises(ValueError, match="max_len=4"):
        SimpleRelativePositionalBias(4)(5)


def test_rotary_bias_equals_rotated_dot_products():
    """bias[i, j] = rot_i(a) . rot_j(b) (MEGA's RotaryRelativePositionalBias) depends on j - i only."""
    torch.manual_seed(0)
    S, n = 8, 6
    rot = RotaryRelativePositionalBias(S).double()
    half = S // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float64) * -(math.log(10000.0) / half))
    ang = torch.arange(n, dtype=torch.float64)[:, None] * freq
    sin, cos = ang.sin(), ang.cos()

    def rotate(x):
        x1, x2 = x[:half], x[half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)  # [n, S]

    expected = rotate(rot.alpha.detach()) @ rotate(rot.beta.detach()).T
    torch.testing.assert_close(bias_matrix(rot(n).detach(), n), expected)


def test_scale_offset_heads():
    so = ScaleOffset(5, heads=2)
    with torch.no_grad():
        so.beta.copy_(torch.randn(2, 5))
    z = torch.randn(3, 4, 5)
    q, k = so(z)
    torch.testing.assert_close(q, z * so.gamma[0] + so.beta[0])
    torch.testing.assert_close(k, z * so.gamma[1] + so.beta[1])


def test_gate_projection_splits_and_activates():
    gp = GateProjection(4, [2, 3, 1], ["sigmoid", "silu", "none"])
    x = torch.randn(2, 4)
    raw = gp.proj(x)
    u, zr, hx = gp(x)
    torch.testing.assert_close(u, torch.sigmoid(raw[:, :2]))
    torch.testing.assert_close(zr, F.silu(raw[:, 2:5]))
    torch.testing.assert_close(hx, raw[:, 5:])
    with pytest.raises(ValueError, match="activation"):
        GateProjection(4, [2], ["tanh"])
