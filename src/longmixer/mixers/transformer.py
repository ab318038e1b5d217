"""Multi-head softmax self-attention (Vaswani et al. 2017, arXiv:1706.03762) through PyTorch SDPA: the Transformer
baseline of every paper's tables."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Transformer(nn.Module):
    """Multi-head attention, causal or bidirectional, with key-padding masks.

    Args:
        d_model: width D (given by the backbone).
        n_heads: heads H; D must be divisible by H.
        causal: mask future keys (language modeling).
        attn_dropout: dropout on the attention weights (training only).
        backend: unused by SDPA itself; kept so every mixer yaml can carry `backend: ${ops.backend}`.
    """

    gated_residual = False

    def __init__(self, d_model: int, n_heads: int = 8, *, causal: bool = False, attn_dropout: float = 0.0,
                 bias: bool = True, backend: str = "auto"):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"model.d_model={d_model} must be divisible by model.mixer.n_heads={n_heads}")
        self.n_heads, self.causal, self.attn_dropout = n_heads, causal, attn_dropout
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
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                           dropout_p=self.attn_dropout if self.training else 0.0,
                                           is_causal=self.causal and attn_mask is None)
        return self.out(y.transpose(1, 2).reshape(B, L, D)), {}
