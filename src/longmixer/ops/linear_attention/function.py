"""Public, dispatching linear attention for CHELA (eq. 2 and 9, arXiv:2406.08128): the Triton kernels registered as the
custom ops `longmixer::linear_attention_fwd` / `_bwd` (see ops/README.md)."""

from __future__ import annotations

import torch
from torch import Tensor

from longmixer.ops.backend import resolve_backend
from longmixer.ops.custom import backward_call, call, define, no_gradient_for, register_autograd
from longmixer.ops.linear_attention.reference import linear_attention_ref

MAX_HEAD_DIM = 128  # a program keeps a [head width, column tile] float32 state in registers; wider heads spill


TUNE_KEYS = ("segments", "block", "warps", "stages", "fuse_sums")  # what `kernel._plan` lets a caller override


def _tune(segments, block, warps, stages, fuse_sums) -> dict | None:
    tune = {key: value for key, value in zip(TUNE_KEYS, (segments, block, warps, stages, fuse_sums))
            if value is not None}
    return tune or None


def _saved_layout(q: Tensor, v: Tensor, g: Tensor | None, causal: bool, normalize: bool, chunk_size: int,
                  save_raw: bool, tune: dict | None) -> tuple[bool, bool, tuple[int, ...]]:
    """Whether the forward keeps segment states h and the raw output, and the shape of h (as `kernel.linear_attention_
    fwd` decides them from sizes only)."""
    from longmixer.ops.linear_attention import kernel

    p = kernel._plan(q, v, chunk_size, tune)
    has_h = not causal or p["NS"] > 1
    return has_h, save_raw and (normalize or g is not None), (p["BH"], p["NS"], p["K"], p["V"])


@define("longmixer::linear_attention_fwd")
def linear_attention_fwd_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, causal: bool, scale: float,
                            normalize: bool, eps: float, chunk_size: int, save_raw: bool, segments: int | None,
                            block: int | None, warps: int | None, stages: int | None,
                            fuse_sums: bool | None) -> list[Tensor]:
    """[o, h, raw]: the output, the segment starting states [BH, NS, K, V] float32 and, with save_raw, the output
    before norm and gate (the backward reads both; an absent one is an empty tensor). The last five arguments
    override `kernel._plan` (None keeps the measured default)."""
    from longmixer.ops.linear_attention import kernel  # Triton is imported only when this backend runs

    o, h, raw = kernel.linear_attention_fwd(q.contiguous(), k.contiguous(), v.contiguous(),
                                            g.contiguous() if g is not None else None, causal=causal, scale=scale,
                                            normalize=normalize, eps=eps, chunk_size=chunk_size, save_raw=save_raw,
                                            tune=_tune(segments, block, warps, stages, fuse_sums))
    return [o, q.new_empty(0) if h is None else h, v.new_empty(0) if raw is None else raw]


@linear_attention_fwd_op.register_fake
def _(q, k, v, g, causal, scale, normalize, eps, chunk_size, save_raw, segments, block, warps, stages, fuse_sums):
    has_h, has_raw, h_shape = _saved_layout(q, v, g, causal, normalize, chunk_size, save_raw,
                                            _tune(segments, block, warps, stages, fuse_sums))
    h = q.new_empty(h_shape, dtype=torch.float32) if has_h else q.new_empty(0)
    out = torch.empty_like(v, memory_format=torch.contiguous_format)
    return [out, h, torch.empty_like(out) if has_raw else v.new_empty(0)]


@define("longmixer::linear_attention_bwd")
def linear_attention_bwd_op(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, do: Tensor, h: Tensor, raw: Tensor,
                            causal: bool, scale: float, normalize: bool, eps: float, chunk_size: int,
                            segments: int | None, block: int | None, warps: int | None, stages: int | None,
                            fuse_sums: bool | None) -> list[Tensor]:
    """[dq, dk, dv] and dg when g is given."""
    from longmixer.ops.linear_attention import kernel

    dq, dk, dv, dg = kernel.linear_attention_bwd(
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous() if g is not None else None, do,
        h if h.numel() else None, raw if raw.numel() else None, causal=causal, scale=scale, normalize=normalize,
        eps=eps, chunk_size=chunk_size, tune=_tune(segments, block, warps, stages, fuse_sums))
    return [dq, dk, dv] + ([] if dg is None else [dg])


@linear_attention_bwd_op.register_fake
def _(q, k, v, g, do, h, raw, causal, scale, normalize, eps, chunk_size, segments, block, warps, stages, fuse_sums):
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
    return grads + ([] if g is None else [torch.empty_like(g, memory_format=torch.contiguous_format)])


