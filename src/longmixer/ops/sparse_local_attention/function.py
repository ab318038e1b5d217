"""Custom ops (see ops/README.md) and dispatching entry point for SeqBoat's fused compress -> local attention -> extract
(SeqBoat, arXiv 2306.11197, section 3.3, appendix A.1-A.2)."""

from __future__ import annotations

import torch
from torch import Tensor

from longmixer.ops.backend import resolve_backend
from longmixer.ops.custom import backward_call, call, define, no_gradient_for, register_autograd
from longmixer.ops.sparse_local_attention.reference import ATTENTIONS, REL_POS, sparse_local_attention_ref


def packed_index(active: Tensor) -> tuple[Tensor, Tensor]:
    """Slot -> original position map of the packed sequence, built with the paper's slot-0-dump scatter.

    Args:
        active: [B, L] bool.

    Returns:
        idx: [B, L] int32; idx[b, j] = original position of the j-th activated token (j < count[b]), 0 after.
        count: [B] int32 activated tokens per row.
    """
    a = active.long()
    slot = a * torch.cumsum(a, dim=-1)  # [B, L]; 0 = the dump slot
    pos = torch.arange(active.shape[1], device=active.device, dtype=torch.int32).expand_as(slot)
    idx = torch.zeros(active.shape[0], active.shape[1] + 1, dtype=torch.int32, device=active.device)
    idx = idx.scatter(1, slot, pos)[:, 1:].contiguous()  # [B, L]
    return idx, a.sum(-1).to(torch.int32)


@define("longmixer::sparse_local_attention_fwd")
def sparse_local_attention_fwd_op(q: Tensor, k: Tensor, v: Tensor, idx: Tensor, cnt: Tensor, rel_bias: Tensor | None,
                                  window: int | None, chunk: int | None, causal: bool, attention: str,
                                  rel_pos: str) -> list[Tensor]:
    """The fused forward over the packed sequence given by `packed_index`: [o [B, L, V], lse [B, L] float32]."""
    from longmixer.ops.sparse_local_attention import kernel

    return list(kernel.sparse_local_attention_fwd(q.contiguous(), k.contiguous(), v.contiguous(), idx, cnt, rel_bias,
                                                  window=window, chunk=chunk, causal=causal, attention=attention,
                                                  rel_pos=rel_pos))


@sparse_local_attention_fwd_op.register_fake
def _(q, k, v, idx, cnt, rel_bias, window, chunk, causal, attention, rel_pos):
    return [torch.empty_like(v, memory_format=torch.contiguous_format), q.new_empty(q.shape[:2], dtype=torch.float32)]


@define("longmixer::sparse_local_attention_bwd")
def sparse_local_attention_bwd_op(q: Tensor, k: Tensor, v: Tensor, o: Tensor, do: Tensor, idx: Tensor, cnt: Tensor,
                                  rel_bias: Tensor | None, lse: Tensor, window: int | None, chunk: int | None,
                                  causal: bool, attention: str, rel_pos: str) -> list[Tensor]:
    """[dq, dk, dv] and, with a bias, dbias."""
    from longmixer.ops.sparse_local_attention import kernel

    dq, dk, dv, dbias = kernel.sparse_local_attention_bwd(q.contiguous(), k.contiguous(), v.contiguous(), o,
                                                          do.contiguous(), idx, cnt, rel_bias, lse, window=window,
                                                          chunk=chunk, causal=causal, attention=attention,
                                                          rel_pos=rel_pos)
    return [dq, dk, dv] + ([] if dbias is None else [dbias])


@sparse_local_attention_bwd_op.register_fake
def _(q, k, v, o, do, idx, cnt, rel_bias, lse, window, chunk, causal, attention, rel_pos):
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
    return grads + ([] if rel_bias is None else [torch.empty_like(rel_bias, memory_format=torch.contiguous_format)])


def _setup_context(ctx, inputs, output):
    q, k, v, idx, cnt, rel_bias, *opts = inputs
    no_gradient_for(ctx, output[1])
    ctx.save_for_backward(q, k, v, idx, cnt, rel_bias, *output)
    ctx.opts = opts


