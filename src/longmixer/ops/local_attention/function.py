"""Public, dispatching chunked attention op (MEGA-chunk, LaS-chunk): `local_attention`, with the Triton kernels
of `kernel.py` registered as the custom ops `longmixer::local_attention_fwd` / `_bwd` (see ops/README.md).
MEGA, arXiv:2209.10655, sections 3.1 and 3.3."""

from __future__ import annotations

import torch
from torch import Tensor

from longmixer.ops.backend import resolve_backend
from longmixer.ops.custom import backward_call, call, define, no_gradient_for, register_autograd
from longmixer.ops.local_attention.reference import ATTENTIONS, default_scale, local_attention_ref


def _kernel_inputs(q, k, v, bias, mask, chunk: int):
    """What the kernels read: contiguous q, k, v (float64 runs in float32), the bias as float32 [H or 1, 2C-1] and
    the mask as uint8."""
    work = torch.float32 if v.dtype == torch.float64 else v.dtype
    q, k, v = (t.to(work).contiguous() for t in (q, k, v))
    bias32 = None if bias is None else bias.float().reshape(-1, 2 * chunk - 1).contiguous()
    mask8 = None if mask is None else mask.to(torch.uint8).contiguous()
    return q, k, v, bias32, mask8


@define("longmixer::local_attention_fwd")
def local_attention_fwd_op(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, mask: Tensor | None,
                           attention: str, causal: bool, chunk: int, scale: float, dropout: float,
                           seed: Tensor | None) -> list[Tensor]:
    """The forward kernel as one opaque op: [o (work dtype), stat [B, H, L] float32]."""
    from longmixer.ops.local_attention import kernel  # lazy: Triton only when the triton backend runs

    q, k, v, bias32, mask8 = _kernel_inputs(q, k, v, bias, mask, chunk)
    o, stat = kernel.local_attention_fwd(q, k, v, bias32, mask8, attention=attention, causal=causal, chunk=chunk,
                                         scale=scale, dropout=dropout, seed=seed)
    return [o, stat]


@local_attention_fwd_op.register_fake
def _(q, k, v, bias, mask, attention, causal, chunk, scale, dropout, seed):
    work = torch.float32 if v.dtype == torch.float64 else v.dtype
    return [v.new_empty(v.shape, dtype=work), q.new_empty(q.shape[:3], dtype=torch.float32)]


@define("longmixer::local_attention_bwd")
def local_attention_bwd_op(q: Tensor, k: Tensor, v: Tensor, o: Tensor, stat: Tensor, do: Tensor,
                           bias: Tensor | None, mask: Tensor | None, attention: str, causal: bool, chunk: int,
                           scale: float, dropout: float, seed: Tensor | None, bias_grad: bool) -> list[Tensor]:
    """The backward kernels: [dq, dk, dv] in the work dtype, then dbias shaped like `bias` when bias_grad."""
    from longmixer.ops.local_attention import kernel

    q, k, v, bias32, mask8 = _kernel_inputs(q, k, v, bias, mask, chunk)
    dq, dk, dv, dbias = kernel.local_attention_bwd(q, k, v, o, stat, do.to(q.dtype).contiguous(), bias32, mask8,
                                                   attention=attention, causal=causal, chunk=chunk, scale=scale,
                                                   dropout=dropout, seed=seed, bias_grad=bias_grad)
    return [dq, dk, dv] + ([dbias.reshape(bias.shape).to(bias.dtype)] if bias_grad else [])


@local_attention_bwd_op.register_fake
def _(q, k, v, o, stat, do, bias, mask, attention, causal, chunk, scale, dropout, seed, bias_grad):
    work = torch.float32 if v.dtype == torch.float64 else v.dtype
    grads = [t.new_empty(t.shape, dtype=work) for t in (q, k, v)]
    return grads + ([torch.empty_like(bias, memory_format=torch.contiguous_format)] if bias_grad else [])


def _setup_context(ctx, inputs, output):
    q, k, v, bias, mask, attention, causal, chunk, scale, dropout, seed = inputs
    o, stat = output
    no_gradient_for(ctx, stat)
    ctx.save_for_backward(q, k, v, o, stat, bias, mask, seed)
    ctx.cfg = (attention, causal, chunk, scale, dropout)


