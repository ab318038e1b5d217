"""The `task.compile` switch: which torch.compile mode a run uses, and compiling a model's blocks in place.

Shared by the tasks (training and evaluation) and the benchmark, so both measure the same compiled model.
"""

from __future__ import annotations

import torch
from torch import nn

COMPILE_MODES = ("auto", "none", "default", "reduce-overhead", "max-autotune")


def resolve_compile_mode(mode: str, device: torch.device) -> str:
    """`task.compile=auto` -> "default" on CUDA (fewer, fused kernels and no Python between them; the mixers trace
    without graph breaks), "none" elsewhere (on a CPU, compiling costs more time than it saves in tests and
    debugging runs). Any other value is returned as is."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"task.compile={mode!r} is not one of {COMPILE_MODES}; use task.compile=auto")
    if mode == "auto":
        return "default" if device.type == "cuda" else "none"
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
