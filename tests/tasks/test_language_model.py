"""The causal LM task: exact windowed evaluation, the adaptive-softmax path, the causal check, and 2-step fits on the
WikiText-103 and enwik8 fixtures."""

from __future__ import annotations

import math
from functools import partial

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.nn import functional as F

from longmixer.data.enwik8 import Enwik8
from longmixer.data.lm_stream import LMEvalStream
from longmixer.data.wikitext103 import WikiText103
from longmixer.mixers.transformer import Transformer
from longmixer.models import SequenceModel
from longmixer.models.adaptive import AdaptiveInput, AdaptiveSoftmax
from longmixer.tasks.language_model import LanguageModel
from longmixer.utils.optim import LinearDecay
from tests.data.fixtures_extra import write_enwik8_fixture, write_wikitext_fixture

OPTIM = (partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.01, betas=(0.9, 0.98), eps=1e-8),
         partial(LinearDecay, warmup_steps=0, warmup_init_lr=1e-7, end_lr=0.0))
V = 40


class CausalConv(nn.Module):
    """A stand-in causal mixer with a finite receptive field: a depthwise causal convolution of `width` taps."""

    gated_residual = False

    def __init__(self, d_model: int, *, causal: bool, width: int = 3):
        super().__init__()
        assert causal
        self.width = width
        self.conv = nn.Conv1d(d_model, d_model, width, groups=d_model)

    def forward(self, x, mask=None, residual=None):
        y = self.conv(F.pad(x.transpose(1, 2), (self.width - 1, 0)))  # [B, D, L], position i sees i-width+1..i
        return y.transpose(1, 2), {}


def tiny_model(mixer, **kw):
    torch.manual_seed(0)
    args = dict(d_model=16, n_layers=2, vocab_size=V, causal=True, pool="none", head="lm_tied", d_ffn=32)
    args.update(kw)
    return SequenceModel(mixer=mixer, **args).double().eval()


def direct_loss(model, tokens):
    """Full-context mean NLL of the whole stream in one pass."""
    h, _ = model.encode(tokens[None, :-1])
    logits = model.head(h)[0]
    return F.cross_entropy(logits, tokens[1:])


def windowed_loss(task, tokens, window, context, batch_size=3):
    meter = task.eval_nll["val"]
    meter.reset()
    with torch.no_grad():
        for batch in LMEvalStream(tokens, window, context, batch_size):
            task._step(batch, "val")
    return meter.compute()


def test_windows_with_enough_context_equal_full_context_scoring():
    """2 layers of width-3 causal convolutions see 5 tokens; windows with >= 4 tokens of context must give exactly the
    full-context loss, and windows with too little context must not."""
    model = tiny_model(partial(CausalConv, width=3))
    task = LanguageModel(model, *OPTIM, metric="bpc")
    tokens = torch.randint(1, V, (101,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = direct_loss(model, tokens)
    torch.testing.assert_close(windowed_loss(task, tokens, window=12, context=4), full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(windowed_loss(task, tokens, window=30, context=17), full, rtol=1e-12, atol=1e-12)
    assert abs(float(windowed_loss(task, tokens, window=12, context=0)) - float(full)) > 1e-6


def test_transformer_window_covering_the_stream_equals_full_context():
    model = tiny_model(partial(Transformer, n_heads=2))
    task = LanguageModel(model, *OPTIM)
    tokens = torch.randint(1, V, (41,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = direct_loss(model, tokens)
    torch.testing.assert_close(windowed_loss(task, tokens, window=64, context=0), full, rtol=1e-12, atol=1e-12)
    assert abs(float(windowed_loss(task, tokens, window=10, context=0)) - float(full)) > 1e-6


def test_adaptive_head_uses_its_loss():
    cut = [10, 25]
    model = tiny_model(partial(Transformer, n_heads=2), n_layers=1,
                       embedding=partial(AdaptiveInput, vocab_size=V, cutoffs=cut, factor=2.0),
                       head=partial(AdaptiveSoftmax, vocab_size=V, cutoffs=cut, factor=2.0, tie_weights=True))
    task = LanguageModel(model, *OPTIM)
    tokens = torch.randint(1, V, (2, 9))
    targets = torch.cat([tokens[:, 1:], torch.full((2, 1), -100)], dim=1)
    nll, _ = task.token_nll({"inputs": tokens, "targets": targets})
    h, _ = model.encode(tokens)
    logp = model.head(h)
    expected = -logp[:, :-1].gather(-1, targets[:, :-1, None]).squeeze(-1)
    torch.testing.assert_close(nll[:, :-1], expected)
    assert torch.equal(nll[:, -1], torch.zeros(2, dtype=nll.dtype))


def test_requires_a_causal_per_token_model():
    with pytest.raises(ValueError, match="model.causal=true"):
        LanguageModel(tiny_model(partial(Transformer, n_heads=2), causal=False), *OPTIM)
    with pytest.raises(ValueError, match="model.pool=none"):
        LanguageModel(tiny_model(partial(Transformer, n_heads=2), pool="mean"), *OPTIM)
    with pytest.raises(ValueError, match="task.metric='acc'"):
        LanguageModel(tiny_model(partial(Transformer, n_heads=2)), *OPTIM, metric="acc")


@pytest.mark.parametrize("fixture,datamodule,metric", [
    pytest.param(write_wikitext_fixture, WikiText103, "ppl", id="wikitext103"),
    pytest.param(write_enwik8_fixture, Enwik8, "bpc", id="enwik8"),
])
def test_two_step_fit_and_test(tmp_path, fixture, datamodule, metric):
    overrides = fixture(tmp_path / "raw")
    dm = datamodule(data_dir=tmp_path / "data", batch_size=2, k_min=1, k_max=2, eval_context=8, **overrides)
    model = SequenceModel(mixer=partial(Transformer, n_heads=2), d_model=16, n_layers=1, vocab_size=dm.vocab_size,
                          causal=True, pool="none", head="lm_tied", pos_encoding="sinusoidal").float()
    task = LanguageModel(model, *OPTIM, metric=dm.metric)
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, val_check_interval=2, limit_val_batches=2,
                         num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(task, datamodule=dm)
    metrics = trainer.callback_metrics
    assert trainer.global_step == 2
    loss = float(metrics["val/loss"])
    assert math.isfinite(loss) and 0 < loss < 2 * math.log(dm.vocab_size)
    expected = math.exp(loss) if metric == "ppl" else loss / math.log(2)
    assert float(metrics[f"val/{metric}"]) == pytest.approx(expected, rel=1e-5)
    assert float(metrics["val/loss_best"]) == pytest.approx(loss)
    result = trainer.test(task, datamodule=dm, verbose=False)[0]
    assert math.isfinite(result["test/loss"]) and f"test/{metric}" in result
