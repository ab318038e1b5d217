"""The mixer contract (STYLE.md 2.6), once for every family and its variants: `mixer(x, mask, residual)` returns
`(y [B, L, D], aux)` with the family's aux keys as scalars; padded tokens do not change real outputs (and a padded
row equals the unpadded sequence); a causal mixer's output i does not depend on inputs j > i; the same seed builds
the same mixer. Family-specific properties stay in tests/mixers/test_<family>.py."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from longmixer.mixers.chela import CONVS, CHELA
from longmixer.mixers.las import LaS
from longmixer.mixers.longvq import LongVQ
from longmixer.mixers.mega import MEGA
from longmixer.mixers.seqboat import SeqBoat
from longmixer.mixers.transformer import Transformer

D, L, REAL = 16, 24, 17  # width, padded length, real tokens of the padded row
VQ_AUX = {"loss/vq_commit", "stats/vq_used_codes", "stats/vq_perplexity"}
SEQBOAT_AUX = {"stats/act_rate", "stats/attn_span"}

# id: (factory called as factory(d_model, causal=..., backend=...), as a model yaml's partial is, and its aux keys)
CASES = {
    **{f"chela-{conv}": (partial(CHELA, max_len=L, n_heads=2, attention="laplace", conv=conv), set())
       for conv in CONVS},
    "chela-norm": (partial(CHELA, max_len=L, n_heads=2, attention="norm"), set()),
    "las": (partial(LaS, n_heads=4, alpha_max=0.3, pool_size=3), set()),
    "las-chunk": (partial(LaS, n_heads=4, alpha_max=0.3, pool_size=5, chunk_size=8), set()),
    "las-alibi": (partial(LaS, n_heads=4, position_bias="alibi", pool_size=3, chunk_size=8), set()),
    "longvq-softmax": (partial(LongVQ, zdim=8, hdim=24, n_codes=16, chunk_size=16), VQ_AUX),
    "longvq-laplace": (partial(LongVQ, zdim=8, hdim=24, n_codes=16, chunk_size=16, attention="laplace"), VQ_AUX),
    "mega-softmax": (partial(MEGA, zdim=8, hdim=12, ndim=4, max_len=L), set()),
    "mega-rotary": (partial(MEGA, zdim=8, hdim=12, ndim=4, rel_pos="rotary"), set()),
    "mega_chunk-laplace": (partial(MEGA, zdim=8, hdim=12, ndim=4, attention="laplace", chunk_size=8), set()),
    "mega_chunk-relu2": (partial(MEGA, zdim=8, hdim=12, ndim=4, attention="relu2", chunk_size=8), set()),
    "seqboat": (partial(SeqBoat, d_qk=16, d_v=32, max_len=64, window=8), SEQBOAT_AUX),
    "seqboat-rotary": (partial(SeqBoat, d_qk=16, d_v=32, rel_pos="rotary", window=8), SEQBOAT_AUX),
    "seqboat_full-relu2": (partial(SeqBoat, d_qk=16, d_v=32, max_len=64, window=None, attention="relu2"),
                           SEQBOAT_AUX),
    "transformer": (partial(Transformer, n_heads=2), set()),
}
MODES = [pytest.param(name, causal, id=f"{name}-{'causal' if causal else 'bidir'}")
         for name in CASES for causal in (False, True)]


def _build(name: str, causal: bool, seed: int = 0):
    torch.manual_seed(seed)
    factory, _ = CASES[name]
    return factory(D, causal=causal, backend="torch").double().eval()


def _x(B=2, seed=1):
    return torch.randn(B, L, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("name, causal", MODES)
def test_shape_and_aux(name, causal):
    x = _x()
    y, aux = _build(name, causal)(x, torch.ones(2, L, dtype=torch.bool), residual=x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert set(aux) == CASES[name][1]
    assert all(v.dim() == 0 for v in aux.values())


@pytest.mark.parametrize("name, causal", MODES)
def test_padding_does_not_change_real_outputs(name, causal):
    m = _build(name, causal)
    x = _x()
    mask = torch.ones(2, L, dtype=torch.bool)
    mask[1, REAL:] = False
    y, _ = m(x, mask, residual=x)
    x2 = x.clone()
    x2[1, REAL:] = 50.0 * torch.randn(L - REAL, D, dtype=torch.float64)
    y2, _ = m(x2, mask, residual=x2)
    torch.testing.assert_close(y2[mask], y[mask])
    short = x[1:, :REAL]
    y3, _ = m(short, None, residual=short)
    torch.testing.assert_close(y[1, :REAL], y3[0])


@pytest.mark.parametrize("name", list(CASES))
def test_causal_mixer_ignores_the_future(name):
    m = _build(name, causal=True)
    x = _x(B=1).requires_grad_()
    y, _ = m(x, None, residual=x)
    for i in (0, 7, 8, L - 2):
        (g,) = torch.autograd.grad(y[0, i].sum(), x, retain_graph=True)
        past = g[0, : i + 1].abs().max().item()
        assert past > 0, f"output {i} depends on nothing"
        # the causal MD-EMA / long convolutions are FFT convolutions: round-off reaches the future at ~1e-16
        assert g[0, i + 1:].abs().max().item() <= 1e-10 * past, f"output {i} depends on the future"


@pytest.mark.parametrize("name", list(CASES))
def test_same_seed_same_mixer(name):
    x = _x()

    def run(seed):
        return _build(name, False, seed=seed)(x, residual=x)[0]

    torch.testing.assert_close(run(3), run(3), rtol=0, atol=0)
    assert not torch.equal(run(3), run(4))
