"""CHELA: short-long convolutions with hardware-efficient linear attention (Liu et al., ICML 2024,
arXiv:2406.08128, section 4, eqs. 8-15)."""

from __future__ import annotations


import torch
from torch import Tensor, nn
from torch.nn import functional as F

from longmixer.layers.ema import MultiHeadEMA
from longmixer.layers.longconv import LongConv, ShortLongConv
from longmixer.layers.s4d import S4DConv
from longmixer.ops.linear_attention import linear_attention
from longmixer.ops.local_attention import laplace

ATTENTIONS = ("norm", "laplace")
CONVS = ("short_long", "long", "ema", "s4d")

def laplace_feature(x: Tensor) -> Tensor:
    """MEGA's laplace function 0.5 (1 + erf((x - mu) / (sigma sqrt 2))) (MEGA eq. 17), applied to q and k separately.

    CHELA Table 7 lists `laplace` as an attention function without saying how it stays linear. Applied to the
    score q.k (as MEGA does) it does not factor, so we apply it elementwise to Q and K as the feature map
    phi of kernelized linear attention, phi(q) (phi(K)^T V): positive features (like elu + 1 in Katharopoulos et
    al. 2020), linear in L, followed by the same output Norm as `norm`. The function and its constants live once,
    in `longmixer.ops.local_attention.laplace`.
    """
    return laplace(x)


class _DampedEMA(nn.Module):
    """Table 6 "damped EMA" structured mixer: MEGA's MD-EMA (layers/ema.py) with the mask-aware signature."""

    def __init__(self, d_model: int, ndim: int, *, causal: bool, backend: str):
        super().__init__()
        self.ema = MultiHeadEMA(d_model, ndim, bidirectional=not causal, silu=True, backend=backend)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.ema(x, mask)


class _MaskedLongConv(LongConv):
    """Table 6 "long conv": the long convolution alone, with padded inputs zeroed first."""

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        if mask is not None:
            x = x.masked_fill(~mask.unsqueeze(-1), 0.0)
        return super().forward(x)


