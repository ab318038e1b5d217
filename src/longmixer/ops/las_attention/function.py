"""LaS attention (arXiv:2311.16620, section 4.1, eq. 3) with O(L) memory: custom ops and the dispatching op.

Two facts make it cheap. AP(A) V = A (M V): the row-wise average pooling moves onto V. And
exp(-alpha (i - j)) = exp(-alpha i) exp(alpha j): the multiplicative decay of the logits separates into a row scale
of q and a column scale of k. While those scales stay in floating-point range, LaS attention is causal softmax
attention on (scaled q, scaled k, smoothed V): one fused Triton pass, then PyTorch SDPA (cuDNN / FlashAttention).
Outside that range a flash-style Triton kernel applies the decay per tile, rebased so that nothing overflows.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from longmixer.ops.backend import resolve_backend
from longmixer.ops.custom import backward_call, call, define, no_gradient_for, register_autograd
from longmixer.ops.las_attention.reference import las_attention_ref

# Largest alpha * (L - 1) / 2 (the exponent of each centred separable factor) for which the SDPA path is used.
# bfloat16 / float32 share float32's exponent range: factors within exp(+-30) ~ 1e13 keep q'.k' far from overflow and
# from subnormals. float16 tops out at 65504, so its factors must stay within exp(+-3) ~ 20.
SEPARABLE_EXPONENT_LIMIT = {torch.float16: 3.0, torch.bfloat16: 30.0, torch.float32: 30.0, torch.float64: 30.0}

# Widest head for which the separable path runs its causal attention on the flash kernel (decay off) rather than
# SDPA. PyTorch's fused kernels are built for heads of 32 or more and pad narrower ones; the flash kernel pads K to
# 16 only, and its backward takes dq by atomics at these widths (kernel.ONE_PASS_MAX_K). LaS's Text recipe has
# heads of 8 (d_model 64, 8 heads). Measured in docs/benchmarks.md (LaS records, "narrow heads").
TRITON_CAUSAL_MAX_K = 16


def _pool_offsets(pool_size: int, causal_pool: bool) -> tuple[int, int]:
    """First window offset of V' = M V (forward) and of M^T (backward)."""
    if causal_pool:  # V'[l] = mean(V[l-P+1..l]); its transpose reads forward
        return -(pool_size - 1), 0
    return -((pool_size - 1) // 2), -((pool_size - 1) // 2)  # centred window: M is symmetric


@define("longmixer::las_prep")
def las_prep_op(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, pool_size: int, offset: int,
                adjoint_offset: int) -> list[Tensor]:
    """(q, k, v) -> [q * f_q, k * f_k, M v] with the centred separable decay factors, one Triton pass. `offset` is the
    pooling window's first offset, `adjoint_offset` that of M^T: the backward is the same op with the two swapped
    (same factors, M^T on dv)."""
    from longmixer.ops.las_attention.kernel import las_prep

    return list(las_prep(q, k, v, alpha, pool_size, offset))


@las_prep_op.register_fake
def _(q, k, v, alpha, pool_size, offset, adjoint_offset):
    return [torch.empty_like(q, memory_format=torch.contiguous_format),
            torch.empty_like(k, memory_format=torch.contiguous_format),
            torch.empty_like(v, memory_format=torch.contiguous_format)]


def _las_prep_setup(ctx, inputs, output):
    *_, alpha, pool_size, offset, adjoint_offset = inputs
    ctx.save_for_backward(alpha)
    ctx.cfg = pool_size, offset, adjoint_offset


def _las_prep_backward(ctx, grads):
    (alpha,) = ctx.saved_tensors
    pool_size, offset, adjoint_offset = ctx.cfg
    dq, dk, dv = backward_call(ctx, las_prep_op, *grads, alpha, pool_size, adjoint_offset, offset)
    return dq, dk, dv, None, None, None, None  # q, k, v, alpha, pool_size, offset, adjoint_offset


register_autograd(las_prep_op, _las_prep_backward, _las_prep_setup)


@define("longmixer::las_smooth_values")
def las_smooth_values_op(v: Tensor, alpha: Tensor, pool_size: int, offset: int, adjoint_offset: int) -> Tensor:
    """v -> M v (the smoothing of V alone, for the flash kernel path); the backward swaps the offsets (M^T)."""
    from longmixer.ops.las_attention.kernel import las_prep

    return las_prep(None, None, v, alpha, pool_size, offset)[2]


@las_smooth_values_op.register_fake
def _(v, alpha, pool_size, offset, adjoint_offset):
    return torch.empty_like(v, memory_format=torch.contiguous_format)


def _smooth_backward(ctx, dvs):
    (alpha,) = ctx.saved_tensors
    pool_size, offset, adjoint_offset = ctx.cfg
    dv = backward_call(ctx, las_smooth_values_op, dvs, alpha, pool_size, adjoint_offset, offset)
    return dv, None, None, None, None  # v, alpha, pool_size, offset, adjoint_offset


register_autograd(las_smooth_values_op, _smooth_backward, _las_prep_setup)


@define("longmixer::las_attention_fwd")
def las_attention_fwd_op(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, scale: float, decay: bool) -> list[Tensor]:
    """Causal softmax attention with logits scale * exp(-alpha_h (i - j)) q_i . k_j (scale * q_i . k_j without
    `decay`), flash-style, O(L) memory: [o, the log2-domain logsumexp [B, H, L] float32]."""
    from longmixer.ops.las_attention.kernel import las_attention_fwd

    return list(las_attention_fwd(q.contiguous(), k.contiguous(), v.contiguous(), alpha, scale, decay))


@las_attention_fwd_op.register_fake
def _(q, k, v, alpha, scale, decay):
    B, H, L, _ = q.shape
    return [q.new_empty(B, H, L, v.shape[-1]), q.new_empty(B, H, L, dtype=torch.float32)]


@define("longmixer::las_attention_bwd")
def las_attention_bwd_op(q: Tensor, k: Tensor, v: Tensor, alpha: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                         scale: float, decay: bool) -> list[Tensor]:
    """[dq, dk, dv] of `las_attention_fwd_op`."""
    from longmixer.ops.las_attention.kernel import las_attention_bwd

    return list(las_attention_bwd(q.contiguous(), k.contiguous(), v.contiguous(), alpha, o, lse, do, scale, decay))


@las_attention_bwd_op.register_fake
def _(q, k, v, alpha, o, lse, do, scale, decay):
    return [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]


def _las_attention_setup(ctx, inputs, output):
    q, k, v, alpha, scale, decay = inputs
    no_gradient_for(ctx, output[1])
    ctx.save_for_backward(q, k, v, alpha, *output)
    ctx.scale, ctx.decay = scale, decay


def _las_attention_backward(ctx, grads):
    q, k, v, alpha, o, lse = ctx.saved_tensors
    dq, dk, dv = backward_call(ctx, las_attention_bwd_op, q, k, v, alpha, o, lse, grads[0], ctx.scale, ctx.decay)
    return dq, dk, dv, None, None, None  # q, k, v, alpha, scale, decay


register_autograd(las_attention_fwd_op, _las_attention_backward, _las_attention_setup)


def las_attention_separable(q, k, v, alpha, *, pool_size: int = 1, causal_pool: bool = False,
                            scale: float | None = None, attention: str = "sdpa") -> torch.Tensor:
    """Triton path 1: the fused prep pass, then causal attention on the scaled q, k and smoothed V: PyTorch's SDPA
    (`attention="sdpa"`) or the flash kernel without the decay (`"triton"`), which is faster for narrow heads
    (`las_attention` picks it up to TRITON_CAUSAL_MAX_K). Valid while alpha (L - 1) / 2 is within
    SEPARABLE_EXPONENT_LIMIT for the dtype; `las_attention` checks that."""
    if attention not in ("sdpa", "triton"):
        raise ValueError(f"attention={attention!r} must be 'sdpa' or 'triton'")
    qs, ks, vs = call(las_prep_op, q, k, v, alpha, pool_size, *_pool_offsets(pool_size, causal_pool))
    if attention == "triton":
        return call(las_attention_fwd_op, qs, ks, vs, alpha, q.shape[-1] ** -0.5 if scale is None else scale,
                    False)[0]
    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)


