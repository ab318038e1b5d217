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


@pytest.mark.parametrize("p", [5.0, -0.1, 1.0])
def test_attention_dropout_outside_zero_one_is_refused(p):
    """Bug: `model.mixer.attention_dropout=5` built the model and failed in the first training step, inside SDPA
    (the materialized path in F.dropout), with a traceback naming no key."""
    with pytest.raises(ValueError, match=rf"^model.mixer.attention_dropout={p} must be in \[0, 1\)$"):
        Transformer(64, 4, attention_dropout=p)


def _sdpa_and_materialized(causal: bool) -> tuple[Transformer, Transformer, torch.Tensor, torch.Tensor]:
    """The two implementations with the same weights, an input [2, 7, 16] and an all-true key mask."""
    torch.manual_seed(0)
    fused = Transformer(16, n_heads=2, causal=causal).eval()
    written_out = Transformer(16, n_heads=2, causal=causal, implementation="materialized").eval()
    written_out.load_state_dict(fused.state_dict())
    return fused, written_out, torch.randn(2, 7, 16), torch.ones(2, 7, dtype=torch.bool)


@pytest.mark.parametrize("causal", [False, True])
def test_materialized_equals_sdpa(causal):
    fused, written_out, x, mask = _sdpa_and_materialized(causal)
    mask[1, 5:] = False
    for m in (None, mask):
        assert torch.allclose(fused(x, m)[0], written_out(x, m)[0], atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_materialized_row_of_only_padding_outputs_zero_as_sdpa(causal):
    """Bug: `implementation=materialized` filled masked scores with -inf, so a batch row that is all padding (no
    real key) came out NaN, and the backward of a loss on the other rows alone made every weight's gradient NaN.
    SDPA outputs 0 for such a row; the materialized path now does the same."""
    fused, written_out, x, mask = _sdpa_and_materialized(causal)
    mask[1] = False
    y = written_out(x, mask)[0]
    torch.testing.assert_close(y, fused(x, mask)[0], atol=1e-5, rtol=1e-5)
    y[0].sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in written_out.parameters())


def test_unmasked_batches_take_the_fused_kernels_fast_path(monkeypatch):
    """Without a key mask (fixed-length tasks, the language-model streams) SDPA gets no `attn_mask`, and a causal
    Transformer asks for `is_causal` instead of building an [L, L] mask: the paths PyTorch's fused kernels run
    fastest (docs/benchmarks.md, "The key mask")."""
    import torch.nn.functional as F

    calls = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append((kw.get("attn_mask"), kw.get("is_causal"))) or sdpa(*a, **kw))
    x = torch.randn(2, 7, 16)
    for causal in (False, True):
        calls.clear()
        Transformer(16, n_heads=2, causal=causal).eval()(x, None)
        assert calls == [(None, causal)]
        calls.clear()
        Transformer(16, n_heads=2, causal=causal).eval()(x, torch.ones(2, 7, dtype=torch.bool))
        assert calls[0][0] is not None and calls[0][1] is False
