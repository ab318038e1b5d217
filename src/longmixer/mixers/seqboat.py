"""SeqBoat: an SSM whose state representations sparsely activate a Gated Attention Unit with working memory
(Ren et al., "Sparse Modular Activation for Efficient Sequence Modeling", arXiv 2306.11197, section 3.3, A.2).

Layer (Fig. 1), with the official code's choices (renll/SeqBoat `seqboat_unit.py`, see shared/research/models.md
section 2): H = SiLU(EMA(S) + omega S) (eq. 2; SiLU outside the EMA); z, r, v = SiLU(H W + b) split (V and the gate
come from H, eqs. 5 and 7); q, k = z * gamma + beta (eqs. 3-4); the latent configurator picks the tokens a and
confidences c; O = attention over the packed activated tokens in a sliding window of w slots (eq. 6); Y = (r * O)
W_h + b_h (eq. 8), zero where a = 0; S' = SiLU(c * Y + H W + b + S) (section 3.3; the residual inside the SiLU,
no update gate, no FFN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longmixer.layers.ema import MultiHeadEMA
from longmixer.layers.gau import rope
from longmixer.layers.s4d import S4DConv
from longmixer.layers.sma import LatentConfigurator, attention_span, compress, extract
from longmixer.ops.sparse_local_attention import packed_index, packing_capacity, sparse_local_attention
from longmixer.ops.sparse_local_attention.reference import attention_reach

ROUTERS = ("softmax", "gumbel", "sigmoid", "moe", "always")
REL_POS = ("original", "compressed", "rotary", "none")


def _trunc_normal_(w: Tensor, std: float = 0.02) -> Tensor:
    """The official code's init: normal with std 0.02 truncated at +-2 std."""
    return nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std)


def rotary(x: Tensor, base: float = 10000.0) -> Tensor:
    """RoPE (Su et al. 2021) at the original positions 0..L-1, half-split rotation: [B, L, K] -> [B, L, K].

    Applied before compression, so packed tokens keep the phases of their original positions (SeqBoat A.2).
    """
    return rope(x, torch.arange(x.shape[1], device=x.device), base)


