"""Public, dispatching entry points of LongVQ's VQ attention op (arXiv:2404.11163, section 4): `vq_search` (eq. 5
with per-code statistics) and `vq_attention` (eqs. 16-18, blockwise, linear in L)."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from longmixer.ops.backend import resolve_backend
from longmixer.ops.custom import backward_call, call, define, no_gradient_for, register_autograd
from longmixer.ops.vq_attention.reference import ATTENTIONS, vq_attention_ref, vq_search_ref


def vq_search(k: torch.Tensor, codebook: torch.Tensor, mask: torch.Tensor | None = None, *,
              backend: str = "auto"):
    """Nearest codeword per key with per-code counts and key sums over the real keys (LongVQ eq. 5).

    Args:
        k: [N, E] keys. codebook: [S, E]. mask: [N] bool (True = real) or None.
        backend: "auto" | "torch" | "triton". The Triton kernel never builds the [N, S] distance matrix.

    Returns:
        codes [N] int64, counts [S] float32, sums [S, E] float32 (float64 on the torch path for float64 keys).
        No gradients: the search and the statistics are not differentiable.
    """
    if k.dim() != 2 or codebook.dim() != 2 or k.shape[1] != codebook.shape[1]:
        raise ValueError(f"vq_search needs k [N, E] and codebook [S, E]; got {tuple(k.shape)} and "
                         f"{tuple(codebook.shape)}")
    with torch.no_grad():
        if resolve_backend("vq_search", backend, k, codebook) == "torch":
            return vq_search_ref(k, codebook, mask)
        return tuple(call(vq_search_op, k, codebook, mask))


@define("longmixer::vq_search")
def vq_search_op(k: Tensor, codebook: Tensor, mask: Tensor | None) -> list[Tensor]:
    """The Triton search: [codes [N] int64, counts [S] float32, sums [S, E] float32]; not differentiable."""
    from longmixer.ops.vq_attention.kernel import vq_search_fwd

    return list(vq_search_fwd(k, codebook, mask))


@vq_search_op.register_fake
def _(k, codebook, mask):
    S, E = codebook.shape
    return [k.new_empty(k.shape[0], dtype=torch.int64), k.new_empty(S, dtype=torch.float32),
            k.new_empty(S, E, dtype=torch.float32)]


@define("longmixer::vq_attention_fwd")
def vq_attention_fwd_op(q: Tensor, k: Tensor, v: Tensor, codebook: Tensor, codes: Tensor, bias: Tensor | None,
                        mask: Tensor, block_size: int, causal: bool, laplace: bool) -> list[Tensor]:
    """The kernels' forward: [o [B, L, H] in v's dtype, lse [B, L] float32, the code statistics n [B, NS, S] and
    u [B, NS, S, H] float32 it summed (kept for the backward; NS = 1 bidirectional, NB causal)]."""
    from longmixer.ops.vq_attention.kernel import vq_attention_fwd

    return list(vq_attention_fwd(*_kernel_args(q, k, v, codebook, codes, bias, mask), block_size, causal, laplace))


@vq_attention_fwd_op.register_fake
def _(q, k, v, codebook, codes, bias, mask, block_size, causal, laplace):
    B, L, H, S = *v.shape, codebook.shape[0]
    NS = L // block_size if causal else 1
    return [torch.empty_like(v, memory_format=torch.contiguous_format), q.new_empty(B, L, dtype=torch.float32),
            q.new_empty(B, NS, S, dtype=torch.float32), q.new_empty(B, NS, S, H, dtype=torch.float32)]


def _kernel_args(q, k, v, codebook, codes, bias, mask):
    return (q.contiguous(), k.contiguous(), v.contiguous(), codebook.contiguous(), codes.contiguous(),
            None if bias is None else bias.float().contiguous(), mask.contiguous())


@define("longmixer::vq_attention_bwd")
def vq_attention_bwd_op(q: Tensor, k: Tensor, v: Tensor, codebook: Tensor, codes: Tensor, n_out: Tensor,
                        u_out: Tensor, bias: Tensor | None, mask: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                        block_size: int, causal: bool, laplace: bool) -> list[Tensor]:
    """[dq, dk, dv] and, with a bias, dbias in the bias's dtype."""
    from longmixer.ops.vq_attention.kernel_bwd import vq_attention_bwd

    q, k, v, codebook, codes, bias, mask = _kernel_args(q, k, v, codebook, codes, bias, mask)
    dq, dk, dv, dbias = vq_attention_bwd(q, k, v, codebook, codes, n_out, u_out, bias, mask, o, lse, do, block_size,
                                         causal, laplace)
    return [dq, dk, dv] + ([] if bias is None else [dbias.to(bias.dtype)])


