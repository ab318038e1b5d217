"""Torch reference of chunked (block-diagonal) attention with softmax, relu2 or laplace weights and a simple
relative-position bias, as MEGA computes it (Ma et al., arXiv:2209.10655, sections 3.1 and 3.3; official code
facebookresearch/mega, `fairseq/modules/moving_average_gated_attention.py`). It materializes one C x C score block
per chunk, [B, H, L/C, C, C]: the oracle of the Triton kernel and the CPU path."""

from __future__ import annotations


import torch
from torch.nn import functional as F

from longmixer.ops.common import laplace

ATTENTIONS = ("softmax", "relu2", "laplace")


def relu2(s: torch.Tensor) -> torch.Tensor:
    """relu(s)^2 (So et al. 2021, Primer)."""
    return F.relu(s) ** 2


def default_scale(attention: str, head_dim: int) -> float:
    """K^-1/2 for softmax (MEGA scales q by zdim^-1/2); 1 for element attention, which divides by the key count."""
    return head_dim ** -0.5 if attention == "softmax" else 1.0


def row_norm(mask: torch.Tensor | None, B: int, L: int, C: int, causal: bool, attention: str,
             device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Per-query divisor of element attention, as 1/n [B, L] in `dtype` (ones for softmax): float32 for the kernels'
    comparisons, float64 for a float64 reference, whose 1/3 would otherwise be float32's.

    n is the number of real keys in the query's chunk (at least 1); causal: the position in the chunk plus one,
    as the official code (lengths = attn_mask.sum(-1)), whatever the padding. A last chunk shorter than C counts
    only its own keys, which equals the official padding of L to a multiple of C with masked pad keys.
    """
    if attention == "softmax":
        return torch.ones(B, L, device=device, dtype=dtype)
    pos = torch.arange(L, device=device)
    if causal:
        return (1.0 / (pos % C + 1).to(dtype)).expand(B, L).contiguous()
    n_chunks = -(-L // C)
    real = torch.ones(B, L, device=device, dtype=dtype) if mask is None else mask.to(dtype)
    counts = F.pad(real, (0, n_chunks * C - L)).view(B, n_chunks, C).sum(-1).clamp_min(1.0)  # [B, nc]
    return (1.0 / counts).repeat_interleave(C, dim=1)[:, :L].contiguous()


def local_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, chunk_size: int | None = None,
                        attention: str = "softmax", causal: bool = False, bias: torch.Tensor | None = None,
                        mask: torch.Tensor | None = None, scale: float | None = None,
                        dropout: float = 0.0) -> torch.Tensor:
    """Attention inside chunks of C consecutive positions (C = L when chunk_size is None: full attention).

    s_ij = scale q_i.k_j + b[(C-1) + j - i] (softmax) or scale q_i.k_j / n_i + b[(C-1) + j - i] (relu2, laplace:
    the bias is added after the division, MEGA's element attention); softmax masks keys with -inf (a row with
    no key left outputs 0), element attention multiplies f(s) by the 0/1 key and causal masks.

    Args:
        q, k: [B, H, L, K]; v: [B, H, L, V].
        chunk_size: C, or None for one chunk of length L. The last chunk may be shorter.
        attention: softmax | relu2 | laplace.
        causal: key j only for j <= i (inside the chunk).
        bias: [2C-1] or [H, 2C-1] relative-position bias, b[(C-1) + j - i], or None.
        mask: [B, L] bool, True = real token; padded keys get no weight.
        scale: multiplier of q.k; None: `default_scale`.
        dropout: probability of dropping each weight (the caller passes 0 in eval); torch's RNG here, Philox in
            the Triton kernel, so the two backends draw different masks.

    Returns:
        [B, H, L, V] in v's dtype.
    """
    B, H, L, Kd = q.shape
    C = L if chunk_size is None else chunk_size
    nc = -(-L // C)
    pad = nc * C - L
    scale = default_scale(attention, Kd) if scale is None else scale
    key_ok = torch.ones(B, L, dtype=torch.bool, device=q.device) if mask is None else mask
    key_ok = F.pad(key_ok, (0, pad), value=False).view(B, 1, nc, 1, C)
    qc, kc, vc = (F.pad(t, (0, 0, 0, pad)).view(B, H, nc, C, -1) for t in (q, k, v))
    s = torch.matmul(qc, kc.transpose(-1, -2)) * scale  # [B, H, nc, C, C]
    allowed = key_ok.expand(B, 1, nc, C, C)
    if causal:
        allowed = allowed & torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    if attention != "softmax":
        inv_n = F.pad(row_norm(mask, B, L, C, causal, attention, q.device, torch.promote_types(q.dtype, torch.float32)),
                      (0, pad), value=1.0)
        s = s * inv_n.view(B, 1, nc, C, 1).to(s.dtype)
    if bias is not None:
        idx = (C - 1) + torch.arange(C, device=q.device)[None, :] - torch.arange(C, device=q.device)[:, None]
        s = s + bias.view(-1, 2 * C - 1)[:, idx].view(1, -1, 1, C, C).to(s.dtype)  # b[(C-1) + j - i]
    if attention == "softmax":
        # finite fill: a fully masked row stays NaN-free (also in backward) and is zeroed below
        w = torch.softmax(s.masked_fill(~allowed, torch.finfo(s.dtype).min), dim=-1)
        w = torch.where(allowed.any(-1, keepdim=True), w, torch.zeros_like(w))
    elif attention in ("relu2", "laplace"):
        w = (relu2(s) if attention == "relu2" else laplace(s)) * allowed
    else:
        raise ValueError(f"attention={attention!r} is not one of {ATTENTIONS}")
    if dropout > 0:
        w = F.dropout(w, dropout, training=True)
    out = torch.matmul(w.to(vc.dtype), vc)  # [B, H, nc, C, V]
    return out.view(B, H, nc * C, -1)[:, :, :L]
