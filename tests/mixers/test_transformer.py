"""Transformer mixer beyond the shared contract: head divisibility and materialized == SDPA attention."""

import pytest
import torch

from longmixer.mixers.transformer import Transformer
from longmixer.models import SequenceModel


def _model(causal=False, **kw):
    from functools import partial

    return SequenceModel(partial(Transformer, n_heads=2), d_model=16, n_layers=2, vocab_size=11, num_classes=3,
                         causal=causal, d_ffn=32, pos_encoding="sinusoidal", **kw).eval()


def test_width_must_divide_heads():
    with pytest.raises(ValueError, match="divisible by model.mixer.n_heads=3"):
        Transformer(16, n_heads=3)


@pytest.mark.parametrize("causal", [False, True])
def test_materialized_equals_sdpa(causal):
    torch.manual_seed(0)
    fused = Transformer(16, n_heads=2, causal=causal).eval()
    written_out = Transformer(16, n_heads=2, causal=causal, implementation="materialized").eval()
    written_out.load_state_dict(fused.state_dict())
    x = torch.randn(2, 7, 16)
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False
    for m in (None, mask):
        assert torch.allclose(fused(x, m)[0], written_out(x, m)[0], atol=1e-5)
