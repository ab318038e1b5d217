"""Torch references for LongVQ's vector-quantized attention (LongVQ, Liu et al. 2024, arXiv:2404.11163, section 4,
eqs. 5-8 and 15-18; the blockwise codebook cache follows Transformer-VQ, Lingle 2023, arXiv:2309.16354).

Three functions, all plain torch and float64-safe:
- `vq_search_ref`: nearest codeword (eq. 5) and per-code counts / key sums over real tokens; it materializes the
  [N, S] distance matrix, which is what the Triton kernel avoids.
- `vq_attention_ref`: the linear-time blockwise attention (local window with bias + codebook summary of the rest,
  one joint normalization); the CPU path and the oracle of the kernel.
- `vq_attention_quadratic_ref`: the same attention written as one [L, L] score matrix (eq. 18); the oracle of the
  blockwise reference.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

from longmixer.ops.common import diagonal_sums, laplace

ATTENTIONS = ("softmax", "laplace")


def vq_search_ref(k: torch.Tensor, codebook: torch.Tensor, mask: torch.Tensor | None = None):
    """Nearest codeword per key plus per-code statistics over the real keys (LongVQ eq. 5).

    Args:
        k: [N, E] keys (any float dtype; distances are computed in float32, or float64 for float64 inputs).
        codebook: [S, E] codewords.
        mask: [N] bool, True = real key; None: all real. Padded keys get a code but add no statistics.

    Returns:
        codes [N] int64, counts [S] float32/64 (number of real keys per code), sums [S, E] (sum of those keys).
    """
    dtype = torch.float64 if k.dtype == torch.float64 else torch.float32
    kf, cf = k.to(dtype), codebook.to(dtype)
    # ||k||^2 is the same for every code, so it is left out of the argmin.
    dist = (cf * cf).sum(-1)[None, :] - 2.0 * kf @ cf.t()  # [N, S]
    codes = dist.argmin(-1)
    weight = torch.ones_like(kf[:, 0]) if mask is None else mask.to(dtype)
    counts = torch.zeros(codebook.shape[0], dtype=dtype, device=k.device).index_add_(0, codes, weight)
    sums = torch.zeros(codebook.shape[0], k.shape[1], dtype=dtype, device=k.device)
    sums.index_add_(0, codes, kf * weight[:, None])
    return codes, counts, sums


def code_block_stats(codes: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, n_codes: int, block_size: int):
    """Per-block code counts and per-code value sums, the summary the codebook cache is built from.

    Args:
        codes: [B, L] int64 with L a multiple of `block_size`; v: [B, L, H]; mask: [B, L] bool.

    Returns:
        counts [B, NB, S] (float32, or float64 for float64 v) and value sums [B, NB, S, H] (differentiable in v).
    """
    B, L, H = v.shape
    NB = L // block_size
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    blk = torch.arange(L, device=v.device) // block_size  # [L]
    index = ((torch.arange(B, device=v.device)[:, None] * NB + blk[None, :]) * n_codes + codes).flatten()  # [B*L]
    w = mask.to(dtype).flatten()
    counts = torch.zeros(B * NB * n_codes, dtype=dtype, device=v.device).index_add_(0, index, w)
    sums = torch.zeros(B * NB * n_codes, H, dtype=dtype, device=v.device)
    sums = sums.index_add(0, index, v.flatten(0, 1).to(dtype) * w[:, None])
    return counts.view(B, NB, n_codes), sums.view(B, NB, n_codes, H)


def outside_window_stats(counts: torch.Tensor, sums: torch.Tensor, causal: bool):
    """Code statistics of the tokens outside each query block's local window.

    The window of block b is blocks b-1, b, b+1 (bidirectional) or b-1, b (causal); outside it: every other block
    (bidirectional) or blocks 0..b-2 (causal, Transformer-VQ's cache).

    Args:
        counts: [B, NB, S]; sums: [B, NB, S, H] from `code_block_stats`.

    Returns:
        counts_out [B, NB, S], sums_out [B, NB, S, H].
    """
    def shifted(x, shift):  # x[:, b - shift] along the block axis, zero where out of range
        if shift > 0:
            return F.pad(x[:, :-shift], [0, 0] * (x.dim() - 2) + [shift, 0]) if x.shape[1] > shift else 0 * x
        return F.pad(x[:, -shift:], [0, 0] * (x.dim() - 2) + [0, -shift]) if x.shape[1] > -shift else 0 * x

    if causal:
        prefix_c, prefix_s = counts.cumsum(1), sums.cumsum(1)  # through block b
        return shifted(prefix_c, 2), shifted(prefix_s, 2)  # through block b-2
    local_c = counts + shifted(counts, 1) + shifted(counts, -1)
    local_s = sums + shifted(sums, 1) + shifted(sums, -1)
    return counts.sum(1, keepdim=True) - local_c, sums.sum(1, keepdim=True) - local_s


def window_bias(bias_table: torch.Tensor, block_size: int) -> torch.Tensor:
    """Local bias matrix [C, 3C] from MEGA's simple relative bias table [4C - 1] (offset key - query).

    Column c of the matrix is key (b-1)*C + c for a query in block b, so entry [i, c] is table[c - C - i + 2C - 1].
    The backward sums the [C, 3C] gradient along its diagonals with a skewed view (`ops.common.diagonal_sums`)
    instead of an index scatter, whose sort cost more than the rest of the op's glue on the GPU.
    """
    return _WindowBias.apply(bias_table, block_size)


class _WindowBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bias_table, block_size):
        C = block_size
        ctx.block_size = C
        i = torch.arange(C, device=bias_table.device)
        c = torch.arange(3 * C, device=bias_table.device)
        return bias_table[(c[None, :] - C - i[:, None]) + 2 * C - 1]  # [C, 3C]

    @staticmethod
    def backward(ctx, grad):
        return diagonal_sums(grad), None  # [C, 3C] -> [4C - 1]


def _window_keys(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, L, F] -> [B, NB, 3C, F]: for each block, the keys of blocks b-1, b, b+1 (zeros past the ends)."""
    B, L, Fd = x.shape
    C = block_size
    padded = F.pad(x, (0, 0, C, C))  # [B, L + 2C, F]
    return padded.unfold(1, 3 * C, C).permute(0, 1, 3, 2)  # [B, NB, 3C, F]


def vq_attention_ref(q, k, v, codebook, codes, mask=None, bias=None, *, block_size: int, causal: bool = False,
                     attention: str = "softmax"):
    """Blockwise VQ attention in linear time (LongVQ eqs. 16-18; cache as Transformer-VQ).

    Query i in block b attends to (1) the keys of its local window (blocks b-1..b+1, or b-1..b causal with j <= i)
    with score q_i.k_j + bias, and (2) every other real key j through its codeword: score q_i.c_{z_j}, which
    equals q_i.k_j for a quantized key. Part (2) is summed per code: count n_s and value sum U_s, so one query costs
    O(3C + S). Softmax: one joint normalization over (1) and (2), code s weighted by n_s (the log-count bias of
    Transformer-VQ). Laplace: weights f(score), no normalization (MEGA's element attention).

    Args:
        q: [B, L, E] queries, already scaled (softmax: E^-1/2; laplace: 1/number of keys).
        k: [B, L, E] quantized keys k_hat (straight-through applied by the caller: gradients reach them only
            through the local window).
        v: [B, L, H] values.
        codebook: [S, E] codewords; used without gradient.
        codes: [B, L] int64 code of each key.
        mask: [B, L] bool, True = real token; None: no padding. Padded queries return 0.
        bias: [C, 3C] local bias (see `window_bias`) or None.
        block_size: C; L must be a multiple of C (the public op pads).
        causal: queries see keys j <= i only.
        attention: "softmax" | "laplace".

    Returns:
        o: [B, L, H] in v's dtype.
    """
    B, L, H = v.shape
    C = block_size
    NB = L // C
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    if mask is None:
        mask = torch.ones(B, L, dtype=torch.bool, device=v.device)
    n_out, u_out = outside_window_stats(*code_block_stats(codes, v, mask, codebook.shape[0], C), causal)
    qb = q.to(dtype).view(B, NB, C, -1)  # [B, NB, C, E]
    kw = _window_keys(k.to(dtype), C)  # [B, NB, 3C, E]
    vw = _window_keys(v.to(dtype), C)  # [B, NB, 3C, H]
    mw = _window_keys(mask[..., None].to(dtype), C)[..., 0] > 0  # [B, NB, 3C]
    s_loc = qb @ kw.transpose(-1, -2)  # [B, NB, C, 3C]
    if bias is not None:
        s_loc = s_loc + bias.to(dtype)
    allowed = mw[:, :, None, :].expand(B, NB, C, 3 * C)
    if causal:
        i = torch.arange(C, device=v.device)
        allowed = allowed & (torch.arange(3 * C, device=v.device)[None, :] <= i[:, None] + C)
    s_code = qb @ codebook.detach().to(dtype).t()[None, None]  # [B, NB, C, S]
    has_code = (n_out > 0)[:, :, None, :]  # [B, NB, 1, S]
    if attention == "softmax":
        m = torch.maximum(s_loc.masked_fill(~allowed, -math.inf).amax(-1),
                          s_code.masked_fill(~has_code, -math.inf).amax(-1))  # [B, NB, C]
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))[..., None]
        p_loc = torch.exp(s_loc - m) * allowed
        p_code = torch.exp(s_code - m) * has_code
        num = p_loc @ vw + p_code @ u_out  # [B, NB, C, H]
        den = p_loc.sum(-1, keepdim=True) + (p_code * n_out[:, :, None, :]).sum(-1, keepdim=True)
        o = num / torch.where(den > 0, den, torch.ones_like(den))
    elif attention == "laplace":
        o = (laplace(s_loc) * allowed) @ vw + (laplace(s_code) * has_code) @ u_out
    else:
        raise ValueError(f"attention={attention!r} is not one of {ATTENTIONS}")
    o = o.reshape(B, L, H) * mask[..., None]
    return o.to(v.dtype)


