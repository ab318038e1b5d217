"""LongVQ mixer beyond the shared contract: torch == triton backends, codebook outside the optimizer, separate Q
and K maps (eqs. 11-12), argument errors and a short fit."""

from __future__ import annotations

import pytest
import torch

from longmixer.mixers.longvq import LongVQ
from longmixer.models import SequenceModel
from longmixer.utils.optim import build_param_groups

D = 16


def make(causal=False, attention="softmax", backend="torch", seed=0, d_model=D, **kw):
    torch.manual_seed(seed)
    kw = dict(dict(zdim=8, hdim=24, n_codes=16, chunk_size=16), **kw)
    return LongVQ(d_model, causal=causal, attention=attention, backend=backend, **kw)


def factory(d_model, causal):
    """What the model yaml's `_partial_: true` gives SequenceModel."""
    return LongVQ(d_model, causal=causal, zdim=8, hdim=24, n_codes=16, chunk_size=16, backend="torch")


# each attention and each direction once (the op's own parity, every combination, is tests/ops/test_vq_attention.py;
# here the mixer's wiring: about 5-10 s a case in the interpreter). Width 4: the interpreter's time is the MD-EMA's
# chunked kernels, one program per channel (at D 16, 25-45 s a case)
MODES = [pytest.param(False, "softmax", id="bidir-softmax"), pytest.param(True, "laplace", id="causal-laplace")]


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("causal,attention", MODES)
def test_torch_equals_triton(causal, attention):
    x = torch.randn(2, 40, 4)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[0, 31:] = False
    outs = []
    for backend in ("torch", "triton"):
        layer = make(causal, attention, backend=backend, d_model=4).eval()
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
    with pytest.raises(ValueError, match="chunk_size"):
        make(chunk_size=100)


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
