"""Classification's accuracy: torchmetrics' MulticlassAccuracy over every sample of an epoch."""

from __future__ import annotations

import logging
from functools import partial
from types import SimpleNamespace

import pytest
import pytorch_lightning as pl
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


def _cuda_trainer(datamodule, **overrides):
    """What `configure_model` reads of a one-GPU trainer, without a GPU."""
    from pytorch_lightning.strategies import SingleDeviceStrategy

    fields = dict(strategy=SingleDeviceStrategy(device=torch.device("cuda", 0)), datamodule=datamodule,
                  accumulate_grad_batches=1, precision_plugin=SimpleNamespace(), gradient_clip_val=1.0,
                  gradient_clip_algorithm=None, callbacks=[])
    return SimpleNamespace(**{**fields, **overrides})


class _ReadsGradients(pl.Callback):
    def on_after_backward(self, trainer, task):
        pass


@pytest.mark.parametrize("few_shapes, overrides, optim, expected, why", [
    (True, {}, OPTIM[0], "step-graph", None),                         # fixed length, or padded to a multiple
    (True, {"accumulate_grad_batches": 2}, OPTIM[0], "reduce-overhead", "trainer.accumulate_grad_batches=1"),
    (True, {"callbacks": [_ReadsGradients()]}, OPTIM[0], "reduce-overhead", "_ReadsGradients"),
    (True, {"precision_plugin": SimpleNamespace(scaler=object())}, OPTIM[0], "reduce-overhead", "16-mixed"),
    (True, {}, partial(torch.optim.SGD, lr=0.1), "reduce-overhead", "SGD is not"),
    (False, {}, OPTIM[0], "default", None),                           # each batch to its own longest
    (None, {}, OPTIM[0], "default", None),                            # data that does not say: no CUDA graphs
])
def test_auto_compile_follows_the_datamodules_shapes_and_the_run_on_cuda(monkeypatch, caplog, few_shapes, overrides,
                                                                         optim, expected, why):
    """`auto` on a GPU: one graph for the whole training step when the batches come in few shapes and nothing in the
    run needs the hooks or host work that a replayed step skips; the log names what kept it out."""
    import longmixer.tasks.base as base

    chosen = []
    monkeypatch.setattr(base, "compile_blocks", lambda model, mode, **kw: chosen.append(mode))
    task = Classification(_Logits(), optim, OPTIM[1], num_classes=3, compile="auto")
    datamodule = None if few_shapes is None else SimpleNamespace(few_shapes=few_shapes)
    task._trainer = _cuda_trainer(datamodule, **overrides)
    with caplog.at_level(logging.INFO, logger="longmixer.tasks.base"):
        task.configure_model()
    assert chosen == [expected] and task.compiled_as == expected
    assert f"task.compile=auto -> {expected} on cuda:0" in caplog.text  # the run's log says what auto chose
    assert (task.eval_graph is not None) == (expected == "step-graph")
    if why:
        assert "not step-graph, which needs" in caplog.text and why in caplog.text


class _Linear(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 3)

    def forward(self, inputs, mask=None, inputs2=None, mask2=None):
        return self.proj(inputs), {}


class _RecordingAdamW(torch.optim.AdamW):
    """Records the joint gradient norm that each step applies (after Lightning's closure has clipped)."""

    norms: list[float] = []

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())
        super().step()
        return loss


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_gradient_clipping_runs_in_front_of_a_fused_optimizer(tmp_path, precision):
    """`configure_gradient_clipping` clips by norm itself: Lightning's clipping refuses fused optimizers (the GPU
    default without a gradient scaler, `SequenceTask._fused_optimizer`), and every step sees clipped gradients."""
    import pytorch_lightning as pl

    torch.manual_seed(0)
    _RecordingAdamW.norms = []
    task = Classification(_Linear(), partial(_RecordingAdamW, lr=1e-3, fused=True), OPTIM[1], num_classes=3)
    data = [{"inputs": 10 * torch.randn(8, 4), "labels": torch.randint(0, 3, (8,))} for _ in range(3)]
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", precision=precision, gradient_clip_val=1e-3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(task, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    assert task.trainer.optimizers[0].defaults["fused"] is True
    assert len(_RecordingAdamW.norms) == 3 and max(_RecordingAdamW.norms) <= 1e-3 * (1 + 1e-4)


@pytest.mark.parametrize("device, scaler, strategy, fused", [
    ("cuda", None, "single", True),     # bf16-mixed / 32-true on one GPU
    ("cuda", None, "ddp", True),
    ("cuda", object(), "single", False),  # 16-mixed: the scaler's unscaling stays outside the step
    ("cuda", None, "other", False),     # a sharded or external strategy clips its own way
    ("cpu", None, "single", False),
])
def test_fused_optimizer_where_it_is_safe(device, scaler, strategy, fused):
    from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy

    task = Classification(_Linear(), *OPTIM, num_classes=3)
    made = {"single": lambda: SingleDeviceStrategy(torch.device("cpu")), "ddp": DDPStrategy, "other": object}
    task._trainer = SimpleNamespace(strategy=made[strategy](), precision_plugin=SimpleNamespace(scaler=scaler))
    task._device = torch.device(device, 0) if device == "cuda" else torch.device(device)
    assert task._fused_optimizer() is fused


@pytest.mark.gpu
def test_adamw_runs_fused_on_a_gpu_and_its_gradients_are_clipped(tmp_path):
    """On a GPU under bf16-mixed the task builds the `optim` partial fused (no config key asks for it) and clips in
    front of it."""
    import pytorch_lightning as pl

    torch.manual_seed(0)
    _RecordingAdamW.norms = []
    task = Classification(_Linear(), partial(_RecordingAdamW, lr=1e-3), OPTIM[1], num_classes=3)
    data = [{"inputs": 10 * torch.randn(8, 4), "labels": torch.randint(0, 3, (8,))} for _ in range(3)]
    trainer = pl.Trainer(max_steps=3, accelerator="gpu", devices=1, precision="bf16-mixed", gradient_clip_val=1e-3,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(task, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    assert task.trainer.optimizers[0].defaults["fused"] is True
    assert len(_RecordingAdamW.norms) == 3 and max(_RecordingAdamW.norms) <= 1e-3 * (1 + 1e-4)
