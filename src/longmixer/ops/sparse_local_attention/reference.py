"""Scatter-based reference for SeqBoat's compress -> local attention -> extract (SeqBoat, Ren et al. 2023,
arXiv 2306.11197, section 3.3 and appendix A.1-A.2).

This is the paper's parallel implementation: `compress_ref` left-packs the activated tokens with one scatter into a
buffer whose slot 0 is a dump for the inactive ones (Listing 1), attention runs on the packed sequence in look-around
blocks (each block of queries sees its own and the neighbouring key blocks, O(r w) memory), and `extract_ref` gathers
the results back to the original positions with zeros elsewhere (Listing 2). It is the oracle for the Triton kernel
and the CPU path.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

ATTENTIONS = ("softmax", "relu2")
REL_POS = ("original", "compressed")


def packing_capacity(active: Tensor) -> int | None:
    """The packed length R to use for `active` [B, L]: L (a fixed capacity, decided from sizes only) under
    torch.compile or on an accelerator, so that no shape depends on the data and nothing is read back to the host;
    None (the largest activated count, read on the host) in eager mode on the CPU, where that read costs no device
    sync and the shorter packed sequence saves work. Both give the same result: slots past a row's count are
    empty and masked."""
    if torch.compiler.is_compiling() or active.device.type != "cpu":
        return active.shape[-1]
    return None


def compress_ref(x: Tensor, active: Tensor, capacity: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Left-pack the activated tokens of each row (SeqBoat Listing 1).

    Args:
        x: [B, L, D] any dtype.
        active: [B, L] bool, True = the module is activated for this token.
        capacity: the packed length R (>= the largest activated count, e.g. L); None uses the largest activated
            count in the batch, read on the host (a data-dependent shape).

    Returns:
        xc: [B, R, D] packed tokens, zero in empty slots.
        positions: [B, R] long, the original position of each packed token (0 in empty slots).
        cmask: [B, R] bool, True = a real packed token.
    """
    a = active.long()
    count = a.sum(-1)  # [B]
    if capacity is not None and capacity < x.shape[1] and not torch.compiler.is_compiling() \
            and bool((count > capacity).any()):
        raise ValueError(f"compress capacity={capacity} is below the largest activated count {int(count.max())}; "
                         f"use capacity=L={x.shape[1]}")
    r = capacity if capacity is not None else (int(count.max()) if count.numel() else 0)
    slot = a * torch.cumsum(a, dim=-1)  # [B, L]; 1-based rank, 0 = the dump slot
    shape = (x.shape[0], r + 1, x.shape[-1])
    xc = x.new_zeros(shape).scatter(1, slot.unsqueeze(-1).expand_as(x), x)[:, 1:]  # [B, R, D]
    pos = torch.arange(x.shape[1], device=x.device).expand_as(slot)
    positions = torch.zeros(x.shape[0], r + 1, dtype=torch.long, device=x.device).scatter(1, slot, pos)[:, 1:]
    cmask = torch.arange(r, device=x.device) < count.unsqueeze(-1)  # [B, R]
    return xc, positions, cmask


def extract_ref(yc: Tensor, active: Tensor) -> Tensor:
    """Scatter packed outputs back to their original positions, zeros elsewhere (SeqBoat Listing 2).

    Args:
        yc: [B, R, D] packed outputs (R >= the largest activated count).
        active: [B, L] bool.

    Returns:
        y: [B, L, D].
    """
    a = active.long()
    slot = a * torch.cumsum(a, dim=-1)  # [B, L]
    padded = F.pad(yc, (0, 0, 1, 0))  # slot 0 holds zeros for the inactive tokens
    return torch.gather(padded, 1, slot.unsqueeze(-1).expand(-1, -1, yc.shape[-1]))


