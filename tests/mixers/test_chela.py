"""CHELA layer (eqs. 8-15) beyond the shared contract (tests/mixers/test_contract.py): torch == triton backends,
reparameterization through the backbone, the laplace feature map, argument errors and short fits."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from longmixer.mixers.chela import CHELA, laplace_feature
from longmixer.models import SequenceModel

CONVS = ["short_long", "long", "ema", "s4d"]


def make(conv="short_long", attention="norm", causal=False, backend="torch", d=16, max_len=24, n_heads=2, seed=0):
    torch.manual_seed(seed)
    m = CHELA(d, causal=causal, max_len=max_len, n_heads=n_heads, attention=attention, conv=conv,
              backend=backend)
    with torch.no_grad():  # larger q/k scales than the GAU init, so attention terms are not vanishingly small
        m.qk_weight.normal_(0.0, 1.0)
        m.qk_bias.normal_(0.0, 0.5)
    return m.double() if backend == "torch" else m


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_torch_backend_equals_triton_backend(causal):
    m = make("short_long", "laplace", causal=causal, backend="triton", d=24, max_len=40, n_heads=2)
    x = torch.randn(2, 40, 24, requires_grad=True)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 29:] = False
    y_tri, _ = m(x, mask)
    g_tri = torch.autograd.grad(y_tri[mask].sum(), [x] + list(m.parameters()))
    m.backend = "torch"
    y_ref, _ = m(x, mask)
    g_ref = torch.autograd.grad(y_ref[mask].sum(), [x] + list(m.parameters()))
    torch.testing.assert_close(y_tri, y_ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(g_tri, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def _model(causal=False, **kw):
    torch.manual_seed(0)
    mixer = partial(CHELA, max_len=32, n_heads=2, attention="laplace", backend="torch")
    if causal:
        return SequenceModel(mixer, d_model=32, n_layers=2, vocab_size=11, causal=True, prenorm=True, d_ffn=64,
                             pool="none", head="lm", **kw)
    return SequenceModel(mixer, d_model=32, n_layers=2, vocab_size=11, num_classes=3, norm="batchnorm",
                         prenorm=False, d_ffn=64, **kw)


def test_model_reparameterize_keeps_outputs():
    model = _model().eval()
    tokens = torch.randint(1, 11, (3, 32))
    mask = torch.ones(3, 32, dtype=torch.bool)
    mask[2, 20:] = False
    before, _ = model(tokens, mask)
    model.reparameterize()
    assert all(len(b.mixer.conv.short_weights) == 1 for b in model.blocks)
    after, _ = model(tokens, mask)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["classification", "lm"])
def test_fit_fixed_batch(causal):
    """A few Adam steps on one batch must cut the loss: gradients reach every part of the layer."""
    model = _model(causal=causal)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 11, (8, 32), generator=gen)
    labels = torch.randint(0, 3, (8,), generator=gen)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        out, _ = model(tokens, torch.ones_like(tokens, dtype=torch.bool))
        if causal:
            loss = torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, 11), tokens[:, 1:].reshape(-1))
        else:
            loss = torch.nn.functional.cross_entropy(out, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    for name, p in model.named_parameters():
        if "mixer" in name:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_laplace_feature_matches_mega():
    mu = torch.tensor(0.5 ** 0.5)
    torch.testing.assert_close(laplace_feature(mu), torch.tensor(0.5))
    assert laplace_feature(torch.tensor(-5.0)) < 1e-6 and laplace_feature(torch.tensor(5.0)) > 1 - 1e-6


@pytest.mark.parametrize("kwargs,match", [
    (dict(attention="softmax"), "attention='softmax'"),
    (dict(conv="s4"), "conv='s4'"),
    (dict(n_heads=3), "n_heads=3"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CHELA(16, max_len=8, **kwargs)
