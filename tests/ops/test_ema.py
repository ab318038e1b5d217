"""ops/ema: the Triton kernel generation (under TRITON_INTERPRET=1 on CPU) against the float64 torch reference."""

import pytest
import torch

from longmixer.ops.ema import ema, ema_kernel, ema_kernel_ref, ema_ref
from tests.ops._helpers import rel_error


def _inputs(Dk, N, seed=0):
    g = torch.Generator().manual_seed(seed)
    coef_in = torch.randn(Dk, N, generator=g, dtype=torch.float64)
    decay = torch.rand(Dk, N, generator=g, dtype=torch.float64) * 0.98 + 0.01
    coef_out = torch.randn(Dk, N, generator=g, dtype=torch.float64)
    return [t.requires_grad_() for t in (coef_in, decay, coef_out)]



@pytest.mark.parametrize("Dk,N,K", [pytest.param(5, 16, 37, id="D5-N16-K37"), pytest.param(12, 3, 70, id="D12-N3-K70"),
                                    pytest.param(1, 1, 1, id="D1-N1-K1")])
def test_kernel_generation_parity(Dk, N, K):
    coef_in, decay, coef_out = _inputs(Dk, N)
    ref = ema_kernel_ref(coef_in, decay, coef_out, K)
    tri = ema_kernel(coef_in, decay, coef_out, K, backend="triton")
    assert rel_error(tri, ref) < 1e-5, "k"
    dk = torch.randn_like(ref)
    g_ref = torch.autograd.grad(ref, [coef_in, decay, coef_out], dk)
    g_tri = torch.autograd.grad(tri, [coef_in, decay, coef_out], dk)
    for name, a, b in zip(("dcoef_in", "ddecay", "dcoef_out"), g_tri, g_ref):
        assert rel_error(a, b) < 1e-5, name


@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidir"])
@pytest.mark.parametrize("L,D,truncation", [pytest.param(33, 3, None, id="L33-D3"),
                                            pytest.param(50, 4, 17, id="L50-D4-trunc17"),
                                            pytest.param(9, 2, 1, id="L9-D2-trunc1")])
def test_ema_parity_fwd_bwd(bidirectional, L, D, truncation):
    coef_in, decay, coef_out = _inputs(2 * D if bidirectional else D, 16, seed=L)
    x = torch.randn(2, L, D, dtype=torch.float64, requires_grad=True)
    outs, grads = [], []
    for fn in (lambda: ema_ref(x, coef_in, decay, coef_out, bidirectional=bidirectional, truncation=truncation),
               lambda: ema(x, coef_in, decay, coef_out, bidirectional=bidirectional, truncation=truncation,
                           backend="triton")):
        y = fn()
        outs.append(y)
        grads.append(torch.autograd.grad(y, [x, coef_in, decay, coef_out], torch.ones_like(y) + y.detach()))
    assert rel_error(outs[1], outs[0]) < 1e-5, "y"
    for name, a, b in zip(("dx", "dcoef_in", "ddecay", "dcoef_out"), grads[1], grads[0]):
        assert rel_error(a, b) < 1e-5, name


def test_reference_against_recurrence():
    """The FFT reference equals the sequential recurrence h_t = c_in x_t + q h_{t-1}, y_t = sum_n c_out h_t."""
    coef_in, decay, coef_out = (t.detach() for t in _inputs(3, 4))
    x = torch.randn(2, 25, 3, dtype=torch.float64)
    h = torch.zeros(2, 3, 4, dtype=torch.float64)
    ys = []
    for t in range(25):
        h = coef_in * x[:, t, :, None] + decay * h
        ys.append((h * coef_out).sum(-1))
    torch.testing.assert_close(ema_ref(x, coef_in, decay, coef_out), torch.stack(ys, 1))


def test_ema_rejects_bad_shapes():
    coef = torch.rand(3, 4)
    with pytest.raises(ValueError, match="expected 6 for D=3"):
        ema(torch.rand(1, 5, 3), coef, coef, coef, bidirectional=True, backend="torch")
    with pytest.raises(ValueError, match="truncation"):
        ema(torch.rand(1, 5, 3), coef, coef, coef, truncation=0, backend="torch")


def test_fft_length_is_smooth_and_minimal():
    from longmixer.ops.ema.function import fft_length

    for n in (1, 7, 1000, 2047, 5023, 32767):
        m = fft_length(n)
        assert m >= n and all(fft_length(k) != k or k < n for k in range(n, m))
        while m % 2 == 0:
            m //= 2
        while m % 3 == 0:
            m //= 3
        while m % 5 == 0:
            m //= 5
        assert m == 1


@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidir"])
@pytest.mark.parametrize("L,K", [pytest.param(64, 16, id="L64-K16"), pytest.param(40, 39, id="L40-K39")])
def test_truncated_ema_with_slow_decays(bidirectional, L, K):
    """Truncated kernels with decays near 1, where the cut-off tail is almost as large as the kept taps: float32
    matches the float64 reference, output and every gradient."""
    D = 3
    coef_in, _, coef_out = _inputs(2 * D if bidirectional else D, 4, seed=K)
    decay = (1.0 - torch.rand(coef_in.shape, dtype=torch.float64) * 1e-3).requires_grad_()  # q in (0.999, 1)
    x = torch.randn(2, L, D, dtype=torch.float64, requires_grad=True)
    leaves = [x, coef_in, decay, coef_out]
    ref = ema_ref(x, coef_in, decay, coef_out, bidirectional=bidirectional, truncation=K)
    f32 = [t.detach().float().requires_grad_() for t in leaves]
    tri = ema(*f32, bidirectional=bidirectional, truncation=K, backend="triton")
    assert rel_error(tri, ref) < 1e-5, "y"
    dy = torch.randn_like(ref)
    g_ref = torch.autograd.grad(ref, leaves, dy)
    g_tri = torch.autograd.grad(tri, f32, dy.float())
    for name, a, b in zip(("dx", "dcoef_in", "ddecay", "dcoef_out"), g_tri, g_ref):
        assert rel_error(a, b) < 1e-5, name

