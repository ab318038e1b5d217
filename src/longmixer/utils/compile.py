"""The `task.compile` switch: which torch.compile mode a run uses, and compiling a model's blocks in place; and
capturing a whole training step in one CUDA graph: `TrainStepGraph` (training's `task.compile=step-graph`, and the
benchmark's `step-graph` mode).

Shared by the tasks (training and evaluation) and the benchmark, so both measure the same compiled model.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from longmixer.utils.errors import UserFacingError

log = logging.getLogger(__name__)

STEP_GRAPH = "step-graph"  # blocks compiled as "default", the whole training step replayed from one CUDA graph
COMPILE_MODES = ("auto", "none", "default", "reduce-overhead", "max-autotune", STEP_GRAPH)


def resolve_compile_mode(mode: str, device: torch.device, few_shapes: bool = True, whole_step: bool = False) -> str:
    """`task.compile=auto` -> on CUDA, when the batches come in few shapes (fixed-length tasks, or variable-length
    ones padded to `data.pad_multiple`), "step-graph" if `whole_step` (the caller found nothing in the run that a
    replayed whole step cannot do: `SequenceTask._step_graph_problems`) and "reduce-overhead" otherwise: either way
    the step's kernels replay from CUDA graphs, so the host no longer paces a small model (CHELA's ListOps recipe:
    1.8x the steps per second of "default"). "step-graph" compiles one block for all identical blocks where
    "reduce-overhead" compiles the whole model, so a run on a fresh machine trains sooner: on an H200 the same
    4-minute ListOps run kept the GPU 88.5% busy against 63.4% (docs/benchmarks.md). "default" when every batch may
    have its own length (a CUDA graph would be recorded per length); "none" elsewhere (on a CPU, compiling costs more
    time than it saves in tests and debugging runs). Any other value is returned as is."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"task.compile={mode!r} is not one of {COMPILE_MODES}; use task.compile=auto")
    if mode == "auto":
        if device.type != "cuda":
            return "none"
        if not few_shapes:
            return "default"
        return STEP_GRAPH if whole_step else "reduce-overhead"
    return mode


class CompileFailedError(UserFacingError, RuntimeError):
    """torch.compile (Dynamo's backend, Inductor, or Triton under it) failed on the model: a compiler defect, not a
    refused setting. The run's fix is another `task.compile` mode."""


