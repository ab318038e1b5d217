"""Public, dispatching linear attention for CHELA (eq. 2 and 9, arXiv:2406.08128): autograd over the Triton kernels."""

from __future__ import annotations

import torch
from torch import Tensor

from longmixer.ops.backend import resolve_backend
from longmixer.ops.linear_attention.reference import linear_attention_ref

MAX_HEAD_DIM = 128  # a program keeps a [head width, column tile] float32 state in registers; wider heads spill


class LinearAttentionFunction(torch.autograd.Function):
    """Autograd over the Triton launchers; `tune` (dict or None) overrides kernel._plan's tiles, warps, stages and
    segments (benchmark sweeps and tests; None keeps the measured defaults)."""

    @staticmethod
    def forward(ctx, q, k, v, g, causal, scale, normalize, eps, chunk_size, tune):
        from longmixer.ops.linear_attention import kernel  # Triton is imported only when this backend runs

        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        g = g.contiguous() if g is not None else None
        opts = dict(causal=causal, scale=scale, normalize=normalize, eps=eps, chunk_size=chunk_size, tune=tune)
        # the backward goes through norm and gate from the raw output, saved rather than recomputed
        o, h, raw = kernel.linear_attention_fwd(q, k, v, g, save_raw=any(ctx.needs_input_grad[:4]), **opts)
        ctx.save_for_backward(q, k, v, g, h, raw)
        ctx.opts = opts
        return o

    @staticmethod
    def backward(ctx, do):
        from longmixer.ops.linear_attention import kernel

        q, k, v, g, h, raw = ctx.saved_tensors
        dq, dk, dv, dg = kernel.linear_attention_bwd(q, k, v, g, do, h, raw, **ctx.opts)
        # one gradient per forward input: q, k, v, g, causal, scale, normalize, eps, chunk_size, tune
        return dq, dk, dv, dg, None, None, None, None, None, None


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
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        # inference: no autograd node, and nothing kept for a backward (Function.forward cannot tell no_grad apart)
        from longmixer.ops.linear_attention import kernel

        g = g.contiguous() if g is not None else None
        return kernel.linear_attention_fwd(q.contiguous(), k.contiguous(), v.contiguous(), g, causal=causal,
                                           scale=scale, normalize=normalize, eps=eps, chunk_size=chunk_size,
                                           save_raw=False, tune=tune)[0]
    return LinearAttentionFunction.apply(q, k, v, g, causal, scale, normalize, eps, chunk_size, tune)
