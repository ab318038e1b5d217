"""Multi-head softmax self-attention (Vaswani et al. 2017, arXiv:1706.03762) through PyTorch SDPA: the Transformer
baseline of every paper's tables."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

IMPLEMENTATIONS = ("sdpa", "materialized")


class Transformer(nn.Module):
    """Multi-head attention, causal or bidirectional, with key-padding masks.

    Args:
        d_model: width D (given by the backbone).
        n_heads: heads H; D must be divisible by H.
        causal: mask future keys (language modeling).
        attention_dropout: dropout on the attention weights (training only).
        implementation: "sdpa" (PyTorch's fused attention) or "materialized" (the L x L matrix written out as two
            matmuls and a softmax: the Transformer the papers' speed and memory tables compare against).
        backend: unused by SDPA itself; kept so every mixer yaml can carry `backend: ${ops.backend}`.
    """

    gated_residual = False

    def __init__(self, d_model: int, n_heads: int = 8, *, causal: bool = False, attention_dropout: float = 0.0,
                 bias: bool = True, implementation: str = "sdpa", backend: str = "auto"):
        super().__init__()
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"model.mixer.implementation={implementation!r} is not one of {IMPLEMENTATIONS}")
        self.implementation = implementation
        if d_model % n_heads:
            raise ValueError(f"model.d_model={d_model} must be divisible by model.mixer.n_heads={n_heads}")
        if not 0.0 <= attention_dropout < 1.0:  # SDPA refuses it only in the first training step
            raise ValueError(f"model.mixer.attention_dropout={attention_dropout} must be in [0, 1)")
        self.n_heads, self.causal, self.attention_dropout = n_heads, causal, attention_dropout
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x, mask=None, residual=None):
        B, L, D = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)  # [B, H, L, K]
        attn_mask = None
        if mask is not None:
            attn_mask = mask[:, None, None, :]  # [B, 1, 1, L] keys
            if self.causal:
                attn_mask = attn_mask & torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        dropout = self.attention_dropout if self.training else 0.0
        if self.implementation == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout,
                                               is_causal=self.causal and attn_mask is None)
        else:
            y = self._materialized(q, k, v, attn_mask, dropout)
        return self.out(y.transpose(1, 2).reshape(B, L, D)), {}

    def _materialized(self, q, k, v, keep, dropout):
        """softmax(Q K^T / sqrt(d)) V with the [B, H, L, L] scores in memory (Vaswani et al. 2017, eq. 1). A query
        with no key left (a row that is all padding) outputs 0, as SDPA does."""
        L = q.shape[2]
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, H, L, L]
        if keep is None and self.causal:
            keep = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        if keep is not None:
            # a finite fill: with -inf a query with no key would be softmax(-inf, ...) = NaN, in forward and backward
            scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        y = F.dropout(scores.softmax(-1), dropout, self.training) @ v  # [B, H, L, K]
        if keep is not None:
            y = y.masked_fill(~keep.any(-1, keepdim=True), 0.0)  # [B, H, L, K]: zero the queries with no key
        return y
