"""Optimizers, parameter groups and learning-rate schedules shared by every task.

Parameter groups: norms, biases and 1-D parameters get no weight decay; a layer can tag a parameter with its own
learning-rate scale or weight decay through `set_optim_hparams` (EMA coefficients, long-convolution kernels). Buffers
(a VQ codebook updated by EMA) are never optimized because they are not parameters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

OPTIM_ATTR = "_longmixer_optim"
OPTIMIZERS = ("adamw", "adam", "radam")
SCHEDULERS = ("linear_decay", "cosine", "constant")


def set_optim_hparams(param: nn.Parameter, *, lr_scale: float | None = None,
                      weight_decay: float | None = None) -> nn.Parameter:
    """Tag `param` with its own optimizer settings; `build_param_groups` reads the tag.

    Args:
        param: the parameter to tag.
        lr_scale: multiplies the base learning rate for this parameter (None: 1).
        weight_decay: overrides the weight decay for this parameter (None: the group's rule).
    """
    tag = {}
    if lr_scale is not None:
        tag["lr_scale"] = float(lr_scale)
    if weight_decay is not None:
        tag["weight_decay"] = float(weight_decay)
    setattr(param, OPTIM_ATTR, tag)
    return param


_NO_DECAY_MODULES = (nn.LayerNorm, nn.BatchNorm1d, nn.GroupNorm, nn.Embedding)


def _is_norm_module(module: nn.Module) -> bool:
    return isinstance(module, _NO_DECAY_MODULES) or "norm" in type(module).__name__.lower()


def build_param_groups(model: nn.Module, lr: float, weight_decay: float) -> list[dict[str, Any]]:
    """Split `model`'s trainable parameters into optimizer groups.

    Returns groups keyed by (lr, weight_decay): decayed weights, undecayed ones (norms, biases, 1-D parameters,
    embeddings are decayed like weights unless tagged) and one group per distinct tag.
    """
    groups: dict[tuple[float, float], list[nn.Parameter]] = {}
    seen: set[int] = set()
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            no_decay = p.ndim <= 1 or name.endswith("bias") or (_is_norm_module(module)
                                                                 and not isinstance(module, nn.Embedding))
            wd = 0.0 if no_decay else weight_decay
            tag = getattr(p, OPTIM_ATTR, {})
            key = (lr * tag.get("lr_scale", 1.0), tag.get("weight_decay", wd))
            groups.setdefault(key, []).append(p)
    return [{"params": ps, "lr": k[0], "initial_lr": k[0], "weight_decay": k[1]} for k, ps in groups.items()]


def build_optimizer(model: nn.Module, cfg: Mapping[str, Any]) -> torch.optim.Optimizer:
    """AdamW / Adam / RAdam over `build_param_groups(model)`, from the `optim` config group."""
    name = cfg.get("optimizer", "adamw")
    if name not in OPTIMIZERS:
        raise ValueError(f"optim.optimizer={name!r} is not one of {OPTIMIZERS}")
    lr, wd = float(cfg["lr"]), float(cfg.get("weight_decay", 0.0))
    if lr <= 0:
        raise ValueError(f"optim.lr={lr} must be > 0")
    groups = build_param_groups(model, lr, wd)
    kwargs = dict(lr=lr, betas=tuple(cfg.get("betas", (0.9, 0.999))), eps=float(cfg.get("eps", 1e-8)))
    if name == "adamw":
        return torch.optim.AdamW(groups, **kwargs)
    if name == "adam":
        # Adam's coupled L2 matches fairseq's `--optimizer adam --weight-decay` (MEGA / SeqBoat recipes).
        return torch.optim.Adam(groups, **kwargs)
    return torch.optim.RAdam(groups, **kwargs)


def lr_factor(step: int, *, scheduler: str, total_steps: int, warmup_steps: int, lr: float,
              warmup_init_lr: float, end_lr: float, warmup_power: float = 1.0) -> float:
    """The multiplier of the base lr at optimizer step `step` (0-based).

    `linear_decay` follows fairseq's polynomial_decay with power 1 as the MEGA / SeqBoat recipes use it: linear
    warmup from `warmup_init_lr` to `lr` over `warmup_steps` (polynomial with `warmup_power`; MEGA's Path-X recipe
    uses 2), then linear decay to `end_lr` at `total_steps`.
    `cosine`: the same warmup, then half a cosine down to `end_lr`.
    """
    if scheduler not in SCHEDULERS:
        raise ValueError(f"optim.scheduler={scheduler!r} is not one of {SCHEDULERS}")
    if scheduler == "constant" and warmup_steps == 0:
        return 1.0
    if step < warmup_steps:
        start = warmup_init_lr / lr
        return start + (1.0 - start) * (step / warmup_steps) ** warmup_power
    if scheduler == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    end = end_lr / lr
    if scheduler == "linear_decay":
        return end + (1.0 - end) * (1.0 - progress)
    return end + (1.0 - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Mapping[str, Any],
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A per-step LambdaLR implementing `lr_factor`; every param group keeps its own base lr."""
    warmup = int(cfg.get("warmup_steps", 0))
    if warmup < 0:
        raise ValueError(f"optim.warmup_steps={warmup} must be >= 0")
    lr = float(cfg["lr"])
    kwargs = dict(scheduler=cfg.get("scheduler", "linear_decay"), total_steps=max(total_steps, 1),
                  warmup_steps=warmup, lr=lr, warmup_init_lr=float(cfg.get("warmup_init_lr", 0.0)),
                  end_lr=float(cfg.get("end_lr", 0.0)), warmup_power=float(cfg.get("warmup_power", 1.0)))
    lr_factor(0, **kwargs)  # validates the scheduler name now, not at the first step
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, **kwargs))


def count_parameters(module: nn.Module) -> dict[str, int]:
    """Total, trainable and non-trainable parameter counts (buffers excluded)."""
    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return {"total": total, "trainable": trainable, "non_trainable": total - trainable}


def iter_tagged(model: nn.Module) -> Iterable[tuple[str, dict]]:
    """(name, tag) for every parameter tagged by `set_optim_hparams`."""
    for name, p in model.named_parameters():
        if hasattr(p, OPTIM_ATTR):
            yield name, getattr(p, OPTIM_ATTR)
