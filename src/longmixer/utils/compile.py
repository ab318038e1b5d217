"""The `task.compile` switch: which torch.compile mode a run uses, and compiling a model's blocks in place; and
capturing a whole training step in one CUDA graph (`capture_train_step`, the benchmark's `step-graph` mode).

Shared by the tasks (training and evaluation) and the benchmark, so both measure the same compiled model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

COMPILE_MODES = ("auto", "none", "default", "reduce-overhead", "max-autotune")


def resolve_compile_mode(mode: str, device: torch.device, few_shapes: bool = True) -> str:
    """`task.compile=auto` -> on CUDA, "reduce-overhead" when the batches come in few shapes (fixed-length tasks, or
    variable-length ones padded to `data.pad_multiple`): the step's kernels replay from CUDA graphs, so the host
    no longer paces a small model (measured on `experiment=chela/listops`: 1.8x the steps per second of "default",
    docs/benchmarks.md); "default" when every batch may have its own length (a CUDA graph would be recorded per
    length); "none" elsewhere (on a CPU, compiling costs more time than it saves in tests and debugging runs).
    Any other value is returned as is."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"task.compile={mode!r} is not one of {COMPILE_MODES}; use task.compile=auto")
    if mode == "auto":
        if device.type != "cuda":
            return "none"
        return "reduce-overhead" if few_shapes else "default"
    return mode


def compile_blocks(model: nn.Module, mode: str, backend: str = "inductor", entry: str = "forward") -> nn.Module:
    """Compile `model` in place for `mode` (parameter names and checkpoints unchanged); "none" leaves it eager.

    "default" / "max-autotune": each block (norm, mixer, FFN) is compiled (`nn.Module.compile`). The blocks hold
    nearly all of a step's kernels and are what every path runs through: `model(...)`, and `model.encode(...)` +
    head in the language-model task. Embedding, pooling and heads stay eager (the adaptive softmax gathers
    data-dependent rows per cluster). Identical blocks share one compiled graph.

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


def capture_train_step(step_fn: Callable[[], object], optimizer: torch.optim.Optimizer,
                       warmup: int = 3) -> Callable[[], None]:
    """Capture a whole training step (forward, loss, backward, optimizer step) in one CUDA graph; return its replay.

    PyTorch's "whole network capture" recipe (CUDA semantics, "CUDA Graphs"): `warmup` steps on a side stream
    (compiling, autotuning and the optimizer's lazy state happen there, not during capture), the gradients set to
    None, then one `step_fn()` under `torch.cuda.graph`, so that its backward allocates the `.grad` tensors from the
    graph's private pool; each replay refills them in place and steps the optimizer on them, so no `zero_grad` is
    needed between replays. Nothing on the host runs per replay: the step must not synchronize (no `.item()`, no
    data-dependent shapes) and its inputs are the tensors it read at capture, to be refilled in place (`copy_`).

    Args:
        step_fn: one training step on static inputs, without `zero_grad` (the replay keeps the captured `.grad`).
            Host-side Python in it (hooks, logging) runs during warm-up and capture only.
        optimizer: the optimizer `step_fn` steps; built with `capturable=True` (e.g. `torch.optim.AdamW(...,
            fused=True, capturable=True)`), so its step count and learning-rate math stay on the GPU.
        warmup: eager steps before capture, at least 1 (PyTorch's example uses 3).

    Returns:
        A callable that replays the captured step (one `CUDAGraph.replay()`); it holds the graph and its memory pool.

    Raises:
        ValueError: `warmup` < 1, or a parameter group of `optimizer` is not capturable.
        RuntimeError: CUDA is not available (CUDA graphs need a CUDA GPU).
    """
    if warmup < 1:
        raise ValueError(f"warmup={warmup} must be >= 1: compiling and the optimizer's lazy state cannot be captured")
    # optimizers without the option (SGD) keep no step count to move to the GPU
    if not all(group.get("capturable", True) for group in optimizer.param_groups):
        raise ValueError(f"{type(optimizer).__name__} is not capturable: build it with capturable=True "
                         "(e.g. torch.optim.AdamW(params, fused=True, capturable=True))")
    if not torch.cuda.is_available():
        raise RuntimeError("capture_train_step needs a CUDA GPU (a CUDA graph replays GPU work); none is available")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            optimizer.zero_grad(set_to_none=True)
            step_fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)  # the captured backward allocates .grad from the graph's pool
    with torch.cuda.graph(graph):
        step_fn()
    return graph.replay
