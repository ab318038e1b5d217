import functools
import math

import pytest
import torch
from torch import nn

from longmixer.utils.optim import (Constant, CosineDecay, InverseSqrtDecay, LinearDecay, build_optimizer,
                                   build_param_groups, clip_grad_norm, set_optim_hparams)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.kernel = set_optim_hparams(nn.Parameter(torch.zeros(2, 8)), lr_scale=0.1, weight_decay=0.0)


def _factor(schedule_cls, lr=1.0, **kw):
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    return schedule_cls(opt, **kw).factor


def test_no_decay_on_norms_biases_and_1d():
    groups = build_param_groups(Tiny(), lr=1.0, weight_decay=0.1)
    by_key = {(g["lr"], g["weight_decay"]): sum(p.numel() for p in g["params"]) for g in groups}
    assert by_key[(1.0, 0.1)] == 16            # lin.weight only
    assert by_key[(1.0, 0.0)] == 4 + 4 + 4     # lin.bias, norm.weight, norm.bias
    assert by_key[(0.1, 0.0)] == 16  # the tagged kernel (lr 1.0 * 0.1)


def test_linear_decay_matches_fairseq_shape():
    factor = _factor(LinearDecay, lr=1e-3, total_steps=100, warmup_steps=10, warmup_init_lr=1e-7)
    assert factor(0) == pytest.approx(1e-4)
    assert factor(10) == pytest.approx(1.0)
    assert factor(55) == pytest.approx(0.5)
    assert factor(100) == pytest.approx(0.0)


def test_cosine_midpoint():
    factor = _factor(CosineDecay, total_steps=110, warmup_steps=10, warmup_init_lr=0.0)
    assert factor(60) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


def test_constant_after_warmup():
    factor = _factor(Constant, total_steps=100, warmup_steps=10, warmup_init_lr=0.0)
    assert factor(5) == pytest.approx(0.5) and factor(50) == 1.0


def test_inverse_sqrt_is_the_lra_rsqrt_decay():
    """LRA's `linear_warmup * rsqrt_decay`: peak at the end of warmup, then lr * sqrt(warmup / step)."""
    factor = _factor(InverseSqrtDecay, total_steps=10_000, warmup_steps=1000, warmup_init_lr=0.0)
    assert factor(500) == pytest.approx(0.5)
    assert factor(1000) == pytest.approx(1.0)
    assert factor(4000) == pytest.approx(0.5)


def test_polynomial_warmup_power():
    """MEGA's Path-X recipe warms up with power 2."""
    square = _factor(LinearDecay, total_steps=100, warmup_steps=10, warmup_init_lr=0.0, warmup_power=2.0)
    linear = _factor(LinearDecay, total_steps=100, warmup_steps=10, warmup_init_lr=0.0)
    assert square(5) == pytest.approx(0.25)
    assert linear(5) == pytest.approx(0.5)


def test_negative_warmup_names_the_key():
    with pytest.raises(ValueError, match="scheduler.warmup_steps=-1"):
        _factor(LinearDecay, total_steps=10, warmup_steps=-1)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.RAdam])
def test_optimizer_partial_gets_the_groups(cls):
    opt = build_optimizer(Tiny(), functools.partial(cls, lr=1e-3, weight_decay=0.01, betas=(0.9, 0.98)))
    assert isinstance(opt, cls)
    assert {g["weight_decay"] for g in opt.param_groups} == {0.01, 0.0}
    assert opt.defaults["betas"] == (0.9, 0.98)


def test_optimizer_without_positive_lr_names_the_key():
    with pytest.raises(ValueError, match="optim.lr=0"):
        build_optimizer(Tiny(), functools.partial(torch.optim.AdamW, lr=0))


def test_plateau_cuts_the_lr_after_patience_epochs_without_improvement():
    """S4's `plateau` (the LaS recipes): no warmup, lr x factor once the metric has not improved for `patience`
    epochs."""
    from longmixer.utils.optim import Plateau

    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = Plateau(opt, total_steps=1000, mode="max", factor=0.2, patience=2)
    assert sched.interval == "epoch" and opt.param_groups[0]["lr"] == pytest.approx(1e-3)
    for acc in (0.30, 0.35, 0.35, 0.34):  # best 0.35 at epoch 2, then two epochs without improvement
        sched.step(acc)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)
    sched.step(0.33)  # the third: past patience
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-4)


@pytest.mark.parametrize("kw, match", [({"factor": 1.0}, "scheduler.factor=1.0"),
                                       ({"patience": -1}, "scheduler.patience=-1")])
