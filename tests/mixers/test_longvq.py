"""Contract tests of the LongVQ mixer: shapes and aux keys, padding invariance, causality, determinism,
torch == triton backends, codebook outside the optimizer, separate Q and K maps (eqs. 11-12), and a short fit."""

from __future__ import annotations

import pytest
import torch

from longmixer.mixers.longvq import LongVQ
from longmixer.models import SequenceModel
from longmixer.utils.optim import build_param_groups

D = 16


def make(causal=False, attention="softmax", backend="torch", seed=0, **kw):
    torch.manual_seed(seed)
    kw = dict(dict(zdim=8, hdim=24, n_codes=16, block_size=16), **kw)
    return LongVQ(D, causal=causal, attention=attention, backend=backend, **kw)


def factory(d_model, causal):
    """What the model yaml's `_partial_: true` gives SequenceModel."""
    return LongVQ(d_model, causal=causal, zdim=8, hdim=24, n_codes=16, block_size=16, backend="torch")


MODES = [pytest.param(c, a, id=f"{'causal' if c else 'bidir'}-{a}") for c in (False, True)
         for a in ("softmax", "laplace")]


@pytest.mark.parametrize("causal,attention", MODES)
def test_shape_and_aux(causal, attention):
    layer = make(causal, attention)
    x = torch.randn(2, 37, D)
    y, aux = layer(x, residual=x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert set(aux) == {"loss/vq_commit", "stats/vq_used_codes", "stats/vq_perplexity"}
    assert all(v.dim() == 0 for v in aux.values())


@pytest.mark.parametrize("causal,attention", MODES)
def test_padding_invariance(causal, attention):
    layer = make(causal, attention).eval()
    x = torch.randn(2, 40, D)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 29:] = False
    y, _ = layer(x, mask)
    x2 = x.clone()
    x2[1, 29:] = 50 * torch.randn(11, D)
    y2, _ = layer(x2, mask)
    torch.testing.assert_close(y[mask], y2[mask], atol=1e-5, rtol=1e-5)
    # the padded row equals the same sequence without padding
    y3, _ = layer(x[1:, :29], None)
    torch.testing.assert_close(y[1, :29], y3[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["softmax", "laplace"])
def test_causality(attention):
    layer = make(True, attention).eval()
    x = torch.randn(1, 70, D, dtype=torch.float64, requires_grad=True)
    layer.double()
    y, _ = layer(x)
    for i in (0, 15, 16, 40, 68):
        (g,) = torch.autograd.grad(y[0, i].sum(), x, retain_graph=True)
        past = g[0, : i + 1].abs().max().item()
        # the causal MD-EMA is an FFT convolution: its round-off reaches the future at ~1e-16, nothing more
        assert g[0, i + 1:].abs().max().item() <= 1e-10 * past, f"output {i} depends on the future"
        assert past > 0


def test_determinism_under_seed():
    x = torch.randn(2, 33, D)
    y1, aux1 = make(seed=3)(x)
    y2, aux2 = make(seed=3)(x)
    torch.testing.assert_close(y1, y2, atol=0, rtol=0)
    torch.testing.assert_close(aux1["loss/vq_commit"], aux2["loss/vq_commit"], atol=0, rtol=0)


@pytest.mark.parametrize("causal,attention", MODES)
def test_torch_equals_triton(causal, attention):
    x = torch.randn(2, 40, D)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, 31:] = False
    outs = []
    for backend in ("torch", "triton"):
        layer = make(causal, attention, backend=backend).eval()
        xx = x.clone().requires_grad_(True)
        y, aux = layer(xx, mask)
        (y[mask].sum() + aux["loss/vq_commit"]).backward()
        outs.append((y, xx.grad, layer.q_proj.weight.grad, layer.k_proj.weight.grad, layer.rel_bias.grad))
    for name, a, b in zip(("y", "dx", "dq_proj", "dk_proj", "drel_bias"), *outs):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=name)


def test_codebook_is_not_optimized():
    model = SequenceModel(factory, d_model=D, n_layers=2, vocab_size=11, num_classes=3)
    params = {id(p) for g in build_param_groups(model, 1e-3, 0.01) for p in g["params"]}
    for block in model.blocks:
        assert id(block.mixer.vq.sums) not in params and id(block.mixer.vq.counts) not in params
    assert "blocks.0.mixer.vq.sums" in model.state_dict() and "blocks.0.mixer.vq.pending_sums" not in model.state_dict()


@pytest.mark.parametrize("causal", [False, True], ids=["classify", "lm"])
def test_fits_a_batch(causal):
    """A post-norm LongVQ model with FFN (eqs. 21-22) lowers its loss (task loss + commit loss) on one batch."""
    torch.manual_seed(0)
    model = SequenceModel(factory, d_model=D, n_layers=2, vocab_size=11,
                          num_classes=None if causal else 3, causal=causal, prenorm=False, d_ffn=32,
                          pool="none" if causal else "mean", head="lm" if causal else "classifier")
    x = torch.randint(1, 11, (4, 32))
    labels = torch.randint(3, (4,))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(15):
        model.set_progress(step, 15)
        out, aux = model(x)
        if causal:
            loss = torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), x[:, 1:].reshape(-1))
        else:
            loss = torch.nn.functional.cross_entropy(out, labels)
        loss = loss + sum(v for k, v in aux.items() if k.startswith("loss/"))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.75 * losses[0], losses


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="attention"):
        make(attention="relu2")
    with pytest.raises(ValueError, match="block_size"):
        make(block_size=100)


def test_query_and_key_are_separate_maps():
    """Eqs. 11-12: Q = Linear(Z), K = Linear(Z), two maps with their own parameters; the key map alone feeds the
    quantizer, so changing it moves the codes while changing the query map does not."""
    layer = make().eval()
    assert layer.q_proj.weight is not layer.k_proj.weight
    assert layer.q_proj.weight.data_ptr() != layer.k_proj.weight.data_ptr()
    assert not hasattr(layer, "qk_gamma")
    x = torch.randn(2, 40, D)
    y, aux = layer(x)
    (y.sum() + aux["loss/vq_commit"]).backward()
    assert layer.q_proj.weight.grad.abs().sum() > 0 and layer.k_proj.weight.grad.abs().sum() > 0
    z = layer.ema(x, None)
    codes = layer.vq(layer.k_proj(z), None)[1]
    with torch.no_grad():
        layer.q_proj.weight.normal_()
    assert torch.equal(layer.vq(layer.k_proj(z), None)[1], codes)
    with torch.no_grad():
        layer.k_proj.weight.normal_()
    assert not torch.equal(layer.vq(layer.k_proj(z), None)[1], codes)


def test_tied_qk_is_megas_shared_projection():
    """tied_qk=True: one projection with per-dimension scale / offset, E (D - 3) parameters fewer per layer."""
    untied, tied = make(), make(tied_qk=True)
    assert not hasattr(tied, "q_proj") and tied.qk_gamma.shape == (2, 8)
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(untied) - n(tied) == 8 * (D - 3)
    y, _ = tied(torch.randn(2, 40, D))
    assert torch.isfinite(y).all()
