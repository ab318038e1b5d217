"""One residual block: norm -> mixer -> residual (or the mixer's own gated residual) -> optional normalized FFN."""

from __future__ import annotations

from torch import nn
from torch.nn import functional as F

from longmixer.layers.norms import build_norm

ACTIVATIONS = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu}


class FeedForward(nn.Module):
    """The FFN sublayer with its own norm, pre- or post-norm (MEGA's NormalizedFeedForwardNetwork)."""

    def __init__(self, d_model: int, d_ffn: int, norm: str, prenorm: bool, activation: str, dropout: float,
                 hidden_dropout: float, init_std: float | None = None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"model.ffn_activation={activation!r} is not one of {sorted(ACTIVATIONS)}")
        self.norm = build_norm(norm, d_model)
        self.prenorm = prenorm
        self.fc1, self.fc2 = nn.Linear(d_model, d_ffn), nn.Linear(d_ffn, d_model)
        self.act = ACTIVATIONS[activation]
        self.dropout, self.hidden_dropout = nn.Dropout(dropout), nn.Dropout(hidden_dropout)
        if init_std is not None:  # MEGA's NormalizedFeedForwardNetwork: N(0, 0.02) weights, zero biases
            for fc in (self.fc1, self.fc2):
                nn.init.normal_(fc.weight, mean=0.0, std=init_std)
                nn.init.zeros_(fc.bias)

    def forward(self, x, mask=None):
        h = self.norm(x, mask) if self.prenorm else x
        h = self.dropout(self.fc2(self.hidden_dropout(self.act(self.fc1(h)))))
        y = x + h
        return y if self.prenorm else self.norm(y, mask)


class Block(nn.Module):
    """Mixer sublayer (+ FFN sublayer when `d_ffn` is set).

    A mixer with `gated_residual = True` receives the block input as `residual=` and returns the combined stream
    (MEGA eq. for h, CHELA eq. 15, SeqBoat, LongVQ eq. 20); otherwise the block adds `x + dropout(y)`.
    """

    def __init__(self, mixer: nn.Module, d_model: int, norm: str, prenorm: bool, d_ffn: int | None,
                 ffn_activation: str, dropout: float, ffn_hidden_dropout: float, ffn_init_std: float | None = None):
        super().__init__()
        self.mixer = mixer
        self.norm = build_norm(norm, d_model)
        self.prenorm = prenorm
        self.dropout = nn.Dropout(dropout)
        self.ffn = None if d_ffn is None else FeedForward(d_model, d_ffn, norm, prenorm, ffn_activation, dropout,
                                                          ffn_hidden_dropout, ffn_init_std)

    def forward(self, x, mask=None):
        h = self.norm(x, mask) if self.prenorm else x
        if getattr(self.mixer, "gated_residual", False):
            y, aux = self.mixer(h, mask, residual=x)
        else:
            y, aux = self.mixer(h, mask)
            y = x + self.dropout(y)
        if not self.prenorm:
            y = self.norm(y, mask)
        if self.ffn is not None:
            y = self.ffn(y, mask)
        return y, aux
