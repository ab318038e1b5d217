"""Vector quantizer with an EMA-updated codebook and straight-through gradients (LongVQ, arXiv:2404.11163,
eqs. 5-8, 15, 23-24; codebook statistics as VQ-VAE, van den Oord et al. 2017, and Transformer-VQ, Lingle 2023).

The codebook is not a parameter: it is `sums / max(counts, clamp)`, two buffers smoothed by an exponential moving
average (decay 0.99, LongVQ section 5) of the per-code counts and key sums of the real (unpadded) tokens.

When the EMA step happens (the paper is silent; our choice): each training forward's statistics are added to
pending buffers; they are applied once per optimizer step, when `set_progress(step, ...)` (called by the task right
after each optimizer step and before each training batch, forwarded by `SequenceModel`) reports a new step, so the
codebook a checkpoint holds has every trained step's update. So under gradient accumulation the statistics
of all micro-batches of one step form one EMA step, and under DDP they are all-reduced (summed over ranks) right
before it. A quantizer that never receives `set_progress` (used outside the task) applies its statistics after
each training forward instead; `apply_update()` applies them by hand.

Where the statistics are added (so that CUDA graphs capture the forward): a compiled training forward writes no
buffer, since a buffer written in place is a mutated graph input and Inductor's CUDA graphs skip any graph that has
one. It leaves its statistics in `_batch_stats`, a plain attribute that torch.compile sets after the graph from the
graph's outputs, and `absorb_stats()` adds them to the pending buffers, eagerly, outside the graph (and, without
`set_progress`, applies each as its EMA step). The task calls it through `SequenceModel.after_forward()` right
after each forward and before any other one: under CUDA graphs those tensors live in the graph's memory pool, and
the next replay overwrites them. An eager forward calls `absorb_stats()` itself, so a quantizer or model used alone
in eager mode needs no hook, and eager and compiled runs add the same statistics in the same order: the same
codebook trajectory. (One exception, outside the task: without `set_progress`, two calls within one compiled
forward both see the codebook from before the forward, where eager calls would see it move in between.)
`apply_update()` absorbs statistics left by a compiled forward before it applies anything. Only the first training
forward writes buffers inside its graph: the data init of the codebook (a Python flag leaves it out of every later
graph, so under CUDA graphs only that first graph runs uncaptured).

The data init waits for a batch with real tokens, so that the codewords are real keys: a training forward whose
keys are all padding keeps the codebook and leaves `initialized` False (a `torch.where` on the device, no host read
in the forward). `absorb_stats()`, outside the graph, reads `initialized` after a forward that ran the init; where it
is still False, it lowers the Python flag again, so the next training forward runs the init again (and writes
buffers in its graph). In the usual run that is one host read, after the first training forward. Under DDP rank
0's batch decides, as its keys become every rank's codewords. Under `task.compile=step-graph` a capture that comes
before the init has taken (every warm-up batch all padding) keeps the init in the replayed step: a no-op once it has
taken, but its multinomial still draws at each replay (docs/architecture.md: the losses then part from an eager
run's after the init).
"""

from __future__ import annotations

import logging

import torch
from einops import rearrange
import torch.distributed as dist
from torch import nn

from longmixer.ops.vq_attention import vq_search

