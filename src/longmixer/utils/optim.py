"""Parameter groups, the optimizer call and the learning-rate schedules shared by every task.

The `optim` config group is a torch optimizer (`_target_: torch.optim.AdamW`, `_partial_: true`, its keys the
constructor's arguments) and the `scheduler` group one of the `WarmupSchedule` classes below; the task calls both.

Parameter groups: norms, biases and 1-D parameters get no weight decay; a layer can tag a parameter with its own
learning-rate scale or weight decay through `set_optim_hparams` (EMA coefficients, long-convolution kernels). Buffers
(a VQ codebook updated by EMA) are never optimized because they are not parameters.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

OPTIM_ATTR = "_longmixer_optim"


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


# torch optimizers with a fused (one kernel per step) CUDA implementation that `build_optimizer` may ask for
FUSABLE = (torch.optim.Adam, torch.optim.AdamW)


def build_optimizer(model: nn.Module, optimizer: Callable[..., torch.optim.Optimizer],
                    fused: bool = False) -> torch.optim.Optimizer:
    """Call the `optim` group's partial (`torch.optim.AdamW`, `Adam`, `RAdam`, ...) on `build_param_groups(model)`.

    Args:
        model: the module whose trainable parameters are optimized.
        optimizer: a `functools.partial` of a torch optimizer with its `lr` and `weight_decay` bound (the `optim`
            config group with `_partial_: true`); the groups take both from it.
        fused: use torch's fused implementation where the optimizer has one (Adam, AdamW) and the config leaves
            the choice open (`fused: null` and no `foreach`). The task passes True on a CUDA GPU without a gradient
            scaler: one kernel per step instead of foreach's dozen, and a shorter Python loop, which is host time
            in every small model's step. `optim.fused=false` opts out, `true` forces it.

    Raises:
        ValueError: `lr` missing or not > 0.
    """
    kwargs = getattr(optimizer, "keywords", {})
    lr, wd = kwargs.get("lr"), float(kwargs.get("weight_decay", 0.0))
    if lr is None or not float(lr) > 0:
        raise ValueError(f"optim.lr={lr!r} must be > 0 (set it in configs/optim/<name>.yaml or the recipe)")
    choose = {}
    cls = getattr(optimizer, "func", None)
    # the config's lists (betas) arrive as OmegaConf containers, which an optimizer keeps in its param groups and
    # so in every checkpoint, where `torch.load(weights_only=True)` refuses them: plain Python values instead
    from omegaconf import DictConfig, ListConfig, OmegaConf

    for key, value in kwargs.items():
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
            choose[key] = tuple(value) if isinstance(value, list) else value
    if fused and isinstance(cls, type) and issubclass(cls, FUSABLE) and kwargs.get("fused") is None \
            and kwargs.get("foreach") is None:
        choose["fused"] = True
    return optimizer(build_param_groups(model, float(lr), wd), **choose)


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor | None:
    """Scale the gradients of `parameters` in place so that their joint L2 norm is at most `max_norm`; return the
    norm before clipping (None when no parameter has a gradient).

    The same arithmetic as `torch.nn.utils.clip_grad_norm_(parameters, max_norm)` (coefficient
    max_norm / (norm + 1e-6), clamped at 1; no error and no host sync on a non-finite norm), in five launches and
    one short Python pass: torch's version regroups the tensors by device and dtype twice per call, which costs
    more host time than its kernels in a small model's step. Gradients on several devices take torch's path.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return None
    grads = [p.grad for p in params]
    if any(g.device != grads[0].device for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norms = torch._foreach_norm(grads)
    if len({n.dtype for n in norms}) > 1:  # mixed gradient dtypes: one norm dtype for the stack
        norms = [n.float() for n in norms]
    total = torch.linalg.vector_norm(torch.stack(norms))
    torch._foreach_mul_(grads, torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


class WarmupSchedule(torch.optim.lr_scheduler.LambdaLR):
    """Per-step warmup then decay; every parameter group keeps its own base lr (the factor multiplies each).

    Warmup goes from `warmup_init_lr` to the optimizer's lr over `warmup_steps`, polynomially with `warmup_power`
    (1: linear, fairseq's `polynomial_decay`; MEGA's Path-X recipe uses 2). Subclasses define the decay.

    Args:
        optimizer: the optimizer (its `defaults["lr"]` is the peak lr).
        total_steps: optimizer steps of the whole run (the task passes the trainer's estimate).
        warmup_steps: steps of warmup (0: none).
        warmup_init_lr: lr at step 0 (fairseq's `--warmup-init-lr`, 1e-7 in the MEGA / SeqBoat recipes).
        warmup_power: exponent of the warmup polynomial.
        end_lr: lr at `total_steps`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                 warmup_init_lr: float = 1e-7, warmup_power: float = 1.0, end_lr: float = 0.0):
        if warmup_steps < 0:
            raise ValueError(f"scheduler.warmup_steps={warmup_steps} must be >= 0")
        self.lr = float(optimizer.defaults["lr"])
        self.total_steps, self.warmup_steps = max(int(total_steps), 1), int(warmup_steps)
        self.warmup_init_lr, self.warmup_power, self.end_lr = warmup_init_lr, warmup_power, end_lr
        super().__init__(optimizer, self.factor)

    def factor(self, step: int) -> float:
        """The multiplier of the base lr at optimizer step `step` (0-based)."""
        if step < self.warmup_steps:
            start = self.warmup_init_lr / self.lr
            return start + (1.0 - start) * (step / self.warmup_steps) ** self.warmup_power
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        end = self.end_lr / self.lr
        return end + (1.0 - end) * self.decay(progress, step)

    def decay(self, progress: float, step: int) -> float:
        raise NotImplementedError


class LinearDecay(WarmupSchedule):
    """fairseq's `polynomial_decay` with power 1 (the MEGA / SeqBoat recipes): linear from lr to `end_lr`."""

    def decay(self, progress: float, step: int) -> float:
        return 1.0 - progress


class CosineDecay(WarmupSchedule):
    """Half a cosine from lr to `end_lr` (the S4 pipeline of LaS; the LRA image and Pathfinder configs)."""

    def decay(self, progress: float, step: int) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * progress))


