import math

import pytest
import torch
from torch import nn

from longmixer.utils.optim import build_optimizer, build_param_groups, lr_factor, set_optim_hparams


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.kernel = set_optim_hparams(nn.Parameter(torch.zeros(2, 8)), lr_scale=0.1, weight_decay=0.0)


def test_no_decay_on_norms_biases_and_1d():
    groups = build_param_groups(Tiny(), lr=1.0, weight_decay=0.1)
    by_key = {(g["lr"], g["weight_decay"]): sum(p.numel() for p in g["params"]) for g in groups}
    assert by_key[(1.0, 0.1)] == 16            # lin.weight only
    assert by_key[(1.0, 0.0)] == 4 + 4 + 4     # lin.bias, norm.weight, norm.bias
    assert by_key[(0.1, 0.0)] == 16  # the tagged kernel (lr 1.0 * 0.1)


def test_linear_decay_matches_fairseq_shape():
    kw = dict(scheduler="linear_decay", total_steps=100, warmup_steps=10, lr=1e-3, warmup_init_lr=1e-7, end_lr=0.0)
    assert lr_factor(0, **kw) == pytest.approx(1e-4)
    assert lr_factor(10, **kw) == pytest.approx(1.0)
    assert lr_factor(55, **kw) == pytest.approx(0.5)
    assert lr_factor(100, **kw) == pytest.approx(0.0)


def test_cosine_midpoint():
    kw = dict(scheduler="cosine", total_steps=110, warmup_steps=10, lr=1.0, warmup_init_lr=0.0, end_lr=0.0)
    assert lr_factor(60, **kw) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


@pytest.mark.parametrize("name", ["adamw", "adam", "radam"])
def test_optimizers_build(name):
    opt = build_optimizer(Tiny(), {"optimizer": name, "lr": 1e-3, "weight_decay": 0.01})
    assert opt.param_groups


def test_unknown_optimizer_names_the_key():
    with pytest.raises(ValueError, match="optim.optimizer='sgdd'"):
        build_optimizer(Tiny(), {"optimizer": "sgdd", "lr": 1e-3})


def test_polynomial_warmup_power():
    """MEGA's Path-X recipe warms up with power 2."""
    kw = dict(scheduler="linear_decay", total_steps=100, warmup_steps=10, lr=1.0, warmup_init_lr=0.0, end_lr=0.0)
    assert lr_factor(5, **kw, warmup_power=2.0) == pytest.approx(0.25)
    assert lr_factor(5, **kw) == pytest.approx(0.5)
