"""Contiguous-stream batching for language modeling (WikiText-103, enwik8).

Training follows Transformer-XL's ordered iterator (frameworks.md section 2.9): the corpus, one long token stream,
is laid out as `global_batch` rows read left to right; each DDP rank reads its own `batch_size` rows (so Lightning's
distributed sampler is not used), and every epoch each row is rolled by its own random offset so that segment
boundaries move. A training batch is a segment of K chunks, K uniform in [k_min, k_max] (MEGA's
`--variant-block-multiple-min/max`, models.md section 1.5; CHELA appendix A.2 "each segment contains m consecutive
chunks"). Every epoch holds each K equally often, in an order drawn per epoch, so that every epoch has the same number
of batches (`LMTrainStream.segment_lengths` says why).

Evaluation scores every token of the stream exactly once, each with at least `context` tokens of left context
(except the first `context` tokens of the stream, which have all there is): windows of `window` tokens slide by
`window - context` and only the tokens past the overlap are scored (SeqBoat section 4.4: windows of 8,192 with at
least 7,000 tokens of context). `context = 0` gives disjoint segments (MEGA / CHELA / LongVQ "segment the test data
and process each segment sequentially"). The last window is aligned to end at the stream's end, so all windows
have the same length and none is padded.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from longmixer.data.base import SequenceDataModule, epoch_complete, init_worker

IGNORE_INDEX = -100


def _mine_in_worker(i: int) -> bool:
    """DataLoader workers each yield every num_workers-th batch, so a stream is not duplicated across workers."""
    info = torch.utils.data.get_worker_info()
    return info is None or i % info.num_workers == info.id


def _rank_and_world_size() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class LMTrainStream(IterableDataset):
    """Ordered training batches `{"inputs", "targets"}` of shape [batch_size, K * chunk] from one stream. Every
    position is real, so the batches carry no key mask (`pad_collate` says why).

    Use it through `LMStreamLoader` (or `DataLoader(stream, batch_size=None)` and `set_epoch`): it batches itself.

    Args:
        tokens: [N] the training stream (any integer dtype; batches are int64).
        batch_size: rows per rank (the global batch is `batch_size * world_size`).
        chunk: C, the chunk length; segments are K * C tokens.
        k_min, k_max: K is uniform in [k_min, k_max] (k_min = k_max: fixed length); `segment_lengths` says how.
        seed: the roll offsets and the order of the K depend on (seed, epoch) only, so every rank agrees on K.
        roll: roll each row by a random offset every epoch (Transformer-XL / s4 `roll_seed`).
        rank, world_size: the DDP shard; None reads them from torch.distributed at iteration time.

    Under gradient accumulation (`accumulate` > 1, set by the datamodule from `trainer.accumulate_grad_batches`)
    each batch also carries `update_tokens`, the tokens of this rank's batches in its optimizer update: the epoch's
    batches [u A, (u + 1) A), the last update cut at the epoch's end (`epoch_batches`, as Lightning steps the
    optimizer). The language-model task weighs each batch's summed loss by it, so an update's gradient is its
    total NLL over its total tokens, as fairseq's; K is known for the whole epoch, so the total is known before
    the update's first backward.
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, chunk: int, k_min: int = 1, k_max: int = 1,
                 seed: int = 0, roll: bool = True, rank: int | None = None, world_size: int | None = None):
        super().__init__()
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D stream, got shape {tuple(tokens.shape)}")
        if batch_size < 1 or chunk < 1:
            raise ValueError(f"data.batch_size={batch_size} and data.seq_len={chunk} (the chunk) must be >= 1")
        if not 1 <= k_min <= k_max:
            raise ValueError(f"data.k_min={k_min}, data.k_max={k_max}: need 1 <= k_min <= k_max")
        self.tokens, self.batch_size, self.chunk = tokens, batch_size, chunk
        self.k_min, self.k_max, self.seed, self.roll = k_min, k_max, seed, roll
        self.rank, self.world_size = rank, world_size
        self.epoch, self.skip = 0, 0  # skip: batches of this epoch already consumed (mid-epoch resume)
        self.accumulate, self.epoch_batches = 1, None  # the optimizer updates' batches (the datamodule and LMStreamLoader set them)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose roll offsets and order of the K the next iteration uses."""
        self.epoch = epoch

    def _stream_seed(self, purpose: int) -> int:
        """Distinct generator seeds per (seed, epoch) for the rolls (0) and the order of the K (1)."""
        return (self.seed * 1_000_003 + self.epoch) * 2 + purpose

    def _shard(self) -> tuple[int, int]:
        rank, world_size = _rank_and_world_size()
        rank = rank if self.rank is None else self.rank
        world_size = world_size if self.world_size is None else self.world_size
        return rank, world_size

    def rows(self) -> torch.Tensor:
        """[batch_size, T] this rank's rows for the current epoch (rolled if `roll`)."""
        rank, world_size = self._shard()
        global_batch = self.batch_size * world_size
        row_len = self.tokens.numel() // global_batch  # the tail that does not fill a row is dropped (TXL)
        if row_len < self.k_min * self.chunk + 1:
            raise ValueError(f"the training stream ({self.tokens.numel()} tokens) is too short for a global batch of "
                             f"{global_batch} rows of >= {self.k_min * self.chunk + 1} tokens; lower data.batch_size, "
                             "data.seq_len or data.k_min")
        data = self.tokens[: row_len * global_batch].view(global_batch, row_len)
        data = data[rank * self.batch_size:(rank + 1) * self.batch_size]
        if self.roll:
            g = torch.Generator().manual_seed(self._stream_seed(0))
            offsets = torch.randint(0, row_len, (global_batch,), generator=g)[
                rank * self.batch_size:(rank + 1) * self.batch_size]
            data = torch.stack([torch.roll(row, -int(o)) for row, o in zip(data, offsets)])
        return data

    def segment_lengths(self, row_len: int) -> list[int]:
        """The segment lengths K * C of one epoch: as many rounds of every K in [k_min, k_max] as the rows' whole
        chunks hold, then the largest K that fit in the rest (which leaves fewer than k_min chunks), in an order drawn
        from (seed, epoch). Every length is a multiple of C (chunked mixers need L % C == 0).

        The same K every epoch, only reordered, give every epoch the same number of batches. Lightning takes
        `len(stream)` batches an epoch, counted once before training: with K drawn independently per batch the
        count changed from epoch to epoch, so a longer epoch lost its last batches and a shorter one ended before
        Lightning's last batch, skipping the epoch's validation and, under gradient accumulation, the gradients of
        its unfinished update."""
        values = list(range(self.k_min, self.k_max + 1))
        rounds, rest = divmod(max(0, row_len - 1) // self.chunk, sum(values))
        ks = values * rounds
        for k in reversed(values):  # consecutive values, taken from the largest, leave fewer than k_min chunks
            if k <= rest:
                ks.append(k)
                rest -= k
        g = torch.Generator().manual_seed(self._stream_seed(1))
        return [ks[i] * self.chunk for i in torch.randperm(len(ks), generator=g).tolist()]

    def __len__(self) -> int:
        rank, world_size = self._shard()
        row_len = self.tokens.numel() // (self.batch_size * world_size)
        return len(self.segment_lengths(row_len))

    def update_tokens(self, lengths: list[int], i: int) -> int:
        """This rank's tokens in the optimizer update that holds the epoch's batch `i` (see the class)."""
        first = i - i % self.accumulate
        last = min(first + self.accumulate, self.epoch_batches or len(lengths))
        return self.batch_size * sum(lengths[first:last])

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        data = self.rows()
        lengths = self.segment_lengths(data.shape[1])
        starts = [0]
        for length in lengths:
            starts.append(starts[-1] + length)
        skip, self.skip = self.skip, 0
        for i, (pos, end) in enumerate(zip(starts[:-1], starts[1:])):
            if i < skip or not _mine_in_worker(i - skip):  # the workers deal from the first batch yielded
                continue
            inputs = data[:, pos:end]
            batch = {"inputs": inputs.long(), "targets": data[:, pos + 1:end + 1].long()}
            if self.accumulate > 1:
                batch["update_tokens"] = torch.tensor(self.update_tokens(lengths, i))
            yield batch


def eval_windows(num_tokens: int, window: int, context: int) -> list[tuple[int, int, int]]:
    """Windows over a stream of `num_tokens` tokens (num_tokens - 1 predictions).

    Input position i predicts token i + 1. Returns (start, end, first_scored): the window feeds inputs
    [start, end) and scores the predictions at [first_scored, end). Every position in [0, num_tokens - 1) is scored
    exactly once, with at least `context` inputs before it inside its window unless it lies in the first window.
    """
    if window < 1:
        raise ValueError(f"data.eval_window={window} must be >= 1")
    if not 0 <= context < window:
        raise ValueError(f"data.eval_context={context} must be in [0, data.eval_window={window}); it is the minimum "
                         "left context of a scored token, so the window must be longer")
    n = num_tokens - 1  # predictions
    if n < 1:
        raise ValueError(f"an evaluation stream needs at least 2 tokens, got {num_tokens}")
    if n <= window:
        return [(0, n, 0)]
    stride = window - context
    windows, start, scored_to = [], 0, 0
    while scored_to < n:
        start = min(start, n - window)  # the last window ends at the stream's end
        end = start + window
        windows.append((start, end, scored_to))
        scored_to = end
        start += stride
    return windows


class LMEvalStream(IterableDataset):
    """Evaluation batches of windows from one stream; targets are -100 outside each window's scored part.

    Args:
        tokens: [N] the validation or test stream.
        window: window length (e.g. 8192).
        context: the minimum left context of a scored token (e.g. 7000); 0 gives disjoint segments.
        batch_size: windows per batch (the last batch may be smaller; nothing is dropped).
        rank, world_size: windows are dealt round-robin to DDP ranks; None reads torch.distributed.
    """

    def __init__(self, tokens: torch.Tensor, window: int, context: int, batch_size: int, rank: int | None = None,
                 world_size: int | None = None):
        super().__init__()
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D stream, got shape {tuple(tokens.shape)}")
        if batch_size < 1:
            raise ValueError(f"data.eval_batch_size={batch_size} must be >= 1")
        self.tokens, self.batch_size = tokens, batch_size
        self.windows = eval_windows(tokens.numel(), window, context)
        self.rank, self.world_size = rank, world_size

    def _my_windows(self) -> list[tuple[int, int, int]]:
        rank, world_size = _rank_and_world_size()
        rank = rank if self.rank is None else self.rank
        world_size = world_size if self.world_size is None else self.world_size
        return self.windows[rank::world_size]

    def __len__(self) -> int:
        return math.ceil(len(self._my_windows()) / self.batch_size)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        mine = self._my_windows()
        for b, i in enumerate(range(0, len(mine), self.batch_size)):
            if not _mine_in_worker(b):
                continue
            group = mine[i:i + self.batch_size]
            inputs = torch.stack([self.tokens[s:e].long() for s, e, _ in group])  # same length by construction
            targets = torch.stack([self.tokens[s + 1:e + 1].long() for s, e, _ in group])
            for row, (s, _, first) in enumerate(group):
                targets[row, :first - s] = IGNORE_INDEX
            yield {"inputs": inputs, "targets": targets}


class LMStreamLoader(DataLoader):
    """The training loader of an `LMTrainStream`: sets the stream's epoch on every pass (so rolls and the order of
    the K change per epoch even with worker processes) and saves its position in checkpoints (Lightning's
    `state_dict` protocol), so a run killed anywhere resumes on the next unseen batch.

    As `ResumableLoader`, it counts its own epochs: a pass that consumed the epoch's batches (`epoch_batches` under
    `trainer.limit_train_batches`, else the whole stream) moves the next pass to the next epoch, also after a resume
    from a checkpoint written at an epoch's end. With `repeat=True` (`trainer.overfit_batches`) every epoch is
    epoch 0's first `epoch_batches` batches (or its whole pass) again, as Lightning's sequential sampler gives a
    map-style set."""

    def __init__(self, stream: LMTrainStream, epoch_batches: int | None = None, repeat: bool = False, **kwargs):
        if kwargs.get("persistent_workers"):
            raise ValueError("LMStreamLoader needs persistent_workers=False: persistent workers keep a copy of the "
                             "stream made before the epoch changed")
        super().__init__(stream, batch_size=None, **kwargs)
        self.epoch_batches = epoch_batches  # as ResumableLoader's: each epoch that many batches of a fresh pass
        stream.epoch_batches = epoch_batches  # where the epoch's last optimizer update ends (`update_tokens`)
        self.repeat = repeat
        self._epoch, self._consumed = 0, 0

    def __iter__(self):
        if epoch_complete(self._consumed, len(self.dataset), self.epoch_batches):
            self._epoch, self._consumed = (0 if self.repeat else self._epoch + 1), 0
        self.dataset.set_epoch(self._epoch)
        self.dataset.skip = self._consumed
        for batch in super().__iter__():
            self._consumed += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "consumed": self._consumed}

    def load_state_dict(self, state) -> None:
        self._epoch, self._consumed = int(state["epoch"]), int(state["consumed"])