def _backward(ctx, grads):
    q, k, v, idx, cnt, rel_bias, o, lse = ctx.saved_tensors
    out = backward_call(ctx, sparse_local_attention_bwd_op, q, k, v, o, grads[0], idx, cnt, rel_bias, lse, *ctx.opts)
    # q, k, v, idx, cnt, rel_bias, window, chunk, causal, attention, rel_pos
    return (*out[:3], None, None, out[3] if rel_bias is not None else None) + (None,) * 5


register_autograd(sparse_local_attention_fwd_op, _backward, _setup_context)


def _validate(q: Tensor, k: Tensor, v: Tensor, active: Tensor, rel_bias: Tensor | None, window: int | None,
              chunk: int | None, attention: str, rel_pos: str) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k must be [B, L, K] and v [B, L, V] with equal B, L; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if active.shape != q.shape[:2] or active.dtype != torch.bool:
        raise ValueError(f"active must be a bool [B, L] = {tuple(q.shape[:2])} mask; got {active.dtype} "
                         f"{tuple(active.shape)}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention={attention!r} is not one of {ATTENTIONS}")
    if rel_pos not in REL_POS:
        raise ValueError(f"rel_pos={rel_pos!r} is not one of {REL_POS}")
    if window is not None and chunk is not None:
        raise ValueError(f"window={window} and chunk={chunk} exclude each other; set one of them to None")
    for name, value in (("window", window), ("chunk", chunk)):
        if value is not None and value < 1:
            raise ValueError(f"{name}={value} must be a positive int, or None to switch it off")
    if rel_bias is not None and (rel_bias.dim() != 1 or rel_bias.shape[0] % 2 != 1):
        raise ValueError(f"rel_bias must be a [2M-1] vector; got shape {tuple(rel_bias.shape)}")


def sparse_local_attention(q: Tensor, k: Tensor, v: Tensor, active: Tensor, rel_bias: Tensor | None = None, *,
                           window: int | None = None, chunk: int | None = None, causal: bool = False,
                           attention: str = "softmax", rel_pos: str = "original", backend: str = "auto") -> Tensor:
    """Attention among the activated tokens only, over the packed sequence, written back in place (SeqBoat eq. 6).

    Equals `extract(attend(compress(q), compress(k), compress(v)), active)` without materialising the packed
    tensors or any L x L / R x R matrix on the Triton path.

    Args:
        q, k: [B, L, K] (fp32, bf16 or fp16); v: [B, L, V].
        active: [B, L] bool, the tokens whose module is activated (padding must be False).
        rel_bias: [2M-1] simple relative-position bias table, or None.
        window: working memory w: a packed query sees w/2 past and w/2 future packed tokens (bidirectional) or
            w past ones (causal); None = full attention over the packed sequence (SeqBoat-full).
        chunk: attention inside packed chunks of this size (the -chunk ablation); exclusive with window.
        causal: whether a packed query sees only earlier packed slots.
        attention: "softmax" (logits scaled by K^-0.5) or "relu2" (logits divided by s; see README).
        rel_pos: "original" (bias by distance in the original sequence) or "compressed" (in packed slots).
        backend: "auto" | "torch" | "triton".

    Returns:
        o: [B, L, V], zero at inactive positions.

    Example:
        >>> q = k = torch.randn(2, 64, 16); v = torch.randn(2, 64, 32); active = torch.rand(2, 64) < 0.3
        >>> sparse_local_attention(q, k, v, active, window=8, backend="torch").shape
        torch.Size([2, 64, 32])
    """
    _validate(q, k, v, active, rel_bias, window, chunk, attention, rel_pos)
    opts = dict(window=window, chunk=chunk, causal=causal, attention=attention, rel_pos=rel_pos)
    if resolve_backend("sparse_local_attention", backend, q, k, v) == "torch":
        return sparse_local_attention_ref(q, k, v, active, rel_bias, **opts)
    idx, cnt = packed_index(active)
    return call(sparse_local_attention_fwd_op, q, k, v, idx, cnt, rel_bias, window, chunk, causal, attention,
                rel_pos)[0]
