"""Adaptive input embeddings (Baevski & Auli 2019) and the adaptive softmax (Grave et al. 2017) for word-level LM.

The vocabulary, sorted by training frequency, is cut into bands at `cutoffs`: band 0 holds the `cutoffs[0]` most
frequent words, band b holds the words in [cutoffs[b-1], cutoffs[b]), the last band runs to `vocab_size`. Band b
uses width d_b = d_model // factor**b (Baevski & Auli section 3; MEGA WikiText-103: cutoffs 20000, 60000, factor 4,
models.md section 1.8; Transformer-XL: 20000, 40000, 200000).

- `AdaptiveInput`: token -> E_b[token - lo_b] @ P_b^T, with E_b [size_b, d_b] ~ N(0, d_b^-0.5) and P_b [D, d_b]
  (xavier), as fairseq's AdaptiveInput; `scale_embedding` multiplies by sqrt(D) (MEGA's embed scale).
- `AdaptiveSoftmax`: a head softmax over band 0's words plus one "cluster" logit per tail band; a word of band b >= 1
  has log p = log p_head(cluster b) + log p_b(word), with p_b = softmax((dropout(h Q_b^T)) E_b^T), Q_b [d_b, D].
  `tie_weights` shares E_b with the adaptive input; `tie_projections` shares Q_b = P_b^T for the tail bands
  (Baevski & Auli section 4.3; MEGA ties both).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

IGNORE_INDEX = -100


def _bands(vocab_size: int, cutoffs: list[int] | tuple[int, ...], key: str) -> list[tuple[int, int]]:
    cuts = [int(c) for c in cutoffs]
    if any(b <= a for a, b in zip([0] + cuts, cuts)) or (cuts and cuts[-1] >= vocab_size):
        raise ValueError(f"{key}.cutoffs={cuts} must be increasing, positive and below vocab_size={vocab_size} "
                         "(e.g. [20000, 60000] for WikiText-103)")
    edges = [0] + cuts + [vocab_size]
    return list(zip(edges[:-1], edges[1:]))


def _band_dims(d_model: int, n_bands: int, factor: float, key: str) -> list[int]:
    dims = [int(d_model // (factor ** b)) for b in range(n_bands)]
    if factor < 1 or dims[-1] < 1:
        raise ValueError(f"{key}.factor={factor} with d_model={d_model} and {n_bands} bands gives widths {dims}; "
                         "need factor >= 1 and every width >= 1")
    return dims


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax in at least float32 (half-precision logits over a large band lose too much)."""
    return F.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))


class AdaptiveInput(nn.Module):
    """Adaptive input embedding: tokens [B, L] -> [B, L, D].

    Args:
        d_model: output width D.
        vocab_size: V (ids sorted by training frequency).
        cutoffs: band boundaries, e.g. [20000, 60000].
        factor: band b has width D // factor**b.
        padding_idx: this id embeds to zero (None: no padding id).
        scale_embedding: multiply the output by sqrt(D) (fairseq's embed scale, used by MEGA).
    """

    # its gathers have data-dependent sizes (`nonzero`): no CUDA-graph capture (`task.compile=step-graph` refuses it)
    cuda_graph_capturable = False

    def __init__(self, d_model: int, vocab_size: int, cutoffs: list[int], factor: float = 4.0,
                 padding_idx: int | None = 0, scale_embedding: bool = False):
        super().__init__()
        self.d_model, self.vocab_size, self.padding_idx = d_model, vocab_size, padding_idx
        self.bands = _bands(vocab_size, cutoffs, "model.embedding")
        self.dims = _band_dims(d_model, len(self.bands), factor, "model.embedding")
        self.scale = d_model ** 0.5 if scale_embedding else 1.0
        self.weights = nn.ParameterList()
        self.projections = nn.ParameterList()
        for (lo, hi), d_b in zip(self.bands, self.dims):
            weight = nn.Parameter(torch.randn(hi - lo, d_b) * d_b ** -0.5)
            projection = nn.Parameter(torch.empty(d_model, d_b))
            nn.init.xavier_uniform_(projection)
            self.weights.append(weight)
            self.projections.append(projection)
        if padding_idx is not None:
            band = self.band_of(padding_idx)
            with torch.no_grad():
                self.weights[band][padding_idx - self.bands[band][0]].zero_()

    def band_of(self, token: int) -> int:
        for b, (lo, hi) in enumerate(self.bands):
            if lo <= token < hi:
                return b
        raise ValueError(f"token id {token} is outside the vocabulary [0, {self.vocab_size})")

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        flat = tokens.reshape(-1)
        out = torch.zeros(flat.shape[0], self.d_model, dtype=self.projections[0].dtype, device=tokens.device)
        for (lo, hi), weight, projection in zip(self.bands, self.weights, self.projections):
            idx = ((flat >= lo) & (flat < hi)).nonzero(as_tuple=True)[0]
            if idx.numel() == 0:
                continue
            pad = self.padding_idx - lo if self.padding_idx is not None and lo <= self.padding_idx < hi else None
            emb = F.embedding(flat[idx] - lo, weight, padding_idx=pad)  # [n, d_b]
            out = out.index_copy(0, idx, F.linear(emb, projection).to(out.dtype))  # [n, D]
        return (out * self.scale).view(*tokens.shape, self.d_model)


