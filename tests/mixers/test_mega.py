"""MEGA and MEGA-chunk (longmixer.mixers.mega) beyond the shared contract: chunk = L equals full attention, the
backends, attention dropout, and the parameter counts of the LRA recipes against the official dimensions."""

from pathlib import Path

import pytest
import torch

from longmixer.mixers.mega import MEGA
from longmixer.utils.compose import CONFIG_DIR, compose

CONFIGS = Path(CONFIG_DIR)


def _mixer(**kw):
    torch.manual_seed(0)
    args = dict(zdim=8, hdim=12, ndim=4, max_len=32, backend="torch")
    args.update(kw)
    return MEGA(6, **args).double().eval()


@pytest.mark.parametrize("attention", ["softmax", "relu2", "laplace"])
def test_chunk_equal_to_length_is_full_attention(attention):
    full = _mixer(attention=attention, max_len=16)
    chunked = _mixer(attention=attention, chunk_size=16)
    x = torch.randn(2, 16, 6, dtype=torch.float64)
    torch.testing.assert_close(chunked(x)[0], full(x)[0])


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("attention,causal", [("softmax", False), ("laplace", True), ("relu2", False)])
def test_torch_and_triton_backends_agree(attention, causal):
    mixer = _mixer(attention=attention, causal=causal, chunk_size=16).float()
    x = torch.randn(2, 20, 6)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[0, 17:] = False
    y_ref, _ = mixer(x, mask)
    for module in mixer.modules():
        if hasattr(module, "backend"):
            module.backend = "triton"
    torch.testing.assert_close(mixer(x, mask)[0], y_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # the Triton interpreter
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_dropout_only_in_training(backend):
    mixer = _mixer(chunk_size=8, attention_dropout=0.5, backend=backend).float()
    x = torch.randn(1, 16, 6)
    y_eval = mixer(x)[0]
    torch.testing.assert_close(mixer(x)[0], y_eval)
    mixer.train()
    torch.manual_seed(0)
    y_train = mixer(x)[0]
    assert not torch.allclose(y_train, y_eval)
    y_train.sum().backward()
    assert torch.isfinite(mixer.qk.gamma.grad).all()


def test_rotary_bias_serves_any_length():
    mixer = _mixer(rel_pos="rotary", causal=True, max_len=4)
    assert mixer(torch.randn(1, 12, 6, dtype=torch.float64))[0].shape == (1, 12, 6)


def test_rejects_bad_rel_pos():
    with pytest.raises(ValueError, match="rel_pos"):
        MEGA(8, rel_pos="alibi")


# --- parameter counts of the LRA recipes against the official dimensions (models.md 1.2, 1.6-1.8) ----------------

TASK_SHAPES = {  # seq_len, vocab_size or None (real inputs, d_input 1), num_classes; vocab sizes cancel out
    "listops": (2000, 20, 10), "text": (4000, 260, 2), "retrieval": (4000, 260, 2), "image": (1024, None, 10),
    "pathfinder": (1024, None, 2), "pathx": (16384, None, 2), "sc10": (16000, None, 10)}
NORM_PARAMS = {"layernorm": 2, "scalenorm": 0, "batchnorm": 2, "syncbatchnorm": 2}  # per channel (+1 for scalenorm)


def _official_encoder_params(D, layers, S, norm, prenorm, M, seq, vocab):
    """Parameters of the official MEGA LRA encoder (embedding, MEGA layers with their norms, NFFN, final norm)."""
    H = F = 2 * D
    n = NORM_PARAMS[norm] * D + (norm == "scalenorm")
    mega = 4 * 2 * D * 16 + D + (D * H + H) + (D * (2 * D + S + H) + 2 * D + S + H) + (H * D + D) + 4 * S + (2 * M - 1)
    ffn = D * F + F + F * D + D
    embed = vocab * D if vocab else 2 * D
    return embed + layers * (mega + n + ffn + n) + (n if prenorm else 0)


def _build(family, task):
    """The recipe `experiment=mega/<task>` with `model=<family>`, composed as training composes it (on the meta
    device: the parameter count needs shapes only)."""
    from hydra.utils import instantiate

    seq, vocab, classes = TASK_SHAPES[task]
    data = [f"data.seq_len={seq}", f"data.num_classes={classes}"] + ([f"data.vocab_size={vocab}"] if vocab else [])
    cfg = compose([f"experiment=mega/{task}", f"model={family}", "ops.backend=torch", *data])
    with torch.device("meta"):
        return instantiate(cfg.model), cfg


@pytest.mark.parametrize("family", ["mega", "mega_chunk"])
@pytest.mark.parametrize("task", sorted(TASK_SHAPES))
def test_lra_recipe_parameter_count(family, task):
    model, cfg = _build(family, task)
    m = cfg.model
    seq, vocab, classes = TASK_SHAPES[task]
    chunk = m.mixer.chunk_size
    M = seq if chunk is None else chunk
    official = _official_encoder_params(m.d_model, m.n_layers, m.mixer.zdim, m.norm, m.prenorm, M, seq, vocab)
    ours = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("head."))
    assert abs(ours - official) / official < 0.02, (ours, official)
    Hc = m.d_classifier
    d_features = 2 * m.d_model if task == "retrieval" else m.d_model  # the official AAN head reads [u, v]
    official += d_features * Hc + Hc + Hc * classes
    total = sum(p.numel() for p in model.parameters())
    assert abs(total - official) / official < 0.02, (total, official)


def test_sc10_big_recipe_is_the_476k_model(compose):
    """CHELA Table 2 / LongVQ Table 5 list Mega-chunk SC10 at 476K: the official `mega_sc_raw_big` (d 72, z 36),
    475,890 parameters when instantiated; `experiment=mega/sc10 model=mega_chunk` is the base model (343,134)."""
    from hydra.utils import instantiate

    cfg = compose(["experiment=mega/sc10_big", "model=mega_chunk"])
    model = instantiate(cfg.model)
    m = cfg.model
    official = _official_encoder_params(72, 6, 36, "batchnorm", True, 1000, 16000, None)
    official += 72 * 144 + 144 + 144 * 10  # classifier Linear(D, 2D) + projection without bias
    assert (m.d_model, m.mixer.zdim, m.d_ffn, m.mixer.chunk_size) == (72, 36, 144, 1000)
    assert sum(p.numel() for p in model.parameters()) == official == 475_890
