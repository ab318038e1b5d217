"""Long FFT convolution and CHELA's short-long convolution (section 4.2): direct-sum parity, structural
reparameterization, causality, padding; plus the S4D kernel against its recurrence."""

from __future__ import annotations

import pytest
import torch

from longmixer.layers.longconv import LongConv, ShortLongConv, fft_conv, fit_kernel, short_kernel_sizes
from longmixer.layers.s4d import S4DConv, S4DKernel


def direct_conv(u, k, bidirectional):
    """y_i = sum_{j<=i} k0[i-j] u_j (+ sum_{j>i} k1[j-i-1] u_j when two-sided), as a loop."""
    B, L, D = u.shape
    y = torch.zeros_like(u)
    for i in range(L):
        for j in range(L):
            if j <= i:
                y[:, i] += (k[0] if bidirectional else k)[:, i - j] * u[:, j]
            elif bidirectional:
                y[:, i] += k[1][:, j - i - 1] * u[:, j]
    return y


@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "two-sided"])
@pytest.mark.parametrize("L", [1, 2, 17])
def test_fft_conv_equals_direct_sum(bidirectional, L):
    gen = torch.Generator().manual_seed(0)
    u = torch.randn(2, L, 3, generator=gen, dtype=torch.float64)
    k = torch.randn(*((2,) if bidirectional else ()), 3, L, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(fft_conv(u, k, bidirectional=bidirectional), direct_conv(u, k, bidirectional))


def test_short_kernel_sizes():
    assert short_kernel_sizes(1000) == (3, 7)
    assert short_kernel_sizes(1024) == (3, 7)
    assert short_kernel_sizes(16000) == (3, 9)
    assert short_kernel_sizes(50) == (3, 3)


@pytest.mark.parametrize("causal", [False, True], ids=["two-sided", "causal"])
@pytest.mark.parametrize("max_len", [30, 1000])
def test_reparameterized_equals_two_branch(causal, max_len):
    torch.manual_seed(0)
    m = ShortLongConv(6, max_len, causal=causal).double()
    with torch.no_grad():
        m.long.kernel.normal_()  # a non-trivial long kernel
    x = torch.randn(2, 30, 6, dtype=torch.float64)
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, 21:] = False
    two_branch = m(x, mask)
    m.reparameterize()
    assert len(m.short_weights) == 1 and m.short_sizes == (max(short_kernel_sizes(max_len)),)
    torch.testing.assert_close(m(x, mask), two_branch, rtol=1e-12, atol=1e-12)
    m.reparameterize()  # idempotent: SequenceModel may reach the module more than once
    torch.testing.assert_close(m(x, mask), two_branch, rtol=1e-12, atol=1e-12)


def _jacobian_future_block(f, L, D):
    x = torch.randn(1, L, D, dtype=torch.float64, requires_grad=True)
    jac = torch.autograd.functional.jacobian(lambda t: f(t)[0].sum(-1), x)[:, 0]  # [L_out, L_in, D]
    return jac.abs().sum(-1)


def test_causal_short_long_conv_is_causal():
    torch.manual_seed(0)
    m = ShortLongConv(4, 1000, causal=True).double()
    with torch.no_grad():
        m.long.kernel.normal_()
    J = _jacobian_future_block(m, 12, 4)
    past = J.tril(-1).abs().max()
    assert past > 0.1
    assert J.triu(1).abs().max() < 1e-12 * past, "an output depends on a later input (beyond FFT round-off)"


def test_padding_does_not_reach_real_positions():
    torch.manual_seed(0)
    m = ShortLongConv(4, 40, causal=False).double()
    with torch.no_grad():
        m.long.kernel.normal_()
    x = torch.randn(1, 40, 4, dtype=torch.float64)
    mask = torch.zeros(1, 40, dtype=torch.bool)
    mask[:, :25] = True
    x2 = x.clone()
    x2[:, 25:] = 100.0 * torch.randn(1, 15, 4, dtype=torch.float64)
    torch.testing.assert_close(m(x, mask)[:, :25], m(x2, mask)[:, :25])
    torch.testing.assert_close(m(x, mask)[:, :25], m(x[:, :25], mask[:, :25]))  # as if the padding were not there


