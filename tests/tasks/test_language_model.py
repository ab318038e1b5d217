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


def test_accumulated_update_weighs_every_token_the_same():
    """Under accumulation each batch puts its summed NLL over the update's tokens into the update (times the count
    Lightning divides by), so the update's gradient is the token mean over all its batches (fairseq's), although
    its batches differ in length."""
    from types import SimpleNamespace

    from longmixer.data.lm_stream import LMTrainStream

    accumulate = 3
    stream = LMTrainStream(torch.randint(0, V, (600,)), batch_size=2, chunk=4, k_min=1, k_max=3, seed=2, roll=False)
    stream.accumulate = accumulate
    batches = list(stream)[:accumulate]
    assert len({b["inputs"].shape[1] for b in batches}) > 1
    task = LanguageModel(tiny_model(partial(Transformer, n_heads=2)), *OPTIM)
    task._trainer = SimpleNamespace(accumulate_grad_batches=accumulate)
    params = [p for p in task.parameters() if p.requires_grad]
    for batch in batches:  # what Lightning's automatic optimization does with each batch's loss
        loss, outputs = task.forward_loss(batch)
        (task.update_share(batch, loss, outputs) / accumulate).backward()
    accumulated = [p.grad.clone() for p in params]
    task.zero_grad()
    nll = sum(task.token_nll(b)[0].sum() for b in batches)
    (nll / sum(b["targets"].numel() for b in batches)).backward()
    for got, want in zip(accumulated, (p.grad for p in params), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    plain = {k: v for k, v in batches[0].items() if k != "update_tokens"}
    loss, outputs = task.forward_loss(plain)
    assert task.update_share(plain, loss, outputs) is loss  # without accumulation: the batch's token mean


def test_fit_with_accumulation_weighs_by_the_updates_tokens(tmp_path, monkeypatch):
    """A real fit under `trainer.accumulate_grad_batches`: every training batch reaches the task with its update's
    token count (the datamodule hands the trainer's accumulation to the stream) and is weighed by it."""
    overrides = write_enwik8_fixture(tmp_path / "raw")
    dm = Enwik8(data_dir=tmp_path / "data", batch_size=2, k_min=1, k_max=3, eval_context=8, **overrides)
    model = SequenceModel(mixer=partial(Transformer, n_heads=2), d_model=16, n_layers=1, vocab_size=dm.vocab_size,
                          causal=True, pool="none", head="lm_tied", pos_encoding="sinusoidal").float()
    task = LanguageModel(model, *OPTIM, metric=dm.metric)
    seen = []
    share = task.update_share

    def spy(batch, loss, outputs):
        out = share(batch, loss, outputs)
        seen.append((batch["inputs"].numel(), int(batch["update_tokens"]), float(out / loss)))
        return out

    monkeypatch.setattr(task, "update_share", spy)
    trainer = pl.Trainer(accelerator="cpu", max_steps=2, accumulate_grad_batches=2, limit_val_batches=0,
                         num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(task, datamodule=dm)
    assert trainer.global_step == 2 and len(seen) == 4
    for i in (0, 2):  # each update: its two batches' tokens, each weighed by its share of them (times 2)
        (n0, total0, w0), (n1, total1, w1) = seen[i], seen[i + 1]
        assert total0 == total1 == n0 + n1
        assert w0 == pytest.approx(2 * n0 / total0) and w1 == pytest.approx(2 * n1 / total1)