def las_attention_flash(q, k, v, alpha, *, pool_size: int = 1, causal_pool: bool = False,
                        scale: float | None = None) -> torch.Tensor:
    """Triton path 2: smooth V, then the flash-style kernel with the decay rebased per tile (any alpha >= 0)."""
    vs = call(las_smooth_values_op, v, alpha, pool_size, *_pool_offsets(pool_size, causal_pool)) if pool_size > 1 else v
    return call(las_attention_fwd_op, q, k, vs, alpha, q.shape[-1] ** -0.5 if scale is None else scale, True)[0]


def las_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, *, pool_size: int = 1,
                  causal_pool: bool = False, scale: float | None = None, max_alpha: float | None = None,
                  backend: str = "auto") -> torch.Tensor:
    """LaS attention: AP(softmax(exp(-alpha_h D_L) * QK^T * scale + causal mask)) V (LaS eq. 3), per head h.

    Args:
        q, k: [B, H, L, K]; v: [B, H, L, V]; float16, bfloat16 or float32 (float64 on the torch backend).
        alpha: [H] float32 decay rates >= 0 on the device of q (fixed: no gradient flows to it).
        pool_size: P, odd; the width of the average pooling along each attention row (1 = no smoothing).
        causal_pool: False (paper): centred pooling window, so row i also reads V up to (P - 1) / 2 steps ahead.
            True: the pooling window of column j is j..j+P-1, which keeps the layer causal (for language models).
        scale: logit scale; None means K ** -0.5.
        max_alpha: an upper bound on alpha as a Python float (the LaS mixer passes max(alpha)), used to pick the
            Triton path: the separable one (prep + SDPA) while max_alpha (L - 1) / 2 is within
            SEPARABLE_EXPONENT_LIMIT, else the flash kernel. None runs the flash kernel, valid for any alpha >= 0:
            the path is decided from sizes and arguments, never from alpha's values.
        backend: "auto" | "torch" | "triton". torch runs the materialized reference (O(L^2) memory).

    Returns:
        [B, H, L, V] in the dtype of q.

    Example:
        >>> q = k = v = torch.randn(2, 8, 256, 64)
        >>> alpha = -torch.log1p(-0.001 * torch.arange(8) / 7)
        >>> las_attention(q, k, v, alpha, pool_size=3, backend="torch").shape
        torch.Size([2, 8, 256, 64])
    """
    if q.dim() != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"las_attention expects q, k [B, H, L, K] and v [B, H, L, V]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if alpha.shape != (q.shape[1],):
        raise ValueError(f"alpha has shape {tuple(alpha.shape)}; expected one decay rate per head, ({q.shape[1]},)")
    if pool_size < 1 or pool_size % 2 == 0:
        raise ValueError(f"pool_size={pool_size} must be a positive odd integer (LaS Table 4 uses 3 or 5)")
    if max_alpha is not None and max_alpha < 0:
        raise ValueError(f"max_alpha={max_alpha} must be >= 0; a negative decay rate grows with distance")
    # alpha's values are read on the host only in eager mode on the CPU, where that is neither a device sync nor a
    # graph break; the LaS mixer checks its rates where it makes them (`las_alphas`)
    if alpha.device.type == "cpu" and not torch.compiler.is_compiling() and float(alpha.min()) < 0:
        raise ValueError(f"alpha must be >= 0 (got min {float(alpha.min())}); a negative rate grows with distance")
    if resolve_backend("las_attention", backend, q, k, v) == "torch":
        return las_attention_ref(q, k, v, alpha, pool_size=pool_size, causal_pool=causal_pool, scale=scale)
    alpha = alpha.to(torch.float32)
    limit = SEPARABLE_EXPONENT_LIMIT.get(q.dtype, 0.0)
    if max_alpha is not None and max_alpha * (q.shape[-2] - 1) / 2 <= limit:
        attention = "triton" if q.shape[-1] <= TRITON_CAUSAL_MAX_K else "sdpa"
        return las_attention_separable(q, k, v, alpha, pool_size=pool_size, causal_pool=causal_pool, scale=scale,
                                       attention=attention)
    return las_attention_flash(q, k, v, alpha, pool_size=pool_size, causal_pool=causal_pool, scale=scale)