@contextlib.contextmanager
def explain_compile_failure(requested: str, resolved: str | None) -> Iterator[None]:
    """Turn a compiler failure inside the block (the first forward or backward of a compiled model, where
    torch.compile compiles) into one line naming the mode and the override that avoids it; the compiler's own
    error is logged in full first (the run's log file) and chained. Errors of the model's own code pass through:
    Dynamo re-raises those as they are."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import InductorError

    try:
        yield
    except (BackendCompilerFailed, InductorError) as err:
        inner = getattr(err, "inner_exception", None) or err
        # a kernel compiled in Inductor's worker process reports the worker's traceback: its last line is the error
        lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
        what = f"{type(inner).__name__}: {lines[-1][:300]}" if lines else type(inner).__name__
        mode = requested if requested == resolved or resolved is None else f"{requested} -> {resolved}"
        log.error("torch.compile failed (task.compile=%s); the compiler's error follows", mode, exc_info=err)
        other = "" if resolved in ("default", "none") else ", or try task.compile=default (no CUDA graphs)"
        raise CompileFailedError(
            f"task.compile={mode}: torch.compile failed to compile the model ({what}). This is a defect of the "
            f"compiler or of its Triton, not of this run's settings: rerun with task.compile=none (eager){other}; "
            "the compiler's full error is in the run's log") from err


def release_cuda_graphs() -> None:
    """Free the CUDA graphs that compiled code recorded (`reduce-overhead`), before a process group is destroyed.

    NCCL keeps every collective that a graph captured (SyncBatchNorm's all-reduce in a DDP run compiled with
    `reduce-overhead`) alive until that graph is destroyed, and `destroy_process_group` waits for them: Lightning's
    exit handler then blocks in `ncclCommFinalize` forever (seen on 2 and 4 H100s, torch 2.11, NCCL; a py-spy stack
    in docs/benchmarks.md "Scaling"). `torch.compiler.reset()` drops the compiled code with its graph trees, so the
    graphs go before the process group. Only in a process that joined a process group on a GPU; a no-op otherwise.
    """
    import torch.distributed as dist

    if not (torch.cuda.is_available() and dist.is_available() and dist.is_initialized()):
        return
    try:
        torch.compiler.reset()
        gc.collect()  # the graphs held by reference cycles of the compiled frames
    except Exception as err:  # noqa: BLE001 - called in `finally`: never hide the error that ended the run
        log.warning("could not free the compiled CUDA graphs (%s: %s); if the process does not exit, stop it: its "
                    "results are written", type(err).__name__, err)


def compile_blocks(model: nn.Module, mode: str, backend: str = "inductor", entry: str = "forward") -> nn.Module:
    """Compile `model` in place for `mode` (parameter names and checkpoints unchanged); "none" leaves it eager.

    "default" / "max-autotune" (and "step-graph", whose CUDA graph is the whole step's, `TrainStepGraph`): each
    block (norm, mixer, FFN) is compiled (`nn.Module.compile`). The blocks hold nearly all of a step's kernels and
    are what every path runs through: `model(...)`, and `model.encode(...)` + head in the language-model task.
    Embedding, pooling and heads stay eager (the adaptive softmax gathers data-dependent rows per cluster).
    Identical blocks share one compiled graph.

    "reduce-overhead" (CUDA graphs): one graph for the whole `entry` ("forward": the model's call, "encode": the
    language-model task's encoder). Per-block graphs cannot be used there: identical blocks share one graph, and
    replaying it for the next block would overwrite the previous block's outputs that the backward still needs.

    `backend` is torch.compile's (the tests use "aot_eager" on CPU; the modes are inductor's and are passed to it
    only when backend is "inductor").
    """
    if mode == "none":
        return model
    if mode not in COMPILE_MODES[2:]:
        raise ValueError(f"compile mode {mode!r} is not one of {COMPILE_MODES[1:]}")
    if entry not in ("forward", "encode"):
        raise ValueError(f"compile entry {entry!r} is not forward or encode")
    if mode == STEP_GRAPH:
        mode = "default"
    options = dict(**({"mode": mode} if backend == "inductor" else {}), backend=backend)
    if mode == "reduce-overhead":
        if entry == "encode" and hasattr(model, "encode"):
            model.encode = torch.compile(model.encode, **options)
        else:
            model.compile(**options)
        return model
    blocks = getattr(model, "blocks", None)
    for module in blocks if isinstance(blocks, nn.ModuleList) else [model]:
        module.compile(**options)
    return model


def _batch_key(batch: Mapping[str, Any]) -> tuple:
    """What a captured graph is specialized to: every tensor entry's name, shape, dtype and device, and every other
    entry's value (a replay reads the tensors captured, so a batch of another shape cannot be replayed)."""
    return tuple(sorted((k, (tuple(v.shape), v.dtype, v.device) if torch.is_tensor(v) else repr(v))
                        for k, v in batch.items()))


def _copy_batch(static: dict, batch: dict) -> None:
    """Copy a batch into a captured graph's static tensors of the same shapes (`_batch_key`), in place."""
    for name, value in static.items():
        if torch.is_tensor(value):
            value.copy_(batch[name], non_blocking=True)


def make_capturable(optimizer: torch.optim.Optimizer) -> None:
    """Prepare `optimizer` for steps inside a CUDA graph: capturable groups, each group's learning rate a 0-dim
    tensor on its parameters' device (read by the step's kernels, so a new value reaches a replay), step counts on
    that device. Idempotent; `TrainStepGraph` calls it before each eager step, so that it also holds after a
    checkpoint's optimizer state (saved by another compile mode: float learning rates, groups not capturable) was
    loaded into the optimizer."""
    for group in optimizer.param_groups:
        group["capturable"] = True
        device = group["params"][0].device
        if not (torch.is_tensor(group["lr"]) and group["lr"].device == device):
            group["lr"] = torch.tensor(float(group["lr"]), device=device)
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if torch.is_tensor(state.get("step")) and state["step"].device != p.device:
                state["step"] = state["step"].to(p.device, torch.float32)


def sync_learning_rates(optimizer: torch.optim.Optimizer, lrs: list[torch.Tensor]) -> None:
    """Put each group's current learning rate into the tensor a captured step reads (`lrs`, one per group). torch's
    schedulers fill a tensor learning rate in place; one that assigns a new float or tensor instead (an older
    torch, a user's scheduler) has it copied here, and the captured tensor goes back into the group."""
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        value = group["lr"]
        if value is not lr:
            if torch.is_tensor(value):
                lr.copy_(value)
            else:
                lr.fill_(float(value))
            group["lr"] = lr


class TrainStepGraph:
    """Training steps replayed from one CUDA graph: what `task.compile=step-graph` runs (tasks/base.py).

    `step_fn(batch)` is one whole training step on a batch dict: forward, loss, backward, gradient clipping and the
    optimizer step, returning the tensors the task logs. The first `warmup` consecutive batches of one shape run it
    eagerly, on a side stream (compilation, autotuning and the optimizer's lazy state happen there); the next one
    is copied into static tensors and the step is captured once (`torch.cuda.graph`, with the gradients set to None
    so that the captured backward allocates them from the graph's pool), then every batch of that shape is copied
    in place and replayed: one launch for the step's hundreds of kernels, no Python between them. Batches of any
    other shape (a short last batch) run the step eagerly on the current stream, so nothing is skipped or padded.
    Memory: the graph's pool holds one step's activations and gradients for the whole run, beside what validation
    and such eager steps allocate.

    Host values that a replay would freeze are kept on the device: each parameter group's learning rate becomes a
    0-dim tensor that the step reads (a scheduler's new value is copied into it before each replay, whichever way the
    scheduler stored it), and the optimizer is made capturable (its step counts stay on the GPU). Everything else
    the step reads from the host must be a tensor updated in place; a model with per-step Python state says what a
    replay did through `after_replay` (`SequenceModel.after_replay`).

    Args:
        step_fn: the training step, called with a batch dict; returns a dict of tensors (valid until the next call).
        optimizer: the optimizer `step_fn` steps; one with a `capturable` option (Adam, AdamW, ...).
        warmup: eager steps of the captured shape before the capture, at least 1.
        after_replay: called after each replay (Python bookkeeping the replay did not run).

    Raises:
        ValueError: `warmup` < 1, or the optimizer has no capturable implementation.
        RuntimeError: (at the first step) no CUDA GPU.
    """

    def __init__(self, step_fn: Callable[[dict], dict], optimizer: torch.optim.Optimizer, warmup: int = 3,
                 after_replay: Callable[[], None] | None = None):
        if warmup < 1:
            raise ValueError(f"warmup={warmup} must be >= 1: compiling and the optimizer's lazy state cannot be "
                             "captured")
        if "capturable" not in optimizer.defaults:
            raise ValueError(f"task.compile={STEP_GRAPH} needs an optimizer that can run inside a CUDA graph "
                             f"(capturable: Adam, AdamW, ...); {type(optimizer).__name__} is not. Set "
                             "optim=adamw or another task.compile")
        self.step_fn, self.optimizer, self.warmup, self.after_replay = step_fn, optimizer, warmup, after_replay
        self.key: tuple | None = None  # the shape captured (or, before the capture, warmed up)
        self.eager_steps = 0  # consecutive eager steps of that shape before the capture
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_batch: dict | None = None
        self.static_out: dict | None = None
        self.lrs: list[torch.Tensor] = []
        self.side: torch.cuda.Stream | None = None  # the warm-up steps' stream
        self.replays = 0

    def __call__(self, batch: dict) -> dict:
        action = self._action(_batch_key(batch))
        if action == "replay":
            _copy_batch(self.static_batch, batch)
            sync_learning_rates(self.optimizer, self.lrs)
            self.graph.replay()
            return self._replayed()
        return self._capture(batch) if action == "capture" else self._eager(batch)

    def _action(self, key: tuple) -> str:
        """What a batch of shape `key` gets: after the capture, "replay" for the captured shape and "eager" for any
        other; before it, "eager" for the first `warmup` consecutive batches of one shape and "capture" for the next.
        A batch of another shape starts the count again, so a short batch first (a run resumed before an epoch's
        last batch) does not decide the shape that is captured."""
        if self.graph is not None:
            return "replay" if key == self.key else "eager"
        if key != self.key:
            self.key, self.eager_steps = key, 0
        if self.eager_steps >= self.warmup:
            return "capture"
        self.eager_steps += 1
        return "eager"

    def _replayed(self) -> dict:
        self.replays += 1
        if self.after_replay is not None:
            self.after_replay()
        return self.static_out

    def _eager(self, batch: dict) -> dict:
        if not torch.cuda.is_available():
            raise RuntimeError(f"task.compile={STEP_GRAPH} needs a CUDA GPU (it replays CUDA graphs); use "
                               "task.compile=auto")
        self.optimizer.zero_grad(set_to_none=True)
        if self.graph is not None:  # a batch of another shape, after the capture: an ordinary step
            sync_learning_rates(self.optimizer, self.lrs)
            return self.step_fn(batch)
        make_capturable(self.optimizer)
        # before the capture, on one side stream (PyTorch's recipe for warming up what a graph will capture). One
        # stream for every such step: the caching allocator keeps freed blocks per stream, so a new stream per step
        # would reserve the step's memory anew each time.
        if self.side is None:
            self.side = torch.cuda.Stream()
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            out = self.step_fn(batch)
        torch.cuda.current_stream().wait_stream(self.side)
        return out

    def _capture(self, batch: dict) -> dict:
        make_capturable(self.optimizer)
        self.lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.static_batch = {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}
        self.optimizer.zero_grad(set_to_none=True)  # the captured backward allocates .grad from the graph's pool
        graph = torch.cuda.CUDAGraph()
        # thread_local, as Inductor's own CUDA graphs: the DataLoader's pin-memory thread may call CUDA meanwhile
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.static_out = self.step_fn(self.static_batch)
        except RuntimeError as err:
            raise RuntimeError(f"task.compile={STEP_GRAPH}: the training step could not be captured in a CUDA graph "
                               f"({err}). A step that reads a GPU value on the host (.item(), a branch on a tensor) "
                               "or has data-dependent shapes (nonzero, boolean indexing) cannot be replayed: use "
                               "task.compile=auto") from err
        self.graph = graph
        torch.cuda.empty_cache()  # the warm-up steps' blocks, cached for the side stream, which no step uses again
        graph.replay()  # capturing records the step without running it: this batch's step runs now
        return self._replayed()


class EvalStepGraph:
    """Validation and test forwards replayed from CUDA graphs, beside `TrainStepGraph`, so that a `step-graph` run
    validates as fast as a `reduce-overhead` one: its blocks are compiled as "default", and without graphs an
    evaluation batch costs the host's launches (the step-graph runs' validations were 82-87% GPU-busy against
    91-92% under `reduce-overhead`, docs/benchmarks.md).

    `fn(batch)` is the task's forward and loss (`forward_loss`, no logging), returning (loss, outputs). Each batch
    shape runs it eagerly `warmup` times (compilation and the kernels' first launches happen there), is captured
    once at the next batch (under the caller's grad mode, autocast and inference mode, which Lightning sets around
    evaluation), and is replayed from then on: the batch is copied into the graph's static tensors and the
    returned tensors are the graph's, overwritten by the next replay of that shape (the tasks log them at once).
    At most `max_graphs` shapes are captured, each with its own memory pool (a pool shared between graphs would let
    one replay overwrite another's outputs); any further shape runs eagerly. A replay reads the parameters and
    buffers in the memory they had at the capture: updates in place (the optimizer, weight EMA's swap,
    `load_state_dict`) reach it, but a module moved or given new tensors would leave it reading freed memory, so the
    task calls `follow(model)` at the start of every evaluation epoch, which drops the graphs when any parameter or
    buffer has moved (Lightning moves the model to the CPU when `fit` ends and back for the `test` that follows).
    """

    def __init__(self, fn: Callable[[dict], tuple[torch.Tensor, dict]], warmup: int = 2, max_graphs: int = 4):
        if warmup < 1:
            raise ValueError(f"warmup={warmup} must be >= 1: compiling cannot be captured")
        self.fn, self.warmup, self.max_graphs = fn, warmup, max_graphs
        self.seen: dict[tuple, int] = {}  # eager calls per shape before its capture
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict, Any]] = {}  # shape -> (graph, batch, outputs)
        self.replays = 0
        self.storage: tuple[int, ...] = ()  # where the model's tensors lived at `follow`

    def follow(self, module: nn.Module) -> None:
        """Drop every captured graph (and the counts before capture) if a parameter or buffer of `module` is no
        longer where it was at the previous call: the graphs read the old memory."""
        storage = tuple(t.data_ptr() for t in (*module.parameters(), *module.buffers()))
        if storage != self.storage:
            self.graphs.clear()
            self.seen.clear()
            self.storage = storage

    def __call__(self, batch: dict) -> tuple[torch.Tensor, dict]:
        key = _batch_key(batch)
        captured = self.graphs.get(key)
        if captured is not None:
            graph, static_batch, static_out = captured
            _copy_batch(static_batch, batch)
            graph.replay()
            self.replays += 1
            return static_out
        count = self.seen.get(key, 0)
        if count < self.warmup or len(self.graphs) >= self.max_graphs:
            self.seen[key] = count + 1
            return self.fn(batch)
        return self._capture(key, batch)

    def _capture(self, key: tuple, batch: dict) -> tuple[torch.Tensor, dict]:
        static_batch = {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                static_out = self.fn(static_batch)
        except RuntimeError as err:
            raise RuntimeError(f"task.compile={STEP_GRAPH}: the evaluation forward could not be captured in a CUDA "
                               f"graph ({err}). A forward that reads a GPU value on the host (.item(), a branch on "
                               "a tensor) or has data-dependent shapes cannot be replayed: use "
                               "task.compile=reduce-overhead") from err
        self.graphs[key] = (graph, static_batch, static_out)
        log.info("%s: evaluation batches of %s replay from a CUDA graph", STEP_GRAPH,
                 ", ".join(f"{k} {list(v.shape)}" for k, v in batch.items() if torch.is_tensor(v)))
        graph.replay()  # capturing records the forward without running it: this batch's forward runs now
        self.replays += 1
        return static_out
