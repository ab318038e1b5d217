"""A seeded synthetic byte stream for language-model plumbing and speed runs (no download).

Text-like bytes: words of 2 to 10 lowercase letters from a fixed lexicon, drawn with Zipf frequencies (rank r with
weight r^-zipf_a), separated by spaces, with a newline after every 12 words on average. A model learns the word
spellings and the word frequencies, so the loss falls from ln(27) towards the stream's entropy within a few hundred
steps, which is what a scaling or smoke run needs; the numbers say nothing about enwik8. Ids are byte + 1 as in
`data/enwik8.py` (id 0 is padding), vocab_size 257, so the enwik8 recipes run on it unchanged (`data=synthetic_bytes`).

Prepared: `{train,val,test}.npy` int16 streams, made from `generator_seed` only (the training `seed` does not change
the data).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from longmixer.data.lm_stream import LMDataModule

SPACE, NEWLINE = ord(" "), ord("\n")


def synthetic_bytes(num_bytes: int, rng: np.random.Generator, lexicon: np.ndarray, offsets: np.ndarray,
                    zipf_a: float) -> np.ndarray:
    """[num_bytes] uint8: Zipf-drawn words of `lexicon` (concatenated letters, word i at offsets[i]:offsets[i+1])
    each followed by a space or, with probability 1/12, a newline."""
    lengths = np.diff(offsets)
    weights = np.arange(1, lengths.size + 1, dtype=np.float64) ** -zipf_a
    mean_len = float((lengths * weights).sum() / weights.sum()) + 1
    ids = rng.choice(lengths.size, size=int(num_bytes / mean_len * 1.2) + 16, p=weights / weights.sum())
    sizes = lengths[ids] + 1  # the word and its separator
    ends = np.cumsum(sizes)
    if ends[-1] < num_bytes:
        raise RuntimeError(f"drew too few words for {num_bytes} bytes (the draw is sized 20% above the mean)")
    keep = int(np.searchsorted(ends, num_bytes)) + 1  # the words that reach num_bytes
    ids, sizes, ends = ids[:keep], sizes[:keep], ends[:keep]
    starts = ends - sizes
    within = np.arange(ends[-1]) - np.repeat(starts, sizes)  # position inside each word (+ separator)
    word_len = np.repeat(sizes - 1, sizes)
    letters = lexicon[np.minimum(np.repeat(offsets[ids], sizes) + within, lexicon.size - 1)]
    separators = np.where(rng.random(ids.size) < 1 / 12, NEWLINE, SPACE).astype(np.uint8)
    out = np.where(within < word_len, letters, np.repeat(separators, sizes))
    return out[:num_bytes].astype(np.uint8)


def make_lexicon(num_words: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """`num_words` random lowercase words of 2-10 letters: (letters uint8 concatenated, offsets [num_words + 1])."""
    lengths = rng.integers(2, 11, size=num_words)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    letters = rng.integers(ord("a"), ord("z") + 1, size=int(offsets[-1])).astype(np.uint8)
    return letters, offsets


class SyntheticBytes(LMDataModule):
    """Seeded synthetic byte-level LM data (see the module docstring); the protocol is `LMDataModule`'s.

    Args:
        train_bytes: length of the training stream.
        eval_bytes: length of each of the val and test streams.
        num_words: lexicon size.
        zipf_a: Zipf exponent of the word frequencies (> 0; larger: fewer distinct words in use).
        generator_seed: the data's seed; the same seed gives byte-identical streams on every machine.
        seq_len, vocab_size (must be 257), k_min, k_max, eval_window, eval_context, metric, roll, data_dir,
            batch_size, eval_batch_size, num_workers, seed, split_seed, pin_memory: see `LMDataModule`.
    """

    name = "synthetic_bytes"

    def __init__(self, train_bytes: int = 10_000_000, eval_bytes: int = 500_000, num_words: int = 5000,
                 zipf_a: float = 1.1, generator_seed: int = 0, seq_len: int = 2048, vocab_size: int = 257,
                 k_min: int = 1, k_max: int = 1, eval_window: int | None = None, eval_context: int = 0,
                 metric: str = "bpc", roll: bool = True, data_dir: str | Path | None = None, batch_size: int = 8,
                 eval_batch_size: int | None = None, num_workers: int | None = None, seed: int = 0,
                 split_seed: int = 0, pin_memory: bool | None = None, persistent_workers: bool | None = None):
        super().__init__(seq_len=seq_len, vocab_size=vocab_size, k_min=k_min, k_max=k_max, eval_window=eval_window,
                         eval_context=eval_context, metric=metric, roll=roll, data_dir=data_dir,
                         batch_size=batch_size, eval_batch_size=eval_batch_size, num_workers=num_workers, seed=seed,
                         split_seed=split_seed, pin_memory=pin_memory, persistent_workers=persistent_workers)
        for key, value in (("train_bytes", train_bytes), ("eval_bytes", eval_bytes), ("num_words", num_words)):
            if value < 2:
                raise ValueError(f"data.{key}={value} must be >= 2")
        if zipf_a <= 0:
            raise ValueError(f"data.zipf_a={zipf_a} must be > 0")
        if vocab_size != 257:
            raise ValueError(f"data.vocab_size={vocab_size}: synthetic_bytes is byte level, set data.vocab_size=257")
        self.train_bytes, self.eval_bytes, self.num_words = train_bytes, eval_bytes, num_words
        self.zipf_a, self.generator_seed = zipf_a, generator_seed

    @property
    def root(self) -> Path:
        # the streams are generated at prepare time from these settings, so each combination has its own folder
        # (as enwik8's eval<eval_bytes>): runs at two settings neither regenerate each other's data in turn nor read
        # it while another run regenerates it
        return self.data_dir / self.name / (f"train{self.train_bytes}_eval{self.eval_bytes}_words{self.num_words}"
                                            f"_zipf{self.zipf_a:g}_seed{self.generator_seed}")

    def prepare_fingerprint(self) -> dict:
        return {"train_bytes": self.train_bytes, "eval_bytes": self.eval_bytes, "num_words": self.num_words,
                "zipf_a": self.zipf_a, "generator_seed": self.generator_seed}

    def _prepare(self, root: Path) -> tuple[dict, dict]:
        self.note_old_layout(self.root.parent, "setting of data.train_bytes / eval_bytes / num_words / zipf_a / "
                             "generator_seed")
        rng = np.random.default_rng(self.generator_seed)
        lexicon, offsets = make_lexicon(self.num_words, rng)
        splits = {}
        for split, size in (("train", self.train_bytes), ("val", self.eval_bytes), ("test", self.eval_bytes)):
            data = synthetic_bytes(size, rng, lexicon, offsets, self.zipf_a)
            np.save(root / f"{split}.npy", data.astype(np.int16) + 1)
            splits[split] = {"count": int(data.size)}
        return splits, {"vocab_size": 257, "tokenizer": "bytes+1"}