def _setup_context(ctx, inputs, output):
    q, k, v, g, causal, scale, normalize, eps, chunk_size, _, *tune = inputs
    _, h, raw = output
    no_gradient_for(ctx, h, raw)
    ctx.save_for_backward(q, k, v, g, h, raw)
    ctx.opts = (causal, scale, normalize, eps, chunk_size, *tune)


def _backward(ctx, grads):
    q, k, v, g, h, raw = ctx.saved_tensors
    out = backward_call(ctx, linear_attention_bwd_op, q, k, v, g, grads[0], h, raw, *ctx.opts)
    # q, k, v, g, then causal, scale, normalize, eps, chunk_size, save_raw and the five tuning overrides
    return (*out[:3], out[3] if g is not None else None) + (None,) * 11


register_autograd(linear_attention_fwd_op, _backward, _setup_context)


def linear_attention_triton(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, causal: bool, scale: float,
                            normalize: bool, eps: float, chunk_size: int, tune: dict | None = None) -> Tensor:
    """The Triton op on inputs of one dtype, without `linear_attention`'s checks; `tune` (dict or None) overrides
    kernel._plan's tiles, warps, stages, segments and sum fusion (benchmark sweeps and tests; None keeps the
    measured defaults). Nothing is saved for a backward when no input needs a gradient."""
    tune = tune or {}
    if set(tune) - set(TUNE_KEYS):
        raise ValueError(f"linear_attention tune keys {sorted(set(tune) - set(TUNE_KEYS))} are not among {TUNE_KEYS}")
    tensors = (q, k, v) if g is None else (q, k, v, g)
    save_raw = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return call(linear_attention_fwd_op, q, k, v, g, causal, scale, normalize, eps, chunk_size, save_raw,
                *(tune.get(key) for key in TUNE_KEYS))[0]


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, chunk_size: int) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, L, H, K]; got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, L, H, V] matching q {tuple(q.shape)}; got {tuple(v.shape)}")
    if g is not None and g.shape != v.shape:
        raise ValueError(f"g must have the shape of v {tuple(v.shape)}; got {tuple(g.shape)}")
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size={chunk_size} must be a power of two >= 16 (tl.dot tiles); try 64")


def linear_attention(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None, *, causal: bool,
                     scale: float | None = None, normalize: bool = True, eps: float = 1e-5,
                     chunk_size: int = 64, backend: str = "auto", num_segments: int | None = None) -> Tensor:
    """Tiled linear attention o = Norm(Q (K^T V)) * g, causal or not (CHELA eq. 2 and 9, section 4.1).

    Args:
        q, k: [B, L, H, K] queries and keys, feature map already applied; K <= 128 on the Triton path.
        v: [B, L, H, V] values, V <= 128 on the Triton path.
        g: [B, L, H, V] gate multiplied after the normalization (CHELA's G_a), or None.
        causal: True: o_i sums over j <= i (language modeling); False: over the whole sequence.
        scale: multiplies q; None means K^-0.5.
        normalize: RMS-normalize each head's output over V before the gate (the "Norm" of eq. 2).
        eps: the normalization's epsilon.
        chunk_size: tile length C (power of two >= 16).
        backend: auto | torch | triton (see longmixer.ops.backend).
        num_segments: Triton only: how many programs split one sequence; None picks enough to fill the GPU.

    Returns:
        o: [B, L, H, V] in v's dtype on the torch path; on the Triton path in the autocast dtype when autocast is
            on, else the promoted dtype of q, k, v (float32 accumulation and state).

    Raises:
        ValueError: bad shapes, chunk size, or a head wider than 128 / float64 on the Triton path.

    Example:
        >>> q = k = v = torch.randn(2, 100, 4, 32)
        >>> linear_attention(q, k, v, causal=True, backend="torch").shape
        torch.Size([2, 100, 4, 32])
    """
    _check(q, k, v, g, chunk_size)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    tensors = (q, k, v) if g is None else (q, k, v, g)
    if resolve_backend("linear_attention", backend, *tensors) == "torch":
        return linear_attention_ref(q, k, v, g, causal=causal, scale=scale, normalize=normalize, eps=eps,
                                    chunk_size=chunk_size)
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"linear_attention head widths K={q.shape[-1]}, V={v.shape[-1]} exceed {MAX_HEAD_DIM} on "
                         "the Triton path; raise the mixer's n_heads so that d_model / n_heads <= 128")
    # one dtype for the kernel: the autocast dtype when autocast is on, else the promoted input dtype
    dtype = (torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type)
             else torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype))
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    g = g.to(dtype) if g is not None else None
    if dtype == torch.float64:
        raise ValueError("linear_attention: float64 inputs run only on backend=torch (the kernel accumulates in "
                         "float32); cast to float32 or set ops.backend=torch")
    tune = None if num_segments is None else {"segments": num_segments}
    return linear_attention_triton(q, k, v, g, causal, scale, normalize, eps, chunk_size, tune)