class CHELA(nn.Module):
    """The CHELA layer (CHELA eqs. 8-15): Z = short-long conv of X, Q, K = scale/offset of Z, V = SiLU(X W_v + b),
    M = Norm(phi(Q) (phi(K)^T V)) * G_a, U = M * G_o + X (1 - G_o).

    Args:
        d_model: D.
        causal: causal convolutions and causal linear attention (language modeling).
        max_len: the training sequence length (short kernel size; the long kernel length unless `kernel_len`),
            ${data.seq_len}.
        kernel_len: long kernel taps per direction for conv=short_long | long (None: max_len, the paper's "as long
            as the sequence"). Language models set it to the longest training segment (k_max chunks); the SC10
            variant matched to the paper's 493K parameters uses 448.
        n_heads: Q, K, V are split into heads of width D / n_heads, each with its own K x V state and output Norm
            (the paper is silent; the Triton path needs D / n_heads <= 128).
        attention: "norm" (identity feature map, output Norm; CHELA eq. 2, 9) | "laplace" (see `laplace_feature`).
        conv: the structured mixer of Table 6: "short_long" (CHELA) | "long" (Fu et al. 2023) | "ema" (MEGA's damped
            EMA) | "s4d".
        ema_ndim: EMA dimension N when conv=ema; s4d_state: state size when conv=s4d.
        dropout: dropout on M before the gated residual (MEGA's output dropout).
        hidden_dropout: dropout on V (MEGA's hidden dropout).
        backend: auto | torch | triton for the linear attention op.
    """

    gated_residual = True

    def __init__(self, d_model: int, *, causal: bool = False, max_len: int, n_heads: int = 1,
                 attention: str = "norm", conv: str = "short_long", ema_ndim: int = 16, s4d_state: int = 64,
                 dropout: float = 0.0, hidden_dropout: float = 0.0, backend: str = "auto",
                 kernel_len: int | None = None):
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"model.mixer.attention={attention!r} is not one of {ATTENTIONS}")
        if conv not in CONVS:
            raise ValueError(f"model.mixer.conv={conv!r} is not one of {CONVS}")
        if n_heads < 1 or d_model % n_heads:
            raise ValueError(f"model.mixer.n_heads={n_heads} must divide model.d_model={d_model}")
        self.d_model, self.n_heads, self.causal = d_model, n_heads, causal
        self.attention, self.backend = attention, backend
        if kernel_len is not None and kernel_len < 1:
            raise ValueError(f"model.mixer.kernel_len={kernel_len} must be >= 1, or null for the sequence length")
        self.conv = self._build_conv(conv, d_model, max_len, causal, ema_ndim, s4d_state, backend, kernel_len)
        self.qk_weight = nn.Parameter(torch.empty(2, d_model))  # alpha_q, alpha_k (CHELA eqs. 11-12)
        self.qk_bias = nn.Parameter(torch.zeros(2, d_model))  # beta_q, beta_k
        self.v_proj = nn.Linear(d_model, d_model)  # CHELA eq. 13
        self.gate_proj = nn.Linear(d_model, 2 * d_model)  # G_a (eq. 10) and G_o (eq. 14), both from Z
        self.norm_weight = nn.Parameter(torch.ones(d_model))  # learned scale of Norm, folded into G_a
        self.dropout, self.hidden_dropout = nn.Dropout(dropout), nn.Dropout(hidden_dropout)
        self.reset_parameters()

    @staticmethod
    def _build_conv(conv, d_model, max_len, causal, ema_ndim, s4d_state, backend, kernel_len) -> nn.Module:
        if conv == "short_long":
            return ShortLongConv(d_model, max_len, causal=causal, kernel_len=kernel_len)
        if conv == "long":
            return _MaskedLongConv(d_model, max_len if kernel_len is None else kernel_len, bidirectional=not causal)
        if conv == "s4d":
            return S4DConv(d_model, s4d_state, bidirectional=not causal)
        return _DampedEMA(d_model, ema_ndim, causal=causal, backend=backend)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GAU / MEGA init of the per-dimension scale (N(0, 0.02)) and offset (0); xavier projections."""
        nn.init.normal_(self.qk_weight, mean=0.0, std=0.02)
        nn.init.zeros_(self.qk_bias)
        for lin in (self.v_proj, self.gate_proj):
            nn.init.xavier_uniform_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x: Tensor, mask: Tensor | None = None, residual: Tensor | None = None
                ) -> tuple[Tensor, dict[str, Tensor]]:
        """x [B, L, D] (normalized block input), mask [B, L] bool (True = real), residual [B, L, D] (the block
        input before its norm; x when None) -> (U [B, L, D], {})."""
        residual = x if residual is None else residual
        B, L, D = x.shape
        z = self.conv(x, mask)  # CHELA eq. 8, [B, L, D]
        q = z * self.qk_weight[0] + self.qk_bias[0]  # CHELA eq. 11
        k = z * self.qk_weight[1] + self.qk_bias[1]  # CHELA eq. 12
        if self.attention == "laplace":
            q, k = laplace_feature(q), laplace_feature(k)
        if mask is not None:  # padded keys add nothing to the K^T V state
            k = k.masked_fill(~mask.unsqueeze(-1), 0.0)
        v = self.hidden_dropout(F.silu(self.v_proj(x)))  # CHELA eq. 13
        g_a, g_o = self.gate_proj(z).chunk(2, dim=-1)
        g_a = F.silu(g_a) * self.norm_weight  # CHELA eq. 10 (W_g: the paper reuses the name W_v)
        g_o = torch.sigmoid(g_o)  # CHELA eq. 14
        heads = (B, L, self.n_heads, D // self.n_heads)
        m = linear_attention(q.reshape(heads), k.reshape(heads), v.reshape(heads), g_a.reshape(heads),
                             causal=self.causal, normalize=True, backend=self.backend).reshape(B, L, D)  # CHELA eq. 9
        u = self.dropout(m) * g_o + residual * (1.0 - g_o)  # CHELA eq. 15
        return u, {}
