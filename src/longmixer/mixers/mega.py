"""MEGA: Moving Average Equipped Gated Attention (Ma et al., ICLR 2023, arXiv:2209.10655, section 3), and
MEGA-chunk (section 3.5) through `chunk_size`. Structure, inits and dropouts follow the official layer
(facebookresearch/mega, `fairseq/modules/moving_average_gated_attention.py`); the norms, the normalized FFN, the
embeddings and the classifier are the backbone's (`SequenceModel` options set in configs/model/mega.yaml)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from longmixer.layers.attention import ChunkedAttention
from longmixer.layers.ema import MultiHeadEMA
from longmixer.layers.gau import (GateProjection, RotaryRelativePositionalBias, ScaleOffset,
                                  SimpleRelativePositionalBias)

REL_POS = ("simple", "rotary")


class MEGA(nn.Module):
    """One MEGA layer with its gated residual (MEGA eqs. 8-16).

    mx = EMA(x) (eq. 8); u = sigmoid, z|r = SiLU, hx (eqs. 10-12) from one projection of mx; q, k = z * gamma +
    beta (eq. 13, single head); v = SiLU(W_v x) from the normalized input, not from the EMA; h = SiLU(hx +
    W_h(attn(q, k, v) * r)) (eqs. 14-15); out = residual + u * (h - residual) (eq. 16).

    Args:
        d_model: D (given by the backbone).
        causal: causal EMA and causal attention (language modeling); else bidirectional EMA.
        zdim: S, the width of z, q and k.
        hdim: H, the width of v and r; None: 2D (every official recipe).
        ndim: N, the EMA dimension.
        attention: softmax | relu2 | laplace.
        chunk_size: None for full attention (MEGA), C for MEGA-chunk. A length that is not a multiple of C leaves
            a shorter last chunk, which equals the official padding to a multiple of C with masked pad keys.
        truncation: EMA kernel length cap (None: the sequence length).
        rel_pos: simple | rotary relative-position bias.
        max_len: the longest sequence the simple relative bias serves (full attention); with chunking it
            is sized to chunk_size, as in the official code. The rotary bias works at any length.
        dropout: on the EMA output and on h (the official `dropout`).
        hidden_dropout: on v (the official `hidden_dropout`).
        attention_dropout: on the attention weights (fused into the Triton kernel).
        backend: auto | torch | triton for the EMA and attention ops.
    """

    gated_residual = True

    def __init__(self, d_model: int, *, causal: bool = False, zdim: int = 64, hdim: int | None = None,
                 ndim: int = 16, attention: str = "softmax", chunk_size: int | None = None,
                 truncation: int | None = None, rel_pos: str = "simple", max_len: int = 1024,
                 dropout: float = 0.0, hidden_dropout: float = 0.0, attention_dropout: float = 0.0,
                 backend: str = "auto"):
        super().__init__()
        if rel_pos not in REL_POS:
            raise ValueError(f"model.mixer.rel_pos={rel_pos!r} is not one of {REL_POS}")
        if chunk_size is None and max_len < 1:
            raise ValueError(f"model.mixer.max_len={max_len} must be >= 1 (e.g. ${{data.seq_len}})")
        hdim = 2 * d_model if hdim is None else hdim
        self.d_model, self.zdim, self.hdim = d_model, zdim, hdim
        self.ema = MultiHeadEMA(d_model, ndim, bidirectional=not causal, truncation=truncation, backend=backend)
        self.v_proj = nn.Linear(d_model, hdim)
        self.mx_proj = GateProjection(d_model, [d_model, zdim + hdim, d_model], ["sigmoid", "silu", "none"])
        self.h_proj = nn.Linear(hdim, d_model)
        self.qk = ScaleOffset(zdim, heads=2)
        bias_len = max_len if chunk_size is None else chunk_size
        self.rel_pos = (SimpleRelativePositionalBias(bias_len) if rel_pos == "simple"
                        else RotaryRelativePositionalBias(zdim))
        self.attn = ChunkedAttention(attention, chunk_size, causal=causal, dropout=attention_dropout, backend=backend)
        self.dropout, self.hidden_dropout = nn.Dropout(dropout), nn.Dropout(hidden_dropout)
        for linear in (self.v_proj, self.h_proj):
            nn.init.normal_(linear.weight, mean=0.0, std=0.02)
            nn.init.zeros_(linear.bias)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """x [B, L, D] (normalized when pre-norm), mask [B, L], residual [B, L, D] (the block input; None: x)
        -> (out [B, L, D], {})."""
        residual = x if residual is None else residual
        v = self.hidden_dropout(F.silu(self.v_proj(x)))  # [B, L, H]
        mx = self.dropout(self.ema(x, mask))  # [B, L, D]
        u, zr, hx = self.mx_proj(mx)
        z, r = torch.split(zr, [self.zdim, self.hdim], dim=-1)
        q, k = self.qk(z)  # [B, L, S] each
        h = self._attend(q, k, v, mask)  # [B, L, H]
        h = self.dropout(F.silu(hx + self.h_proj(h * r)))  # MEGA eq. 15
        return torch.addcmul(residual, u, h - residual), {}  # MEGA eq. 16

    def _attend(self, q, k, v, mask):
        bias = self.rel_pos(self.attn.chunk_length(q.shape[1]))  # [2C-1]
        q, k, v = (t.unsqueeze(1) for t in (q, k, v))  # [B, 1, L, .] single head
        return self.attn(q, k, v, bias, mask).squeeze(1)
