"""MEGA's attention over chunks (Ma et al., arXiv:2209.10655, sections 3.1, 3.3 and 3.5): softmax (scaled by
K^-1/2) or element attention (relu2, laplace: q.k divided by the number of real keys, then the relative bias, then
f, then multiplicative 0/1 masks), full or chunked, causal or bidirectional. The work is done by
`longmixer.ops.local_attention` (Triton on GPU, never materializing L x L)."""

from __future__ import annotations

import torch
from torch import nn

from longmixer.ops.local_attention import local_attention
from longmixer.ops.local_attention.reference import ATTENTIONS


class ChunkedAttention(nn.Module):
    """Single- or multi-head attention inside chunks of `chunk_size` positions (None: full attention).

    Args:
        attention: softmax | relu2 | laplace.
        chunk_size: C, or None for full attention. A length that is not a multiple of C leaves a shorter last
            chunk, which equals the official code's padding to a multiple of C with masked pad keys.
        causal: keys j <= i only.
        scale: multiplier of q.k; None: K^-1/2 for softmax, 1 for element attention.
        dropout: attention-weight dropout, in training only (fused into the Triton kernel).
        backend: auto | torch | triton.
    """

    def __init__(self, attention: str = "softmax", chunk_size: int | None = None, *, causal: bool = False,
                 scale: float | None = None, dropout: float = 0.0, backend: str = "auto"):
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"attention={attention!r} is not one of {ATTENTIONS}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size} must be >= 1, or null for full attention")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"attention dropout={dropout} must be in [0, 1)")
        self.attention, self.chunk_size, self.causal, self.scale, self.dropout, self.backend = (
            attention, chunk_size, causal, scale, dropout, backend)

    def chunk_length(self, length: int) -> int:
        """The chunk length C used for sequences of `length` (the relative bias is sized to it)."""
        return length if self.chunk_size is None else min(self.chunk_size, length)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """q, k [B, H, L, K], v [B, H, L, V], bias [2C-1] (C = `chunk_length(L)`), mask [B, L] -> [B, H, L, V]."""
        return local_attention(q, k, v, chunk_size=self.chunk_length(q.shape[2]), attention=self.attention,
                               causal=self.causal, bias=bias, mask=mask, scale=self.scale,
                               dropout=self.dropout if self.training else 0.0, backend=self.backend)
