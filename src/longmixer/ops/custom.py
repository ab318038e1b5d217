"""How the Triton paths are registered as custom ops and called (see ops/README.md, "Registration").

`define` registers a function as a `torch.library.custom_op` (no mutated arguments), `register_autograd` attaches
its backward, and `call` runs it: under torch.compile the registered op (one opaque node with fake and autograd
rules), in eager mode the function's own body, wrapped in a plain `torch.autograd.Function` with the same
`setup_context` and backward when a gradient is needed. Both paths run the same body, setup and backward; the
eager one skips the dispatcher and the custom op's generated autograd layer, which measured about 3x the host time
of an `autograd.Function` per forward + backward call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_BODIES: dict[Any, Callable] = {}
_AUTOGRAD: dict[Any, tuple[Callable, Callable]] = {}
_EAGER: dict[Any, type[torch.autograd.Function]] = {}


def define(name: str) -> Callable[[Callable], Any]:
    """Decorator: register `fn` as the custom op `name` ("longmixer::<op>") that mutates none of its arguments."""
    def wrap(fn: Callable):
        op = torch.library.custom_op(name, mutates_args=())(fn)
        _BODIES[op] = fn
        return op
    return wrap


def register_autograd(op, backward: Callable, setup_context: Callable) -> None:
    """`op.register_autograd` with the same two functions kept for the eager path. `backward(ctx, grads)` gets the
    output gradient (a list for list outputs; None for outputs without one) and returns one gradient per input."""
    op.register_autograd(backward, setup_context=setup_context)
    _AUTOGRAD[op] = backward, setup_context


def _eager_function(op) -> type[torch.autograd.Function]:
    if op not in _EAGER:
        body = _BODIES[op]
        backward, setup_context = _AUTOGRAD[op]

        class Eager(torch.autograd.Function):
            # forward(ctx, ...) rather than a separate setup_context staticmethod: with the latter, every apply()
            # binds default arguments through inspect.signature (about 25 us a call)
            @staticmethod
            def forward(ctx, *args):
                out = body(*args)
                ctx.eager, ctx.list_output = True, isinstance(out, list)
                setup_context(ctx, args, out)
                return tuple(out) if ctx.list_output else out

            @staticmethod
            def backward(ctx, *grads):
                return backward(ctx, list(grads) if ctx.list_output else grads[0])

        Eager.__name__ = f"Eager_{body.__name__}"
        _EAGER[op] = Eager
    return _EAGER[op]


def call(op, *args):
    """Run a registered op: the custom op under torch.compile, its body (under autograd when needed) in eager mode.
    List outputs come back as a list or tuple; index or unpack them."""
    if torch.compiler.is_compiling():
        return op(*args)
    if op in _AUTOGRAD and torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                                            for a in args):
        return _eager_function(op).apply(*args)
    return _BODIES[op](*args)


def backward_call(ctx, op, *args):
    """Call a backward op from a backward formula: its body when the forward ran on the eager path, the custom op
    when AOTAutograd traces the backward (so that it stays one node of the compiled backward graph)."""
    return _BODIES[op](*args) if getattr(ctx, "eager", False) else op(*args)


def no_gradient_for(ctx, *outputs: torch.Tensor) -> None:
    """Mark outputs kept only for the backward (statistics, transposed copies) as non-differentiable, and let
    autograd pass None instead of materialising zero gradients for outputs nobody used."""
    ctx.mark_non_differentiable(*outputs)
    ctx.set_materialize_grads(False)
