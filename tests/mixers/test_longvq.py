"""LongVQ mixer beyond the shared contract: torch == triton backends, codebook outside the optimizer, argument
errors and a short fit."""

from __future__ import annotations

import pytest
import torch

from longmixer.mixers.longvq import LongVQ
from longmixer.models import SequenceModel
from longmixer.utils.optim import build_param_groups

D = 16


def make(causal=False, attention="softmax", backend="torch", seed=0, **kw):
    torch.manual_seed(seed)
    kw = dict(dict(zdim=8, hdim=24, n_codes=16, chunk_size=16), **kw)
    return LongVQ(D, causal=causal, attention=attention, backend=backend, **kw)


def factory(d_model, causal):
    """What the model yaml's `_partial_: true` gives SequenceModel."""
    return LongVQ(d_model, causal=causal, zdim=8, hdim=24, n_codes=16, chunk_size=16, backend="torch")


MODES = [pytest.param(c, a, id=f"{'causal' if c else 'bidir'}-{a}") for c in (False, True)
         for a in ("softmax", "laplace")]


@pytest.mark.slow  # the Triton interpreter
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
        outs.append((y, xx.grad, layer.qk_gamma.grad, layer.rel_bias.grad))
    for name, a, b in zip(("y", "dx", "dqk_gamma", "drel_bias"), *outs):
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
