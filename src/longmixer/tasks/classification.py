"""Sequence classification (LRA, sCIFAR, SC10, s/pMNIST), including two-document retrieval: cross-entropy,
accuracy, masked mean pooling in the model; test accuracy is reported at the best-validation checkpoint."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from torchmetrics.classification import MulticlassAccuracy

from longmixer.tasks.base import SequenceTask

STAGES = ("train", "val", "test")


class Classification(SequenceTask):
    """Cross-entropy classification over a `SequenceModel`.

    Batches are dicts with `inputs`, `mask`, `labels` and, for retrieval, `inputs2`, `mask2`.

    Args:
        model, optim, monitor, mode: see `SequenceTask`.
        num_classes: the number of labels (the recipe takes it from `${model.num_classes}`).
    """

    def __init__(self, model: nn.Module, optim: Callable[..., torch.optim.Optimizer],
                 scheduler: Callable[..., torch.optim.lr_scheduler.LRScheduler], num_classes: int,
                 monitor: str = "val/acc", mode: str = "max", compile: str = "auto"):
        super().__init__(model, optim, scheduler, monitor=monitor, mode=mode, compile=compile)
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"task.num_classes={num_classes!r} must be an integer >= 2 (set data.num_classes)")
        self.check_monitor(("val/acc", "val/loss"))
        # accuracy over every sample of the epoch (micro average), summed across ranks by torchmetrics; keyed
        # `<stage>_acc` because a ModuleDict key `train` would shadow nn.Module.train
        self.accuracy = nn.ModuleDict({f"{stage}_acc": MulticlassAccuracy(num_classes, average="micro")
                                       for stage in STAGES})

    def forward_loss(self, batch: dict[str, torch.Tensor]):
        logits, aux = self.model(batch["inputs"], batch.get("mask"), batch.get("inputs2"), batch.get("mask2"))
        self.after_forward()
        return F.cross_entropy(logits.float(), batch["labels"]), {"logits": logits, "aux": aux}

    def log_step(self, batch, stage, loss, outputs):
        labels = batch["labels"]
        n = labels.shape[0]
        if stage == "train":
            self.log_train("train/loss", loss, n)
        else:
            self.log(f"{stage}/loss", loss, on_step=False, on_epoch=True, prog_bar=True, batch_size=n, sync_dist=True)
        accuracy = self.accuracy[f"{stage}_acc"]
        accuracy(outputs["logits"].detach(), labels)
        self.log(f"{stage}/acc", accuracy, on_step=False, on_epoch=True, prog_bar=True, batch_size=n)
