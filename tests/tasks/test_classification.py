"""Classification's accuracy: torchmetrics' MulticlassAccuracy over every sample of an epoch."""

from __future__ import annotations

from functools import partial
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from longmixer.tasks.classification import Classification
from longmixer.utils.optim import LinearDecay

OPTIM = (partial(torch.optim.AdamW, lr=1e-3), partial(LinearDecay, warmup_steps=0))


class _Logits(nn.Module):
    """Returns the batch's `inputs` as logits: the test chooses every prediction."""

    def forward(self, inputs, mask=None, inputs2=None, mask2=None):
        return inputs.float(), {}


def test_epoch_accuracy_counts_samples_not_batch_means():
    task = Classification(_Logits(), *OPTIM, num_classes=3)
    logged = {}
    task.log = lambda name, value, **kw: logged.__setitem__(name, value)
    # batch 1: 3 of 3 right; batch 2: 0 of 1 right -> 3 / 4 (the mean of batch means would be 0.5)
    task.validation_step({"inputs": torch.eye(3), "labels": torch.tensor([0, 1, 2])}, 0)
    task.validation_step({"inputs": torch.eye(3)[:1], "labels": torch.tensor([2])}, 1)
    assert logged["val/acc"].compute().item() == pytest.approx(0.75)


@pytest.mark.parametrize("bad", [1, None, 2.5])
def test_num_classes_is_checked(bad):
    with pytest.raises(ValueError, match="task.num_classes"):
        Classification(_Logits(), *OPTIM, num_classes=bad)


@pytest.mark.parametrize("datamodule, expected", [
    (SimpleNamespace(few_shapes=True), "reduce-overhead"),   # fixed length, or padded to a multiple
    (SimpleNamespace(few_shapes=False), "default"),          # each batch to its own longest
    (None, "default"),                                       # data that does not say: no CUDA graphs
])
def test_auto_compile_follows_the_datamodules_shapes_on_cuda(monkeypatch, datamodule, expected):
    import longmixer.tasks.base as base

    chosen = []
    monkeypatch.setattr(base, "compile_blocks", lambda model, mode, **kw: chosen.append(mode))
    task = Classification(_Logits(), *OPTIM, num_classes=3, compile="auto")
    task._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)),
                                    datamodule=datamodule)
    task.configure_model()
    assert chosen == [expected] and task.compiled_as == expected