class AdaptiveSoftmax(nn.Module):
    """Adaptive softmax head: h [B, L, D] -> per-token NLL (`loss`) or full log-probabilities (`forward`).

    Called by `SequenceModel` as `head(d_model=..., embedding=<embedding module>)`.

    Args:
        d_model: input width D.
        vocab_size: V; must equal the tied embedding's.
        cutoffs, factor: as `AdaptiveInput` (must match it when tied).
        dropout: dropout on the tail projections (MEGA / fairseq `adaptive_softmax_dropout`, 0.2 on WikiText-103).
        tie_weights: share the word embeddings E_b with the `AdaptiveInput`.
        tie_projections: also share the tail projections (Q_b = P_b^T for b >= 1).
        embedding: the model's input embedding (needed when tying).
    """

    # data-dependent row selections and a host check of the targets: no CUDA-graph capture (see AdaptiveInput)
    cuda_graph_capturable = False

    def __init__(self, d_model: int, vocab_size: int, cutoffs: list[int], factor: float = 4.0, dropout: float = 0.0,
                 tie_weights: bool = False, tie_projections: bool = False, embedding: nn.Module | None = None):
        super().__init__()
        self.vocab_size = vocab_size
        self.bands = _bands(vocab_size, cutoffs, "model.head")
        self.dims = _band_dims(d_model, len(self.bands), factor, "model.head")
        if tie_projections and not tie_weights:
            raise ValueError("model.head.tie_projections=true needs model.head.tie_weights=true")
        # the embedding stays a child of the model only (not of this head), so its weights are saved and counted once
        object.__setattr__(self, "tied", embedding if tie_weights else None)
        self.tie_projections = tie_projections
        if tie_weights:
            if not isinstance(embedding, AdaptiveInput):
                raise ValueError(f"model.head.tie_weights=true needs model.embedding to be an AdaptiveInput, got "
                                 f"{type(embedding).__name__}")
            if embedding.bands != self.bands or embedding.dims != self.dims:
                raise ValueError(f"model.head (bands {self.bands}, widths {self.dims}) must match model.embedding "
                                 f"(bands {embedding.bands}, widths {embedding.dims}) to tie; use the same cutoffs, "
                                 "factor and vocab_size")
        n_tail = len(self.bands) - 1
        size0 = self.bands[0][1]
        self.cluster = nn.Parameter(torch.randn(n_tail, d_model) * d_model ** -0.5)  # [n_tail, D]
        self.head_weight = None if tie_weights else nn.Parameter(torch.randn(size0, d_model) * d_model ** -0.5)
        self.tail_weights = nn.ParameterList()
        self.tail_projections = nn.ParameterList()
        for (lo, hi), d_b in list(zip(self.bands, self.dims))[1:]:
            if not tie_weights:
                self.tail_weights.append(nn.Parameter(torch.randn(hi - lo, d_b) * d_b ** -0.5))
            if not tie_projections:
                projection = nn.Parameter(torch.empty(d_b, d_model))
                nn.init.xavier_uniform_(projection)
                self.tail_projections.append(projection)
        self.dropout = nn.Dropout(dropout)

    def _word_weight(self, band: int) -> torch.Tensor:
        if self.tied is not None:
            return self.tied.weights[band]
        return self.head_weight if band == 0 else self.tail_weights[band - 1]

    def _projection(self, band: int) -> torch.Tensor:  # [d_b, D]
        if self.tie_projections:
            return self.tied.projections[band].t()
        return self.tail_projections[band - 1]

    def _head_logprobs(self, h: torch.Tensor) -> torch.Tensor:
        weight = torch.cat([self._word_weight(0), self.cluster], dim=0)  # [size0 + n_tail, D]
        return _log_softmax(F.linear(h, weight))

    def _tail_logprobs(self, h: torch.Tensor, band: int) -> torch.Tensor:
        z = self.dropout(F.linear(h, self._projection(band)))  # [n, d_b]
        return _log_softmax(F.linear(z, self._word_weight(band)))  # [n, size_b]

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """h [B, L, D], targets [B, L] (-100 = not scored) -> per-token NLL [B, L] in nats (0 where not scored)."""
        flat_h = h.reshape(-1, h.shape[-1])
        flat_t = targets.reshape(-1)
        nll = torch.zeros(flat_t.shape[0], dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
        scored = (flat_t != IGNORE_INDEX).nonzero(as_tuple=True)[0]
        if scored.numel() == 0:
            return nll.view(targets.shape)
        hs, ts = flat_h[scored], flat_t[scored]
        if bool(((ts < 0) | (ts >= self.vocab_size)).any()):
            raise ValueError(f"targets must be in [0, {self.vocab_size}) or -100")
        head = self._head_logprobs(hs)  # [n, size0 + n_tail]
        size0 = self.bands[0][1]
        # the head position of each target: the word itself in band 0, the band's cluster logit otherwise
        band_idx = torch.bucketize(ts, torch.tensor([hi for _, hi in self.bands[:-1]], device=ts.device), right=True)
        head_pos = torch.where(band_idx == 0, ts, size0 + band_idx - 1)
        out = -head.gather(1, head_pos.unsqueeze(1)).squeeze(1)
        for band in range(1, len(self.bands)):
            rows = (band_idx == band).nonzero(as_tuple=True)[0]
            if rows.numel() == 0:
                continue
            tail = self._tail_logprobs(hs[rows], band)
            word = ts[rows] - self.bands[band][0]
            out = out.index_add(0, rows, -tail.gather(1, word.unsqueeze(1)).squeeze(1))
        return nll.index_copy(0, scored, out).view(targets.shape)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [..., D] -> log-probabilities [..., V] over the whole vocabulary (for sampling and tests)."""
        head = self._head_logprobs(h)
        size0 = self.bands[0][1]
        parts = [head[..., :size0]]
        for band in range(1, len(self.bands)):
            parts.append(head[..., size0 + band - 1:size0 + band] + self._tail_logprobs(h, band))
        return torch.cat(parts, dim=-1)