def test_long_conv_runs_past_its_trained_length():
    """A kernel trained at L is zero-padded at longer L (length extrapolation), so the first L outputs agree."""
    torch.manual_seed(0)
    m = LongConv(3, 8, bidirectional=False).double()
    u = torch.randn(2, 20, 3, dtype=torch.float64)
    torch.testing.assert_close(m(u)[:, :8], m(u[:, :8]))
    assert fit_kernel(m.kernel, 20).shape == (3, 20) and fit_kernel(m.kernel, 20)[:, 8:].abs().max() == 0


@pytest.mark.parametrize("causal", [False, True], ids=["two-sided", "causal"])
def test_short_long_conv_with_a_shorter_kernel_equals_direct_sum(causal):
    """kernel_len taps per direction: offsets up to kernel_len - 1 into the past (and kernel_len into the future)
    get weights, farther ones none, while the short kernels still follow the sequence length."""
    torch.manual_seed(0)
    m = ShortLongConv(3, 1000, causal=causal, kernel_len=4).double()
    with torch.no_grad():
        m.long.kernel.normal_()
    assert m.short_sizes == (3, 7) and m.long.kernel.shape[-1] == 4
    x = torch.randn(2, 15, 3, dtype=torch.float64)
    h = torch.nn.functional.silu(sum(m._short(x, w, b) for w, b in zip(m.short_weights, m.short_biases)))
    k = torch.nn.functional.pad(m.long.kernel, (0, 11))  # [.., 15]: zero past the 4 taps
    torch.testing.assert_close(m(x), direct_conv(h, k, not causal) + h * m.long.skip)


@pytest.mark.parametrize("causal", [False, True], ids=["two-sided", "causal"])
def test_fused_module_loads_the_trained_state(causal):
    """Checkpoints hold the two-branch form; a fused module loads them by fusing on load."""
    torch.manual_seed(0)
    trained = ShortLongConv(4, 100, causal=causal).double()
    x = torch.randn(2, 12, 4, dtype=torch.float64)
    fused = ShortLongConv(4, 100, causal=causal).double()
    fused.reparameterize()
    fused.load_state_dict(trained.state_dict())
    assert len(fused.short_weights) == 1
    torch.testing.assert_close(fused(x), trained(x), rtol=1e-12, atol=1e-12)


def test_long_conv_kernel_has_no_weight_decay():
    from longmixer.utils.optim import OPTIM_ATTR

    assert getattr(LongConv(3, 8, bidirectional=True).kernel, OPTIM_ATTR) == {"weight_decay": 0.0}


def test_s4d_kernel_equals_recurrence():
    """K[l] = 2 Re(C_bar A_bar^l B_bar) with ZOH: compare with running x_l = A_bar x_{l-1} + B_bar u_l on an impulse."""
    torch.manual_seed(0)
    kern = S4DKernel(3, d_state=8)
    K = kern(10)[0].double()  # [D, L]
    dt = kern.log_dt.exp()[0].double()[:, None]
    a = torch.complex(-kern.log_neg_re_a.exp()[0].double(), kern.im_a[0].double())
    a_bar, b_bar = torch.exp(dt * a), (torch.exp(dt * a) - 1) / a
    c = torch.view_as_complex(kern.c[0].double().contiguous())
    x = torch.zeros_like(a)
    out = []
    for l in range(10):
        x = a_bar * x + (b_bar if l == 0 else 0.0)
        out.append(2 * (c * x).sum(-1).real)
    torch.testing.assert_close(K, torch.stack(out, -1), rtol=1e-5, atol=1e-6)


def test_s4d_conv_bidirectional_shapes_and_bad_state():
    m = S4DConv(4, 8, bidirectional=True)
    assert m(torch.randn(2, 9, 4)).shape == (2, 9, 4)
    with pytest.raises(ValueError, match="d_state=7"):
        S4DKernel(4, 7)
