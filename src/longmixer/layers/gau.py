"""Gated-attention-unit parts shared by MEGA and its descendants (MEGA, arXiv:2209.10655, section 3; FLASH, Hua
et al. 2022): per-dimension scale-and-offset Q/K from one shared z, the gate projection, and the relative-position
biases (simple and rotary) as vectors b[(C-1) + j - i] for `longmixer.ops.local_attention`. Details follow the
official code (facebookresearch/mega, `fairseq/modules/moving_average_gated_attention.py` and
`relative_positional_bias.py`)."""

from __future__ import annotations


import torch
from torch import nn
from torch.nn import functional as F

_GATE_ACTIVATIONS = {"sigmoid": torch.sigmoid, "silu": F.silu, "none": lambda t: t}


class ScaleOffset(nn.Module):
    """n heads from one z by a per-dimension affine map: out_h = z * gamma[h] + beta[h] (MEGA eq. 13, FLASH).

    Init as the official code: gamma ~ N(0, 0.02), beta = 0.

    Args:
        dim: S, the width of z.
        heads: how many outputs (2 for MEGA's q and k).
    """

    def __init__(self, dim: int, heads: int = 2):
        super().__init__()
        self.gamma = nn.Parameter(torch.empty(heads, dim))
        self.beta = nn.Parameter(torch.zeros(heads, dim))
        nn.init.normal_(self.gamma, mean=0.0, std=0.02)

    def forward(self, z: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """z [..., S] -> heads tensors [..., S]."""
        out = z.unsqueeze(-2) * self.gamma + self.beta  # [..., heads, S]
        return out.unbind(-2)


class GateProjection(nn.Module):
    """One Linear split into named pieces, each with its own activation (MEGA's mx_proj: u, zr, hx, eq. 10-12).

    Init as MEGA: weight ~ N(0, 0.02), bias 0.

    Args:
        d_in: input width.
        sizes: output widths, in order.
        activations: one of sigmoid | silu | none per piece.
    """

    def __init__(self, d_in: int, sizes: list[int], activations: list[str]):
        super().__init__()
        if len(sizes) != len(activations) or any(a not in _GATE_ACTIVATIONS for a in activations):
            raise ValueError(f"GateProjection wants one activation in {sorted(_GATE_ACTIVATIONS)} per size; got "
                             f"sizes={sizes}, activations={activations}")
        self.sizes, self.activations = list(sizes), list(activations)
        self.proj = nn.Linear(d_in, sum(sizes))
        nn.init.normal_(self.proj.weight, mean=0.0, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        pieces = torch.split(self.proj(x), self.sizes, dim=-1)
        return [_GATE_ACTIVATIONS[a](p) for a, p in zip(self.activations, pieces)]


class SimpleRelativePositionalBias(nn.Module):
    """A learned scalar per offset: bias[i, j] = w[(M-1) + j - i] (MEGA's `SimpleRelativePositionalBias`).

    Args:
        max_len: M, the longest sequence (or chunk) it serves; w has 2M-1 entries, init N(0, 0.02).
    """

    def __init__(self, max_len: int):
        super().__init__()
        self.max_len = max_len
        self.weight = nn.Parameter(torch.empty(2 * max_len - 1))
        nn.init.normal_(self.weight, mean=0.0, std=0.02)

    def forward(self, length: int) -> torch.Tensor:
        """The bias vector for sequences of `length` C: [2C-1], entry (C-1) + j - i.

        Raises:
            ValueError: length > max_len (the official code raises too).
        """
        M = self.max_len
        if length > M:
            raise ValueError(f"sequence (or chunk) length {length} exceeds the relative-position bias size "
                             f"max_len={M}; raise max_len (it is the mixer's max_len)")
        return self.weight[M - length:M + length - 1]


def rope(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """RoPE (Su et al. 2021), half-split: rotate x [..., P, S] by the angles positions [P] x base^(-2i/S).

    The one rotation MEGA's rotary bias and SeqBoat's rotary q / k share; an odd last channel is left as it is.
    """
    half = x.shape[-1] // 2
    freq = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)  # [S/2]
    angle = positions.to(torch.float32)[:, None] * freq  # [P, S/2]
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:2 * half]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:]], -1)


class RotaryRelativePositionalBias(nn.Module):
    """MEGA's rotary bias: bias[i, j] = rot_i(a) . rot_j(b) with learned a, b [S] (RoPE rotation, base 10000,
    half-split). Rotations compose, so it equals a . rot_{j-i}(b), a function of j - i only: we return it as the
    same [2C-1] vector as the simple bias, which lets the chunked kernel take either. The sinusoids are computed
    per call, so unlike the official table (sized by max_len) any length works.

    Args:
        dim: S (even).
    """

    def __init__(self, dim: int):
        super().__init__()
        if dim % 2:
            raise ValueError(f"RotaryRelativePositionalBias dim={dim} must be even")
        self.dim = dim
        self.alpha = nn.Parameter(torch.empty(dim))
        self.beta = nn.Parameter(torch.empty(dim))
        nn.init.normal_(self.alpha, mean=0.0, std=0.02)
        nn.init.normal_(self.beta, mean=0.0, std=0.02)

    def forward(self, length: int) -> torch.Tensor:
        """[2C-1] vector, entry (C-1) + r = a . rot_r(b) for r = j - i in [-(C-1), C-1]."""
        r = torch.arange(-(length - 1), length, device=self.alpha.device)
        rot_b = rope(self.beta.expand(len(r), self.dim), r)  # [2C-1, S]
        return rot_b @ self.alpha


def bias_matrix(bias: torch.Tensor, length: int) -> torch.Tensor:
    """Expand a [2C-1] relative bias into the [C, C] matrix bias[i, j] = b[(C-1) + j - i] (tests, small C)."""
    pos = torch.arange(length, device=bias.device)
    return bias[(length - 1) + pos[None, :] - pos[:, None]]
