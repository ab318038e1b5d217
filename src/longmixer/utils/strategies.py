"""`ZeroDDPStrategy`: DDP with the optimizer state sharded over the ranks (ZeRO stage 1), `trainer=zero`.

Each rank keeps the AdamW moments of about 1/N of the parameters and updates only those, then broadcasts them;
gradients are all-reduced as in plain DDP, so the updates (and the loss curve) are DDP's up to rounding, and the
saving is 8 bytes per parameter x (N - 1) / N per GPU (fp32 moments). Lightning consolidates the shards on every
rank before a checkpoint is written (`Strategy.optimizer_state` calls `consolidate_state_dict`), so checkpoints are
ordinary full optimizer states and resume with any strategy.

Why not Lightning's FSDP: sharded parameters are flat 1-D views, so `utils/optim.build_param_groups` (which keeps
parameters with ndim <= 1 out of weight decay) would silently take every weight out of weight decay, and the
per-parameter optimizer tags would apply to shards; FSDP also needs a CUDA device (no CPU test is possible).
"""

from __future__ import annotations

import functools
import inspect

from pytorch_lightning.strategies import DDPStrategy
from torch.distributed.optim import ZeroRedundancyOptimizer


def _track_step_calls(optimizer) -> None:
    """Mark `optimizer.step` the way `torch.optim.lr_scheduler.LRScheduler.__init__` does, so the scheduler's
    "scheduler.step() before optimizer.step()" check still works after the optimizer is swapped."""
    step = optimizer.step

    @functools.wraps(step)
    def counted(*args, **kwargs):
        optimizer._opt_called = True
        return step(*args, **kwargs)

    counted._wrapped_by_lr_sched = True
    optimizer.step = counted


class ZeroDDPStrategy(DDPStrategy):
    """`DDPStrategy` whose optimizers become `torch.distributed.optim.ZeroRedundancyOptimizer`s of the same class,
    parameter groups (lr, weight decay, tags) and defaults; the LR schedulers are pointed at the new optimizers.
    Takes DDPStrategy's arguments (`find_unused_parameters`, `process_group_backend`, ...)."""

    strategy_name = "ddp_zero"

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        sharded = []
        for optimizer in self.optimizers:
            if isinstance(optimizer, ZeroRedundancyOptimizer):
                sharded.append(optimizer)
                continue
            if optimizer.state:
                raise RuntimeError(f"{type(optimizer).__name__} already holds state; ZeroDDPStrategy must shard it "
                                   "before the first step")
            # `defaults` can hold derived keys the constructor does not take (AdamW: decoupled_weight_decay)
            accepted = inspect.signature(type(optimizer).__init__).parameters
            defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
            zero = ZeroRedundancyOptimizer([dict(group) for group in optimizer.param_groups],
                                           optimizer_class=type(optimizer), **defaults)
            for config in self.lr_scheduler_configs:
                if config.scheduler.optimizer is optimizer:
                    config.scheduler.optimizer = zero
                    _track_step_calls(zero)
            sharded.append(zero)
        self.optimizers = sharded
