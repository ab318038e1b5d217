"""LaS attention (Local and Smooth), LaS-chunk and their ablations: Zimerman & Wolf, "On the Long Range Abilities of
Transformers", arXiv:2311.16620 (ICML'24 as "Viewing Transformers Through the Lens of Long Convolutions Layers"),
section 4.1 eq. 3, section 5.2 Table 3.

Head c computes AP(softmax(exp(-alpha_c D_L) * QK^T / sqrt(d_k))) V with a causal mask: the decay multiplies the
logits, AP averages each attention row over a window of P keys, and the alpha_c are fixed (no parameters are added).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from longmixer.ops.las_attention import las_attention, smooth_values

POSITION_BIASES = ("eld", "alibi")


def las_alphas(n_heads: int, alpha_max: float) -> list[float]:
    """alpha_c = -log(1 - B c / (H - 1)) for c = 0..H-1, i.e. exp(-alpha_c) evenly spaced from 1 down to 1 - B.

    The paper (section 4.1, "Initialization of alpha_c") asks for alpha_0 = 0 and for exp(-alpha_c) "uniformly
    distributed" with B in (0, 1); read literally ("in [0, B]") no alpha_0 = 0 fits. We read the B as the width of
    the interval below 1: it keeps alpha_0 = 0, spaces the values evenly in exponential space, gives max alpha =
    -log(1 - B) ~ B, and explains why B must be below 1. Our choice; see docs/architecture.md (LaS).
    """
    if not 0.0 <= alpha_max < 1.0:
        raise ValueError(f"model.mixer.alpha_max={alpha_max} must lie in [0, 1) (the paper's B; Table 4 uses 1e-3 "
                         "and 1e-4)")
    if n_heads == 1:
        return [0.0]
    return [-math.log1p(-alpha_max * c / (n_heads - 1)) for c in range(n_heads)]


def alibi_slopes(n_heads: int) -> list[float]:
    """ALiBi's head slopes m_c = 2^(-8 c / H), c = 1..H (Press et al. 2021)."""
    return [2.0 ** (-8.0 * c / n_heads) for c in range(1, n_heads + 1)]


