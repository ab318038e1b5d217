"""MultiHeadEMA (longmixer.layers.ema) against a direct O(L^2) convolution, the recurrent step, and causality."""

import pytest
import torch
from torch.nn import functional as F

from longmixer.layers.ema import MultiHeadEMA


def _direct(layer: MultiHeadEMA, x: torch.Tensor) -> torch.Tensor:
    """y[i] = silu(sum_j k[i-j] x[j] (+ ahead taps) + omega x[i]) with k[d, t] = sum_n gamma*scale*p*beta*q^t."""
    coef_in, decay, coef_out = layer.coeffs()
    B, L, D = x.shape
    K = L if layer.truncation is None else min(layer.truncation, L)
    t = torch.arange(K, dtype=x.dtype)
    k = (coef_out[..., None] * coef_in[..., None] * decay[..., None] ** t).sum(1)  # [Dk, K]
    y = x * layer.omega
    for i in range(L):
        for a in range(K):
            if i - a >= 0:
                y[:, i] = y[:, i] + k[:D, a] * x[:, i - a]
            if layer.bidirectional and i + a < L:
                y[:, i] = y[:, i] + k[D:, a] * x[:, i + a]
    return F.silu(y) if layer.silu else y


@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidir"])
@pytest.mark.parametrize("truncation", [None, 7], ids=["full", "trunc7"])
@pytest.mark.parametrize("silu", [True, False], ids=["silu", "nosilu"])
def test_forward_matches_direct_convolution(bidirectional, truncation, silu):
    torch.manual_seed(0)
    layer = MultiHeadEMA(6, 4, bidirectional=bidirectional, truncation=truncation, silu=silu,
                         backend="torch").double()
    x = torch.randn(2, 19, 6, dtype=torch.float64)
    torch.testing.assert_close(layer(x), _direct(layer, x), rtol=1e-9, atol=1e-9)


def test_step_matches_fft_forward():
    torch.manual_seed(1)
    layer = MultiHeadEMA(5, 16, backend="torch").double()
    x = torch.randn(3, 23, 5, dtype=torch.float64)
    state, ys = None, []
    for t in range(x.shape[1]):
        y_t, state = layer.step(x[:, t], state)
        ys.append(y_t)
    torch.testing.assert_close(torch.stack(ys, 1), layer(x), rtol=1e-9, atol=1e-9)
    assert state.shape == (3, 5, 16)


def test_causal_layer_is_causal():
    torch.manual_seed(2)
    layer = MultiHeadEMA(4, 8, backend="torch").double()
    x = torch.randn(1, 12, 4, dtype=torch.float64, requires_grad=True)
    jac = torch.autograd.functional.jacobian(lambda v: layer(v).sum(-1), x)  # [1, L, 1, L, D]
    dep = jac[0, :, 0].abs().sum(-1)  # [L_out, L_in]
    # FFT round-off leaks ~1e-18 (float64); a real dependence on the future would be of order 1
    assert dep.triu(1).max() < 1e-12
    assert torch.all(dep.diagonal() > 1e-3)


def test_padding_does_not_reach_real_positions():
    torch.manual_seed(3)
    layer = MultiHeadEMA(4, 8, bidirectional=True, backend="torch").double()
    x = torch.randn(2, 10, 4, dtype=torch.float64)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[:, 7:] = False
    x2 = x.clone()
    x2[:, 7:] = 100.0
    torch.testing.assert_close(layer(x, mask)[:, :7], layer(x2, mask)[:, :7])


def test_official_parameter_shapes_and_init():
    layer = MultiHeadEMA(8, 16, bidirectional=True)
    assert layer.delta.shape == (16, 16, 1) and layer.gamma.shape == (16, 16) and layer.omega.shape == (8,)
    assert layer.scale == 0.25
    signs = torch.sign(layer.beta.mean(0).squeeze(-1))
    assert torch.equal(signs, torch.tensor([1.0, -1.0] * 8))
    assert sum(p.numel() for p in layer.parameters()) == 16 * 16 * 4 + 8


def test_step_rejects_bidirectional():
    with pytest.raises(ValueError, match="bidirectional"):
        MultiHeadEMA(4, bidirectional=True).step(torch.zeros(1, 4))
