"""Sequence classification (LRA, sCIFAR, SC10, s/pMNIST), including two-document retrieval: cross-entropy,
accuracy, masked mean pooling in the model; test accuracy is reported at the best-validation checkpoint."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from longmixer.tasks.base import SequenceTask


class Classification(SequenceTask):
    """Cross-entropy classification over a `SequenceModel` (see `SequenceTask` for the arguments).

    Batches are dicts with `inputs`, `mask`, `labels` and, for retrieval, `inputs2`, `mask2`.
    """

    def _step(self, batch: dict[str, torch.Tensor], stage: str):
        logits, aux = self.model(batch["inputs"], batch.get("mask"), batch.get("inputs2"), batch.get("mask2"))
        labels = batch["labels"]
        loss = F.cross_entropy(logits.float(), labels)
        acc = (logits.argmax(-1) == labels).float().mean()
        n = labels.shape[0]
        self.log(f"{stage}/loss", loss.detach(), on_step=stage == "train", on_epoch=True, prog_bar=stage != "train",
                 batch_size=n, sync_dist=stage != "train")
        self.log(f"{stage}/acc", acc, on_step=False, on_epoch=True, prog_bar=True, batch_size=n,
                 sync_dist=stage != "train")
        return self.add_aux(loss, aux, stage, n)

    def training_step(self, batch, batch_idx):
        return self._step(batch, "train")

    def validation_step(self, batch, batch_idx):
        self._step(batch, "val")

    def test_step(self, batch, batch_idx):
        self._step(batch, "test")
