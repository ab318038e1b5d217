"""What every task shares: optimizer + schedule from the `optim` group, aux losses and statistics, progress for
scheduled layers, and every rank's RNG state in checkpoints (so a resumed run continues exactly)."""

from __future__ import annotations

import inspect
import logging
import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy
from pytorch_lightning.trainer.states import TrainerFn
from torch import nn

from longmixer.utils.compile import (
    COMPILE_MODES,
    STEP_GRAPH,
    EvalStepGraph,
    TrainStepGraph,
    compile_blocks,
    explain_compile_failure,
    resolve_compile_mode,
)
from longmixer.utils.config import ConfigError
from longmixer.utils.errors import TrainingDivergedError
from longmixer.utils.optim import build_optimizer, clip_grad_norm, configured_settings, reapply_settings
from longmixer.utils.strategies import ZeroDDPStrategy

log = logging.getLogger(__name__)

MODES = ("max", "min")
AUX_PREFIXES = ("val/aux/", "val/stats/")  # what `log_aux` logs from a model's aux dict, named by the model


def _numpy_state_to_tensor():
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))


class SequenceTask(pl.LightningModule):
    """Base LightningModule.

    Args:
        model: the `SequenceModel` (instantiated from `model:`).
        optim: the `optim` group: a torch optimizer partial (`torch.optim.AdamW` with lr, weight_decay, betas, eps),
            called on the model's parameter groups.
        scheduler: the `scheduler` group: a `WarmupSchedule` or `Plateau` partial, called as
            `scheduler(optimizer, total_steps)`; `Plateau` is stepped once per epoch on `monitor`.
        monitor: the metric that selects the best checkpoint, e.g. `val/acc` (declared once, interpolated by the
            checkpoint callback, early stopping and hparams_search).
        mode: "max" or "min" for `monitor`.
        compile: torch.compile mode of the model's blocks (`compile_blocks`): "none" | "default" |
            "reduce-overhead" | "max-autotune", "step-graph" (blocks as "default", each training step replayed
            from one CUDA graph, `TrainStepGraph`, and each evaluation forward from another, `EvalStepGraph`;
            single-GPU runs), or "auto": on CUDA, where the batches come in few shapes, "step-graph" when the run
            allows it (`_step_graph_problems`: one GPU, no accumulation or gradient scaler, a capturable
            optimizer, no callback reading gradients, no data-dependent shapes) and "reduce-overhead" when not;
            "default" where every batch may have its own length; "none" elsewhere (decided in `configure_model`
            from the trainer's device, `resolve_compile_mode`).

    Subclasses define `forward_loss` (the model's call and the task loss, no logging) and `log_step` (the metrics
    of one step); `training_step`, `validation_step` and `test_step` are built from the two.
    """

    def __init__(self, model: nn.Module, optim: Callable[..., torch.optim.Optimizer],
                 scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler], monitor: str = "val/acc",
                 mode: str = "max", compile: str = "auto"):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"task.mode={mode!r} is not one of {MODES}")
        if compile not in COMPILE_MODES:
            raise ValueError(f"task.compile={compile!r} is not one of {COMPILE_MODES}; use task.compile=auto")
        self.compile_mode = compile
        self.compiled_as: str | None = None  # the mode `configure_model` applied, once
        if not monitor.startswith("val/"):
            raise ValueError(f"task.monitor={monitor!r} must be a validation metric (val/...)")
        self.model = model
        self.optimizer_factory, self.scheduler_factory = optim, scheduler
        self.monitor, self.mode = monitor, mode
        # a float, not torchmetrics' MaxMetric: it must travel in checkpoints (MaxMetric state is not persistent)
        self.best_score: float | None = None
        self._first_bad_step: torch.Tensor | None = None  # the divergence guard's device-side record
        self.total_steps = 1
        self.step_graph: TrainStepGraph | None = None  # task.compile=step-graph during fit (`on_fit_start`)
        self.eval_graph: EvalStepGraph | None = None  # task.compile=step-graph on CUDA (`configure_model`)
        # the run's resolved `model:` config, set by train.py and written into every checkpoint: evaluate compares it
        # with the model it builds, since variants with weights of the same shapes (LaS and LaS-chunk) load into
        # each other's model without an error
        self.model_config: dict | None = None

    # --- the steps ------------------------------------------------------------------------------------------------
    def forward_loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        """The model on `batch` and the task's loss, without logging: (loss, outputs), where outputs holds the
        model's `aux` dict and whatever `log_step` reads. The interface each task defines (Classification,
        LanguageModel)."""
        raise NotImplementedError(f"{type(self).__name__} defines no forward_loss: a task subclass defines it")

    def log_step(self, batch: dict[str, torch.Tensor], stage: str, loss: torch.Tensor,
                 outputs: dict[str, Any]) -> None:
        """Log one step's metrics from `forward_loss`'s detached loss and outputs (defined by each task subclass)."""
        raise NotImplementedError(f"{type(self).__name__} defines no log_step: a task subclass defines it")

    def _compiling(self):
        """Where torch.compile compiles (the first forward and backward of each shape): its failures in one line."""
        return explain_compile_failure(self.compile_mode, self.compiled_as)

    def update_share(self, batch: dict[str, torch.Tensor], loss: torch.Tensor, outputs: dict[str, Any]) -> torch.Tensor:
        """The loss a training batch puts into its optimizer update, before Lightning divides it by
        `trainer.accumulate_grad_batches`: here the batch's own loss (every batch of an update weighs the same);
        the language-model task weighs by tokens."""
        return loss

    def _step(self, batch: dict[str, torch.Tensor], stage: str, forward: Callable | None = None) -> torch.Tensor:
        """`forward` (default `forward_loss`; evaluation under step-graph: the replayed `eval_graph`, whose tensors
        the next replay overwrites, so they are logged here at once), then logging and the step's loss."""
        with self._compiling():
            loss, outputs = (forward or self.forward_loss)(batch)
        self.log_step(batch, stage, loss.detach(), outputs)
        self.log_aux(outputs["aux"], stage, _batch_size(batch))
        if stage == "train":
            loss = self.update_share(batch, loss, outputs)
        return self.with_aux_losses(loss, outputs["aux"])

    def training_step(self, batch, batch_idx):
        if self.step_graph is None:
            return self._step(batch, "train")
        out = self.step_graph(batch)  # forward, backward and the optimizer step, replayed
        # the graph's outputs are overwritten by the next replay: logged scalars are copied
        aux = {key: value.clone() for key, value in out["aux"].items()}
        self.log_step(batch, "train", out["loss"].clone(), out)
        self.log_aux(aux, "train", _batch_size(batch))
        return out["total"].clone()

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val", self.eval_graph)

    def test_step(self, batch, batch_idx):
        self._step(batch, "test", self.eval_graph)

    def on_validation_epoch_start(self) -> None:
        if self.eval_graph is not None:
            self.eval_graph.follow(self.model)

    def on_test_epoch_start(self) -> None:
        if self.eval_graph is not None:
            self.eval_graph.follow(self.model)

    # --- torch.compile (the `task.compile` switch) ------------------------------------------------------------------
    compile_entry = "forward"  # what the task calls on the model (utils/compile.py: one CUDA graph around it)

    def configure_model(self) -> None:
        """Compile the model's blocks once per task, for fit, validate and test alike (Lightning calls this hook
        before each of them, with the trainer's device known)."""
        if self.compiled_as is not None:
            return
        device = self._trainer.strategy.root_device if self._trainer is not None else torch.device("cpu")
        # the datamodule says whether its batches come in few shapes (data/base.py: `few_shapes`); `auto` picks
        # CUDA graphs only then, and not for data that does not say (a user's own datamodule, bare dataloaders)
        few_shapes = getattr(getattr(self._trainer, "datamodule", None), "few_shapes", False)
        # only where `auto` chooses between the two CUDA-graph modes
        kept_out = (self._step_graph_problems(device)
                    if self.compile_mode == "auto" and few_shapes and device.type == "cuda" else [])
        self.compiled_as = resolve_compile_mode(self.compile_mode, device, few_shapes=few_shapes,
                                                whole_step=not kept_out)
        if self.compile_mode == "auto":
            why_not = f"; not {STEP_GRAPH}, which needs " + "; ".join(kept_out) if kept_out else ""
            log.info("task.compile=auto -> %s on %s (batches of %s%s)", self.compiled_as, device,
                     "few shapes" if few_shapes else "any length", why_not)
        compile_blocks(self.model, self.compiled_as, entry=self.compile_entry)
        if self.compiled_as == STEP_GRAPH and device.type == "cuda" and not self._uncapturable_modules():
            self.eval_graph = EvalStepGraph(self.forward_loss)

    def on_fit_start(self) -> None:
        if self.compiled_as == STEP_GRAPH:
            self._check_step_graph()
            optimizer = self.trainer.optimizers[0]
            self.step_graph = TrainStepGraph(self._graph_update, optimizer,
                                             after_replay=getattr(self.model, "after_replay", None))

    def on_train_start(self) -> None:
        """After a resume has restored the optimizer and its schedule: the config's settings for them, not the
        checkpoint's (`reapply_settings`; the same values unless `resume=force` continues with a changed config)."""
        settings = getattr(self, "_configured_settings", None)
        schedulers = self.trainer.lr_scheduler_configs
        if settings is None or len(self.trainer.optimizers) != 1 or len(schedulers) != 1:
            return
        changed = reapply_settings(self.trainer.optimizers[0], schedulers[0].scheduler, settings)
        if changed:
            log.warning("the optimizer and its schedule continue with the config's %s, not the checkpoint's",
                        ", ".join(changed))

    def on_fit_end(self) -> None:
        self.step_graph = None  # the graph and its memory pool

    def _check_step_graph(self) -> None:
        """What `task.compile=step-graph` needs, each with the override that provides it."""
        problems = self._step_graph_problems(self.device)
        if len(self.trainer.optimizers) != 1:
            problems.append(f"one optimizer (there are {len(self.trainer.optimizers)})")
        if problems:
            raise ConfigError(f"task.compile={STEP_GRAPH} needs " + "; ".join(problems))

    def _step_graph_problems(self, device: torch.device) -> list[str]:
        """What in this run a training step replayed whole from a CUDA graph cannot do, each with its fix; empty
        when `step-graph` can train it. Read from the trainer and the config only (no optimizer built yet), so
        `auto` decides with it in `configure_model`, and an explicit `step-graph` is refused by it at fit start."""
        trainer = self._trainer
        if trainer is None:
            return ["a trainer"]
        problems = []
        if device.type != "cuda":
            problems.append(f"a CUDA GPU (the model is on {device}): use trainer=gpu, or task.compile=auto")
        if type(trainer.strategy) is not SingleDeviceStrategy:
            problems.append(f"one device (the strategy is {type(trainer.strategy).__name__}): set trainer.devices=1, "
                            "or task.compile=auto for data-parallel runs")
        if trainer.accumulate_grad_batches != 1:
            problems.append(f"one batch per optimizer step (trainer.accumulate_grad_batches="
                            f"{trainer.accumulate_grad_batches}): set trainer.accumulate_grad_batches=1")
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            problems.append("no gradient scaler (16-mixed has one): set trainer.precision=bf16-mixed or 32-true")
        if trainer.gradient_clip_val and (trainer.gradient_clip_algorithm or "norm") != "norm":
            problems.append("clipping by norm: set trainer.gradient_clip_algorithm=norm")
        optimizer = getattr(self.optimizer_factory, "func", self.optimizer_factory)
        if not (isinstance(optimizer, type) and "capturable" in inspect.signature(optimizer).parameters):
            problems.append(f"an optimizer that runs inside a CUDA graph (capturable: Adam, AdamW, ...; "
                            f"{getattr(optimizer, '__name__', optimizer)} is not): set optim=adamw")
        readers = sorted({type(c).__name__ for c in trainer.callbacks if _reads_gradients(c)})
        if readers:
            problems.append(f"no callback that reads gradients ({', '.join(readers)}: a replayed step runs no "
                            "on_after_backward or on_before_optimizer_step hook): use task.compile=auto")
        uncapturable = self._uncapturable_modules()
        if uncapturable:
            problems.append(f"a model without data-dependent shapes ({', '.join(uncapturable)} select rows by value, "
                            "e.g. model.embedding=adaptive / model.head=adaptive): use task.compile=auto")
        return problems

    def _uncapturable_modules(self) -> list[str]:
        """The model's modules that select rows by value (`cuda_graph_capturable = False`): no CUDA graph holds them."""
        return sorted({type(m).__name__ for m in self.model.modules()
                       if getattr(m, "cuda_graph_capturable", True) is False})

    def _graph_update(self, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
        """One whole training step for `TrainStepGraph`: forward (under the trainer's autocast, which wraps
        `training_step`), loss, backward, clipping by norm (`trainer.gradient_clip_val`) and the optimizer step."""
        with self._compiling():
            loss, outputs = self.forward_loss(batch)
            total = self.with_aux_losses(loss, outputs["aux"])
            with torch.autocast(self.device.type, enabled=False):
                total.backward()
        optimizer = self.trainer.optimizers[0]
        if self.trainer.gradient_clip_val:
            clip_grad_norm((p for group in optimizer.param_groups for p in group["params"]),
                           float(self.trainer.gradient_clip_val))
        optimizer.step()
        detached = {key: value.detach() if torch.is_tensor(value) else value for key, value in outputs.items()}
        detached["aux"] = {key: value.detach() for key, value in outputs["aux"].items()}
        return {**detached, "loss": loss.detach(), "total": total.detach()}

    # Lightning's automatic optimization around a replayed step: its closure runs `training_step` (which replays
    # the forward, backward and optimizer step) and the hooks around backward (the divergence guard), and nothing
    # else: no second backward, no optimizer.step(). (Its zero_grad, after the step, only drops the Python
    # references to the graph's gradients; the next replay writes them again.) So under step-graph no
    # `on_before_optimizer_step` hook runs and `on_after_backward` sees no gradients: `_check_step_graph` refuses a
    # callback that defines either.
    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None) -> None:
        if self.step_graph is None:
            super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        else:
            optimizer_closure()
        # The step is complete: the model gets the next step's progress now, not at the next batch's start, so that
        # what waits for the end of a step (LongVQ's codebook EMA of the step's statistics, `VectorQuantizer`) is in
        # the state that callbacks, validation and checkpoints see. Lightning counts the step after this hook returns.
        if hasattr(self.model, "set_progress"):
            self.model.set_progress(self.global_step + 1, self.total_steps)

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        if self.step_graph is None:
            with self._compiling():  # a compiled forward's backward is compiled at its first call
                super().backward(loss, *args, **kwargs)

    # --- optimization ------------------------------------------------------------------------------------------
    def configure_optimizers(self):
        optimizer = build_optimizer(self.model, self.optimizer_factory, fused=self._fused_optimizer())
        # computed once here (it can walk the dataloaders), then reused by every training step
        self.total_steps = int(self.trainer.estimated_stepping_batches) if self.trainer is not None else 1
        scheduler = self.scheduler_factory(optimizer, total_steps=self.total_steps)
        self._configured_settings = configured_settings(optimizer, scheduler)
        # per-step schedules by default; an epoch-stepped one (`Plateau`) says so and follows the task's monitor
        config = {"scheduler": scheduler, "interval": getattr(scheduler, "interval", "step")}
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            if scheduler.mode != self.mode:
                raise ValueError(f"scheduler.mode={scheduler.mode!r} but task.mode={self.mode!r} for "
                                 f"{self.monitor}: set scheduler.mode=${{task.mode}} (scheduler/plateau.yaml does)")
            # Lightning wants a monitor for it; `step_epoch_scheduler` does the stepping (`lr_scheduler_step`)
            config.update(monitor=self.monitor, strict=False)
        return {"optimizer": optimizer, "lr_scheduler": config}

    def _plain_data_parallel(self) -> bool:
        """Whether every rank holds whole parameters and gradients (one device, DDP, ZeRO-1), so that
        `configure_gradient_clipping` can clip them itself; sharded and external strategies clip their own way."""
        strategy = getattr(self._trainer, "strategy", None)
        return type(strategy) in (SingleDeviceStrategy, DDPStrategy, ZeroDDPStrategy)

    def _fused_optimizer(self) -> bool:
        """Fused Adam / AdamW (`build_optimizer`) where it is safe and pays: parameters on a CUDA GPU, no gradient
        scaler (bf16-mixed or 32-true; a scaler's unscaling would move into the fused step), and gradients that
        `configure_gradient_clipping` clips (Lightning's own clipping refuses fused optimizers)."""
        if self._trainer is None or self.device.type != "cuda" or not self._plain_data_parallel():
            return False
        return getattr(self.trainer.precision_plugin, "scaler", None) is None

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """`trainer.gradient_clip_val` by norm (Lightning's default algorithm), with `clip_grad_norm`: the same
        arithmetic as Lightning's call of `torch.nn.utils.clip_grad_norm_` over the optimizer's parameters, with less
        host time per step, and in front of fused optimizers too. A fused optimizer under a gradient scaler (a
        checkpoint of a bf16 run resumed in 16-mixed) has its gradients unscaled here first, as Lightning does for
        the others. Clipping by value, and sharded strategies, keep Lightning's path."""
        if not gradient_clip_val:
            return
        if (gradient_clip_algorithm or "norm") != "norm" or not self._plain_data_parallel():
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False):
            scaler.unscale_(optimizer)
        clip_grad_norm((p for group in optimizer.param_groups for p in group["params"]), float(gradient_clip_val))

    def lr_scheduler_step(self, scheduler, metric) -> None:
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            return  # stepped by `step_epoch_scheduler`, before the end-of-epoch checkpoint
        super().lr_scheduler_step(scheduler, metric)

    def step_epoch_scheduler(self) -> None:
        """Step a plateau schedule once per completed training epoch, at the first validation of the fit after the
        epoch boundary, with the monitored value (S4 validates at every epoch end and steps there).

        Here and not in Lightning's epoch-end update, which runs after the end-of-epoch validation has written
        `last.ckpt`: a run resumed from that checkpoint would lose the step. The count of epochs stepped is the
        scheduler's own `last_epoch`, so it travels in the checkpoint; epochs that ended without a validation are
        skipped, not stepped later."""
        trainer = self.trainer
        if trainer is None or trainer.sanity_checking or trainer.state.fn != "fit":
            return
        current = trainer.callback_metrics.get(self.monitor)
        if current is None:
            return
        completed = trainer.current_epoch + int(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and completed > scheduler.last_epoch:
                scheduler.step(float(current))
                scheduler.last_epoch = completed

    def on_train_batch_start(self, batch, batch_idx):
        if hasattr(self.model, "set_progress"):
            self.model.set_progress(self.global_step, self.total_steps)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        """At `trainer.max_steps` ask Lightning to stop, which makes it validate that step: a run whose last step
        falls between validations (max_steps mid-epoch, or off the `val_check_interval` grid) had its last steps
        trained and never scored, so the test took an earlier best checkpoint (transformer/listops: 2,000 of its
        5,000 steps). At a step that validates anyway this changes nothing."""
        trainer = self.trainer
        if 0 < trainer.max_steps <= trainer.global_step:
            trainer.should_stop = True

    def after_forward(self) -> None:
        """Right after each call of the model (the compiled entry): the model's `after_forward()` hook, eagerly and
        before any other forward (LongVQ's codebook statistics; see `SequenceModel.after_forward`)."""
        if hasattr(self.model, "after_forward"):
            self.model.after_forward()

    # --- divergence guard --------------------------------------------------------------------------------------
    divergence_check_every = 50  # steps between the host reads of the guard (each read waits for the GPU)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        """The divergence guard, without a host sync per step: the first step whose loss is non-finite is recorded on
        the device and read every `divergence_check_every` steps, at every checkpoint save (so no checkpoint holds
        diverged weights) and at the end of training; then every rank stops."""
        step = torch.full((), self.global_step + 1, device=loss.device, dtype=torch.long)
        bad = ~torch.isfinite(loss.detach()).all()
        if self._first_bad_step is None or self._first_bad_step.device != loss.device:
            self._first_bad_step = torch.zeros((), device=loss.device, dtype=torch.long)
        self._first_bad_step = torch.where(bad & (self._first_bad_step == 0), step, self._first_bad_step)
        if (self.global_step + 1) % self.divergence_check_every == 0:
            self._raise_if_diverged()

    def on_train_end(self) -> None:
        self._raise_if_diverged()

    def _raise_if_diverged(self) -> None:
        first = self._first_bad_step
        step = int(first) if first is not None else 0  # the host read
        diverged = step > 0
        strategy = getattr(self._trainer, "strategy", None)
        if strategy is not None and self.trainer.world_size > 1:
            diverged = strategy.reduce_boolean_decision(diverged, all=False)
        if diverged:
            lr = self.trainer.optimizers[0].param_groups[0]["lr"] if self.trainer.optimizers else float("nan")
            raise TrainingDivergedError(
                f"training diverged: non-finite loss at step {step or '?'} (learning rate {lr:.3g} at the stop). "
                "Lower optim.lr, raise scheduler.warmup_steps, set trainer.gradient_clip_val, or train in "
                "trainer.precision=32-true; the run dir keeps the last finite checkpoint")

    # --- inference form -----------------------------------------------------------------------------------------
    def on_test_start(self) -> None:
        """Test the inference form: fuse training-time branches (CHELA's parallel short kernels, structural
        reparameterization, section 4.2) through `SequenceModel.reparameterize()`. Outputs are unchanged (tested);
        checkpoints keep the trained form, which the fused model still loads."""
        if hasattr(self.model, "reparameterize"):
            self.model.reparameterize()

    def on_predict_start(self) -> None:
        self.on_test_start()

    # --- aux losses and statistics (docs/architecture.md) ----------------------------------------------------------
    def check_monitor(self, logged: tuple[str, ...]) -> None:
        """Refuse a `task.monitor` the task never logs (`val/acc_bst`): the checkpoint callback and the best score
        look it up only at the first validation, which may come hours into the run. `logged`: the validation
        metrics of the task; a model's aux values (`val/aux/...`, `val/stats/...`) are its own and pass."""
        if self.monitor not in logged and not self.monitor.startswith(AUX_PREFIXES):
            raise ValueError(f"task.monitor={self.monitor!r} is not a metric this task logs: one of "
                             f"{', '.join(logged)}, or a model's {'... or '.join(AUX_PREFIXES)}...")

    @staticmethod
    def with_aux_losses(loss: torch.Tensor, aux: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The task loss plus every `loss/...` entry of the model's aux dict."""
        for key, value in aux.items():
            if key.startswith("loss/"):
                loss = loss + value
        return loss

    def log_aux(self, aux: Mapping[str, torch.Tensor], stage: str, batch_size: int) -> None:
        """Log aux losses as `<stage>/aux/<name>` and statistics as `<stage>/stats/<name>`."""
        for key, value in aux.items():
            kind, name = key.split("/", 1)
            if kind == "loss" and stage == "train":
                self.log_train(f"train/aux/{name}", value.detach(), batch_size)
            elif kind == "loss":
                self.log(f"{stage}/aux/{name}", value.detach(), on_step=False, on_epoch=True, batch_size=batch_size,
                         sync_dist=True)
            else:
                self.log(f"{stage}/stats/{name}", value.detach().float(), on_step=False, on_epoch=True,
                         batch_size=batch_size, sync_dist=True)

    def log_train(self, name: str, value: torch.Tensor, batch_size: int) -> None:
        """A training value, as Lightning's `on_step=True, on_epoch=True` names it: each step's own (this rank's
        batch) as `<name>_step`, and the epoch's mean over every rank's batches as `<name>_epoch`. The epoch's mean
        is summed across ranks once, when the epoch ends; Lightning's `sync_dist` on a value logged at every step
        would all-reduce it at every step, and without it the epoch's value was rank 0's batches only."""
        self.log(f"{name}_step", value, on_step=True, on_epoch=False, batch_size=batch_size)
        self.log(f"{name}_epoch", value, on_step=False, on_epoch=True, batch_size=batch_size, sync_dist=True)

    def track_best(self) -> None:
        """Log `<monitor>_best` (e.g. val/acc_best), the best value of the monitored metric so far."""
        current = self.trainer.callback_metrics.get(self.monitor) if self.trainer is not None else None
        if current is None or self.trainer.sanity_checking:
            return
        value = float(current)
        if not np.isfinite(value):
            return  # a non-finite metric never becomes the best
        better = max if self.mode == "max" else min
        self.best_score = value if self.best_score is None else better(self.best_score, value)
        # the same on every rank (from synced metrics): the max across ranks keeps it exact, and marks it synced
        self.log(f"{self.monitor}_best", self.best_score, prog_bar=True, sync_dist=True, reduce_fx="max")

    def on_validation_epoch_end(self):
        self.track_best()
        self.step_epoch_scheduler()

    # --- checkpoints: RNG states and the best score -------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self._raise_if_diverged()  # a checkpoint never holds weights trained on a non-finite loss
        # Every rank keeps its own RNG state: the ranks are seeded alike, but each draws dropout masks for its own
        # batches (their shapes differ with their padding), so the states drift apart. Rank 0 writes the file, so
        # it gathers all of them (Lightning calls this hook on every rank), indexed by global rank.
        states = [_rng_state()]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, _rng_state())
        checkpoint["longmixer"] = {"best_score": self.best_score, "rng": states, "model_config": self.model_config}
        if checkpoint.get("optimizer_states"):
            _portable_optimizer_states(checkpoint, self.trainer.optimizers)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        # the weights are scored at the progress they were trained to (SeqBoat's annealed Gumbel temperature, which
        # no checkpoint holds): `evaluate` as the validation that saved them, and the test after fit at the best
        # checkpoint's step, not at the last step's (a resumed fit sets it again before each batch)
        step = checkpoint.get("global_step")
        if step is not None and hasattr(self.model, "set_progress"):
            self.model.set_progress(int(step), self.total_steps)
        state = checkpoint.get("longmixer")
        if state is None:
            return
        self.best_score = state["best_score"]
        states = state["rng"]
        if isinstance(states, Mapping):
            states = [states]  # a checkpoint holding one state for every rank
        fitting = self._trainer is not None and self.trainer.state.fn == TrainerFn.FITTING
        if fitting and len(states) != self.trainer.world_size and self.global_rank == 0:
            log.warning("the checkpoint holds the RNG states of %d rank(s), this run has %d: rank r resumes from "
                        "the state of rank r %% %d, and the run does not continue exactly as it would have",
                        len(states), self.trainer.world_size, len(states))
        _set_rng_state(states[self.global_rank % len(states)])


def _portable_optimizer_states(checkpoint: dict, optimizers: list[torch.optim.Optimizer]) -> None:
    """Save the optimizer groups as another compile mode or a CPU would load them: under `task.compile=step-graph`
    `make_capturable` turned each learning rate into a device tensor and each group capturable for the replays; the
    file gets floats and the constructor's `capturable` (a capturable group on CPU parameters fails torch's device
    check). A resumed step-graph run makes them capturable again before its first step."""
    for state, optimizer in zip(checkpoint.get("optimizer_states", []), optimizers, strict=False):
        capturable = optimizer.defaults.get("capturable", False)
        for group in state.get("param_groups", []):
            if torch.is_tensor(group.get("lr")):
                group["lr"] = float(group["lr"])  # one host read per checkpoint
            if "capturable" in group:
                group["capturable"] = capturable


def _reads_gradients(callback: pl.Callback) -> bool:
    """Whether a callback defines the hooks that see gradients, which a replayed training step does not run."""
    return any(getattr(type(callback), hook, None) is not getattr(pl.Callback, hook)
               for hook in ("on_after_backward", "on_before_optimizer_step"))


def _batch_size(batch: Mapping[str, torch.Tensor]) -> int:
    return int(batch["inputs"].shape[0])


def _rng_state() -> dict:
    # numpy's key array stored as a tensor so checkpoints stay loadable with torch.load(weights_only=True)
    return {"torch": torch.get_rng_state(), "numpy": _numpy_state_to_tensor(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(rng: Mapping[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    random.setstate(rng["python"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
