"""LRA ListOps (Nangia & Bowman 2018; LRA, arXiv:2011.04006): the official `listops-1000` TSVs, or the same format
written by our seeded generator (`GeneratedListOps`)."""

from __future__ import annotations

import csv
import logging
import os
from pathlib import Path

import numpy as np

from longmixer.data.base import RaggedDataset, SequenceDataModule, label_counts, save_ragged
from longmixer.data.download import progress
from longmixer.data.generators.listops import OPERATORS, SHARD, ListOpsSpec, write_tsv_splits
from longmixer.data.integrity import SourceFileError, SourceFileMissingError, read_utf8_lines

log = logging.getLogger(__name__)

# <pad> = 0, <unk> = 1; `]` is renamed `X` and parentheses dropped (the LRA tokenization, frameworks.md 2.1).
VOCAB = ("<pad>", "<unk>", *OPERATORS, "X", *"0123456789")
TOKEN_ID = {tok: i for i, tok in enumerate(VOCAB)}
SPLITS = ("train", "val", "test")
csv.field_size_limit(1 << 30)


def tokenize(source: str) -> np.ndarray:
    """`( ( [MAX 2 ) 9 ) ] )` -> ids of `[MAX 2 9 X`; unknown tokens map to <unk>."""
    words = source.replace("(", " ").replace(")", " ").replace("]", "X").split()
    return np.fromiter((TOKEN_ID.get(w, 1) for w in words), dtype=np.int16, count=len(words))


def read_tsv(path: Path) -> tuple[list[np.ndarray], list[int]]:
    """Read an LRA ListOps TSV (header `Source\\tTarget`)."""
    if not path.exists():
        raise SourceFileMissingError(f"ListOps file {path} is missing: point data.source_dir at the folder with the LRA "
                                     "release's basic_{train,val,test}.tsv, or train on data=listops_gen")
    sequences, labels = [], []
    reader = csv.reader(read_utf8_lines(path, "ListOps", "re-extract the file or regenerate it"), delimiter="\t")
    header = next(reader, None)
    if header is None or [h.strip() for h in header[:2]] != ["Source", "Target"]:
        raise SourceFileError(f"{path} is not an LRA ListOps TSV: its header is {header!r}, expected "
                         "['Source', 'Target']")
    for line_no, row in enumerate(reader, start=2):
        if not any(cell.strip() for cell in row):
            continue  # a blank line (a trailing newline too many): no example
        if len(row) != 2 or not row[1].strip().isdigit() or not 0 <= int(row[1]) <= 9:
            raise SourceFileError(f"{path}:{line_no}: expected `<source>\\t<digit 0-9>`, got {row[:2]!r}")
        sequences.append(tokenize(row[0]))
        labels.append(int(row[1]))
    if not sequences:
        raise SourceFileError(f"{path} has a header but no examples; the split is empty: re-extract or regenerate it")
    return sequences, labels


class ListOps(SequenceDataModule):
    """ListOps from the official LRA release (`lra_release/listops-1000/basic_{train,val,test}.tsv`).

    Args:
        seq_len: truncation length (LRA: 2000).
        vocab_size: must equal the tokenizer's vocabulary (17).
        num_classes: 10.
        source_dir: a folder that already holds the three TSVs (skips the download).
    """

    name = "listops"
    variable_length = True

    def __init__(self, seq_len: int = 2000, vocab_size: int = len(VOCAB), num_classes: int = 10,
                 source_dir: str | None = None, **kwargs):
        super().__init__(**kwargs)
        if vocab_size != len(VOCAB):
            raise ValueError(f"data.vocab_size={vocab_size} but the ListOps tokenizer has {len(VOCAB)} symbols; "
                             f"set data.vocab_size={len(VOCAB)}")
        if num_classes != 10:
            raise ValueError(f"data.num_classes={num_classes}: ListOps has 10 classes")
        if seq_len < 1:  # a negative one would slice tokens off each example's end (`seq[:seq_len]`)
            raise ValueError(f"data.seq_len={seq_len} must be positive (LRA: 2000)")
        self.seq_len, self.vocab_size, self.num_classes = seq_len, vocab_size, num_classes
        self.source_dir = source_dir

    def _source_tsvs(self) -> Path:
        if self.source_dir is not None:
            return Path(self.source_dir)
        from longmixer.data.lra_release import ensure_lra_release

        release = ensure_lra_release(self.data_dir / "lra_release", parts=["listops-1000"])["listops-1000"]
        return release / "listops-1000"

    def _prepare(self, root: Path) -> tuple[dict, dict]:
        tsv_dir = self._source_tsvs()
        splits = {}
        for split in SPLITS:
            sequences, labels = read_tsv(tsv_dir / f"basic_{split}.tsv")
            save_ragged(root, split, sequences, labels, dtype=np.int16)
            lengths = np.array([len(s) for s in sequences])
            splits[split] = {"count": len(labels), "labels": label_counts(labels),
                             "length_mean": float(lengths.mean()), "length_max": int(lengths.max())}
        return splits, {"source": str(tsv_dir), "vocab": list(VOCAB)}

    def _load(self, root: Path, manifest: dict):
        return {split: RaggedDataset(root, split, max_len=self.seq_len) for split in SPLITS}


class GeneratedListOps(ListOps):
    """ListOps written by the seeded generator (data/generators/listops.py) in the LRA format, then read by the
    same code as the official files. Sizes and lengths are config values; the defaults are LRA's."""

    name = "listops_gen"

    def __init__(self, num_train: int = 96_000, num_val: int = 2_000, num_test: int = 2_000, max_depth: int = 10,
                 max_args: int = 10, min_length: int = 500, max_length: int = 2_000, generator_seed: int = 0,
                 source_dir: str | None = None, **kwargs):
        super().__init__(**kwargs)
        for key, count in (("num_train", num_train), ("num_val", num_val), ("num_test", num_test)):
            # every split needs an example (the TSV reader refuses an empty one, and the generator would stop short)
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ValueError(f"data.{key}={count!r} must be a whole number >= 1")
        if source_dir is not None:
            raise ValueError(f"data.source_dir={source_dir} is not used by {self.name}, which generates its "
                             "examples; use data=listops to read a folder of TSVs")
        self.spec = ListOpsSpec(num_train, num_val, num_test, max_depth, max_args, min_length, max_length)
        self.generator_seed = generator_seed
        if self.seq_len < max_length - 1:
            log.warning("data.seq_len=%d truncates generated sequences of up to %d tokens", self.seq_len,
                        max_length - 1)

    @property
    def root(self) -> Path:
        s = self.spec
        return self.data_dir / (f"listops_gen/n{s.num_train}-{s.num_val}-{s.num_test}_len{s.min_length}-"
                                f"{s.max_length}_d{s.max_depth}_a{s.max_args}_seed{self.generator_seed}_shard{SHARD}")

    @property
    def prepare_hint(self) -> str:
        return (f"python scripts/prepare_data.py listops_gen paths.data_dir={self.data_dir} (with the same "
                "data.* settings), or let the training run prepare it")

    def prepare_fingerprint(self) -> dict:
        return {"spec": self.spec.__dict__, "generator_seed": self.generator_seed}

    def _source_tsvs(self) -> Path:
        out = self.root / "tsv"
        total = self.spec.num_train + self.spec.num_val + self.spec.num_test
        # LRA sizes take minutes on one core: draw the generator's shards on every core (same output)
        workers = (os.cpu_count() or 1) if total > 20_000 else 1
        with progress("generating ListOps", total, unit="examples") as advance:
            write_tsv_splits(out, self.spec, self.generator_seed, progress=advance, workers=workers)
        return out