class LaS(nn.Module):
    """Multi-head LaS attention with the paper's variants as flags.

    | variant (paper)                  | position_bias | smooth        | chunk_size |
    | -------------------------------- | ------------- | ------------- | ---------- |
    | LaS (eq. 3)                      | "eld"         | True          | None       |
    | LaS-chunk (Table 1)              | "eld"         | True          | 128        |
    | L-attention (cT+ELD, Table 3)    | "eld"         | False         | 128        |
    | S-attention (cT+Smooth)          | None          | True          | 128        |
    | cT+ALiBi / cT+Smooth+ALiBi       | "alibi"       | False / True  | 128        |
    | causal Transformer (cT)          | None          | False         | C or None  |

    Attention is always causal (section 4.1: the decay needs a direction). `causal` (set by the backbone) only picks
    the smoothing window: False reproduces the paper (a centred window, which lets row i read up to (P-1)/2 future
    values through the pooled attention matrix); True, for language models, uses the window j..j+P-1 of each column,
    which keeps the whole layer causal (our choice: the paper does not say how its WikiText-103 runs pooled).

    Args:
        d_model: width D (given by the backbone).
        n_heads: heads H (8 in every LaS experiment, appendix A).
        causal: see above.
        alpha_max: B in the paper (Table 4): the decay rates are `las_alphas(n_heads, alpha_max)`.
        pool_size: P, the odd average-pooling width (Table 4).
        smooth: apply the average pooling (False: L-attention and the non-smooth rows of Table 3). A separate flag
            so that an ablation file can switch it off while a recipe sets P.
        position_bias: "eld" (exponentially locally decaying logits, eq. 3), "alibi" (eq. 1) or None.
        chunk_size: attend within non-overlapping chunks of this many tokens (LaS-chunk: 128); None = full length.
        bias: biases of the q/k/v and output projections.
        backend: "auto" | "torch" | "triton" for the las_attention op.

    Padding must be trailing (the datamodules pad at the end): with causal attention real queries never see later
    keys, and padded values are zeroed so that the smoothing reads zeros past the end, exactly as for an unpadded
    sequence.
    """

    gated_residual = False

    def __init__(self, d_model: int, n_heads: int = 8, *, causal: bool = False, alpha_max: float = 0.001,
                 pool_size: int = 3, smooth: bool = True, position_bias: str | None = "eld",
                 chunk_size: int | None = None,
                 bias: bool = True, backend: str = "auto"):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"model.d_model={d_model} must be divisible by model.mixer.n_heads={n_heads}")
        if pool_size < 1 or pool_size % 2 == 0:
            raise ValueError(f"model.mixer.pool_size={pool_size} must be an odd integer >= 1 (3 or 5 in LaS Table 4);"
                             " set model.mixer.smooth=false for no smoothing")
        if position_bias is not None and position_bias not in POSITION_BIASES:
            raise ValueError(f"model.mixer.position_bias={position_bias!r} is not one of {POSITION_BIASES} or null")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"model.mixer.chunk_size={chunk_size} must be >= 1 (LaS-chunk uses 128) or null")
        self.n_heads, self.causal, self.backend = n_heads, causal, backend
        self.pool_size = pool_size if smooth else 1  # P = 1 is the identity pooling
        self.position_bias, self.chunk_size = position_bias, chunk_size
        alphas = las_alphas(n_heads, alpha_max) if position_bias == "eld" else [0.0] * n_heads
        self.max_alpha = max(alphas)
        self.register_buffer("alpha", torch.tensor(alphas, dtype=torch.float32), persistent=False)  # [H]
        self.register_buffer("slopes", torch.tensor(alibi_slopes(n_heads), dtype=torch.float32), persistent=False)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.out = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x, mask=None, residual=None):
        B, L, D = x.shape
        H = self.n_heads
        q, k, v = self.qkv(x).view(B, L, 3, H, D // H).permute(2, 0, 3, 1, 4)  # [B, H, L, K]
        if mask is not None:
            v = v * mask[:, None, :, None].to(v.dtype)  # padded values read as the zeros past the end
        C = L if self.chunk_size is None else min(self.chunk_size, L)
        if C < L:
            q, k, v = (_to_chunks(t, C) for t in (q, k, v))  # [B * n, H, C, K]
        y = self._attend(q, k, v)
        if C < L:
            y = _from_chunks(y, B, L)  # [B, H, L, K]
        return self.out(y.transpose(1, 2).reshape(B, L, D)), {}

    def _attend(self, q, k, v):
        if self.position_bias == "alibi":
            return _alibi_attention(q, k, v, self.slopes, self.pool_size, self.causal)
        return las_attention(q, k, v, self.alpha, pool_size=self.pool_size, causal_pool=self.causal,
                             max_alpha=self.max_alpha, backend=self.backend)


def _to_chunks(t: torch.Tensor, C: int) -> torch.Tensor:
    """[B, H, L, K] -> [B * n, H, C, K], zero-padding L up to n * C (the padded tail sits after every real token)."""
    B, H, L, K = t.shape
    n = -(-L // C)
    t = F.pad(t, (0, 0, 0, n * C - L))  # [B, H, n*C, K]
    return t.view(B, H, n, C, K).transpose(1, 2).reshape(B * n, H, C, K)


def _from_chunks(t: torch.Tensor, B: int, L: int) -> torch.Tensor:
    """Inverse of `_to_chunks`: [B * n, H, C, K] -> [B, H, L, K]."""
    Bn, H, C, K = t.shape
    return t.view(B, Bn // B, H, C, K).transpose(1, 2).reshape(B, H, -1, K)[:, :, :L]


def _alibi_attention(q, k, v, slopes, pool_size: int, causal_pool: bool):
    """The Table 3 ALiBi ablations: AP(softmax((QK^T - m_c D_L) / sqrt(d_k))) V (LaS eq. 1, bias divided by sqrt(d_k)
    as written there), with the same smoothing moved onto V. Torch SDPA with a materialized [H, L, L] bias: meant for
    the chunked ablations (L = 128)."""
    L, K = q.shape[-2:]
    idx = torch.arange(L, device=q.device)
    dist = (idx[:, None] - idx[None, :]).to(torch.float32)  # [L, L]
    bias = (-slopes[:, None, None] * dist / math.sqrt(K)).masked_fill(dist < 0, -math.inf)  # [H, L, L]
    vs = smooth_values(v, pool_size, causal_pool)
    return F.scaled_dot_product_attention(q, k, vs, attn_mask=bias.to(q.dtype))