LM_METRICS = ("ppl", "bpc")


class LMDataModule(SequenceDataModule):
    """Base of the language-model datamodules: prepared token streams `{train,val,test}.npy` (1-D), served as
    ordered training segments and evaluation windows. Subclasses set `name` and implement `_prepare`.

    Args:
        seq_len: C, the chunk length; training segments are K * C tokens (MEGA: 1024 on WikiText-103, 2048 on
            enwik8; a model's chunk or learned positions interpolate it).
        vocab_size: checked against the prepared vocabulary.
        k_min, k_max: K is uniform in [k_min, k_max] per batch (MEGA: 2..6 on WikiText-103, 2..4 on enwik8).
        eval_window: evaluation window length (None: k_max * seq_len).
        eval_context: minimum left context of each scored evaluation token (0: disjoint segments).
        metric: what the task reports besides the loss: "ppl" (word level) | "bpc" (bits per byte / character).
        roll: roll each training row by a random offset every epoch.
        data_dir, batch_size (rows per device), eval_batch_size (windows per batch), num_workers, seed, split_seed,
            pin_memory: see `SequenceDataModule`.
    """

    name = "lm"

    def __init__(self, seq_len: int, vocab_size: int, k_min: int = 1, k_max: int = 1, eval_window: int | None = None,
                 eval_context: int = 0, metric: str = "ppl", roll: bool = True, data_dir: str | Path | None = None,
                 batch_size: int = 8, eval_batch_size: int | None = None, num_workers: int | None = None, seed: int = 0,
                 split_seed: int = 0, pin_memory: bool | None = None,
                 persistent_workers: bool | None = None):
        super().__init__(data_dir=data_dir, batch_size=batch_size, eval_batch_size=eval_batch_size,
                         num_workers=num_workers, seed=seed, split_seed=split_seed, pin_memory=pin_memory,
                         persistent_workers=persistent_workers)
        if metric not in LM_METRICS:
            raise ValueError(f"data.metric={metric!r} is not one of {LM_METRICS}")
        if not 1 <= k_min <= k_max:
            raise ValueError(f"data.k_min={k_min}, data.k_max={k_max}: need 1 <= k_min <= k_max")
        self.seq_len, self.vocab_size, self.k_min, self.k_max = seq_len, vocab_size, k_min, k_max
        self.eval_window = k_max * seq_len if eval_window is None else eval_window
        if not 0 <= eval_context < self.eval_window:
            raise ValueError(f"data.eval_context={eval_context} must be in [0, data.eval_window={self.eval_window})")
        self.eval_context, self.metric, self.roll = eval_context, metric, roll

    def _load(self, root: Path, manifest: dict) -> dict[str, IterableDataset]:
        meta = manifest.get("meta", {})
        if meta.get("vocab_size") != self.vocab_size:
            raise ValueError(f"data.vocab_size={self.vocab_size} does not match the prepared {self.name} vocabulary "
                             f"({meta.get('vocab_size')}); set data.vocab_size={meta.get('vocab_size')}")
        tokens = {split: torch.from_numpy(np.load(root / f"{split}.npy")) for split in ("train", "val", "test")}
        return {
            "train": LMTrainStream(tokens["train"], self.batch_size, self.seq_len, self.k_min, self.k_max,
                                   seed=self.seed, roll=self.roll),
            **{split: LMEvalStream(tokens[split], self.eval_window, self.eval_context, self.eval_batch_size)
               for split in ("val", "test")},
        }

    def _loader(self, split: str, train: bool) -> DataLoader:
        if split not in self.datasets:
            raise KeyError(f"{self.name} has no {split!r} split (has {sorted(self.datasets)})")
        # a private generator: creating an iterator (with workers, each epoch) must not draw from the global RNG, or a
        # resumed run's dropout masks would drift from the uninterrupted run's (data/base.py does the same)
        kwargs = dict(num_workers=self.num_workers, pin_memory=self.pin_memory, worker_init_fn=init_worker,
                      generator=torch.Generator().manual_seed(self.seed))
        if train:  # workers are re-created each epoch so that they receive the stream's new epoch and skip
            # Lightning keeps this loader under trainer.overfit_batches too (it has no sampler to put in), so
            # `_epoch_batches` counts that limit as well, and the loader repeats those batches every epoch
            stream = self.datasets[split]
            overfit = self.trainer is not None and bool(getattr(self.trainer, "overfit_batches", 0))
            stream.accumulate = int(getattr(self.trainer, "accumulate_grad_batches", 1) or 1)
            return LMStreamLoader(stream, epoch_batches=self._epoch_batches(len(stream)), repeat=overfit, **kwargs)
        return DataLoader(self.datasets[split], batch_size=None, persistent_workers=self.persistent_workers, **kwargs)
