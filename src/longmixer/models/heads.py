"""Output heads: sequence classifier (MEGA's LRA classifier), NLI fusion for two-document retrieval, LM logits."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


CLASSIFIER_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu}


class ClassifierHead(nn.Module):
    """Linear(D, H) -> dropout -> activation -> Linear(H, classes, bias=False); the hidden layer xavier-initialised
    and the dropout placed before the activation, as MEGA's LRA classifier (models.md section 1.7). The activation is
    GELU (MEGA's) or ReLU (the LRA paper's `classifier_head`, which its Transformer baselines use)."""

    def __init__(self, d_in: int, num_classes: int, d_hidden: int | None = None, dropout: float = 0.0,
                 activation: str = "gelu"):
        super().__init__()
        if activation not in CLASSIFIER_ACTIVATIONS:
            raise ValueError(f"model.classifier_activation={activation!r} is not one of "
                             f"{sorted(CLASSIFIER_ACTIVATIONS)}")
        self.activation = CLASSIFIER_ACTIVATIONS[activation]
        d_hidden = d_hidden or d_in
        self.hidden = nn.Linear(d_in, d_hidden)
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(d_hidden, num_classes, bias=False)
        nn.init.xavier_uniform_(self.hidden.weight)
        nn.init.zeros_(self.hidden.bias)

    def forward(self, x):
        return self.out(self.activation(self.dropout(self.hidden(x))))


class NLIHead(nn.Module):
    """Two pooled documents u, v -> classifier over [u, v, u*v, u-v] (LRA retrieval, frameworks.md section 2.3),
    or over [u, v] alone (`fusion="concat"`, the head of MEGA's official AAN model)."""

    def __init__(self, d_model: int, num_classes: int, d_hidden: int | None = None, fusion: str = "nli",
                 dropout: float = 0.0, activation: str = "gelu"):
        super().__init__()
        if fusion not in ("nli", "concat"):
            raise ValueError(f"NLI fusion={fusion!r} is not one of ['nli', 'concat']")
        self.fusion = fusion
        width = 4 * d_model if fusion == "nli" else 2 * d_model
        self.classifier = ClassifierHead(width, num_classes, d_hidden or d_model, dropout, activation)

    def forward(self, u, v):
        features = [u, v, u * v, u - v] if self.fusion == "nli" else [u, v]
        return self.classifier(torch.cat(features, dim=-1))


class LMHead(nn.Module):
    """Per-token vocabulary logits; `tied` shares the token embedding's weight."""

    def __init__(self, d_model: int, vocab_size: int, embedding: nn.Module | None = None, tied: bool = False):
        super().__init__()
        if tied:
            if not isinstance(embedding, nn.Embedding):
                raise ValueError("head=lm_tied needs a token embedding (model.embedding=token)")
            self.weight = embedding.weight
        else:
            self.weight = nn.Parameter(torch.randn(vocab_size, d_model) * d_model ** -0.5)

    def forward(self, h):
        return F.linear(h, self.weight)  # [B, L, V]