class SeqBoat(nn.Module):
    """The SeqBoat layer (SeqBoat-full with `window=None`); ablations of Tables 7-8 are flags.

    Args:
        d_model: D (d_m).
        causal: causal EMA, causal attention over the packed sequence (LM).
        d_qk: d_z, the query/key width.
        d_v: d_v, the value and gate width (None: 2D, as the paper).
        ndim: EMA dimension h (16).
        ssm: "ema" (MD-EMA) or "s4d" (the S4D-kernel ablation of Table 7).
        truncation: EMA kernel length cap (None: full length).
        window: working memory w (A.5: 256, Path-X 512, LM 1024); None attends over the whole packed sequence
            (SeqBoat-full).
        chunk_size: the -chunk ablation: attention inside packed chunks of this size (use with router="always",
            window=None).
        attention: "softmax" (text tasks, LM) or "relu2" (image, speech), SeqBoat A.2.
        rel_pos: "original" (simple relative bias on original distances, the default), "compressed" (on packed
            distances: Text, SC), "rotary" (RoPE at original positions: LM), or "none".
        max_len: the longest sequence (${data.seq_len}); bounds the bias table [2M-1] (distances beyond M-1 use the
            edge value). With "compressed" and a window (or chunk) the table is sized from the offsets the window
            can reach instead (M = reach + 1, or the chunk), so no entry is unreachable; "original" and SeqBoat-full
            need the sequence length, since packed neighbours can be far apart originally.
        router: "softmax" (Tempered Softmax) | "gumbel" | "sigmoid" | "moe" | "always" (no SMA: every real token
            activated, confidence 1: the always-activated / -local / -chunk ablations).
        init_temp_scale: alpha of Table 4.
        modules: "gau" or "gau_ffn" (the -{GAU, FFN} ablation: an FFN module of width d_v with its own decision).
        dropout: dropout on H and on the combined branch before the final SiLU (Table 4 DP).
        hidden_dropout: dropout on V.
        backend: "auto" | "torch" | "triton" for the EMA and the attention ops.
    """

    gated_residual = True

    def __init__(self, d_model: int, *, causal: bool = False, d_qk: int = 64, d_v: int | None = None, ndim: int = 16,
                 ssm: str = "ema", truncation: int | None = None, window: int | None = 256, chunk_size: int | None = None,
                 attention: str = "softmax", rel_pos: str = "original", max_len: int | None = None,
                 router: str = "softmax", init_temp_scale: float = 1.0, modules: str = "gau", dropout: float = 0.0,
                 hidden_dropout: float = 0.0, backend: str = "auto"):
        super().__init__()
        if ssm not in ("ema", "s4d"):
            raise ValueError(f"ssm={ssm!r} is not one of ('ema', 's4d')")
        if router not in ROUTERS:
            raise ValueError(f"router={router!r} is not one of {ROUTERS}")
        if rel_pos not in REL_POS:
            raise ValueError(f"rel_pos={rel_pos!r} is not one of {REL_POS}")
        if modules not in ("gau", "gau_ffn"):
            raise ValueError(f"modules={modules!r} is not one of ('gau', 'gau_ffn')")
        if attention not in ("softmax", "relu2"):
            raise ValueError(f"attention={attention!r} is not one of ('softmax', 'relu2')")
        if window is not None and chunk_size is not None:
            raise ValueError(f"window={window} and chunk_size={chunk_size} exclude each other; set window=null for "
                             "-chunk")
        bias_positions = self._bias_positions(rel_pos, window, chunk_size, causal, max_len)
        if rel_pos in ("original", "compressed") and not bias_positions:
            raise ValueError(f"rel_pos={rel_pos!r} needs max_len (the bias table size, e.g. ${{data.seq_len}}); "
                             f"got {max_len}")
        if modules == "gau_ffn" and router == "always":
            raise ValueError("modules='gau_ffn' needs a router that decides per module; router='always' has none")
        self.d_model, self.d_qk, self.d_v = d_model, d_qk, d_v or 2 * d_model
        self.causal, self.window, self.chunk_size, self.attention = causal, window, chunk_size, attention
        self.rel_pos, self.router_kind, self.modules, self.backend = rel_pos, router, modules, backend
        if ssm == "ema":
            self.ssm = MultiHeadEMA(d_model, ndim, bidirectional=not causal, truncation=truncation, silu=False,
                                    backend=backend)
        else:
            self.ssm = S4DConv(d_model, bidirectional=not causal)
        self.mx_proj = nn.Linear(d_model, d_qk + 2 * self.d_v)  # z, r (gate, eq. 7), v (eq. 5)
        self.hx_proj = nn.Linear(d_model, d_model)  # H W + b of the aggregation
        self.h_proj = nn.Linear(self.d_v, d_model)  # W_h, b_h of eq. 8
        self.gamma = nn.Parameter(torch.empty(2, d_qk))  # w_q, w_k of eqs. 3-4
        self.beta = nn.Parameter(torch.empty(2, d_qk))  # b_q, b_k
        self.rel_bias = nn.Parameter(torch.empty(2 * bias_positions - 1)) \
            if rel_pos in ("original", "compressed") else None
        num_modules = 2 if modules == "gau_ffn" else 1
        self.configurator = None if router == "always" else LatentConfigurator(
            d_model, num_modules=num_modules, router=router, init_temp_scale=init_temp_scale)
        if modules == "gau_ffn":  # MEGA's FFN shape: fc2(SiLU(fc1(x))), width d_v
            self.ffn = nn.Sequential(nn.Linear(d_model, self.d_v), nn.SiLU(), nn.Linear(self.d_v, d_model))
        self.dropout, self.hidden_dropout = nn.Dropout(dropout), nn.Dropout(hidden_dropout)
        self.reset_parameters()

    @staticmethod
    def _bias_positions(rel_pos: str, window: int | None, chunk: int | None, causal: bool,
                        max_len: int | None) -> int | None:
        """M of the relative bias table: one entry per offset that can occur. Compressed offsets are bounded by
        the window reach (|j - i| <= w/2 two-sided, w causal) or the chunk; original ones only by the sequence."""
        if rel_pos != "compressed" or (window is None and chunk is None):
            return max_len
        reach = max(attention_reach(window, causal)) + 1 if window is not None else chunk
        return reach if not max_len else min(reach, max_len)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Official init: linears and gamma truncated-normal std 0.02, biases and beta zero, rel bias std 0.02."""
        linears = [self.mx_proj, self.hx_proj, self.h_proj] + ([self.ffn[0], self.ffn[2]] if hasattr(self, "ffn")
                                                               else [])
        for lin in linears:
            _trunc_normal_(lin.weight)
            nn.init.zeros_(lin.bias)
        _trunc_normal_(self.gamma)
        nn.init.zeros_(self.beta)
        if self.rel_bias is not None:
            _trunc_normal_(self.rel_bias)

    def decide(self, h: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """Activation decisions [B, L, M] bool and confidences [B, L, M] (SeqBoat section 3.3)."""
        if self.configurator is None:
            active = torch.ones(h.shape[:2], dtype=torch.bool, device=h.device) if mask is None else mask
            return active[..., None], active[..., None].to(h.dtype)
        return self.configurator(h, mask)

    def gau(self, h: Tensor, active: Tensor) -> Tensor:
        """The GAU on the activated tokens only: Y of eq. 8, [B, L, D], zero (up to b_h) where inactive."""
        z, r, v = F.silu(self.mx_proj(h)).split([self.d_qk, self.d_v, self.d_v], dim=-1)
        q = z * self.gamma[0] + self.beta[0]  # eq. 3
        k = z * self.gamma[1] + self.beta[1]  # eq. 4
        if self.rel_pos == "rotary":
            q, k = rotary(q), rotary(k)
        rel_pos = "compressed" if self.rel_pos == "compressed" else "original"
        o = sparse_local_attention(q, k, self.hidden_dropout(v), active, self.rel_bias, window=self.window,
                                   chunk=self.chunk_size, causal=self.causal, attention=self.attention, rel_pos=rel_pos,
                                   backend=self.backend)  # eq. 6
        return self.h_proj(r * o)  # eq. 8

    def forward(self, x: Tensor, mask: Tensor | None = None, residual: Tensor | None = None):
        """x [B, L, D] (normalised when pre-norm), mask [B, L] bool, residual [B, L, D] the block input
        -> (S^{l+1} [B, L, D], aux with stats/act_rate, stats/attn_span)."""
        residual = x if residual is None else residual
        h = self.dropout(F.silu(self.ssm(x, mask)))  # eq. 2
        active, conf = self.decide(h, mask)
        out = self.hx_proj(h) + conf[..., :1].to(h.dtype) * self.gau(h, active[..., 0])  # c * Y + H W + b
        if self.modules == "gau_ffn":  # the second module runs on its own packed tokens (Fig. 2)
            hc, _, _ = compress(h, active[..., 1], packing_capacity(active[..., 1]))
            out = out + conf[..., 1:].to(h.dtype) * extract(self.ffn(hc), active[..., 1])
        out = F.silu(self.dropout(out) + residual)  # section 3.3: S^{l+1} = SiLU(c*Y + HW + b + S^l)
        return out, self.statistics(active, mask)

    @torch.no_grad()
    def statistics(self, active: Tensor, mask: Tensor | None) -> dict[str, Tensor]:
        """Fraction of real tokens that activate the GAU (Fig. 3) and the mean attention span (Fig. 6)."""
        real = active.new_ones(active.shape[:2]) if mask is None else mask
        stats = {"stats/act_rate": active[..., 0].sum() / real.sum().clamp(min=1)}
        idx, count = packed_index(active[..., 0])
        stats["stats/attn_span"] = attention_span(idx, count, self.window, self.chunk_size, self.causal)
        if self.modules == "gau_ffn":
            stats["stats/act_rate_ffn"] = active[..., 1].sum() / real.sum().clamp(min=1)
        return {key: value.float() for key, value in stats.items()}

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_qk={self.d_qk}, d_v={self.d_v}, window={self.window}, "
                f"chunk_size={self.chunk_size}, attention={self.attention}, rel_pos={self.rel_pos}, router={self.router_kind}, "
                f"modules={self.modules}, causal={self.causal}")
