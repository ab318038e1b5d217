"""LongVQ: gated SSM-attention hybrid with vector-quantized keys and linear-time attention (Liu et al. 2024,
"LongVQ: Long Sequence Modeling with Vector Quantization on Structured Memory", arXiv:2404.11163, section 4,
eqs. 9-22). The blockwise attention with a codebook cache follows Transformer-VQ (Lingle 2023, arXiv:2309.16354).

Q and K are two linear maps of Z, as eqs. 11-12 write them (`tied_qk=True` gives MEGA's form instead: one
projection of Z with a per-dimension scale and offset for each, which is what reproduces the paper's reported
parameter counts). Where the paper is silent we follow MEGA (arXiv:2209.10655), whose block LongVQ builds on and
whose recipes it compares against: a single head; the output projection O_a = SiLU(W_hx Z + W_h (G_a * Attn))
from H back to D (eq. 14 leaves the H -> D map open); N(0, 0.02) weights; softmax logits scaled by E^-1/2,
laplace logits divided by the number of keys. Local bias (eq. 18): MEGA's simple relative-position table over the
window, a query's own block and its neighbours (b-1, b, b+1; causal: b-1, b); everything outside the window is
seen through the codebook summary.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from longmixer.layers.ema import MultiHeadEMA
from longmixer.layers.vq import VectorQuantizer
from longmixer.ops.vq_attention import vq_attention, window_bias
from longmixer.ops.vq_attention.reference import ATTENTIONS


class LongVQ(nn.Module):
    """The LongVQ layer (eqs. 9-20); the block's post-norm and FFN (eqs. 21-22) are `SequenceModel` options.

    Args:
        d_model: D (given by the backbone).
        causal: causal MD-EMA and causal attention with Transformer-VQ's blockwise cache (language modeling);
            False: bidirectional EMA and attention (classification).
        zdim: E, the query/key width (MEGA's zdim).
        hdim: H, the value width; None: 2D (MEGA).
        ndim: N, the MD-EMA dimension.
        n_codes: S, the codebook size (LongVQ section 5: 512; Table 6: 256 / 1024).
        chunk_size: C, the local window block, a power of two >= 16.
        attention: "softmax" (default) | "laplace" (Table 6).
        truncation: MD-EMA kernel length cap (MEGA recipes), or None.
        commit_coef: gamma of eq. 23 (1e-4).
        codebook_decay: EMA rate of the codebook statistics (0.99).
        dropout: on the layer output before the gated residual (MEGA's dropout).
        hidden_dropout: on the EMA output Z and on V (MEGA's hidden dropout).
        backend: "auto" | "torch" | "triton" for the MD-EMA, the codeword search and the attention.
        tied_qk: False: Q = Linear(Z) and K = Linear(Z), two maps (eqs. 11-12). True: MEGA's shared projection
            with per-dimension scale / offset (E (D - 3) parameters fewer per layer).
    """

    gated_residual = True

    def __init__(self, d_model: int, *, causal: bool = False, zdim: int = 64, hdim: int | None = None,
                 ndim: int = 16, n_codes: int = 512, chunk_size: int = 128, attention: str = "softmax",
                 truncation: int | None = None, commit_coef: float = 1e-4, codebook_decay: float = 0.99,
                 dropout: float = 0.0, hidden_dropout: float = 0.0, backend: str = "auto", tied_qk: bool = False):
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"model.mixer.attention={attention!r} is not one of {ATTENTIONS}")
        if chunk_size < 16 or chunk_size & (chunk_size - 1):
            raise ValueError(f"model.mixer.chunk_size={chunk_size} must be a power of two >= 16 (e.g. 128)")
        hdim = 2 * d_model if hdim is None else hdim
        self.causal, self.zdim, self.hdim, self.chunk_size = causal, zdim, hdim, chunk_size
        self.attention, self.backend, self.tied_qk = attention, backend, tied_qk
        self.ema = MultiHeadEMA(d_model, ndim, bidirectional=not causal, truncation=truncation, silu=True,
                                backend=backend)
        self.v_proj = nn.Linear(d_model, hdim)  # eq. 13
        self.z_proj = nn.Linear(d_model, hdim + (zdim if tied_qk else 0) + d_model)  # eq. 10 and MEGA's hx
        self.h_proj = nn.Linear(hdim, d_model)  # eq. 14, H -> D
        self.gate_proj = nn.Linear(d_model, d_model)  # eq. 19
        if tied_qk:
            self.qk_gamma = nn.Parameter(torch.empty(2, zdim))  # per-dimension scale of Q and K
            self.qk_beta = nn.Parameter(torch.empty(2, zdim))  # and offset
        else:
            self.q_proj = nn.Linear(d_model, zdim)  # eq. 11
            self.k_proj = nn.Linear(d_model, zdim)  # eq. 12
        self.rel_bias = nn.Parameter(torch.empty(4 * chunk_size - 1))  # key - query offsets -(2C-1)..(2C-1)
        self.vq = VectorQuantizer(zdim, n_codes, decay=codebook_decay, commit_coef=commit_coef, backend=backend)
        self.dropout, self.hidden_dropout = nn.Dropout(dropout), nn.Dropout(hidden_dropout)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """MEGA's init: linear weights (and qk_gamma) ~ N(0, 0.02), biases (and qk_beta) 0, rel bias ~ N(0, 0.02)."""
        qk = [] if self.tied_qk else [self.q_proj, self.k_proj]
        for lin in (self.v_proj, self.z_proj, self.h_proj, self.gate_proj, *qk):
            nn.init.normal_(lin.weight, std=0.02)
            nn.init.zeros_(lin.bias)
        if self.tied_qk:
            nn.init.normal_(self.qk_gamma, std=0.02)
            nn.init.zeros_(self.qk_beta)
        nn.init.normal_(self.rel_bias, std=0.02)

    def _query_scale(self, mask: torch.Tensor | None, B: int, L: int, device) -> torch.Tensor | float:
        """Softmax: E^-1/2. Laplace: 1 / number of keys the query sees (MEGA's element attention)."""
        if self.attention == "softmax":
            return self.zdim ** -0.5
        real = torch.ones(B, L, device=device) if mask is None else mask.float()
        n_keys = real.cumsum(1) if self.causal else real.sum(1, keepdim=True).expand(B, L)
        return (1.0 / n_keys.clamp_min(1.0))[..., None]  # [B, L, 1]

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, residual: torch.Tensor | None = None):
        """x [B, L, D] (normalized when pre-norm), mask [B, L] bool, residual [B, L, D] -> (y [B, L, D], aux)."""
        residual = x if residual is None else residual
        B, L, _ = x.shape
        z = self.hidden_dropout(self.ema(x, mask))  # eq. 9: Z = SiLU(SSM(X))  [B, L, D]
        if self.tied_qk:
            g_a, base, hx = self.z_proj(z).split([self.hdim, self.zdim, x.shape[-1]], dim=-1)
            q = base * self.qk_gamma[0] + self.qk_beta[0]  # eq. 11, MEGA's form  [B, L, E]
            k = base * self.qk_gamma[1] + self.qk_beta[1]  # eq. 12  [B, L, E]
        else:
            g_a, hx = self.z_proj(z).split([self.hdim, x.shape[-1]], dim=-1)
            q, k = self.q_proj(z), self.k_proj(z)  # eqs. 11-12  [B, L, E]
        g_a = F.silu(g_a)  # eq. 10  [B, L, H]
        v = self.hidden_dropout(F.silu(self.v_proj(x)))  # eq. 13  [B, L, H]
        k_hat, codes, codebook, aux = self.vq(k, mask)  # eq. 15, straight-through
        q = q * self._query_scale(mask, B, L, x.device)
        bias = window_bias(self.rel_bias, self.chunk_size)  # eq. 18 local bias  [C, 3C]
        attn = vq_attention(q, k_hat, v, codebook, codes, mask, bias, block_size=self.chunk_size,
                            causal=self.causal, attention=self.attention, backend=self.backend)  # eqs. 16-18
        o_a = F.silu(hx + self.h_proj(g_a * attn))  # eq. 14 with MEGA's H -> D projection  [B, L, D]
        g_o = torch.sigmoid(self.gate_proj(x))  # eq. 19
        y = residual + g_o * (self.dropout(o_a) - residual)  # eq. 20: G_o * O_a + (1 - G_o) * X
        return y, aux
