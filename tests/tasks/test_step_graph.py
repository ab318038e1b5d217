"""`task.compile=step-graph`: each training step replayed from one CUDA graph (utils/compile.py: `TrainStepGraph`),
driven by Lightning's automatic optimization (tasks/base.py)."""

from __future__ import annotations

from functools import partial

import pytest
import pytorch_lightning as pl
import torch
from torch import nn

import longmixer.tasks.base as base
from longmixer.tasks.classification import Classification
from longmixer.utils.compile import EvalStepGraph, TrainStepGraph, make_capturable, sync_learning_rates
from longmixer.utils.optim import LinearDecay


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, inputs, mask=None, inputs2=None, mask2=None):
        h = torch.relu(self.proj(inputs))
        return self.out(h), {"loss/l2": 1e-3 * h.pow(2).mean(), "stats/mean": h.mean()}


def _batches(n: int, last: int, seed: int = 0):
    """n batches of 8 and a short last one (another shape: it runs eagerly)."""
    g = torch.Generator().manual_seed(seed)
    sizes = [8] * n + [last]
    return [{"inputs": 3 * torch.randn(b, 4, generator=g), "labels": torch.randint(0, 3, (b,), generator=g)}
            for b in sizes]


class _CountingAdamW(torch.optim.AdamW):
    calls = 0

    def step(self, closure=None):
        type(self).calls += 1
        return super().step(closure)


