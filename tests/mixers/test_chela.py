"""CHELA layer (eqs. 8-15) beyond the shared contract (tests/mixers/test_contract.py): torch == triton backends,
reparameterization through the backbone and at test time, the laplace feature map, argument errors, short fits, and
the long kernel length of the recipes (parameter counts against the paper)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from longmixer.mixers.chela import CHELA, laplace_feature
from longmixer.models import SequenceModel
from longmixer.utils.optim import LinearDecay

CONVS = ["short_long", "long", "ema", "s4d"]


def make(conv="short_long", attention="norm", causal=False, backend="torch", d=16, max_len=24, n_heads=2, seed=0):
    torch.manual_seed(seed)
    m = CHELA(d, causal=causal, max_len=max_len, n_heads=n_heads, attention=attention, conv=conv,
              backend=backend)
    with torch.no_grad():  # larger q/k scales than the GAU init, so attention terms are not vanishingly small
        m.qk_weight.normal_(0.0, 1.0)
        m.qk_bias.normal_(0.0, 0.5)
    return m.double() if backend == "torch" else m


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
def test_torch_backend_equals_triton_backend(causal):
    m = make("short_long", "laplace", causal=causal, backend="triton", d=24, max_len=40, n_heads=2)
    x = torch.randn(2, 40, 24, requires_grad=True)
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 29:] = False
    y_tri, _ = m(x, mask)
    g_tri = torch.autograd.grad(y_tri[mask].sum(), [x] + list(m.parameters()))
    m.backend = "torch"
    y_ref, _ = m(x, mask)
    g_ref = torch.autograd.grad(y_ref[mask].sum(), [x] + list(m.parameters()))
    torch.testing.assert_close(y_tri, y_ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(g_tri, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


def _model(causal=False, **kw):
    torch.manual_seed(0)
    mixer = partial(CHELA, max_len=32, n_heads=2, attention="laplace", backend="torch")
    if causal:
        return SequenceModel(mixer, d_model=32, n_layers=2, vocab_size=11, causal=True, prenorm=True, d_ffn=64,
                             pool="none", head="lm", **kw)
    return SequenceModel(mixer, d_model=32, n_layers=2, vocab_size=11, num_classes=3, norm="batchnorm",
                         prenorm=False, d_ffn=64, **kw)


def test_model_reparameterize_keeps_outputs():
    model = _model().eval()
    tokens = torch.randint(1, 11, (3, 32))
    mask = torch.ones(3, 32, dtype=torch.bool)
    mask[2, 20:] = False
    before, _ = model(tokens, mask)
    model.reparameterize()
    assert all(len(b.mixer.conv.short_weights) == 1 for b in model.blocks)
    after, _ = model(tokens, mask)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True], ids=["classification", "lm"])
def test_fit_fixed_batch(causal):
    """A few Adam steps on one batch must cut the loss: gradients reach every part of the layer."""
    model = _model(causal=causal)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(1, 11, (8, 32), generator=gen)
    labels = torch.randint(0, 3, (8,), generator=gen)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        out, _ = model(tokens, torch.ones_like(tokens, dtype=torch.bool))
        if causal:
            loss = torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, 11), tokens[:, 1:].reshape(-1))
        else:
            loss = torch.nn.functional.cross_entropy(out, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    for name, p in model.named_parameters():
        if "mixer" in name:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_laplace_feature_matches_mega():
    mu = torch.tensor(0.5 ** 0.5)
    torch.testing.assert_close(laplace_feature(mu), torch.tensor(0.5))
    assert laplace_feature(torch.tensor(-5.0)) < 1e-6 and laplace_feature(torch.tensor(5.0)) > 1 - 1e-6


@pytest.mark.parametrize("kwargs,match", [
    (dict(attention="softmax"), "attention='softmax'"),
    (dict(conv="s4"), "conv='s4'"),
    (dict(n_heads=3), "n_heads=3"),
    (dict(kernel_len=0), "kernel_len=0"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CHELA(16, max_len=8, **kwargs)


def test_test_stage_runs_the_reparameterized_form():
    """Lightning's test loop fuses the short branches (on_test_start) and scores the same outputs as the trained
    form; a trained-form checkpoint still loads into the fused model."""
    import pytorch_lightning as pl

    from longmixer.tasks.classification import Classification

    model = _model().eval()
    trained_state = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(1, 11, (6, 32), generator=gen)
    mask = torch.ones(6, 32, dtype=torch.bool)
    mask[4:, 23:] = False
    with torch.no_grad():
        trained_logits, _ = model(tokens, mask)
    labels = trained_logits.argmax(-1)
    labels[:2] = (labels[:2] + 1) % 3  # accuracy 4/6 under the trained form
    samples = [{"inputs": tokens[i], "mask": mask[i], "labels": labels[i]} for i in range(6)]
    task = Classification(model, partial(torch.optim.AdamW, lr=1e-3), partial(LinearDecay, warmup_steps=0),
                          num_classes=3)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    (result,) = trainer.test(task, dataloaders=torch.utils.data.DataLoader(samples, batch_size=3), verbose=False)
    assert all(len(b.mixer.conv.short_weights) == 1 for b in model.blocks), "test ran the two-branch form"
    assert result["test/acc"] == pytest.approx(4 / 6)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, mask)[0], trained_logits, rtol=1e-5, atol=1e-5)
        for p in model.parameters():
            p.add_(1.0)
    model.load_state_dict(trained_state)  # two-branch keys into the fused module
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, mask)[0], trained_logits, rtol=1e-5, atol=1e-5)


def _n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_sc10_paper_params_variant_matches_table_2(compose):
    """CHELA Table 2 lists 493K parameters for SC10; the sequence-length kernel gives 11.7M, the variant 493,320."""
    from hydra.utils import instantiate

    model = instantiate(compose(["experiment=chela/sc10_paper_params"]).model)
    assert abs(_n_params(model) - 493_000) / 493_000 < 0.05, _n_params(model)
    assert model.blocks[0].mixer.conv.long.kernel.shape == (2, 60, 448)
    assert model.blocks[0].mixer.conv.short_sizes == (3, 9)  # the short kernels still follow L = 16,000


@pytest.mark.parametrize("recipe", ["wikitext103", "enwik8"])
def test_lm_long_kernel_covers_the_training_segment(compose, recipe):
    """LM segments are K chunks of seq_len (K <= k_max); taps past the kernel would be zero, so the kernel must
    cover the longest segment, not one chunk."""
    cfg = compose([f"experiment=chela/{recipe}"])
    assert cfg.model.mixer.kernel_len == cfg.data.k_max * cfg.data.seq_len > cfg.data.seq_len


def test_kernel_len_sets_the_long_kernel_only():
    m = CHELA(8, max_len=1000, kernel_len=12, backend="torch")
    assert m.conv.long.kernel.shape == (2, 8, 12) and m.conv.short_sizes == (3, 7)
    m = CHELA(8, causal=True, max_len=1000, conv="long", kernel_len=12, backend="torch")
    assert m.conv.kernel.shape == (8, 12)