def attention_reach(window: int | None, causal: bool) -> tuple[int, int]:
    """Keys a packed query at slot i sees with working memory `window`: slots i-left .. i+right.

    SeqBoat section 3.3: w/2 past and w/2 future tokens when bidirectional, w past tokens when causal.
    """
    if window is None:
        raise ValueError("attention_reach needs a window")
    return (window, 0) if causal else (window // 2, window // 2)


def relu2_normalizer(window: int | None, chunk: int | None, causal: bool, slots: Tensor, count: Tensor) -> Tensor:
    """The relu^2 normalising factor s of SeqBoat eq. 6 per packed query, broadcastable to [B, R, 1].

    s = w with working memory (appendix A.2), the chunk size for the -chunk ablation, and for full attention over
    the packed sequence s = r (bidirectional; r = this row's activated count) or the number of visible keys i+1
    (causal, so that no future count leaks in; our choice, MEGA does the same for causal element attention).
    """
    if window is not None:
        return torch.full_like(slots, float(window), dtype=torch.float32)[..., None]
    if chunk is not None:
        return torch.full_like(slots, float(chunk), dtype=torch.float32)[..., None]
    if causal:
        return (slots + 1).float()[..., None]
    return count.clamp(min=1).float()[:, None, None].expand(-1, slots.shape[-1], 1)


def _bias(rel_bias: Tensor, rel: Tensor) -> Tensor:
    """Simple relative position bias w[(M-1) + (j-i)] (MEGA / SeqBoat A.2), clamped at the table edge."""
    m = (rel_bias.shape[0] + 1) // 2
    return rel_bias[(rel + m - 1).clamp(0, 2 * m - 2)]


def packed_attention_ref(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cmask: Tensor,
                         rel_bias: Tensor | None = None, *, window: int | None = None, chunk: int | None = None,
                         causal: bool = False, attention: str = "softmax", rel_pos: str = "original") -> Tensor:
    """Attention on packed sequences in blocks: O(R w) memory with a window, O(R C) with chunks, O(R^2) full.

    Args:
        q, k: [B, R, K]; v: [B, R, V]; positions: [B, R] long original positions; cmask: [B, R] bool.
        rel_bias, window, chunk, causal, attention, rel_pos: as `sparse_local_attention_ref`.

    Returns:
        o: [B, R, V], zero on empty slots.
    """
    bsz, r, dk = q.shape
    count = cmask.sum(-1)
    if window is not None:
        left, right = attention_reach(window, causal)
        block = max(left, 1)
        look = (1, 1 if right > 0 else 0)
    elif chunk is not None:
        block, look = chunk, (0, 0)
    else:
        block, look = max(r, 1), (0, 0)
    nb = -(-r // block)
    pad = nb * block - r
    slots = torch.arange(nb * block, device=q.device).expand(bsz, -1)  # [B, nb*C]

    def blocks(t: Tensor) -> Tensor:
        return F.pad(t, (0, 0, 0, pad)).view(bsz, nb, block, t.shape[-1])  # [B, nb, C, .]

    def around(t: Tensor) -> Tensor:  # keys of the neighbouring blocks: [B, nb, (1+lb+lf) C, .]
        parts = [F.pad(t, (0, 0, 0, 0, 1, 0))[:, :-1]] if look[0] else []
        parts.append(t)
        if look[1]:
            parts.append(F.pad(t, (0, 0, 0, 0, 0, 1))[:, 1:])
        return torch.cat(parts, dim=2)

    extra = torch.stack([slots[:, :r], positions, cmask.long()], -1)  # [B, R, 3]
    qb, kb, vb = blocks(q), around(blocks(k)), around(blocks(v))
    info_q, info_k = blocks(extra), around(blocks(extra))
    slot_q, slot_k = info_q[..., 0:1], info_k[..., 0].unsqueeze(2)  # [B, nb, C, 1], [B, nb, 1, C']
    # Zero-padded neighbour blocks carry slot 0: mark them invalid through their cmask (0) below.
    valid = (info_q[..., 2:3] > 0) & (info_k[..., 2].unsqueeze(2) > 0)
    rel_c = slot_k - slot_q
    if window is not None:
        valid = valid & (rel_c >= -left) & (rel_c <= right)
    if chunk is not None:
        valid = valid & (slot_k // chunk == slot_q // chunk)
    if causal:
        valid = valid & (rel_c <= 0)
    scores = torch.einsum("bnik,bnjk->bnij", qb, kb)  # [B, nb, C, C']
    if attention == "softmax":
        scores = scores * dk ** -0.5
    else:
        norm = relu2_normalizer(window, chunk, causal, slots, count).view(bsz, nb, block, 1)
        scores = scores / norm.to(scores.dtype)
    if rel_bias is not None:
        rel = rel_c if rel_pos == "compressed" else info_k[..., 1].unsqueeze(2) - info_q[..., 1:2]
        scores = scores + _bias(rel_bias, rel).to(scores.dtype)
    if attention == "softmax":
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32)).masked_fill(~valid, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(v.dtype)  # rows with no key are empty slots
    else:
        probs = torch.where(valid, F.relu(scores) ** 2, torch.zeros_like(scores))
    out = torch.einsum("bnij,bnjv->bniv", probs, vb)  # [B, nb, C, V]
    return out.reshape(bsz, nb * block, -1)[:, :r]


def sparse_local_attention_ref(q: Tensor, k: Tensor, v: Tensor, active: Tensor, rel_bias: Tensor | None = None, *,
                               window: int | None = None, chunk: int | None = None, causal: bool = False,
                               attention: str = "softmax", rel_pos: str = "original") -> Tensor:
    """compress -> attention on the packed sequence -> extract, as three torch steps (SeqBoat eq. 6, A.1-A.2).

    Logits are q k^T K^-0.5 for softmax (official code) and q k^T / s for relu^2 (s: `relu2_normalizer`), plus the
    simple relative bias w[(M-1) + (j-i)] where j-i is the distance in original positions (`rel_pos="original"`,
    the paper's default) or in packed slots (`"compressed"`, Text and SC).

    Args:
        q, k: [B, L, K] per-token queries and keys (RoPE, if any, is applied before, at original positions).
        v: [B, L, V].
        active: [B, L] bool, the tokens the module is activated for (padding must be False).
        rel_bias: [2M-1] or None; offsets beyond M-1 use the edge value.
        window: working memory w (w/2 + w/2 slots bidirectional, w past slots causal); None = full attention.
        chunk: the -chunk ablation: attention inside packed chunks of this size (exclusive with window).
        causal: keys only at packed slots <= the query's.
        attention: "softmax" | "relu2".
        rel_pos: "original" | "compressed".

    Returns:
        o: [B, L, V], zero at inactive positions.
    """
    capacity = packing_capacity(active)
    qc, positions, cmask = compress_ref(q, active, capacity)
    if qc.shape[1] == 0:
        return torch.zeros_like(v)
    kc, vc = compress_ref(k, active, capacity)[0], compress_ref(v, active, capacity)[0]
    oc = packed_attention_ref(qc, kc, vc, positions, cmask, rel_bias, window=window, chunk=chunk, causal=causal,
                              attention=attention, rel_pos=rel_pos)
    return extract_ref(oc, active)


def sparse_attention_naive(q: Tensor, k: Tensor, v: Tensor, active: Tensor, rel_bias: Tensor | None = None, *,
                           window: int | None = None, chunk: int | None = None, causal: bool = False,
                           attention: str = "softmax", rel_pos: str = "original") -> Tensor:
    """A second, simpler reference for the tests: an explicit [L, L] mask per row over the original sequence."""
    bsz, length, dk = q.shape
    out = torch.zeros_like(v)
    for b in range(bsz):
        idx = active[b].nonzero().squeeze(-1)
        r = idx.numel()
        if r == 0:
            continue
        slot = torch.arange(r, device=q.device)
        rel_c = slot[None, :] - slot[:, None]
        valid = torch.ones(r, r, dtype=torch.bool, device=q.device)
        if window is not None:
            left, right = attention_reach(window, causal)
            valid &= (rel_c >= -left) & (rel_c <= right)
        if chunk is not None:
            valid &= slot[None, :] // chunk == slot[:, None] // chunk
        if causal:
            valid &= rel_c <= 0
        s = q[b, idx] @ k[b, idx].T
        if attention == "softmax":
            s = s / math.sqrt(dk)
        else:
            norm = relu2_normalizer(window, chunk, causal, slot[None], torch.tensor([r], device=q.device))[0]
            s = s / norm.to(s.dtype)
        if rel_bias is not None:
            s = s + _bias(rel_bias, rel_c if rel_pos == "compressed" else idx[None, :] - idx[:, None])
        if attention == "softmax":
            p = torch.softmax(s.masked_fill(~valid, float("-inf")), -1)
        else:
            p = torch.where(valid, F.relu(s) ** 2, torch.zeros_like(s))
        out[b, idx] = p @ v[b, idx]
    return out