def _fit(tmp_path, compile_mode: str, accelerator: str, data, epochs: int = 1, callbacks=(), **trainer_kw):
    torch.manual_seed(0)
    _CountingAdamW.calls = 0
    optim = (partial(_CountingAdamW, lr=1e-2, weight_decay=0.1), partial(LinearDecay, warmup_steps=3))
    task = Classification(_Net(), *optim, num_classes=3, compile=compile_mode)
    logged = []
    log = task.log
    task.log = lambda name, value, **kw: (logged.append((name, float(value) if torch.is_tensor(value) else None)),
                                          log(name, value, **kw))
    trainer = pl.Trainer(max_epochs=epochs, accelerator=accelerator, devices=1, gradient_clip_val=0.5, logger=False,
                         callbacks=list(callbacks),
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, default_root_dir=tmp_path, **trainer_kw)
    trainer.fit(task, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return task, trainer, [v for name, v in logged if name == "train/loss_step"]


class _EagerRunner:
    """Runs the task's whole-step function as `TrainStepGraph`'s eager steps do, without a GPU: the Lightning wiring
    around a replayed step, checked on a CPU."""

    def __init__(self, step_fn, optimizer, after_replay=None, **kw):
        self.step_fn, self.optimizer, self.calls = step_fn, optimizer, 0

    def __call__(self, batch):
        self.calls += 1
        self.optimizer.zero_grad(set_to_none=True)
        return self.step_fn(batch)


def test_a_replayed_step_trains_as_automatic_optimization_does(tmp_path, monkeypatch):
    """With `step-graph`, Lightning's closure runs the task's whole step (forward, backward, clipping, optimizer
    step) once per batch and nothing else: no second backward, no zero_grad between, no second optimizer step. So
    the run ends with the weights, step count and logged losses of an ordinary run (here both eager on a CPU; the
    captured graph's own run is `test_step_graph_matches_eager_training_on_a_gpu`)."""
    monkeypatch.setattr(base, "compile_blocks", lambda model, mode, **kw: model)
    data = _batches(4, 5)
    eager, eager_trainer, eager_losses = _fit(tmp_path, "none", "cpu", data)
    assert _CountingAdamW.calls == len(data)

    runners = []
    monkeypatch.setattr(base, "TrainStepGraph", lambda *a, **kw: runners.append(_EagerRunner(*a, **kw)) or runners[-1])
    monkeypatch.setattr(base.SequenceTask, "_check_step_graph", lambda self: None)  # it asks for a GPU
    graphed, trainer, losses = _fit(tmp_path, "step-graph", "cpu", data)

    assert len(runners) == 1 and runners[0].calls == len(data)
    assert _CountingAdamW.calls == len(data), "the optimizer is stepped inside the replayed step only"
    assert trainer.global_step == eager_trainer.global_step == len(data)
    state = trainer.optimizers[0].state
    assert all(int(s["step"]) == len(data) for s in state.values()), "one optimizer step per batch"
    assert losses == pytest.approx(eager_losses, rel=1e-6)
    for p, q in zip(graphed.model.parameters(), eager.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert graphed.step_graph is None, "released at the end of fit"


def test_step_graph_names_what_it_cannot_replay(tmp_path):
    with pytest.raises(ValueError, match="task.compile=step-graph needs") as err:
        _fit(tmp_path, "step-graph", "cpu", _batches(2, 8), accumulate_grad_batches=2)
    message = str(err.value)
    assert "trainer=gpu" in message and "trainer.accumulate_grad_batches=1" in message


def test_an_optimizer_without_a_capturable_step_is_refused():
    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="capturable.*optim=adamw"):
        TrainStepGraph(lambda batch: {}, opt)


def test_the_captured_shape_is_the_one_warmed_up_in_a_row():
    """Before the capture, `warmup` consecutive batches of one shape run eagerly and the next is captured; a batch of
    another shape starts the count again. So a run resumed just before an epoch's short last batch still captures
    the full batches' shape (had the first batch fixed the shape, every full batch would run eagerly). After the
    capture, that shape replays and any other runs eagerly."""
    step = TrainStepGraph(lambda batch: {}, torch.optim.AdamW(nn.Linear(2, 2).parameters()), warmup=2)
    short, full = ("short",), ("full",)
    actions = [step._action(key) for key in (short, full, full)]
    assert actions == ["eager", "eager", "eager"]
    assert step._action(full) == "capture" and step.key == full
    step.graph = object()  # what `_capture` leaves; no GPU here to record one
    assert [step._action(key) for key in (full, short, full)] == ["replay", "eager", "replay"]
    fresh = TrainStepGraph(lambda batch: {}, torch.optim.AdamW(nn.Linear(2, 2).parameters()), warmup=2)
    assert [fresh._action(key) for key in (full, short, full, full, full)] == ["eager"] * 4 + ["capture"]


def test_a_step_without_a_gpu_names_the_fix(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    step = TrainStepGraph(lambda batch: {}, torch.optim.AdamW(nn.Linear(2, 2).parameters()))
    with pytest.raises(RuntimeError, match="needs a CUDA GPU.*task.compile=auto"):
        step({"inputs": torch.zeros(2, 2)})


def test_learning_rates_live_in_the_tensors_a_replay_reads():
    """A captured optimizer step reads each group's learning rate from device memory: `make_capturable` makes them
    tensors, a torch scheduler then fills them in place, and `sync_learning_rates` puts back the captured tensor
    where something assigned a new value instead (a plateau schedule in an older torch, a user's scheduler)."""
    net = nn.Linear(3, 2)
    opt = torch.optim.AdamW([{"params": [net.weight], "lr": 1e-2, "initial_lr": 1e-2},
                             {"params": [net.bias], "lr": 5e-3, "initial_lr": 5e-3}])
    schedule = LinearDecay(opt, total_steps=10, warmup_steps=4)
    make_capturable(opt)
    lrs = [group["lr"] for group in opt.param_groups]
    assert all(torch.is_tensor(lr) and lr.ndim == 0 for lr in lrs)
    assert all(group["capturable"] for group in opt.param_groups)
    expected = [schedule.factor(0) * 1e-2, schedule.factor(0) * 5e-3]
    assert [float(lr) for lr in lrs] == pytest.approx(expected)
    schedule.step()
    assert [group["lr"] is lr for group, lr in zip(opt.param_groups, lrs)] == [True, True], "filled in place"
    assert [float(lr) for lr in lrs] == pytest.approx([schedule.factor(1) * 1e-2, schedule.factor(1) * 5e-3])
    opt.param_groups[0]["lr"] = 0.123  # assigned, not filled
    opt.param_groups[1]["lr"] = torch.tensor(0.456)
    sync_learning_rates(opt, lrs)
    assert [group["lr"] is lr for group, lr in zip(opt.param_groups, lrs)] == [True, True]
    assert [float(lr) for lr in lrs] == pytest.approx([0.123, 0.456])
    make_capturable(opt)
    assert [group["lr"] is lr for group, lr in zip(opt.param_groups, lrs)] == [True, True], "idempotent"


class _GradientNorms(pl.Callback):
    """Reads gradients: a hook that a replayed step does not run."""

    def on_before_optimizer_step(self, trainer, task, optimizer):
        pass


def test_an_explicit_step_graph_refuses_a_callback_that_reads_gradients(tmp_path):
    """A replayed step runs no `on_before_optimizer_step` / `on_after_backward` hook: such a callback would see no
    gradients, so the run stops before its first step and names it."""
    with pytest.raises(ValueError, match=r"step-graph needs .*\(_GradientNorms: a replayed step runs no.*auto"):
        _fit(tmp_path, "step-graph", "cpu", _batches(2, 8), callbacks=[_GradientNorms()])


class _FakeGraph:
    """Stands in for a CUDA graph on a CPU: a replay runs the captured function again on the static batch and writes
    its results into the captured outputs, as a real replay's kernels do."""

    owner: EvalStepGraph | None = None

    def replay(self):
        for graph, static_batch, static_out in self.owner.graphs.values():
            if graph is self:
                loss, outputs = self.owner.fn(static_batch)
                static_out[0].copy_(loss)
                static_out[1]["logits"].copy_(outputs["logits"])


def test_evaluation_forwards_replay_per_shape_from_the_copied_batch(monkeypatch):
    """`EvalStepGraph`: each shape runs eagerly `warmup` times and is captured at the next batch; then every batch
    of that shape is copied into the static tensors and replayed (the outputs are this batch's, in the captured
    tensors); at most `max_graphs` shapes are captured, the rest run eagerly; the graphs are dropped once a
    parameter has moved."""
    import contextlib

    net = nn.Linear(4, 3)
    calls = []

    def forward_loss(batch):
        calls.append(batch["inputs"].shape[0])
        logits = net(batch["inputs"])
        return nn.functional.cross_entropy(logits, batch["labels"]), {"logits": logits}

    graphs = EvalStepGraph(forward_loss, warmup=2, max_graphs=2)
    graphs.follow(net)  # what the task does at every evaluation epoch's start
    _FakeGraph.owner = graphs
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, **kw: contextlib.nullcontext())
    full = _batches(6, 8, seed=1)[:6]
    rows = {n: [dict(d, inputs=d["inputs"][:n], labels=d["labels"][:n]) for d in _batches(4, 8, seed=n)[:4]]
            for n in (2, 3)}

    def check(batch):
        loss, outputs = graphs(batch)
        expected = net(batch["inputs"])
        torch.testing.assert_close(outputs["logits"], expected)
        torch.testing.assert_close(loss, nn.functional.cross_entropy(expected, batch["labels"]))
        return outputs["logits"]

    with torch.no_grad():
        outs = [check(batch) for batch in full]
        # 2 eager calls, the capture's and its replay, 3 replays (the fake's replays run the function again)
        assert graphs.replays == 4 and len(calls) == 2 + 1 + 4
        assert all(out is outs[2] for out in outs[3:]) and outs[1] is not outs[2], "replays return the captured tensors"
        for batch in rows[2] + rows[3]:
            check(batch)
    assert len(graphs.graphs) == 2, "shapes of 8 and 2 rows; the third stays eager (max_graphs=2)"
    assert graphs.replays == 4 + 2 and graphs.seen[_key(rows[3][0])] == 4
    graphs.follow(net)
    assert len(graphs.graphs) == 2, "the parameters have not moved: the graphs stay"
    net.weight.data = net.weight.data.clone()  # moved (as Lightning's teardown moves the model to the CPU and back)
    graphs.follow(net)
    assert not graphs.graphs and not graphs.seen, "a replay would read the freed memory: the graphs are dropped"
    with torch.no_grad():
        check(full[0])


def _key(batch):
    from longmixer.utils.compile import _batch_key

    return _batch_key(batch)


class _ReservedMemory(pl.Callback):
    """The CUDA caching allocator's reserved bytes at the end of each training epoch."""

    def __init__(self):
        self.reserved = []

    def on_train_epoch_end(self, trainer, task):
        torch.cuda.synchronize()
        self.reserved.append(torch.cuda.memory_reserved())


def _count_replays(monkeypatch) -> list[int]:
    """The list that `TrainStepGraph`'s replay count is appended to after each of its steps."""
    replays = []
    original = TrainStepGraph.__call__

    def counting(self, batch):
        out = original(self, batch)
        replays.append(self.replays)
        return out

    monkeypatch.setattr(TrainStepGraph, "__call__", counting)
    return replays


@pytest.mark.gpu
def test_step_graph_matches_eager_training_on_a_gpu(tmp_path, monkeypatch):
    """On a GPU, over three epochs of 7 full batches and a short one: three eager warm-up steps, one capture, replays
    of every later full batch, each short batch eagerly; the learning rate changes every step (warm-up, then decay)
    and the gradients are clipped. The run ends where an eager run ends, in float32, and its eager steps after the
    capture reserve no new memory (a new stream per step would)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    data = _batches(7, 5)
    eager, _, eager_losses = _fit(tmp_path, "none", "gpu", data, epochs=3, precision="32-true")
    replays = _count_replays(monkeypatch)
    memory = _ReservedMemory()
    graphed, trainer, losses = _fit(tmp_path, "step-graph", "gpu", data, epochs=3, callbacks=[memory],
                                    precision="32-true")
    # epoch 1: 3 eager steps, capture + 4 replays, the short batch eagerly; epochs 2 and 3: 7 replays, 1 eager
    assert replays == [0, 0, 0, 1, 2, 3, 4, 4] + list(range(5, 12)) + [11] + list(range(12, 19)) + [18]
    assert trainer.global_step == 3 * len(data)
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    for p, q in zip(graphed.model.parameters(), eager.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert memory.reserved[2] == memory.reserved[1], memory.reserved


@pytest.mark.gpu
def test_step_graph_validates_from_replayed_forwards_as_eager_does(tmp_path):
    """On a GPU, a step-graph fit validates each epoch from captured forwards (`EvalStepGraph`: two eager batches of
    a shape, then one capture, then replays; a short last batch's shape captured in a later epoch) and logs the same
    validation losses and accuracies as an eager fit, in float32. The test after fit scores the same too: Lightning
    moved the model to the CPU at the end of fit and back, so the graphs captured before read freed memory and are
    captured anew (`EvalStepGraph.follow`)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    data, val = _batches(7, 5), _batches(5, 3, seed=1)
    results = {}
    for mode in ("none", "step-graph"):
        torch.manual_seed(0)
        task = Classification(_Net(), partial(torch.optim.AdamW, lr=1e-2), partial(LinearDecay, warmup_steps=3),
                              num_classes=3, compile=mode)
        logged = []
        log = task.log
        task.log = lambda name, value, _log=log, **kw: (
            logged.append((name, value.compute().item() if hasattr(value, "compute") else float(value)))
            if name.startswith(("val/", "test/")) and not name.endswith("_best") else None, _log(name, value, **kw))
        trainer = pl.Trainer(max_epochs=3, accelerator="gpu", devices=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, precision="32-true",
                             num_sanity_val_steps=0, default_root_dir=tmp_path)
        loader = partial(torch.utils.data.DataLoader, batch_size=None)
        trainer.fit(task, train_dataloaders=loader(data), val_dataloaders=loader(val))
        trainer.test(task, dataloaders=loader(val))
        results[mode] = (logged, task)
    graphed = results["step-graph"][1].eval_graph
    # after the test: its shape of 8 rows captured anew; its last batch (3 rows) ran once, eagerly
    assert graphed is not None and graphed.replays > 0 and len(graphed.graphs) == 1, (graphed and graphed.seen)
    eager_logged, graphed_logged = results["none"][0], results["step-graph"][0]
    assert [name for name, _ in graphed_logged] == [name for name, _ in eager_logged]
    assert [v for _, v in graphed_logged] == pytest.approx([v for _, v in eager_logged], rel=1e-5, abs=1e-6)


class _BufferTrace(pl.Callback):
    """Each model buffer after every training step, LongVQ's codebook buffers summed over their codes."""

    def __init__(self):
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
        self.steps.append({name: (value.sum(0) if ".vq." in name else value).detach().to("cpu", torch.float32, copy=True)
                           for name, value in task.model.named_buffers()})


def _family_fit(tmp_path, cfg, mode: str, accelerator: str, data) -> tuple[list[float], list[dict]]:
    """A family's model trained through Lightning on `data` (one epoch, float32, clipping, a warm-up schedule),
    compiled as `mode`; returns each step's logged loss and the buffers after each step (`_BufferTrace`)."""
    from hydra.utils import instantiate

    torch._dynamo.reset()
    torch.manual_seed(0)
    task = Classification(instantiate(cfg.model), partial(torch.optim.AdamW, lr=1e-3),
                          partial(LinearDecay, warmup_steps=3), num_classes=int(cfg.model.num_classes), compile=mode)
    losses = []
    log = task.log
    task.log = lambda name, value, _log=log, **kw: (
        losses.append(float(value)) if name == "train/loss_step" else None, _log(name, value, **kw))
    trace = _BufferTrace()
    trainer = pl.Trainer(max_epochs=1, accelerator=accelerator, devices=1, gradient_clip_val=1.0, logger=False,
                         callbacks=[trace], enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, precision="32-true", default_root_dir=tmp_path)
    trainer.fit(task, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    return losses, trace.steps


def assert_same_buffer_updates(graphed: list[dict], eager: list[dict]) -> None:
    """Each step changed every buffer as eager's step did, within a fifth of eager's change. Not the values: a
    compiled model's rounding differs from eager's, and training amplifies it (Adam's first steps move a parameter
    whose gradient is rounding noise by about the learning rate; a key near two codewords takes either),
    so after ten steps LaS's batch-norm running mean is 0.7% of its size off eager's and LongVQ's code counts 9%,
    compiled with or without CUDA graphs, while a replay that dropped or repeated an update would be a whole step's
    change off. LongVQ's buffers are compared summed over the codes: every token counts once, whatever its code."""
    assert len(graphed) == len(eager)
    for step in range(1, len(eager)):
        for name, value in graphed[step].items():
            change, eager_change = value - graphed[step - 1][name], eager[step][name] - eager[step - 1][name]
            bound = 0.2 * eager_change.abs().max().item() + 1e-6
            off = (change - eager_change).abs().max().item()
            assert off <= bound, f"step {step}: {name} changed by {off:.2e} more or less than eager's (bound {bound:.2e})"


def test_buffer_updates_are_compared_by_each_step_s_change():
    """The GPU test's comparison: drift of a few percent of one step's change passes, a step whose update was
    dropped, or applied twice, fails, whatever the values' size."""
    g = torch.Generator().manual_seed(0)
    changes = torch.rand(10, 4, generator=g) + 0.5
    eager = [{"norm.running_mean": v} for v in changes.cumsum(0)]
    drift = [{"norm.running_mean": v + 0.03 * step * changes[0]} for step, v in enumerate(changes.cumsum(0))]
    assert_same_buffer_updates(drift, eager)
    for times in (0, 2):  # step 6's update dropped, or applied twice
        faulty = changes.clone()
        faulty[6] *= times
        with pytest.raises(AssertionError, match="step 6: norm.running_mean"):
            assert_same_buffer_updates([{"norm.running_mean": v} for v in faulty.cumsum(0)], eager)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["chela", "las", "longvq", "mega", "mega_chunk", "seqboat", "seqboat_full"])
def test_each_family_trains_under_step_graph_as_eagerly_on_a_gpu(tmp_path, monkeypatch, family):
    """`task.compile=auto` trains one-GPU runs of few-shape data under `step-graph`, so every family's real model is
    checked against eager through the task and Lightning, as training runs it: each family's Text model in float32
    (B2 L512, ten batches: three eager warm-up steps, the capture, six replays), norm clipping, a warm-up schedule,
    the task's hooks (LongVQ's codebook statistics recorded after each replay, its EMA applied by `set_progress`),
    both runs drawing eager's dropout masks (Inductor's `fallback_random`). Every step's loss agrees, and every step
    updates the buffers as eager's did (`assert_same_buffer_updates`)."""
    import torch._inductor.config as inductor_config

    from longmixer import bench

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = bench.compose_model_config(dict(bench.model_specs("text", quick=False))[family])
    g = torch.Generator().manual_seed(1)
    vocab, classes = int(cfg.model.vocab_size), int(cfg.model.num_classes)
    data = [{"inputs": torch.randint(1, vocab, (2, 512), generator=g),
             "labels": torch.randint(0, classes, (2,), generator=g)} for _ in range(10)]
    replays = _count_replays(monkeypatch)
    with inductor_config.patch(fallback_random=True):
        eager_losses, eager_buffers = _family_fit(tmp_path, cfg, "none", "gpu", data)
        losses, buffers = _family_fit(tmp_path, cfg, "step-graph", "gpu", data)
    assert replays == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7], replays
    assert len(losses) == len(eager_losses) == len(data)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=0, atol=1e-5)
    assert_same_buffer_updates(buffers, eager_buffers)
    torch._dynamo.reset()


