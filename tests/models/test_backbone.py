import pytest
import torch
from torch import nn

from longmixer.models import SequenceModel


class StatsMixer(nn.Module):
    """A mixer that reports an aux loss and a statistic, to check the backbone's aux contract."""

    gated_residual = True

    def __init__(self, d_model, causal=False):
        super().__init__()
        self.lin = nn.Linear(d_model, d_model)
        self.progress = None
        self.after_forward_calls = self.after_replay_calls = 0

    def forward(self, x, mask=None, residual=None):
        return residual + self.lin(x), {"loss/extra": x.new_tensor(0.5), "stats/rate": x.new_tensor(0.25)}

    def set_progress(self, step, total):
        self.progress = (step, total)

    def after_forward(self):
        self.after_forward_calls += 1

    def after_replay(self):
        self.after_replay_calls += 1


def test_aux_losses_sum_and_stats_are_per_layer():
    model = SequenceModel(StatsMixer, d_model=8, n_layers=3, vocab_size=5, num_classes=2)
    _, aux = model(torch.randint(0, 5, (2, 4)))
    assert aux["loss/extra"].item() == pytest.approx(1.5)
    assert sorted(k for k in aux if k.startswith("stats/")) == [f"stats/rate/layer_0{i}" for i in range(3)]


def test_progress_reaches_every_layer():
    model = SequenceModel(StatsMixer, d_model=8, n_layers=2, vocab_size=5, num_classes=2)
    model.set_progress(3, 10)
    assert all(block.mixer.progress == (3, 10) for block in model.blocks)


def test_after_forward_reaches_every_layer_once():
    """`after_forward()`, which the tasks call after each forward (LongVQ's codebook statistics), reaches every
    submodule that defines it, once per call."""
    model = SequenceModel(StatsMixer, d_model=8, n_layers=2, vocab_size=5, num_classes=2)
    model.after_forward()
    assert [block.mixer.after_forward_calls for block in model.blocks] == [1, 1]
    model.after_replay()
    model.after_replay()  # the modules found at the first call are reused
    assert [block.mixer.after_replay_calls for block in model.blocks] == [2, 2]
    assert [block.mixer.after_forward_calls for block in model.blocks] == [1, 1]


@pytest.mark.parametrize("norm", ["layernorm", "scalenorm", "rmsnorm", "batchnorm", "syncbatchnorm"])
@pytest.mark.parametrize("prenorm", [True, False])
def test_norms_and_placements_run(norm, prenorm):
    model = SequenceModel(StatsMixer, d_model=8, n_layers=2, vocab_size=5, num_classes=2, norm=norm,
                          prenorm=prenorm, d_ffn=16)
    out, _ = model(torch.randint(0, 5, (3, 6)), torch.ones(3, 6, dtype=torch.bool))
    assert out.shape == (3, 2) and torch.isfinite(out).all()


def test_real_inputs_and_retrieval_head():
    model = SequenceModel(StatsMixer, d_model=8, n_layers=1, d_input=3, num_classes=2, embedding="real",
                          head="nli")
    x, x2 = torch.randn(2, 5, 3), torch.randn(2, 7, 3)
    out, aux = model(x, None, x2, None)
    assert out.shape == (2, 2)
    assert aux["loss/extra"].item() == pytest.approx(1.0)  # both documents' aux losses count


def test_missing_shape_keys_name_the_interpolation():
    with pytest.raises(ValueError, match=r"model.vocab_size \(token inputs, e.g. \$\{data.vocab_size\}\)"):
        SequenceModel(StatsMixer, d_model=8, n_layers=1)
    with pytest.raises(ValueError, match="model.pool='max'"):
        SequenceModel(StatsMixer, d_model=8, n_layers=1, vocab_size=3, num_classes=2, pool="max")


def test_masked_batchnorm_ignores_padding():
    from longmixer.layers.norms import MaskedBatchNorm

    norm = MaskedBatchNorm(4).train()
    x = torch.randn(2, 5, 4)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    y1 = norm(x, mask)
    x2 = x.clone()
    x2[1, 3:] = 1e3  # garbage in the padding
    y2 = MaskedBatchNorm(4).train()(x2, mask)
    assert torch.allclose(y1[mask], y2[mask], atol=1e-5)


def test_mega_initialisation_options():
    model = SequenceModel(StatsMixer, d_model=64, n_layers=2, d_input=1, num_classes=2, d_ffn=512,
                          ffn_init_std=0.02, embed_bias_std=0.1, final_norm_affine=False, classifier_dropout=0.1)
    fc1 = model.blocks[0].ffn.fc1
    assert fc1.weight.std().item() == pytest.approx(0.02, rel=0.1) and fc1.bias.abs().max() == 0
    assert model.embedding.proj.bias.std().item() == pytest.approx(0.1, rel=0.35)
    assert sum(p.numel() for p in model.final_norm.parameters()) == 0
    with pytest.raises(ValueError, match="only defined for layernorm"):
        SequenceModel(StatsMixer, d_model=8, n_layers=1, vocab_size=3, num_classes=2, norm="rmsnorm",
                      final_norm_affine=False)


def test_scaled_sinusoidal_positions_learn_one_scale_from_d_to_the_minus_half():
    """SeqBoat's --add-apos (pixel tasks): the sinusoid times one learned scalar initialised to D^-0.5."""
    from longmixer.models.embeddings import SinusoidalPositions

    fixed, scaled = SinusoidalPositions(16), SinusoidalPositions(16, learned_scale=True)
    assert fixed.scale is None and [n for n, _ in scaled.named_parameters()] == ["scale"]
    out = scaled(7, torch.device("cpu"), torch.float32)
    assert torch.allclose(out, fixed(7, torch.device("cpu"), torch.float32) * 16 ** -0.5)
    out.sum().backward()
    assert scaled.scale.grad is not None and scaled.scale.grad.abs() > 0


def test_classifier_activation_relu_for_the_lra_head_and_bad_names_refused():
    torch.manual_seed(0)
    gelu = SequenceModel(StatsMixer, d_model=8, n_layers=1, d_input=1, num_classes=3)
    torch.manual_seed(0)
    relu = SequenceModel(StatsMixer, d_model=8, n_layers=1, d_input=1, num_classes=3, classifier_activation="relu")
    x = torch.randn(2, 5, 1)
    hidden = relu.head.hidden(torch.randn(4, 8))
    assert torch.equal(relu.head.out(relu.head.activation(hidden)), relu.head.out(hidden.clamp_min(0)))
    assert not torch.allclose(gelu(x)[0], relu(x)[0])  # same weights, different activation
    with pytest.raises(ValueError, match="model.classifier_activation='tanh'"):
        SequenceModel(StatsMixer, d_model=8, n_layers=1, d_input=1, num_classes=3, classifier_activation="tanh")


def test_no_mask_equals_an_all_true_mask_in_every_family():
    """Fixed-length batches and language-model streams carry no key mask (`pad_collate`); every family's recipe model
    (the bench's small Text models) gives the same logits without a mask as with an all-true one."""
    from hydra.utils import instantiate

    from longmixer.bench import compose_model_config, model_specs

    for name, overrides in model_specs("text", quick=True):
        torch.manual_seed(0)
        cfg = compose_model_config([*overrides, "data.seq_len=32"])
        model = instantiate(cfg.model).eval()
        x = torch.randint(1, int(cfg.model.vocab_size), (2, 32))
        with torch.no_grad():
            masked, _ = model(x, torch.ones(2, 32, dtype=torch.bool))
            unmasked, _ = model(x, None)
        torch.testing.assert_close(unmasked, masked, msg=lambda m, name=name: f"{name}: {m}")