def _backward(ctx, grads):
    q, k, v, o, stat, bias, mask, seed = ctx.saved_tensors
    attention, causal, chunk, scale, dropout = ctx.cfg
    bias_grad = bias is not None and ctx.needs_input_grad[3]
    out = backward_call(ctx, local_attention_bwd_op, q, k, v, o, stat, grads[0], bias, mask, attention, causal,
                        chunk, scale, dropout, seed, bias_grad)
    dq, dk, dv = (g.to(t.dtype) for g, t in zip(out[:3], (q, k, v)))
    # gradients for (q, k, v, bias, mask, attention, causal, chunk, scale, dropout, seed); stat gets none
    return dq, dk, dv, out[3] if bias_grad else None, None, None, None, None, None, None, None


register_autograd(local_attention_fwd_op, _backward, _setup_context)


def _check(q, k, v, chunk_size, attention, bias, mask) -> int:
    if attention not in ATTENTIONS:
        raise ValueError(f"attention={attention!r} is not one of {ATTENTIONS}")
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"local_attention wants q, k [B, H, L, K] and v [B, H, L, V]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, H, L, _ = q.shape
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1, or None for full attention")
    C = L if chunk_size is None else chunk_size
    if bias is not None and (bias.shape[-1] != 2 * C - 1 or (bias.dim() == 2 and bias.shape[0] not in (1, H))):
        raise ValueError(f"bias must be [2C-1] or [H, 2C-1] = [{H}, {2 * C - 1}] for chunk C={C}; "
                         f"got {tuple(bias.shape)}")
    if mask is not None and mask.shape != (B, L):
        raise ValueError(f"mask must be [B, L] = {(B, L)}; got {tuple(mask.shape)}")
    return C


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, chunk_size: int | None = None,
                    attention: str = "softmax", causal: bool = False, bias: torch.Tensor | None = None,
                    mask: torch.Tensor | None = None, scale: float | None = None, dropout: float = 0.0,
                    backend: str = "auto") -> torch.Tensor:
    """Attention inside chunks of C positions; same signature and result as `local_attention_ref`.

    Args:
        q, k: [B, H, L, K]; v: [B, H, L, V] (float32, bfloat16, float16; float64 runs in float32 on Triton).
        chunk_size: C, or None for full attention (one chunk of length L). The last chunk may be shorter.
        attention: softmax | relu2 | laplace (MEGA's element attention divides q.k by the number of real keys of
            the chunk, or by the position + 1 when causal, before adding the bias).
        causal: only keys j <= i (inside the chunk).
        bias: [2C-1] or [H, 2C-1], b[(C-1) + j - i] added to the scores (SimpleRelativePositionalBias), or None.
        mask: [B, L] bool, True = real token; padded keys get no weight. A query with no key outputs 0.
        scale: multiplier of q.k; None: K^-1/2 for softmax, 1 for relu2 / laplace.
        dropout: probability of dropping each attention weight (pass 0 in eval). The Triton kernel draws its mask
            with Philox inside the tiles (forward and backward draw the same one); the reference uses torch's RNG.
        backend: auto | torch | triton.

    Returns:
        [B, H, L, V] in v's dtype.

    Raises:
        ValueError: an unknown attention, mismatched shapes, or a bias of the wrong length.

    Example:
        >>> q = torch.randn(2, 1, 10, 8); local_attention(q, q, q, chunk_size=4, backend="torch").shape
        torch.Size([2, 1, 10, 8])
    """
    C = _check(q, k, v, chunk_size, attention, bias, mask)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"attention dropout={dropout} must be in [0, 1)")
    scale = default_scale(attention, q.shape[-1]) if scale is None else scale
    if resolve_backend("local_attention", backend, q, k, v) == "torch":
        return local_attention_ref(q, k, v, chunk_size=C, attention=attention, causal=causal, bias=bias,
                                   mask=mask, scale=scale, dropout=dropout)
    # drawn on q's device by its generator (reproducible under torch.manual_seed), read by the kernels from device
    # memory: no host sync, and a CUDA graph replay draws a new mask (the draw is a kernel of the graph)
    seed = torch.randint(0, 2 ** 31 - 1, (1,), device=q.device) if dropout > 0 else None
    o, _ = call(local_attention_fwd_op, q.contiguous(), k.contiguous(), v.contiguous(), bias, mask, attention, causal,
                C, scale, dropout, seed)
    return o.to(v.dtype)
