import pytest
import torch

from longmixer.mixers.transformer import Transformer
from longmixer.models import SequenceModel


def _model(causal=False, **kw):
    from functools import partial

    return SequenceModel(partial(Transformer, n_heads=2), d_model=16, n_layers=2, vocab_size=11, num_classes=3,
                         causal=causal, d_ffn=32, pos_encoding="sinusoidal", **kw).eval()


def test_padding_does_not_change_real_outputs():
    torch.manual_seed(0)
    model = _model()
    x = torch.randint(2, 11, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 6:] = False
    out_padded, _ = model(x, mask)
    out_short, _ = model(x[1:, :6], mask[1:, :6])
    assert torch.allclose(out_padded[1], out_short[0], atol=1e-5)


def test_causal_outputs_ignore_the_future():
    torch.manual_seed(0)
    model = _model(causal=True, pool="none", head="none")
    x = torch.randn(1, 12, 16, requires_grad=True)
    mixer = model.blocks[0].mixer
    y, _ = mixer(x)
    y[0, 5].sum().backward()
    assert x.grad[0, 6:].abs().max() == 0
    assert x.grad[0, :6].abs().max() > 0


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