def vq_attention_quadratic_ref(q, k, v, codebook, codes, mask=None, bias=None, *, block_size: int,
                               causal: bool = False, attention: str = "softmax"):
    """The same attention as one [L, L] score matrix: phi(Q K_hat^T + B) V (LongVQ eq. 18), O(L^2).

    Keys inside a query's local window enter as `k` (with the bias), keys outside as their detached codeword
    `codebook[codes]` (no bias), so forward values and all gradients match `vq_attention_ref`. Same arguments.
    """
    B, L, H = v.shape
    C = block_size
    dtype = torch.float64 if v.dtype == torch.float64 else torch.float32
    if mask is None:
        mask = torch.ones(B, L, dtype=torch.bool, device=v.device)
    pos = torch.arange(L, device=v.device)
    blk = pos // C
    in_window = (blk[None, :] - blk[:, None]).abs() <= 1  # [L, L] query x key
    if causal:
        in_window = in_window & (blk[None, :] >= blk[:, None] - 1)
    qf = q.to(dtype)
    far_keys = codebook.detach().to(dtype)[codes]  # [B, L, E]
    s = torch.where(in_window, qf @ k.to(dtype).transpose(1, 2), qf @ far_keys.transpose(1, 2))  # [B, L, L]
    if bias is not None:
        rel = pos[None, :] - (blk[:, None] - 1) * C  # window column of key j for query i
        local = bias.to(dtype)[(pos % C)[:, None], rel.clamp(0, 3 * C - 1)]
        s = s + torch.where(in_window, local, torch.zeros_like(local))
    allowed = mask[:, None, :].expand(B, L, L)
    if causal:
        allowed = allowed & (pos[None, :] <= pos[:, None])
    if attention == "softmax":
        p = torch.softmax(s.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0)
    elif attention == "laplace":
        p = laplace(s) * allowed
    else:
        raise ValueError(f"attention={attention!r} is not one of {ATTENTIONS}")
    return ((p @ v.to(dtype)) * mask[..., None]).to(v.dtype)
