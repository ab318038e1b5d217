"""Input embeddings: tokens, real values (pixels, audio) and optional absolute positions."""

from __future__ import annotations

import math

import torch
from torch import nn

POS_ENCODINGS = ("none", "sinusoidal", "scaled_sinusoidal", "learned")


class TokenEmbedding(nn.Embedding):
    """Token embedding initialised N(0, std) with the padding row zero; MEGA uses std = D^-0.5 (models.md 1.7)."""

    def __init__(self, vocab_size: int, d_model: int, padding_idx: int | None = 0, std: float | None = None):
        super().__init__(vocab_size, d_model, padding_idx=padding_idx)
        nn.init.normal_(self.weight, mean=0.0, std=d_model ** -0.5 if std is None else std)
        if padding_idx is not None:
            with torch.no_grad():
                self.weight[padding_idx].zero_()


class RealEmbedding(nn.Module):
    """Real-valued inputs [B, L, d_input] -> [B, L, D]; MEGA's RealNumberEmbedding for d_input = 1 (weight
    N(0, std), default D^-0.5; bias N(0, bias_std), MEGA 0.1, default zeros)."""

    def __init__(self, d_input: int, d_model: int, std: float | None = None, bias_std: float = 0.0):
        super().__init__()
        self.proj = nn.Linear(d_input, d_model)
        nn.init.normal_(self.proj.weight, mean=0.0, std=d_model ** -0.5 if std is None else std)
        if bias_std > 0:
            nn.init.normal_(self.proj.bias, mean=0.0, std=bias_std)
        else:
            nn.init.zeros_(self.proj.bias)

    def forward(self, x):
        if x.ndim == 2:  # [B, L] scalars
            x = x.unsqueeze(-1)
        return self.proj(x.to(self.proj.weight.dtype))


class SinusoidalPositions(nn.Module):
    """Sine/cosine positions (Vaswani et al. 2017), computed for any length. `learned_scale`: times one learned scalar
    initialised to D^-0.5, SeqBoat's `--add-apos` (the official ScaledSinuEmbedding) on the pixel tasks."""

    def __init__(self, d_model: int, learned_scale: bool = False):
        super().__init__()
        self.d_model = d_model
        self.scale = nn.Parameter(torch.tensor(d_model ** -0.5)) if learned_scale else None

    def forward(self, length: int, device, dtype):
        half = self.d_model // 2
        freq = torch.exp(-math.log(10000.0) * torch.arange(half, device=device, dtype=torch.float32) / half)
        angle = torch.arange(length, device=device, dtype=torch.float32)[:, None] * freq  # [L, D/2]
        pe = torch.cat([angle.sin(), angle.cos()], dim=-1)
        if pe.shape[-1] < self.d_model:
            pe = nn.functional.pad(pe, (0, self.d_model - pe.shape[-1]))
        if self.scale is not None:
            pe = pe * self.scale
        return pe.to(dtype)  # [L, D]


class LearnedPositions(nn.Module):
    def __init__(self, d_model: int, max_len: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(max_len, d_model) * d_model ** -0.5)

    def forward(self, length: int, device, dtype):
        if length > self.table.shape[0]:
            raise ValueError(f"sequence length {length} exceeds model.max_len={self.table.shape[0]} of the learned "
                             "positions; raise model.max_len or use pos_encoding=sinusoidal")
        return self.table[:length].to(dtype)
