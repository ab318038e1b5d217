"""Sparse Modular Activation: the latent configurator and compress / extract (SeqBoat, Ren et al. 2023,
arXiv 2306.11197, sections 3.2-3.3, appendix A.1 and A.4, Table 8).

The configurator turns state representations H [B, L, D] into, per module, a binary decision a (argmax, no gradient)
and a confidence c (the probability of that decision, zero where a = 0): the module's output is scaled by c, so the
router learns only through c. `compress` / `extract` are the paper's scatter / gather (Listings 1-2), defined once
in `longmixer.ops.sparse_local_attention.reference` (the op's oracle) and re-exported here for the layers.
"""

from __future__ import annotations

import math

import torch
from einops import rearrange
import torch.nn.functional as F
from torch import Tensor, nn

from longmixer.ops.sparse_local_attention.reference import compress_ref as compress
from longmixer.ops.sparse_local_attention.reference import extract_ref as extract

__all__ = ["ROUTERS", "LatentConfigurator", "attention_span", "compress", "extract", "gumbel_temperature"]

ROUTERS = ("softmax", "gumbel", "sigmoid", "moe")


def gumbel_temperature(step: int) -> float:
    """tau' = max(2 * 0.999995^T, 0.5) at training step T (SeqBoat A.4, after wav2vec 2.0)."""
    return max(2.0 * 0.999995 ** step, 0.5)


