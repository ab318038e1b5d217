"""Explicit backend dispatch for the hot-path ops: `auto` picks Triton on CUDA tensors, the torch reference otherwise.

No probing happens at import time; the choice is made per call from the tensors' device only (never from their
values), so torch.compile traces it into a constant, and logged once per op in eager mode (a logger call would
break the compiled graph; an eager call of the same op logs it).
"""

from __future__ import annotations

import importlib.util
import logging
import os

import torch

from longmixer.utils.backends import BACKENDS

log = logging.getLogger("longmixer.ops")

_logged: set[tuple[str, str]] = set()


@torch._dynamo.assume_constant_result
def triton_interpreter_on() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (`TRITON_INTERPRET=1`, set by the tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@torch._dynamo.assume_constant_result
def triton_installed() -> bool:
    """Whether Triton can be imported. A constant to torch.compile: dynamo does not trace `find_spec`, and a call
    it cannot trace would break the graph at every op (on CUDA, where `auto` asks)."""
    return importlib.util.find_spec("triton") is not None


def resolve_backend(op: str, backend: str, *tensors: torch.Tensor) -> str:
    """Return "torch" or "triton" for one call of `op`.

    Args:
        op: the op's name, for messages and the one-time log line.
        backend: "auto" | "torch" | "triton" (the `ops.backend` config value).
        tensors: the op's tensor inputs; their device decides `auto`.

    Raises:
        ValueError: an unknown backend name.
        RuntimeError: "triton" requested where it cannot run (no Triton installed, or CPU tensors without the
            interpreter); the message says how to fix it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"ops.backend={backend!r} is not one of {BACKENDS}; set ops.backend=auto")
    on_cuda = any(t.is_cuda for t in tensors)
    if backend == "auto":
        choice = "triton" if on_cuda and triton_installed() else "torch"
    elif backend == "torch":
        choice = "torch"
    else:
        if not triton_installed():
            raise RuntimeError(f"ops.backend=triton for op {op!r} but Triton is not installed: "
                               "`pip install triton==3.6.0`, or set ops.backend=torch")
        if not on_cuda and not triton_interpreter_on():
            raise RuntimeError(f"ops.backend=triton for op {op!r} needs CUDA tensors (or TRITON_INTERPRET=1 to run "
                               "the kernel in Triton's CPU interpreter); set ops.backend=auto or torch on CPU")
        choice = "triton"
    if not torch.compiler.is_compiling() and (op, choice) not in _logged:
        _logged.add((op, choice))
        log.info("op %s: backend %s (requested %s)", op, choice, backend)
    return choice
