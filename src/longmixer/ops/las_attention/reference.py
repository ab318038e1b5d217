"""Torch references for LaS attention (Zimerman & Wolf, "On the Long Range Abilities of Transformers", arXiv:2311.16620,
section 4.1, eq. 3): the materialized form written as the paper does (the oracle and the CPU path), and the
separable form built from plain torch ops (the second reference, and the unfused baseline of the benchmark).
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F


def _check_pool_size(pool_size: int) -> None:
    if pool_size < 1 or pool_size % 2 == 0:
        raise ValueError(f"pool_size={pool_size} must be a positive odd integer (the paper's P: 1 = no smoothing, "
                         "3 or 5 in LaS Table 4)")


def smooth_values(v: torch.Tensor, pool_size: int, causal_pool: bool) -> torch.Tensor:
    """Move the row-wise average pooling of the attention matrix onto V.

    AP(A) = A M with M[j', j] = 1/P when j' lies in the pooling window of column j (zero padding, divisor P as in
    `torch.nn.AvgPool1d(P, 1, P // 2)` with its default count_include_pad=True), hence AP(A) V = A (M V): V' = M V
    is V averaged along L over the window that is the mirror image of the pooling window.

    Args:
        v: [B, H, L, V] values.
        pool_size: P, odd; 1 returns v unchanged.
        causal_pool: False: the paper's centred window (columns j-h..j+h, h = (P-1)//2), so V'[j] averages
            V[j-h..j+h] and row i of the output can read up to h future values. True (our LM variant): the pooling
            window of column j is j..j+P-1, so V'[j] averages V[j-P+1..j] and the layer stays causal.

    Returns:
        V' = M V, [B, H, L, V], same dtype.
    """
    _check_pool_size(pool_size)
    return _window_mean(v, -2, pool_size, -(pool_size - 1) if causal_pool else -((pool_size - 1) // 2))


def _window_mean(x: torch.Tensor, dim: int, P: int, lo: int) -> torch.Tensor:
    """out[t] = (1/P) sum_{w < P} x[t + lo + w] along `dim`, zeros outside (a shape-preserving average pool, as
    `nn.AvgPool1d` with count_include_pad=True). Sums shifted slices (float32 at least): contiguous output, no 32-bit index limit.
    `dim` is -1 or -2."""
    if P == 1:
        return x
    L = x.shape[dim]
    pad = [0, 0] * (-1 - dim) + [-lo, P - 1 + lo]  # F.pad lists the last dim first
    xp = F.pad(x.to(torch.promote_types(x.dtype, torch.float32)), pad)  # L + P - 1 along dim
    return (sum(xp.narrow(dim, w, L) for w in range(P)) / P).to(x.dtype)


def eld_matrix(alpha: torch.Tensor, L: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """exp(-alpha_c D_L) of LaS eq. 3 with D_L[i, j] = max(i - j, 0) (distance times the causal mask), [H, L, L]."""
    idx = torch.arange(L, device=alpha.device)
    dist = (idx[:, None] - idx[None, :]).clamp_min(0).to(dtype)  # [L, L]
    return torch.exp(-alpha.to(dtype)[:, None, None] * dist)  # [H, L, L]


def las_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, *, pool_size: int = 1,
                      causal_pool: bool = False, scale: float | None = None) -> torch.Tensor:
    """LaS attention, materialized: AP(softmax(exp(-alpha_c D_L) * QK^T / sqrt(d_k) + causal mask)) V (eq. 3).

    The decay multiplies the logits; the causal mask is added separately as -inf (exp(-alpha * inf) would turn a
    masked logit into 0, i.e. unmask it). Softmax runs in float32 at least. O(L^2) memory.

    Args:
        q, k: [B, H, L, K]. v: [B, H, L, V].
        alpha: [H] decay rates alpha_c >= 0 (alpha = 0 is plain causal attention).
        pool_size: P, odd; the AP window (1 = no smoothing).
        causal_pool: use the causal pooling window (see `smooth_values`) instead of the paper's centred one.
        scale: logit scale; None means K ** -0.5.

    Returns:
        [B, H, L, V] in the dtype of q.
    """
    _check_pool_size(pool_size)
    L = q.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    cdt = torch.promote_types(q.dtype, torch.float32)
    s = (q.to(cdt) @ k.to(cdt).transpose(-1, -2)) * scale  # [B, H, L, L]
    s = s * eld_matrix(alpha, L, cdt)  # LaS eq. 3: ELD(S) = exp(-alpha_c D_L) * S
    future = torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1)
    a = torch.softmax(s.masked_fill(future, -math.inf), dim=-1)  # [B, H, L, L]
    # AP: 1-D average pooling along each row (the key axis) with shape-preserving zero padding; the causal window
    # of column j is j..j+P-1
    a = _window_mean(a, -1, pool_size, 0 if causal_pool else -((pool_size - 1) // 2))
    return (a @ v.to(cdt)).to(q.dtype)


def separable_factors(alpha: torch.Tensor, L: int, dtype: torch.dtype = torch.float32):
    """Row and column factors with exp(-alpha (i - j)) = f_q[i] * f_k[j], centred at c = (L - 1) / 2 so that each
    factor spans exp(+-alpha (L - 1) / 2) rather than exp(+-alpha (L - 1)). Returns two [H, L, 1] tensors."""
    t = torch.arange(L, device=alpha.device, dtype=dtype) - (L - 1) / 2
    a = alpha.to(dtype)[:, None, None]
    return torch.exp(-a * t[:, None]), torch.exp(a * t[:, None])


def las_attention_separable_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, *,
                                pool_size: int = 1, causal_pool: bool = False,
                                scale: float | None = None) -> torch.Tensor:
    """LaS attention as causal softmax attention on scaled q, k and smoothed V, in plain torch ops around SDPA.

    exp(-alpha (i - j)) (q_i . k_j) = (f_q[i] q_i) . (f_k[j] k_j), and AP(A) V = A (M V) (see `smooth_values`).
    Exact in exact arithmetic; valid in floating point while exp(alpha (L - 1) / 2) stays in range. Same arguments
    and result as `las_attention_ref`.
    """
    fq, fk = separable_factors(alpha, q.shape[-2], torch.promote_types(q.dtype, torch.float32))
    qs, ks = (q * fq).to(q.dtype), (k * fk).to(k.dtype)
    vs = smooth_values(v, pool_size, causal_pool)
    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)