class Constant(WarmupSchedule):
    """The lr after warmup stays constant."""

    def decay(self, progress: float, step: int) -> float:
        return 1.0


class InverseSqrtDecay(WarmupSchedule):
    """lr * sqrt(warmup_steps / step) after warmup: the LRA codebase's `linear_warmup * rsqrt_decay`, whose
    peak is its `learning_rate / sqrt(warmup)`. `end_lr` is ignored: the decay has no end."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                 warmup_init_lr: float = 1e-7, warmup_power: float = 1.0, end_lr: float = 0.0):
        if warmup_steps < 1:
            raise ValueError(f"scheduler.warmup_steps={warmup_steps} must be >= 1 for the inverse-sqrt decay")
        super().__init__(optimizer, total_steps, warmup_steps, warmup_init_lr, warmup_power, end_lr)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return super().factor(step)
        return math.sqrt(self.warmup_steps / max(step, 1))


# What a checkpoint restores into the optimizer and its schedule but the config decides: `configured_settings` takes
# them from the freshly configured pair, `reapply_settings` puts them back after the restore. A plain resume restores
# the same values; a run continued with `resume=force` and a changed optim / scheduler config (a new lr, weight
# decay, warmup, or max_steps, which sets the schedule's length) trains with the new ones. Counters (the step, the
# plateau's best and patience) stay as restored; `lr_lambdas` are the schedule's own functions.
GROUP_SETTINGS = ("initial_lr", "weight_decay", "betas", "eps", "momentum", "dampening")
SCHEDULE_COUNTERS = ("last_epoch", "best", "num_bad_epochs", "cooldown_counter", "lr_lambdas")


def configured_settings(optimizer: torch.optim.Optimizer, scheduler) -> dict[str, Any]:
    return {"groups": [{k: g[k] for k in GROUP_SETTINGS if k in g} for g in optimizer.param_groups],
            "schedule": {k: v for k, v in scheduler.state_dict().items()
                         if not k.startswith("_") and k not in SCHEDULE_COUNTERS}}


def reapply_settings(optimizer: torch.optim.Optimizer, scheduler, settings: dict[str, Any]) -> list[str]:
    """Put `settings` (`configured_settings` of the configured pair) back into the restored `optimizer` and
    `scheduler`, and set each group's current lr from them: the schedule's value at its restored step (a
    `LambdaLR`), or the restored lr scaled by the new base lr over the old (`ReduceLROnPlateau`, whose reductions so
    far are kept). Returns the names of the settings that differed from the restored ones."""
    groups = optimizer.param_groups
    if len(groups) != len(settings["groups"]):
        return []
    changed = set()
    old_bases = [g.get("initial_lr") for g in groups]
    for group, configured in zip(groups, settings["groups"]):
        for key, value in configured.items():
            if group.get(key) != value:
                changed.add(key)
                group[key] = value
    for key, value in settings["schedule"].items():
        if getattr(scheduler, key, None) != value:
            changed.add(f"scheduler.{key}")
            setattr(scheduler, key, value)
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * factor(scheduler.last_epoch)
    else:
        for group, old in zip(groups, old_bases):
            if old and group.get("initial_lr") and old != group["initial_lr"]:
                group["lr"] = group["lr"] * group["initial_lr"] / old
    scheduler._last_lr = [group["lr"] for group in groups]
    return sorted(changed)


def count_parameters(module: nn.Module) -> dict[str, int]:
    """Total, trainable and non-trainable parameter counts (buffers excluded)."""
    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    return {"total": total, "trainable": trainable, "non_trainable": total - trainable}


class Plateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """The S4 pipeline's `plateau` scheduler: no warmup; the lr is multiplied by `factor` once the monitored
    validation metric has not improved for `patience` epochs. S4's v1 LRA configs (`lra/old/s4-lra-*.yaml`), which
    the LaS recipes follow (docs/reproduction.md), train with it.

    The task steps it once per training epoch with its `monitor` value (`interval = "epoch"`); `mode` must be the
    task's (`scheduler/plateau.yaml` interpolates `${task.mode}`). `total_steps` is accepted for the common
    `scheduler(optimizer, total_steps)` call and unused.
    """

    interval = "epoch"

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int = 0, mode: str = "max",
                 factor: float = 0.2, patience: int = 10, min_lr: float = 0.0, threshold: float = 1e-4,
                 warmup_steps: int = 0):
        if warmup_steps:  # accepted so that a recipe's warmup for the per-step schedules is named, not unknown
            from longmixer.utils.config import ConfigError

            raise ConfigError(f"scheduler.warmup_steps={warmup_steps}: scheduler=plateau has no warmup (the recipe's "
                             "value is for the per-step schedules); add ~scheduler.warmup_steps to the command")
        if not 0.0 < factor < 1.0:
            raise ValueError(f"scheduler.factor={factor} must be in (0, 1)")
        if patience < 0:
            raise ValueError(f"scheduler.patience={patience} must be >= 0")
        super().__init__(optimizer, mode=mode, factor=factor, patience=patience, min_lr=min_lr, threshold=threshold)