def test_plateau_bad_values_name_the_key(kw, match):
    from longmixer.utils.optim import Plateau

    with pytest.raises(ValueError, match=match):
        Plateau(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), **kw)


def test_embed_weight_decay_tags_the_token_embedding_only():
    """S4's parameter grouping (the LaS ListOps recipe): the token embedding is not decayed; other weights are."""
    from longmixer.mixers.transformer import Transformer as TransformerMixer
    from longmixer.models import SequenceModel

    def groups(**kw):
        model = SequenceModel(mixer=functools.partial(TransformerMixer, n_heads=2), d_model=8, n_layers=1,
                              vocab_size=11, num_classes=3, **kw)
        emb = model.embedding.weight
        (wd,) = [g["weight_decay"] for g in build_param_groups(model, lr=1.0, weight_decay=0.1)
                 if any(p is emb for p in g["params"])]
        return wd

    assert groups() == 0.1 and groups(embed_weight_decay=0.0) == 0.0
    with pytest.raises(ValueError, match="model.embed_weight_decay=0.0 applies to a token embedding"):
        SequenceModel(mixer=functools.partial(TransformerMixer, n_heads=2), d_model=8, n_layers=1, d_input=1,
                      num_classes=3, embed_weight_decay=0.0)


def _grads(seed: int, dtypes=(torch.float32,) * 4, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.zeros(n, dtype=dtype)) for n, dtype in zip((3, 7, 1, 12), dtypes)]
    for p in params:
        p.grad = (scale * torch.randn(p.shape, generator=gen)).to(p.dtype)
    return params


@pytest.mark.parametrize("max_norm, dtypes", [
    (0.5, (torch.float32,) * 4),                                          # clipped
    (1e3, (torch.float32,) * 4),                                          # under the bound: unchanged
    (0.5, (torch.float32, torch.bfloat16, torch.float32, torch.bfloat16)),  # mixed gradient dtypes
    (0.5, (torch.float64,) * 4),
])
def test_clip_grad_norm_matches_torch(max_norm, dtypes):
    ours, theirs = _grads(0, dtypes), _grads(0, dtypes)
    total = clip_grad_norm(ours, max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    assert total.item() == pytest.approx(expected.item(), rel=1e-6)
    for a, b in zip(ours, theirs):
        assert a.grad.dtype == b.grad.dtype
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    joint = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.double()) for p in ours]))
    assert joint.item() <= max_norm * (1 + 1e-2) or max_norm > expected.item()


def test_clip_grad_norm_skips_parameters_without_gradients_and_keeps_non_finite_norms():
    params = _grads(1)
    params[1].grad = None
    assert clip_grad_norm(params, 0.5).item() == pytest.approx(
        torch.nn.utils.clip_grad_norm_(_grads(1)[:1] + _grads(1)[2:], 0.5).item(), rel=1e-6)
    assert clip_grad_norm([nn.Parameter(torch.zeros(2))], 1.0) is None
    bad = _grads(2)
    bad[0].grad[0] = float("inf")
    assert not torch.isfinite(clip_grad_norm(bad, 1.0))  # no error, no host sync: the divergence guard sees it


@pytest.mark.parametrize("keywords, fused", [
    ({}, True),                     # the config leaves it open: fused
    ({"fused": None}, True),        # configs/optim/adamw.yaml's `fused: null`
    ({"fused": False}, False),      # optim.fused=false opts out
    ({"foreach": True}, False),     # an explicit foreach choice stands
])
def test_build_optimizer_asks_for_the_fused_step_only_where_the_config_leaves_it_open(keywords, fused):
    opt = build_optimizer(Tiny(), functools.partial(torch.optim.AdamW, lr=1e-3, **keywords), fused=True)
    assert bool(opt.defaults["fused"]) is fused
    radam = build_optimizer(Tiny(), functools.partial(torch.optim.RAdam, lr=1e-3), fused=True)  # has no fused step
    assert "fused" not in radam.defaults
    assert not build_optimizer(Tiny(), functools.partial(torch.optim.AdamW, lr=1e-3)).defaults["fused"]


def _trained_pair(schedule, lr, steps, metrics=()):
    """An AdamW on `Tiny`'s groups with `schedule`, stepped `steps` times (Plateau: once per value of `metrics`)."""
    opt = build_optimizer(Tiny(), functools.partial(torch.optim.AdamW, lr=lr, weight_decay=0.01))
    sched = schedule(opt)
    for _ in range(steps):
        opt.step()
        sched.step()
    for value in metrics:
        sched.step(value)
    return opt, sched


