"""`task.compiled_autograd=true`: each training backward compiled whole by torch's compiled autograd
(utils/compile.py: `backward_compiler`, `compiled_backward`), wired into Lightning's backward (tasks/base.py)."""

from __future__ import annotations

from functools import partial

import pytest
import pytorch_lightning as pl
import torch
from torch._dynamo.utils import counters

import longmixer.tasks.base as base
from longmixer.tasks.classification import Classification
from longmixer.utils.compile import backward_compiler, compile_blocks
from longmixer.utils.config import ConfigError
from longmixer.utils.optim import LinearDecay
from tests.tasks.test_step_graph import _batches, _Net


def _fit(tmp_path, data, compile_mode="default", epochs=2, **task_kw):
    torch.manual_seed(0)
    optim = (partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1), partial(LinearDecay, warmup_steps=3))
    task = Classification(_Net(), *optim, num_classes=3, compile=compile_mode, **task_kw)
    trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, gradient_clip_val=0.5, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(task, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return task


@pytest.fixture
def aot_eager(monkeypatch):
    """The CPU's stand-in for Inductor: the same graphs, run by eager kernels."""
    torch._dynamo.reset()
    monkeypatch.setattr(base, "compile_blocks", partial(compile_blocks, backend="aot_eager"))
    monkeypatch.setattr(base, "backward_compiler", partial(backward_compiler, backend="aot_eager"))
    yield
    torch._dynamo.reset()


def test_compiled_backwards_train_to_the_same_weights(tmp_path, aot_eager, monkeypatch):
    """Two epochs with clipping, a schedule, an aux loss and a short last batch (another shape): the run whose
    backwards went through compiled autograd ends at the weights of the run whose backwards did not."""
    data = _batches(4, 5)
    plain = _fit(tmp_path, data)
    entered = []
    inner = base.compiled_backward
    monkeypatch.setattr(base, "compiled_backward", lambda compiler: entered.append(compiler) or inner(compiler))
    counters.clear()
    compiled = _fit(tmp_path, data, compiled_autograd=True)
    assert plain.backward_compiler is None and compiled.backward_compiler is not None
    assert len(entered) == 2 * len(data) and all(c is compiled.backward_compiler for c in entered)
    assert counters["compiled_autograd"]["captures"] >= 1, "the backwards were traced by compiled autograd"
    for p, q in zip(compiled.model.parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_an_eager_model_leaves_it_off(tmp_path, aot_eager):
    """On a CPU `auto` leaves the model eager, and compiled autograd with it (harmless, no error)."""
    counters.clear()
    task = _fit(tmp_path, _batches(2, 8), compile_mode="auto", epochs=1, compiled_autograd=True)
    assert task.compiled_as == "none" and task.backward_compiler is None
    assert not counters["compiled_autograd"]["captures"]


def test_what_compiled_autograd_cannot_do_is_refused_with_the_fix(tmp_path, aot_eager):
    with pytest.raises(ConfigError, match=r"trainer.accumulate_grad_batches=1; or set task.compiled_autograd=false"):
        torch.manual_seed(0)
        optim = (partial(torch.optim.AdamW, lr=1e-2), partial(LinearDecay, warmup_steps=3))
        task = Classification(_Net(), *optim, num_classes=3, compile="default", compiled_autograd=True)
        pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, accumulate_grad_batches=2, logger=False,
                   enable_checkpointing=False, enable_progress_bar=False, limit_val_batches=0,
                   default_root_dir=tmp_path).fit(task, torch.utils.data.DataLoader(_batches(2, 8), batch_size=None))
    optim = (partial(torch.optim.AdamW, lr=1e-2), partial(LinearDecay, warmup_steps=3))
    with pytest.raises(ValueError, match="exclude each other.*task.compile=reduce-overhead"):
        Classification(_Net(), *optim, num_classes=3, compile="step-graph", compiled_autograd=True)
    with pytest.raises(ValueError, match="must be true or false"):
        Classification(_Net(), *optim, num_classes=3, compiled_autograd="yes")


@pytest.mark.gpu
def test_compiled_backwards_under_cuda_graphs_train_as_eager_on_a_gpu(tmp_path):
    """On a GPU with Inductor, `reduce-overhead` and compiled autograd (the whole backward, accumulation into .grad
    included, replayed from CUDA graphs) over three epochs of 4 full batches and a short one, with clipping and a
    changing learning rate: the run ends where an eager float32 run ends."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.reset()
    data = [{k: v.cuda() for k, v in batch.items()} for batch in _batches(4, 5)]

    def fit(compile_mode, **task_kw):
        torch.manual_seed(0)
        optim = (partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1), partial(LinearDecay, warmup_steps=3))
        task = Classification(_Net(), *optim, num_classes=3, compile=compile_mode, **task_kw)
        pl.Trainer(max_epochs=3, accelerator="gpu", devices=1, gradient_clip_val=0.5, logger=False,
                   precision="32-true", enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path).fit(
            task, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
        return task

    eager = fit("none")
    counters.clear()
    compiled = fit("reduce-overhead", compiled_autograd=True)
    assert counters["compiled_autograd"]["captures"] >= 1
    for p, q in zip(compiled.model.parameters(), eager.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()