log = logging.getLogger(__name__)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class VectorQuantizer(nn.Module):
    """Nearest-codeword quantization of keys with a straight-through estimator and an EMA codebook.

    Args:
        dim: key width E.
        n_codes: codebook size S (LongVQ: 512; Table 6 ablates 256 / 1024).
        decay: EMA rate eta of the counts and sums (LongVQ section 5: 0.99).
        commit_coef: gamma of the commitment loss (LongVQ eq. 23, section 5: 1e-4), >= 0 (0: none).
        count_clamp: lower bound of a code's count when forming the codeword (Transformer-VQ: 0.01).
        backend: "auto" | "torch" | "triton" for the nearest-codeword search.
    """

    def __init__(self, dim: int, n_codes: int = 512, *, decay: float = 0.99, commit_coef: float = 1e-4,
                 count_clamp: float = 0.01, backend: str = "auto"):
        super().__init__()
        if n_codes < 1:
            raise ValueError(f"model.mixer.n_codes={n_codes} must be >= 1; LongVQ uses 512")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"model.mixer.codebook_decay={decay} must be in [0, 1); LongVQ uses 0.99")
        if not commit_coef >= 0.0:
            # a negative gamma turns the commitment loss into a reward for keys far from their codewords
            raise ValueError(f"model.mixer.commit_coef={commit_coef} must be >= 0 (0: no commitment loss); LongVQ "
                             "uses 1e-4")
        self.dim, self.n_codes, self.decay = dim, n_codes, decay
        self.commit_coef, self.count_clamp, self.backend = commit_coef, count_clamp, backend
        self.register_buffer("counts", torch.ones(n_codes))  # [S]
        self.register_buffer("sums", torch.randn(n_codes, dim) * dim ** -0.5)  # [S, E]
        # False until the first training batch replaces the random codewords by real keys (our choice: the keys
        # come from a learned projection whose scale at init is unknown, so a data init avoids dead codes).
        self.register_buffer("initialized", torch.zeros((), dtype=torch.bool))
        self.register_buffer("pending_counts", torch.zeros(n_codes), persistent=False)
        self.register_buffer("pending_sums", torch.zeros(n_codes, dim), persistent=False)
        self._step: int | None = None
        # whether set_progress drives the EMA steps; the forward reads this bool, never the step number (an int
        # attribute read in a compiled forward would recompile it at every step)
        self._stepped_by_progress = False
        self._has_pending = False
        # statistics ([S] counts, [S, E] sums) of the training forwards not yet added to the pending buffers, in call
        # order: left by compiled forwards for `absorb_stats()` (one entry per quantizer call; a two-document batch
        # calls it twice within one forward)
        self._batch_stats: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
        # Python-side: True once a training forward has run the data init; `absorb_stats()` sets it back to False
        # where that forward had no real key (`initialized` still False), so the next one tries again. The forward
        # branches on this flag, never on the buffer's value, so it needs no host sync and no graph break.
        self._init_checked = False
        self._init_unconfirmed = False  # a forward ran the init; `absorb_stats()` has not read `initialized` since

    @property
    def codebook(self) -> torch.Tensor:
        """[S, E] codewords c_s = m_s / max(n_s, clamp)."""
        return self.sums / self.counts.clamp_min(self.count_clamp)[:, None]

    def forward(self, k: torch.Tensor, mask: torch.Tensor | None = None):
        """Quantize keys (LongVQ eqs. 7-8, 15).

        Args:
            k: [B, L, E] keys. mask: [B, L] bool, True = real token, or None.

        Returns:
            k_hat [B, L, E] (k's dtype; value c_z, gradient of k), codes [B, L] int64, codebook [S, E] used, and
            aux: `loss/vq_commit` (gamma * MSE(K, sg(C_z)) over real tokens, eq. 24), `stats/vq_used_codes`,
            `stats/vq_perplexity` (of this batch's assignments).
        """
        B, L, E = k.shape
        flat_mask = None if mask is None else mask.reshape(-1)
        if self.training and not self._init_checked:
            self._init_from_keys(rearrange(k.detach(), "b l e -> (b l) e"), flat_mask)
            self._init_checked = self._init_unconfirmed = True
        codebook = self.codebook
        codes, counts, sums = vq_search(rearrange(k.detach(), "b l e -> (b l) e"), codebook, flat_mask,
                                        backend=self.backend)
        codes = rearrange(codes, "(b l) -> b l", b=B)  # [B, L]
        c_z = codebook[codes].to(k.dtype)  # [B, L, E]
        k_hat = k + (c_z - k).detach()  # LongVQ eq. 8: straight-through
        sq_err = ((k.float() - c_z.float()) ** 2).sum(-1)  # [B, L]
        if mask is None:
            # the count from the shape: a sum over a ones tensor made Inductor emit a reduction of a constant that
            # Triton 3.6 fails to compile for sm_90 (float32 at B x L = 1024; tests/test_compile.py)
            commit = sq_err.sum() / (B * L * E)  # eq. 24, MSE over every entry
        else:
            weight = mask.float()
            commit = (sq_err * weight).sum() / (weight.sum().clamp_min(1.0) * E)  # eq. 24, MSE over real entries
        if self.training:
            # read-then-set of a Python attribute: torch.compile replays it after the graph, no buffer is written
            self._batch_stats = (*self._batch_stats, (counts.float(), sums.float()))
            if not torch.compiler.is_compiling():
                self.absorb_stats()
        probs = counts.float() / counts.sum().clamp_min(1.0)
        entropy = -(probs * torch.log(probs.clamp_min(1e-12))).sum()
        aux = {"loss/vq_commit": self.commit_coef * commit,
               "stats/vq_used_codes": (counts > 0).sum().float(),
               "stats/vq_perplexity": torch.exp(entropy)}
        return k_hat, codes, codebook, aux

    @torch.no_grad()
    def _init_from_keys(self, keys: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Replace the codewords by keys drawn uniformly from the real ones, unless `initialized` is already set
        (a loaded or hand-set codebook) or the batch has no real key (rank 0's batch under DDP), which leaves
        `initialized` False for a later batch. Statistics pending from before the init, gathered against the
        codewords it replaces, are dropped. Written without data-dependent shapes or host reads (a multinomial over
        the real-key weights, `torch.where` on the flags), so that it traces."""
        weights = keys.new_ones(keys.shape[0], dtype=torch.float32) if mask is None else mask.float()
        has_real = weights.sum() > 0
        if _distributed():
            # rank 0's keys become every rank's codewords (the broadcast below): its batch decides on every rank
            flag = has_real.float()
            dist.broadcast(flag, src=0)
            has_real = flag > 0
        pick = torch.multinomial(torch.where(has_real, weights, torch.ones_like(weights)), self.n_codes,
                                 replacement=True)
        replace = has_real & ~self.initialized
        self.sums.copy_(torch.where(replace, keys[pick].float(), self.sums))
        self.counts.copy_(torch.where(replace, torch.ones_like(self.counts), self.counts))
        self.pending_counts.copy_(torch.where(replace, torch.zeros_like(self.pending_counts), self.pending_counts))
        self.pending_sums.copy_(torch.where(replace, torch.zeros_like(self.pending_sums), self.pending_sums))
        if _distributed():
            dist.broadcast(self.sums, src=0)
        self.initialized.copy_(self.initialized | has_real)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        self._init_checked = False  # the next training forward looks at the loaded `initialized` again

    @torch.no_grad()
    def absorb_stats(self) -> None:
        """Add the statistics left by training forwards to the pending buffers, in call order; without
        `set_progress`, apply each as its own EMA step (what an eager forward does at once). Call it eagerly, right
        after a compiled training forward (`SequenceModel.after_forward()` does; the tasks call that)."""
        stats, self._batch_stats = self._batch_stats, ()
        if self._init_unconfirmed and not (self.initialized.is_cuda and torch.cuda.is_current_stream_capturing()):
            # the host read (none while a CUDA graph is captured: that graph keeps the init, correct on replay)
            self._init_checked = bool(self.initialized)
            self._init_unconfirmed = False
        for counts, sums in stats:
            self.pending_counts += counts
            self.pending_sums += sums
            self._has_pending = True
            if not self._stepped_by_progress:
                self.apply_update()

    def after_forward(self) -> None:
        """The hook `SequenceModel.after_forward()` calls after each forward: `absorb_stats()`."""
        self.absorb_stats()

    def after_replay(self) -> None:
        """After a training step replayed from a CUDA graph (`task.compile=step-graph`): its captured
        `absorb_stats()` added this step's statistics to the pending buffers on the GPU, without the Python that
        records it, so record it here; the next `set_progress` applies them."""
        self._has_pending = True

    @torch.no_grad()
    def apply_update(self) -> None:
        """One EMA step with the pending statistics (summed over DDP ranks): n <- eta n + (1 - eta) n_batch,
        m <- eta m + (1 - eta) m_batch (VQ-VAE appendix; LongVQ section 5, eta = 0.99). Statistics a
        compiled forward left unabsorbed are absorbed first."""
        if self._batch_stats:
            self.absorb_stats()  # without set_progress, this applies them itself; then nothing is pending
        if not self._has_pending:
            return
        if _distributed():
            dist.all_reduce(self.pending_counts)
            dist.all_reduce(self.pending_sums)
        self.counts.mul_(self.decay).add_(self.pending_counts, alpha=1.0 - self.decay)
        self.sums.mul_(self.decay).add_(self.pending_sums, alpha=1.0 - self.decay)
        self.pending_counts.zero_()
        self.pending_sums.zero_()
        self._has_pending = False

    def set_progress(self, step: int, total_steps: int) -> None:
        """Called after each optimizer step and before each training batch: a new step applies the pending ones."""
        if self._step is None:
            log.info("VectorQuantizer: codebook EMA applied once per optimizer step (set_progress)")
        if step != self._step:
            self.apply_update()
        self._step = step
        self._stepped_by_progress = True

    def extra_repr(self) -> str:
        return f"dim={self.dim}, n_codes={self.n_codes}, decay={self.decay}, commit_coef={self.commit_coef}"

