"""Causal language modeling (WikiText-103, enwik8): next-token cross-entropy over the scored targets.

Batches carry `inputs` [B, L] and `targets` [B, L] (-100 = not scored: the context part of an evaluation window);
every position is real, so they carry no `mask` (a causal model then uses its unmasked causal path). The model
encodes (`model.encode`), then its head scores: a head with `.loss(h, targets)` (the adaptive softmax) returns the
per-token NLL itself, any other head returns logits for a cross-entropy. Validation and test losses are exact token
means over the whole split (NLL sums and scored-token counts accumulate across batches and ranks), so windowed
evaluation reports the papers' per-token numbers: `<stage>/ppl` = exp(loss) for word level, `<stage>/bpc` =
loss / ln 2 (bits per byte or character) for enwik8.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torchmetrics import MeanMetric

from longmixer.tasks.base import SequenceTask

IGNORE_INDEX = -100
METRICS = ("ppl", "bpc")


def report(loss: torch.Tensor, metric: str) -> torch.Tensor:
    """Mean NLL in nats -> perplexity or bits per token."""
    return torch.exp(loss) if metric == "ppl" else loss / math.log(2.0)


class LanguageModel(SequenceTask):
    """Causal LM over a `SequenceModel` built with `causal=True` and a per-token head.

    Args:
        model, optim, scheduler, monitor, mode, compile: see `SequenceTask` (monitor `val/loss`, mode `min`).
        metric: "ppl" (WikiText-103) | "bpc" (enwik8); the recipe takes it from `${data.metric}`.
    """

    compile_entry = "encode"  # the task runs `model.encode`, then the head (kept eager)

    def __init__(self, model: nn.Module, optim: Callable[..., torch.optim.Optimizer],
                 scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler], monitor: str = "val/loss",
                 mode: str = "min", metric: str = "ppl", compile: str = "auto"):
        super().__init__(model, optim, scheduler, monitor=monitor, mode=mode, compile=compile)
        if getattr(model, "causal", None) is not True:
            raise ValueError("task=language_model needs a causal model: set model.causal=true (a bidirectional mixer "
                             "would see the tokens it predicts)")
        if getattr(model, "pool", "none") != "none":
            raise ValueError(f"task=language_model needs per-token outputs: set model.pool=none (got "
                             f"{model.pool!r})")
        if metric not in METRICS:
            raise ValueError(f"task.metric={metric!r} is not one of {METRICS}")
        self.metric = metric
        self.check_monitor(("val/loss", f"val/{metric}"))
        self.eval_nll = nn.ModuleDict({stage: MeanMetric().set_dtype(torch.float64) for stage in ("val", "test")})

    def token_nll(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token NLL [B, L] in nats (0 where `targets` is -100) and the model's aux."""
        h, aux = self.model.encode(batch["inputs"], batch.get("mask"))  # [B, L, D]
        self.after_forward()
        targets = batch["targets"]
        head = self.model.head
        if hasattr(head, "loss"):  # adaptive softmax: never materializes the [B, L, V] logits
            return head.loss(h, targets), aux
        logits = head(h)  # [B, L, V]
        logits = logits.flatten(0, 1)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least fp32 for the softmax
        nll = F.cross_entropy(logits, targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
        return nll.view(targets.shape), aux

    def forward_loss(self, batch: dict[str, torch.Tensor]):
        nll, aux = self.token_nll(batch)
        count = (batch["targets"] != IGNORE_INDEX).sum()
        return nll.sum() / count.clamp_min(1), {"count": count, "aux": aux}

    def update_share(self, batch, loss, outputs):
        """Under gradient accumulation, the batch's summed NLL over its update's tokens (`update_tokens`, from
        `LMTrainStream`), times the accumulation count that Lightning divides by: the update's gradient is its total
        NLL over its total tokens, as fairseq's, however K varies between its batches. Without accumulation (or
        without `update_tokens`), the batch's token mean."""
        total = batch.get("update_tokens")
        if total is None:
            return loss
        return loss * (outputs["count"].to(loss.dtype) / total.to(loss.dtype)) * self.trainer.accumulate_grad_batches

    def log_step(self, batch, stage, loss, outputs):
        n = batch["targets"].shape[0]
        if stage == "train":
            self.log_train("train/loss", loss, n)
            self.log(f"train/{self.metric}", report(loss, self.metric), on_step=True, on_epoch=False, batch_size=n)
        else:
            self.eval_nll[stage].update(loss.double(), weight=outputs["count"].double())

    def _log_eval(self, stage: str) -> None:
        meter = self.eval_nll[stage]
        if meter.update_count == 0:
            return
        loss = meter.compute()  # token mean over the split, summed across ranks
        meter.reset()
        # summed across ranks by the meter: the same on every rank, so the max across ranks keeps it exact
        self.log(f"{stage}/loss", loss.float(), prog_bar=True, sync_dist=True, reduce_fx="max")
        self.log(f"{stage}/{self.metric}", report(loss, self.metric).float(), prog_bar=True, sync_dist=True,
                 reduce_fx="max")

    def on_validation_epoch_end(self):
        self._log_eval("val")
        super().on_validation_epoch_end()

    def on_test_epoch_end(self):
        self._log_eval("test")