@vq_attention_bwd_op.register_fake
def _(q, k, v, codebook, codes, n_out, u_out, bias, mask, o, lse, do, block_size, causal, laplace):
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
    return grads + ([] if bias is None else [torch.empty_like(bias, memory_format=torch.contiguous_format)])


def _setup_context(ctx, inputs, output):
    *tensors, block_size, causal, laplace = inputs
    no_gradient_for(ctx, *output[1:])
    ctx.save_for_backward(*tensors, *output)
    ctx.cfg = block_size, causal, laplace


def _backward(ctx, grads):
    q, k, v, codebook, codes, bias, mask, o, lse, n_out, u_out = ctx.saved_tensors
    out = backward_call(ctx, vq_attention_bwd_op, q, k, v, codebook, codes, n_out, u_out, bias, mask, o, lse,
                        grads[0], *ctx.cfg)
    # q, k, v, codebook, codes, bias, mask, block_size, causal, laplace
    return (*out[:3], None, None, out[3] if bias is not None else None, None, None, None, None)


register_autograd(vq_attention_fwd_op, _backward, _setup_context)


def _check(q, k, v, codebook, codes, mask, bias, block_size, attention):
    if attention not in ATTENTIONS:
        raise ValueError(f"model.mixer.attention={attention!r} is not one of {ATTENTIONS}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"vq_attention block_size={block_size} must be a power of two >= 16 (e.g. 128; the LongVQ "
                         "mixer passes model.mixer.chunk_size)")
    B, L, E = q.shape
    if k.shape != q.shape or v.shape[:2] != (B, L) or codes.shape != (B, L) or codebook.shape[1] != E:
        raise ValueError(f"vq_attention shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, codes {tuple(codes.shape)}, codebook {tuple(codebook.shape)}")
    if mask is not None and mask.shape != (B, L):
        raise ValueError(f"vq_attention mask must be [B, L] = {(B, L)}; got {tuple(mask.shape)}")
    if bias is not None and bias.shape != (block_size, 3 * block_size):
        raise ValueError(f"vq_attention bias must be [C, 3C] = {(block_size, 3 * block_size)}; "
                         f"got {tuple(bias.shape)}")


def vq_attention(q, k, v, codebook, codes, mask=None, bias=None, *, block_size: int, causal: bool = False,
                 attention: str = "softmax", backend: str = "auto"):
    """Blockwise VQ attention, linear in L (LongVQ eqs. 16-18; the codebook cache of Transformer-VQ).

    Args:
        q: [B, L, E] queries, already scaled (softmax: E^-1/2; laplace: 1 / number of keys seen).
        k: [B, L, E] quantized keys (k_hat with the straight-through estimator applied by the caller).
        v: [B, L, H] values.
        codebook: [S, E] codewords (a buffer; no gradient).
        codes: [B, L] int64 code of each key (from `vq_search`).
        mask: [B, L] bool, True = real token, or None. Padded queries return 0; padded keys are ignored.
        bias: [C, 3C] local bias over the window [block b-1 | b | b+1] (see `reference.window_bias`) or None.
        block_size: C, a power of two >= 16; L need not be a multiple (padded here).
        causal: query i sees keys j <= i; the window is blocks b-1 and b.
        attention: "softmax" (one joint normalization) | "laplace" (MEGA's element attention).
        backend: "auto" | "torch" | "triton".

    Returns:
        o: [B, L, H] in v's dtype. Gradients reach q, v, bias and k (k only through the local window).

    Example:
        >>> q, k = torch.randn(2, 100, 16), torch.randn(2, 100, 16)
        >>> cb = torch.randn(32, 16); codes, _, _ = vq_search(k.flatten(0, 1), cb); codes = codes.view(2, 100)
        >>> o = vq_attention(q * 16 ** -0.5, cb[codes], torch.randn(2, 100, 24), cb, codes, block_size=16)
    """
    _check(q, k, v, codebook, codes, mask, bias, block_size, attention)
    B, L, _ = q.shape
    if mask is None:
        mask = torch.ones(B, L, dtype=torch.bool, device=q.device)
    pad = -L % block_size
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        codes, mask = F.pad(codes, (0, pad)), F.pad(mask, (0, pad), value=False)
    if resolve_backend("vq_attention", backend, q, k, v) == "torch":
        o = vq_attention_ref(q, k, v, codebook, codes, mask, bias, block_size=block_size, causal=causal,
                             attention=attention)
    else:
        o = call(vq_attention_fwd_op, q, k, v, codebook.detach(), codes, bias, mask, block_size, causal,
                 attention == "laplace")[0]
    return o[:, :L] if pad else o
