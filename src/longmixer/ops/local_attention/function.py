"""Public, dispatching chunked attention op (MEGA-chunk, LaS-chunk): `local_attention`, with the Triton kernels
of `kernel.py` behind an autograd Function. MEGA, arXiv:2209.10655, sections 3.1 and 3.3."""

from __future__ import annotations

import torch

from longmixer.ops.backend import resolve_backend
from longmixer.ops.local_attention.reference import ATTENTIONS, default_scale, local_attention_ref


def _kernel_inputs(q, k, v, bias, mask, chunk: int, dropout: float):
    """What the kernels read: contiguous q, k, v (float64 runs in float32), the bias as float32 [H or 1, 2C-1],
    the mask as uint8, and the Philox seed (drawn from torch's generator, so runs are reproducible under
    torch.manual_seed; 0 without dropout)."""
    work = torch.float32 if v.dtype == torch.float64 else v.dtype
    q, k, v = (t.to(work).contiguous() for t in (q, k, v))
    bias32 = None if bias is None else bias.float().reshape(-1, 2 * chunk - 1).contiguous()
    mask8 = None if mask is None else mask.to(torch.uint8).contiguous()
    seed = int(torch.randint(0, 2 ** 31 - 1, (1,)).item()) if dropout > 0 else 0
    return q, k, v, bias32, mask8, seed


class LocalAttentionFunction(torch.autograd.Function):
    """Chunked attention by the Triton kernels; float32 inputs use IEEE dots, float64 inputs run in float32."""

    @staticmethod
    def forward(ctx, q, k, v, bias, mask, attention: str, causal: bool, chunk: int, scale: float, dropout: float):
        from longmixer.ops.local_attention import kernel  # lazy: Triton only when the triton backend runs

        dtype = v.dtype
        q, k, v, bias32, mask8, seed = _kernel_inputs(q, k, v, bias, mask, chunk, dropout)
        o, stat = kernel.local_attention_fwd(q, k, v, bias32, mask8, attention=attention, causal=causal,
                                             chunk=chunk, scale=scale, dropout=dropout, seed=seed)
        ctx.save_for_backward(q, k, v, o, stat, bias32, mask8)
        bias_meta = None if bias is None else (bias.shape, bias.dtype)
        ctx.cfg = (attention, causal, chunk, scale, dropout, seed, dtype, bias_meta)
        return o.to(dtype)

    @staticmethod
    def backward(ctx, do):
        from longmixer.ops.local_attention import kernel

        q, k, v, o, stat, bias32, mask8 = ctx.saved_tensors
        attention, causal, chunk, scale, dropout, seed, dtype, bias_meta = ctx.cfg
        dq, dk, dv, dbias = kernel.local_attention_bwd(q, k, v, o, stat, do.to(q.dtype).contiguous(), bias32, mask8,
                                                       attention=attention, causal=causal, chunk=chunk,
                                                       scale=scale, dropout=dropout, seed=seed,
                                                       bias_grad=ctx.needs_input_grad[3])
        if dbias is not None:
            dbias = dbias.reshape(bias_meta[0]).to(bias_meta[1])
        # gradients for (q, k, v, bias, mask, attention, causal, chunk, scale, dropout)
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), dbias, None, None, None, None, None, None


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
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, bias)):
        return LocalAttentionFunction.apply(q, k, v, bias, mask, attention, causal, C, scale, dropout)
    return _forward_no_grad(q, k, v, bias, mask, attention, causal, C, scale, dropout)


def _forward_no_grad(q, k, v, bias, mask, attention, causal, chunk, scale, dropout) -> torch.Tensor:
    """The forward kernel without an autograd node and without saving anything (evaluation, `no_grad`): the
    autograd Function's host cost is a large share of a call at MEGA's chunk sizes (docs/notes/mega.md)."""
    from longmixer.ops.local_attention import kernel

    dtype = v.dtype
    q, k, v, bias32, mask8, seed = _kernel_inputs(q, k, v, bias, mask, chunk, dropout)
    o, _ = kernel.local_attention_fwd(q, k, v, bias32, mask8, attention=attention, causal=causal, chunk=chunk,
                                      scale=scale, dropout=dropout, seed=seed)
    return o.to(dtype)