class LatentConfigurator(nn.Module):
    """Per-token, per-module activation decisions and confidences (SeqBoat section 3.3, A.4, Table 8).

    Routers:
        softmax: Tempered Softmax, p = softmax((H W + b) / tau) over {off, on}; tau = exp(theta) is learned, with
            theta initialised to log(init_temp_scale * sqrt(D)) (section 3.3; the official code learns log tau).
        gumbel: the A.4 ablation: Gumbel(0, 1) noise added to the logits and tau' annealed by
            `gumbel_temperature(step)` from `set_progress`; no noise in eval mode (our choice: deterministic eval).
        sigmoid: the -Sigmoid ablation: one logit per module, p_on = sigmoid(H w + b), no temperature (our
            reading: with a learned temperature it would equal the softmax router exactly, which the paper's
            different results rule out).
        moe: the -MoE ablation, X-MoE routing between the module and an always-zero module: cosine similarity
            of a low-dimensional projection of H with two learned expert embeddings, over a learned temperature
            (initialised to 0.07 as in X-MoE; dimension `moe_dim`); no load-balancing loss (Table 8 text).

    Args:
        d_model: D.
        num_modules: M modules, each with its own binary decision (2 for the -{GAU, FFN} ablation).
        router: one of ROUTERS.
        init_temp_scale: alpha of Table 4 (tau_0 = alpha sqrt(D)) for the softmax router.
        moe_dim: the routing dimension of the moe router.

    Returns (forward):
        active: [B, L, M] bool; padded tokens (mask False) are never active.
        confidence: [B, L, M] float32, max_i p_i where active, 0 elsewhere.
    """

    def __init__(self, d_model: int, *, num_modules: int = 1, router: str = "softmax", init_temp_scale: float = 1.0,
                 moe_dim: int = 16):
        super().__init__()
        if router not in ROUTERS:
            raise ValueError(f"router={router!r} is not one of {ROUTERS}")
        if init_temp_scale <= 0:
            raise ValueError(f"init_temp_scale={init_temp_scale} must be > 0 (Table 4 uses 0.3 to 1.0)")
        self.router, self.num_modules = router, num_modules
        # a tensor updated in place: a float attribute would be a constant of each compiled graph (a recompile per
        # step, and frozen in a replayed CUDA graph); not in checkpoints (`set_progress` sets it from the step). As a
        # buffer it is averaged by `callbacks=ema` with the weights (the averaged model is evaluated at the averaged
        # temperature, which lags the annealed one by the average's horizon: about 0.5% at decay 0.999)
        self.register_buffer("gumbel_tau", torch.tensor(gumbel_temperature(0)), persistent=False)
        if router == "moe":
            self.proj = nn.Linear(d_model, moe_dim, bias=False)
            self.experts = nn.Parameter(torch.empty(num_modules, 2, moe_dim))
            self.log_temp = nn.Parameter(torch.full((num_modules,), math.log(0.07)))
        else:
            self.proj = nn.Linear(d_model, num_modules * (1 if router == "sigmoid" else 2))
        if router == "softmax":  # only the Tempered Softmax learns its temperature
            self.log_temp = nn.Parameter(torch.full((num_modules,), math.log(init_temp_scale * math.sqrt(d_model))))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Truncated normal (+-2 std) with std 0.02 and zero bias, as every linear of the official code."""
        nn.init.trunc_normal_(self.proj.weight, std=0.02, a=-0.04, b=0.04)
        if self.proj.bias is not None:
            nn.init.zeros_(self.proj.bias)
        if self.router == "moe":
            nn.init.trunc_normal_(self.experts, std=0.02, a=-0.04, b=0.04)

    def set_progress(self, step: int, total_steps: int) -> None:
        """Anneal the Gumbel temperature (A.4); the schedule depends on the step only, not on total_steps."""
        self.gumbel_tau.fill_(gumbel_temperature(step))

    def probabilities(self, h: Tensor) -> Tensor:
        """p(on) and p(off) per module: [B, L, M, 2] float32 (index 1 = activate)."""
        if self.router == "moe":
            z = F.normalize(self.proj(h).float(), dim=-1)  # [B, L, E]
            e = F.normalize(self.experts.float(), dim=-1)  # [M, 2, E]
            logits = torch.einsum("ble,mke->blmk", z, e) / self.log_temp.exp()[:, None]
            return torch.softmax(logits, -1)
        logits = rearrange(self.proj(h).float(), "b l (m k) -> b l m k", m=self.num_modules)  # M modules, on/off
        if self.router == "sigmoid":
            p_on = torch.sigmoid(logits)
            return torch.cat([1.0 - p_on, p_on], -1)
        if self.router == "gumbel":
            if self.training:
                gumbel = -torch.empty_like(logits).exponential_().log()  # Gumbel(0, 1)
                logits = logits + gumbel
            return torch.softmax(logits / self.gumbel_tau, -1)
        return torch.softmax(logits / self.log_temp.exp()[:, None], -1)  # SeqBoat section 3.3

    def forward(self, h: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """h [B, L, D], mask [B, L] bool -> (active [B, L, M] bool, confidence [B, L, M] float32)."""
        p = self.probabilities(h)
        conf, choice = p.max(-1)  # a = argmax_i p_i, c = max_i p_i
        active = choice == 1
        if mask is not None:
            active = active & mask[..., None]
        return active, conf * active


def attention_span(idx: Tensor, count: Tensor, window: int | None, chunk_size: int | None, causal: bool) -> Tensor:
    """Mean distance, in original positions, from each activated query to the keys it can attend to, averaged
    over queries (SeqBoat section 5, Fig. 6), in O(L) with prefix sums; 0 when nothing is activated.

    Args:
        idx: [B, L] original position of each packed slot, the first count[b] valid and 0 after them (as
            `packed_index` gives); count: [B].
        window, chunk_size, causal: the attention pattern over the packed sequence (see `sparse_local_attention`).
    """
    bsz, length = idx.shape
    slot = torch.arange(length, device=idx.device).expand(bsz, -1)
    valid = slot < count[:, None]
    # idx is already 0 past each row's count, so the prefix sum reads no per-row value: on a GPU, Inductor splits a
    # scan this long over several programs (L > 8192 with few rows on an H100), and torch 2.11's split-scan codegen
    # fails on a per-row operand ("list indices must be integers or slices, not NoneType", pytorch#180221).
    pos = idx.double()  # [B, L]
    prefix = F.pad(pos.cumsum(-1), (1, 0))  # [B, L+1]
    last = (count[:, None].long() - 1).clamp(min=0)
    if window is not None:
        left, right = (window, 0) if causal else (window // 2, window // 2)
        lo, hi = (slot - left).clamp(min=0), torch.minimum(slot + right, last)
    elif chunk_size is not None:
        lo = slot // chunk_size * chunk_size
        hi = torch.minimum(lo + chunk_size - 1, last) if not causal else slot
    else:
        lo, hi = torch.zeros_like(slot), slot if causal else last.expand(-1, length)
    hi = torch.maximum(hi, slot)
    n_right, n_left = (hi - slot).double(), (slot - lo).double()
    right_sum = prefix.gather(1, hi + 1) - prefix.gather(1, slot + 1) - n_right * pos
    left_sum = n_left * pos - (prefix.gather(1, slot) - prefix.gather(1, lo))
    span = (right_sum + left_sum) / (n_right + n_left + 1)  # the query itself counts as distance 0
    total = valid.sum()
    return torch.where(total > 0, (span * valid).sum() / total.clamp(min=1), 0.0).float()
