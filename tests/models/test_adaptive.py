"""Adaptive input and adaptive softmax: band layout, exact probabilities, weight tying, use inside SequenceModel."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

from longmixer.models import SequenceModel
from longmixer.models.adaptive import AdaptiveInput, AdaptiveSoftmax

V, D, CUTOFFS = 50, 16, [10, 30]


def make_pair(tie_weights=True, tie_projections=True, dropout=0.0):
    torch.manual_seed(0)
    emb = AdaptiveInput(D, V, CUTOFFS, factor=2.0, padding_idx=0)
    head = AdaptiveSoftmax(D, V, CUTOFFS, factor=2.0, dropout=dropout, tie_weights=tie_weights,
                           tie_projections=tie_projections, embedding=emb)
    return emb.double(), head.double()


def test_adaptive_input_bands_and_values():
    emb, _ = make_pair()
    assert emb.bands == [(0, 10), (10, 30), (30, 50)] and emb.dims == [16, 8, 4]
    tokens = torch.tensor([[0, 3, 10, 29, 30, 49]])
    out = emb(tokens)
    assert out.shape == (1, 6, D)
    assert torch.equal(out[0, 0], torch.zeros(D, dtype=out.dtype))  # the padding id embeds to zero
    for pos, tok in enumerate(tokens[0].tolist()):
        band = emb.band_of(tok)
        lo = emb.bands[band][0]
        expected = emb.weights[band][tok - lo] @ emb.projections[band].t()
        if tok != 0:
            torch.testing.assert_close(out[0, pos], expected)
    out.sum().backward()
    assert torch.equal(emb.weights[0].grad[0], torch.zeros(D, dtype=out.dtype))  # padding row gets no gradient


def test_adaptive_input_scale_embedding():
    torch.manual_seed(0)
    a = AdaptiveInput(D, V, CUTOFFS, scale_embedding=False)
    torch.manual_seed(0)
    b = AdaptiveInput(D, V, CUTOFFS, scale_embedding=True)
    tokens = torch.arange(1, V).view(1, -1)
    torch.testing.assert_close(b(tokens), a(tokens) * D ** 0.5)


@pytest.mark.parametrize("tie_weights,tie_projections", [(False, False), (True, False), (True, True)],
                         ids=["untied", "tied-weights", "tied-all"])
def test_adaptive_softmax_is_a_normalized_distribution_and_loss_matches(tie_weights, tie_projections):
    _, head = make_pair(tie_weights, tie_projections)
    h = torch.randn(2, 7, D, dtype=torch.float64)
    logp = head(h)  # [2, 7, V]
    assert logp.shape == (2, 7, V)
    torch.testing.assert_close(logp.logsumexp(-1), torch.zeros(2, 7, dtype=torch.float64))
    targets = torch.tensor([[1, 9, 10, 29, 30, 49, -100], [5, 31, 12, -100, 2, 40, 48]])
    nll = head.loss(h, targets)
    keep = targets != -100
    expected = -logp.gather(-1, targets.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(nll[keep], expected[keep])
    assert torch.equal(nll[~keep], torch.zeros_like(nll[~keep]))


def test_adaptive_softmax_ties_parameters():
    emb, head = make_pair(True, True)
    own = {id(p) for p in head.parameters()}
    shared = {id(p) for p in emb.parameters()}
    assert own.isdisjoint(shared)  # tied tensors stay owned by the embedding, counted once
    assert head._word_weight(1) is emb.weights[1]
    assert torch.equal(head._projection(2), emb.projections[2].t())
    _, untied = make_pair(False, False)
    n_tied = sum(p.numel() for p in head.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == sum(w.numel() for w in emb.weights) + sum(p.numel() for p in emb.projections[1:])
    h = torch.randn(1, 4, D, dtype=torch.float64)
    head.loss(h, torch.tensor([[3, 12, 35, 49]])).sum().backward()
    assert emb.weights[0].grad is not None and emb.weights[2].grad is not None
    assert emb.projections[2].grad is not None


def test_adaptive_softmax_rejects_mismatched_tying():
    emb = AdaptiveInput(D, V, CUTOFFS, factor=2.0)
    with pytest.raises(ValueError, match="must match model.embedding"):
        AdaptiveSoftmax(D, V, [10, 20], factor=2.0, tie_weights=True, embedding=emb)
    with pytest.raises(ValueError, match="needs model.embedding to be an AdaptiveInput"):
        AdaptiveSoftmax(D, V, CUTOFFS, tie_weights=True, embedding=nn.Embedding(V, D))
    with pytest.raises(ValueError, match="tie_projections=true needs"):
        AdaptiveSoftmax(D, V, CUTOFFS, tie_projections=True, embedding=emb)
    with pytest.raises(ValueError, match="cutoffs"):
        AdaptiveInput(D, V, [30, 10])
    with pytest.raises(ValueError, match="cutoffs"):
        AdaptiveInput(D, V, [10, 50])


def test_adaptive_modules_inside_sequence_model():
    from longmixer.mixers.transformer import Transformer

    torch.manual_seed(0)
    model = SequenceModel(mixer=partial(Transformer, n_heads=2), d_model=D, n_layers=1, causal=True, pool="none",
                          embedding=partial(AdaptiveInput, vocab_size=V, cutoffs=CUTOFFS, factor=2.0),
                          head=partial(AdaptiveSoftmax, vocab_size=V, cutoffs=CUTOFFS, factor=2.0, dropout=0.1,
                                       tie_weights=True, tie_projections=True))
    tokens = torch.randint(1, V, (2, 9))
    h, _ = model.encode(tokens)
    nll = model.head.loss(h, tokens)
    assert nll.shape == (2, 9) and torch.isfinite(nll).all()
    logp, _ = model(tokens)
    assert logp.shape == (2, 9, V)