def test_a_model_with_data_dependent_shapes_is_refused(tmp_path, monkeypatch):
    """WikiText-103's adaptive input and softmax select rows by value (`nonzero`): a capture would fail deep inside
    CUDA, so the run stops before it, naming the module and the mode to use."""
    from longmixer.models.adaptive import AdaptiveInput

    class _WithAdaptive(_Net):
        def __init__(self):
            super().__init__()
            self.embed = AdaptiveInput(8, 20, [10])

    monkeypatch.setattr(base, "compile_blocks", lambda model, mode, **kw: model)
    task = Classification(_WithAdaptive(), partial(torch.optim.AdamW, lr=1e-3), partial(LinearDecay), num_classes=3,
                          compile="step-graph")
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match="AdaptiveInput select rows by value.*task.compile=auto"):
        trainer.fit(task, train_dataloaders=torch.utils.data.DataLoader(_batches(1, 8), batch_size=None))


def test_checkpoints_keep_the_optimizer_loadable_by_any_mode():
    """A step-graph run's optimizer groups hold device-tensor learning rates and `capturable=True`; its checkpoints
    store floats and the constructor's `capturable`, so a CPU (or another compile mode) resumes from them: a
    capturable AdamW step on CPU parameters fails torch's device check."""
    net = nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.randn(4, 3)).sum().backward()
    opt.step()
    make_capturable(opt)
    checkpoint = {"optimizer_states": [opt.state_dict()]}
    base._portable_optimizer_states(checkpoint, [opt])
    group = checkpoint["optimizer_states"][0]["param_groups"][0]
    assert group["lr"] == pytest.approx(1e-3) and isinstance(group["lr"], float) and group["capturable"] is False
    assert torch.is_tensor(opt.param_groups[0]["lr"]), "the live groups keep what the replays read"
    resumed_net = nn.Linear(3, 2)
    resumed = torch.optim.AdamW(resumed_net.parameters(), lr=1e-3)
    resumed.load_state_dict(checkpoint["optimizer_states"][0])
    resumed_net(torch.randn(4, 3)).sum().backward()
    resumed.step()
    assert int(resumed.state[resumed_net.weight]["step"]) == 2
