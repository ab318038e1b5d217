"""ops/ema scan: the causal MD-EMA recurrence kernel (`ema_scan`, Triton under TRITON_INTERPRET=1 on CPU) against
the float64 loop reference `ema_scan_ref` and the official FFT reference `ema_ref`, forward and every gradient."""

import copy

import pytest
import torch
from torch.nn import functional as F

from longmixer.layers.ema import MultiHeadEMA
from longmixer.ops.ema import ema_ref, ema_scan, ema_scan_ref


def _inputs(B, L, D, N, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, L, D, generator=g, dtype=dtype)
    coef_in = torch.randn(D, N, generator=g, dtype=dtype)
    decay = torch.rand(D, N, generator=g, dtype=dtype) * 0.98 + 0.01
    coef_out = torch.randn(D, N, generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (x, coef_in, decay, coef_out)]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _run(fn, tensors, seed=1):
    y = fn()
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(y.dtype)
    return (y,) + torch.autograd.grad(y, tensors, dy)


def test_loop_reference_equals_official_fft_reference():
    tensors = _inputs(2, 23, 3, 4)
    for name, a, b in zip(("y", "dx", "dcoef_in", "ddecay", "dcoef_out"),
                          _run(lambda: ema_scan_ref(*tensors), tensors), _run(lambda: ema_ref(*tensors), tensors)):
        assert _rel(a, b) < 1e-12, name


# ragged L around the 64-step chunk of the saved states, D not a power of two, N = 16 and 2, B = 1 and 3
@pytest.mark.parametrize("B,L,D,N", [pytest.param(1, 37, 5, 16, id="B1-L37-D5-N16"),
                                     pytest.param(3, 70, 3, 2, id="B3-L70-D3-N2"),
                                     pytest.param(1, 129, 6, 16, id="B1-L129-D6-N16"),
                                     pytest.param(3, 64, 1, 1, id="B3-L64-D1-N1")])
def test_scan_parity_fwd_bwd_float64(B, L, D, N):
    tensors = _inputs(B, L, D, N, seed=L)
    ref = _run(lambda: ema_scan_ref(*tensors), tensors)
    tri = _run(lambda: ema_scan(*tensors, backend="triton"), tensors)
    assert all(t.dtype == torch.float64 for t in tri)
    for name, a, b in zip(("y", "dx", "dcoef_in", "ddecay", "dcoef_out"), tri, ref):
        assert _rel(a, b) < 1e-5, name


def test_scan_parity_float32_and_torch_backend():
    tensors64 = _inputs(2, 50, 7, 16, seed=3)
    tensors32 = [t.detach().float().requires_grad_() for t in tensors64]
    ref = _run(lambda: ema_scan_ref(*tensors64), tensors64)
    tri = _run(lambda: ema_scan(*tensors32, backend="triton"), tensors32)
    tor = _run(lambda: ema_scan(*tensors32, backend="torch"), tensors32)
    for name, a, b, c in zip(("y", "dx", "dcoef_in", "ddecay", "dcoef_out"), tri, tor, ref):
        assert a.dtype == torch.float32, name
        assert _rel(a, c) < 1e-5, f"triton {name}"
        assert _rel(b, c) < 1e-5, f"torch {name}"


@pytest.mark.parametrize("block_d", [4, 16], ids=["block4", "block16"])
def test_launch_configurations_agree(block_d):
    """Other channel blocks (masked last block, several blocks per batch row) give the same y and gradients."""
    from longmixer.ops.ema import scan

    x, coef_in, decay, coef_out = (t.detach().float() for t in _inputs(1, 66, 10, 16, seed=5))
    pb, q, g = (t.t().contiguous() for t in (coef_in, decay, coef_out))
    dy = torch.randn_like(x)
    y0, s0 = scan.ema_scan_fwd(x, pb, q, g, True)
    y1, s1 = scan.ema_scan_fwd(x, pb, q, g, True, block_d=block_d, num_warps=1)
    assert s0.shape == (1, 2, 16, 10)  # one saved state per 64-step chunk, never a (B, L, D, N) tensor
    torch.testing.assert_close(y1, y0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s1, s0, rtol=1e-6, atol=1e-6)
    for a, b in zip(scan.ema_scan_bwd(x, dy, pb, q, g, s1, block_d=block_d, num_warps=1),
                    scan.ema_scan_bwd(x, dy, pb, q, g, s0)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_causal_layer_through_scan_equals_torch_backend():
    """MultiHeadEMA (causal, padded batch): SiLU(ema_scan(x) + omega x) with the layer's coefficients equals the
    layer on the torch backend, output and the gradients of x and every parameter (delta, alpha, beta, gamma,
    omega through the parameter transforms)."""
    torch.manual_seed(0)
    layer = MultiHeadEMA(6, 16, backend="torch").double()
    twin = copy.deepcopy(layer)
    x = torch.randn(2, 40, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 31:] = False

    def through_scan():
        xm = x.masked_fill(~mask[..., None], 0.0)
        return F.silu(ema_scan(xm, *twin.coeffs(), backend="triton") + x * twin.omega)

    dy = torch.randn(2, 40, 6, dtype=torch.float64)
    y_ref, y_tri = layer(x, mask), through_scan()
    g_ref = torch.autograd.grad(y_ref, [x, *layer.parameters()], dy)
    g_tri = torch.autograd.grad(y_tri, [x, *twin.parameters()], dy)
    assert _rel(y_tri, y_ref) < 1e-5
    for (name, _), a, b in zip([("x", None), *layer.named_parameters()], g_tri, g_ref):
        assert _rel(a, b) < 1e-5, name


def test_rejects_bidirectional_coefficients():
    x, coef_in, decay, coef_out = (t.detach() for t in _inputs(1, 8, 3, 4))
    two = [torch.cat([t, t]) for t in (coef_in, decay, coef_out)]
    with pytest.raises(ValueError, match="causal only"):
        ema_scan(x, *two, backend="torch")
