"""`SequenceModel`: embedding -> N blocks -> final norm (pre-norm only) -> masked pooling -> head.

The shared skeleton of all families (models.md section 0): the mixer is the only thing a family changes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from longmixer.layers.norms import build_norm
from longmixer.models.blocks import Block
from longmixer.models.embeddings import (POS_ENCODINGS, LearnedPositions, RealEmbedding, SinusoidalPositions,
                                         TokenEmbedding)
from longmixer.models.heads import ClassifierHead, LMHead, NLIHead
from longmixer.utils.optim import set_optim_hparams

POOLS = ("mean", "none")
HEADS = ("classifier", "nli", "nli_concat", "lm", "lm_tied", "none")


class SequenceModel(nn.Module):
    """A stack of mixer blocks over token or real-valued sequences.

    Args:
        mixer: a factory (Hydra `_partial_`) called as `mixer(d_model=..., causal=...)` once per layer.
        d_model: width D.
        n_layers: number of blocks.
        vocab_size / d_input: token vocabulary (embedding=token) or input channels (embedding=real).
        num_classes: classes for the classifier / NLI heads.
        causal: passed to every mixer; language modeling needs True.
        norm, prenorm: the norm type of every block and whether it is applied before (pre) or after (post).
        d_ffn: width of the normalized FFN sublayer; None leaves it out.
        embedding: "auto" (token when `vocab_size` is set, else real) | "token" | "real" | a factory called as
            `embedding(d_model=...)`.
        embed_std: init std of the embedding (None: D^-0.5, MEGA).
        pos_encoding: "none" | "sinusoidal" | "scaled_sinusoidal" (times a learned scalar, SeqBoat's) | "learned"
            absolute positions (learned needs `max_len`).
        pool: "mean" over real tokens (classification) | "none" (per-token outputs).
        head: "classifier" | "nli" ([u, v, u*v, u-v]) | "nli_concat" ([u, v], MEGA's AAN head) | "lm" | "lm_tied" |
            "none" | a factory called as
            `head(d_model=..., embedding=<embedding module>)`.
        d_classifier: hidden width of the classifier MLP (None: D).
        classifier_dropout: dropout between the classifier's hidden layer and its activation (MEGA's placement).
        classifier_activation: the classifier's hidden activation, "gelu" (MEGA's) or "relu" (the LRA paper's).
        embed_bias_std: init std of the real-valued embedding's bias (MEGA: 0.1; 0 = zeros).
        embed_weight_decay: weight decay of a token embedding (`nn.Embedding`) in place of the optimizer's (None:
            decayed like any weight; 0.0: S4's parameter grouping, which the LaS recipes follow).
        ffn_init_std: N(0, std) init of the FFN weights with zero biases (MEGA: 0.02; None = PyTorch's default).
        final_norm_affine: whether the pre-norm model's final norm has learned scale / shift (MEGA's LM recipes
            use `--no-affine-final-norm`: False).
    """

    def __init__(self, mixer: Callable[..., nn.Module], d_model: int, n_layers: int, vocab_size: int | None = None,
                 d_input: int | None = None, num_classes: int | None = None, causal: bool = False,
                 norm: str = "layernorm", prenorm: bool = True, d_ffn: int | None = None,
                 ffn_activation: str = "gelu", dropout: float = 0.0, ffn_hidden_dropout: float = 0.0,
                 embed_dropout: float = 0.0, embedding: str | Callable[..., nn.Module] = "auto",
                 embed_std: float | None = None, pos_encoding: str = "none", max_len: int | None = None,
                 pool: str = "mean", head: str | Callable[..., nn.Module] = "classifier",
                 d_classifier: int | None = None, padding_idx: int = 0, classifier_dropout: float = 0.0,
                 embed_bias_std: float = 0.0, ffn_init_std: float | None = None, final_norm_affine: bool = True,
                 embed_weight_decay: float | None = None, classifier_activation: str = "gelu"):
        super().__init__()
        if n_layers < 1 or d_model < 1:
            raise ValueError(f"model.n_layers={n_layers} and model.d_model={d_model} must be >= 1")
        if pool not in POOLS:
            raise ValueError(f"model.pool={pool!r} is not one of {POOLS}")
        if pos_encoding not in POS_ENCODINGS:
            raise ValueError(f"model.pos_encoding={pos_encoding!r} is not one of {POS_ENCODINGS}")
        self.d_model, self.causal, self.pool, self.prenorm = d_model, causal, pool, prenorm
        self.embedding = self._build_embedding(embedding, vocab_size, d_input, d_model, embed_std, padding_idx,
                                               embed_bias_std)
        if embed_weight_decay is not None:
            if not isinstance(self.embedding, nn.Embedding):
                raise ValueError(f"model.embed_weight_decay={embed_weight_decay} applies to a token embedding; this "
                                 f"model's is {type(self.embedding).__name__}: drop the key (the weight is decayed "
                                 "like any other) or set model.embedding=token")
            set_optim_hparams(self.embedding.weight, weight_decay=embed_weight_decay)
        if pos_encoding == "learned" and max_len is None:
            raise ValueError("model.pos_encoding=learned needs model.max_len (e.g. ${data.seq_len})")
        self.positions = {"none": lambda: None, "sinusoidal": lambda: SinusoidalPositions(d_model),
                          "scaled_sinusoidal": lambda: SinusoidalPositions(d_model, learned_scale=True),
                          "learned": lambda: LearnedPositions(d_model, max_len)}[pos_encoding]()
        self.embed_dropout = nn.Dropout(embed_dropout)
        self.blocks = nn.ModuleList(
            Block(mixer(d_model=d_model, causal=causal), d_model, norm, prenorm, d_ffn, ffn_activation, dropout,
                  ffn_hidden_dropout, ffn_init_std) for _ in range(n_layers))
        self.final_norm = build_norm(norm, d_model, affine=final_norm_affine) if prenorm else None
        self.head = self._build_head(head, d_model, num_classes, vocab_size, d_classifier, classifier_dropout,
                                     classifier_activation)

    @staticmethod
    def _build_embedding(embedding, vocab_size, d_input, d_model, std, padding_idx, bias_std):
        if callable(embedding):
            return embedding(d_model=d_model)
        if embedding == "auto":
            if vocab_size is not None and d_input is not None:
                raise ValueError(f"model.vocab_size={vocab_size} and model.d_input={d_input} are both set; a task "
                                 "has token inputs (vocab_size) or real-valued inputs (d_input), not both")
            embedding = "token" if vocab_size is not None else "real"
        if embedding == "token":
            if vocab_size is None:
                raise ValueError("model.embedding=token needs model.vocab_size (e.g. ${data.vocab_size})")
            return TokenEmbedding(vocab_size, d_model, padding_idx, std)
        if embedding == "real":
            if d_input is None:
                raise ValueError("the model needs model.vocab_size (token inputs, e.g. ${data.vocab_size}) or "
                                 "model.d_input (real-valued inputs, e.g. ${data.d_input})")
            return RealEmbedding(d_input, d_model, std, bias_std)
        raise ValueError(f"model.embedding={embedding!r} is not one of ['auto', 'token', 'real'] or a _partial_ "
                         "factory")

    def _build_head(self, head, d_model, num_classes, vocab_size, d_classifier, dropout, activation):
        if callable(head):
            return head(d_model=d_model, embedding=self.embedding)
        if head not in HEADS:
            raise ValueError(f"model.head={head!r} is not one of {HEADS} or a _partial_ factory")
        if head in ("classifier", "nli", "nli_concat") and num_classes is None:
            raise ValueError(f"model.head={head} needs model.num_classes (e.g. ${{data.num_classes}})")
        if head == "classifier":
            return ClassifierHead(d_model, num_classes, d_classifier, dropout, activation)
        if head in ("nli", "nli_concat"):
            return NLIHead(d_model, num_classes, d_classifier, fusion="nli" if head == "nli" else "concat",
                           dropout=dropout, activation=activation)
        if head in ("lm", "lm_tied"):
            if vocab_size is None:
                raise ValueError(f"model.head={head} needs model.vocab_size")
            return LMHead(d_model, vocab_size, self.embedding, tied=head == "lm_tied")
        return nn.Identity()

    def encode(self, inputs: torch.Tensor, mask: torch.Tensor | None = None):
        """inputs [B, L] tokens or [B, L, d_input] reals, mask [B, L] bool -> (h [B, L, D], aux)."""
        x = self.embedding(inputs)  # [B, L, D]
        if self.positions is not None:
            x = x + self.positions(x.shape[1], x.device, x.dtype)
        if mask is not None:
            x = x * mask.unsqueeze(-1).to(x.dtype)
        x = self.embed_dropout(x)
        aux: dict[str, torch.Tensor] = {}
        for i, block in enumerate(self.blocks):
            x, layer_aux = block(x, mask)
            for key, value in layer_aux.items():
                if key.startswith("loss/"):
                    aux[key] = aux[key] + value if key in aux else value
                elif key.startswith("stats/"):
                    aux[f"{key}/layer_{i:02d}"] = value
                else:
                    raise KeyError(f"mixer {type(block.mixer).__name__} returned aux key {key!r}; aux keys must "
                                   "start with 'loss/' or 'stats/' (docs/architecture.md)")
        if self.final_norm is not None:
            x = self.final_norm(x, mask)
        return x, aux

    def _pool(self, h, mask):
        if self.pool == "none":
            return h
        if mask is None:
            return h.mean(dim=1)
        w = mask.unsqueeze(-1).to(h.dtype)
        return (h * w).sum(dim=1) / w.sum(dim=1).clamp_min(1.0)  # [B, D]

    def forward(self, inputs, mask=None, inputs2=None, mask2=None):
        """Classification / LM logits and aux; `inputs2` (retrieval) goes through the same encoder."""
        h, aux = self.encode(inputs, mask)
        pooled = self._pool(h, mask)
        if inputs2 is None:
            return self.head(pooled), aux
        if not isinstance(self.head, NLIHead):
            raise ValueError("a two-document batch (inputs2) needs model.head=nli")
        h2, aux2 = self.encode(inputs2, mask2)
        for key, value in aux2.items():
            aux[key] = aux[key] + value if key.startswith("loss/") else (aux[key] + value) / 2
        return self.head(pooled, self._pool(h2, mask2)), aux

    def set_progress(self, step: int, total_steps: int) -> None:
        """Hand the training progress to every submodule that schedules something (e.g. Gumbel temperature)."""
        for module in self.modules():
            if module is not self and hasattr(module, "set_progress"):
                module.set_progress(step, total_steps)

    def after_forward(self) -> None:
        """Call every submodule's `after_forward()` (LongVQ's quantizer adds its batch statistics to its buffers).
        The task calls it right after each forward, eagerly: outside the compiled graph, whose forward then mutates no
        buffer (CUDA graphs skip a graph that does), and before the next forward, whose CUDA-graph replay would
        overwrite what this one left."""
        self._call_hook("after_forward")

    def after_replay(self) -> None:
        """Call every submodule's `after_replay()`: the host-side bookkeeping of one training step whose kernels were
        replayed from a CUDA graph (`task.compile=step-graph`), where `after_forward` ran once, at the capture. The
        quantizer marks its statistics pending: the replay added them on the GPU."""
        self._call_hook("after_replay")

    def _call_hook(self, name: str) -> None:
        """Call `name()` on every submodule that defines it. It runs every step, so the modules are found once per
        hook (the module tree is fixed after construction; compiling blocks in place keeps it)."""
        hooked = self.__dict__.setdefault("_hooked_modules", {})  # plain dict: not registered as submodules
        if name not in hooked:
            hooked[name] = [m for m in self.modules() if m is not self and hasattr(m, name)]
        for module in hooked[name]:
            getattr(module, name)()

    def reparameterize(self) -> "SequenceModel":
        """Fuse training-time branches for inference in every submodule that supports it (CHELA short-long conv)."""
        for module in self.modules():
            if module is not self and hasattr(module, "reparameterize"):
                module.reparameterize()
        return self