@pytest.mark.parametrize("schedule", [functools.partial(LinearDecay, total_steps=10, warmup_steps=2),
                                      functools.partial(CosineDecay, total_steps=10, warmup_steps=0)])
def test_reapplied_settings_give_the_new_schedule_at_the_restored_step(schedule):
    """A resume restores the checkpoint's base lrs and schedule length; the config's come back on top, with the
    lr of the new schedule at the restored step. Restoring into a pair of the same config changes nothing."""
    from longmixer.utils.optim import configured_settings, reapply_settings

    old_opt, old_sched = _trained_pair(schedule, 1e-3, 4)
    same_opt, same_sched = _trained_pair(schedule, 1e-3, 0)
    settings = configured_settings(same_opt, same_sched)
    same_opt.load_state_dict(old_opt.state_dict())
    same_sched.load_state_dict(old_sched.state_dict())
    lrs = [g["lr"] for g in same_opt.param_groups]
    assert reapply_settings(same_opt, same_sched, settings) == []
    assert [g["lr"] for g in same_opt.param_groups] == lrs

    new_opt, new_sched = _trained_pair(functools.partial(schedule, total_steps=20), 5e-3, 0)
    settings = configured_settings(new_opt, new_sched)
    new_opt.load_state_dict(old_opt.state_dict())
    new_sched.load_state_dict(old_sched.state_dict())
    changed = reapply_settings(new_opt, new_sched, settings)
    assert {"initial_lr", "scheduler.base_lrs", "scheduler.total_steps"} <= set(changed)
    reference_opt, reference_sched = _trained_pair(functools.partial(schedule, total_steps=20), 5e-3, 4)
    assert [g["lr"] for g in new_opt.param_groups] == pytest.approx([g["lr"] for g in reference_opt.param_groups])
    assert new_sched.get_last_lr() == pytest.approx(reference_sched.get_last_lr())
    assert new_opt.state_dict()["state"].keys() == old_opt.state_dict()["state"].keys()  # the moments stay


def test_reapplied_settings_keep_a_plateaus_reductions():
    from longmixer.utils.optim import Plateau, configured_settings, reapply_settings

    plateau = functools.partial(Plateau, mode="max", factor=0.5, patience=0)
    old_opt, old_sched = _trained_pair(plateau, 1e-3, 0, metrics=(0.5, 0.4))  # one reduction: lr 5e-4
    new_opt, new_sched = _trained_pair(functools.partial(Plateau, mode="max", factor=0.1, patience=3), 2e-3, 0)
    settings = configured_settings(new_opt, new_sched)
    new_opt.load_state_dict(old_opt.state_dict())
    new_sched.load_state_dict(old_sched.state_dict())
    assert {"initial_lr", "scheduler.factor", "scheduler.patience"} <= set(reapply_settings(new_opt, new_sched,
                                                                                             settings))
    scale = [g["initial_lr"] / 2e-3 for g in new_opt.param_groups]  # Tiny's tagged kernel has lr_scale 0.1
    assert [g["lr"] for g in new_opt.param_groups] == pytest.approx([1e-3 * s for s in scale])  # 2e-3 x 0.5
    assert (new_sched.factor, new_sched.patience, new_sched.best) == (0.1, 3, 0.5)


@pytest.mark.parametrize("cls", [torch.optim.RAdam, torch.optim.AdamW])
def test_config_lists_reach_the_optimizer_as_plain_values_a_checkpoint_can_hold(cls, tmp_path):
    """The optim config's `betas` is an OmegaConf list: kept as such in the param groups, it made every RAdam
    checkpoint unreadable under weights_only=True (the test phase and resume refused them)."""
    from omegaconf import OmegaConf

    from longmixer.runs.checkpoints import load_checkpoint

    betas = OmegaConf.create({"betas": [0.9, 0.98]}).betas
    opt = build_optimizer(Tiny(), functools.partial(cls, lr=1e-3, betas=betas))
    assert all(g["betas"] == (0.9, 0.98) and type(g["betas"]) is tuple for g in opt.param_groups)
    torch.save({"optimizer": opt.state_dict()}, tmp_path / "opt.ckpt")
    assert load_checkpoint(tmp_path / "opt.ckpt")["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.98)


def test_plateau_names_a_recipes_warmup_and_the_fix():
    from longmixer.utils.config import ConfigError
    from longmixer.utils.optim import Plateau

    with pytest.raises(ConfigError, match=r"scheduler.warmup_steps=50: .*~scheduler.warmup_steps"):
        Plateau(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), warmup_steps=50)
    Plateau(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0), warmup_steps=0)
