"""Torch reference for CHELA's linear attention: Norm(Q (K^T V)) * G (CHELA eq. 2 and 9, arXiv:2406.08128).

The reference is the oracle for the Triton kernel and the CPU path. It computes the chunked (tiled) form of
section 4.1 with plain torch ops; `linear_attention_quadratic` is the second, simpler reference (the masked
L x L form) the tests check it against.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _normalize_gate(o: Tensor, g: Tensor | None, normalize: bool, eps: float) -> Tensor:
    """Per-head RMS normalization over the value width, then the gate (CHELA eq. 9: Norm(.) * G_a)."""
    if normalize:
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)
    if g is not None:
        o = o * g
    return o


def linear_attention_ref(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None, *, causal: bool,
                         scale: float | None = None, normalize: bool = True, eps: float = 1e-5,
                         chunk_size: int = 64, backend: str = "torch") -> Tensor:
    """Chunked linear attention with output normalization and gate, in plain torch.

    Args:
        q, k: [B, L, H, K] queries and keys (feature map already applied).
        v: [B, L, H, V] values.
        g: [B, L, H, V] output gate, or None.
        causal: True: o_i = sum_{j<=i} (q_i.k_j) v_j; False: o = Q (K^T V) over the whole sequence.
        scale: multiplies q; None means K^-0.5.
        normalize: RMS-normalize each head's output over V (eps inside the root) before the gate.
        eps: the normalization's epsilon.
        chunk_size: tile length C of the causal form (section 4.1); the result does not depend on it.
        backend: accepted for signature parity with `linear_attention`; the reference is always torch.

    Returns:
        o: [B, L, H, V] in the dtype of v; accumulation and the state are float32 (float64 for float64 inputs).
    """
    del backend
    B, L, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = (t.to(acc).transpose(1, 2) for t in (q, k, v))  # [B, H, L, *]
    qf = qf * scale
    if not causal:
        o = qf @ (kf.transpose(-1, -2) @ vf)  # CHELA eq. 2: Q (K^T V), [B, H, L, V]
    else:
        S = qf.new_zeros(B, H, K, v.shape[-1])  # running state sum_j k_j^T v_j, [B, H, K, V]
        mask = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
        outs = []
        for t0 in range(0, L, chunk_size):
            qc, kc, vc = (t[:, :, t0:t0 + chunk_size] for t in (qf, kf, vf))
            n = qc.shape[2]
            intra = (qc @ kc.transpose(-1, -2)).masked_fill(~mask[:n, :n], 0.0) @ vc  # left product inside the tile
            outs.append(qc @ S + intra)  # right product across tiles (section 4.1)
            S = S + kc.transpose(-1, -2) @ vc
        o = torch.cat(outs, dim=2)
    o = o.transpose(1, 2)  # [B, L, H, V]
    o = _normalize_gate(o, None if g is None else g.to(acc), normalize, eps)
    return o.to(v.dtype)


def linear_attention_quadratic(q: Tensor, k: Tensor, v: Tensor, g: Tensor | None = None, *, causal: bool,
                               scale: float | None = None, normalize: bool = True, eps: float = 1e-5) -> Tensor:
    """The L x L form (Q K^T, masked when causal) V: quadratic memory, for checking the chunked reference only."""
    K = q.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qf, kf, vf = (t.to(acc).transpose(1, 2) for t in (q, k, v))
    A = (qf * scale) @ kf.transpose(-1, -2)  # [B, H, L, L]
    if causal:
        L = q.shape[1]
        A = A.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=q.device).tril(), 0.0)
    o = (A @ vf).transpose(1, 2)
    return _normalize_gate(o, None if g is None else g.to(acc), normalize, eps).to(v.dtype)
