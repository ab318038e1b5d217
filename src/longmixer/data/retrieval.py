"""LRA Retrieval: ACL Anthology Network citation pairs at byte level (Radev et al. 2013; LRA, arXiv 2011.04006,
section 3.4).

Files (`lra_release/tsv_data/new_aan_pairs.{train,eval,test}.tsv`, frameworks.md 2.3): no header, five
tab-separated columns `label id1 id2 text1 text2`, quotes literal (LRA reads them with `use_quote_delim=False`, so
we split on tabs only; a CSV reader with quoting would mis-split rows). The label is written as a float (`1.0`).
Each document is its UTF-8 bytes + 1 (0 = padding), truncated to `seq_len` = 4000 bytes per document; both
documents are returned (`inputs`, `inputs2`) and the model's NLI head combines them. `eval` is the validation split.

A file cut short (a download or copy interrupted mid-row) is never read without a word. A cut inside the first four
columns leaves a row of fewer than five columns, and the file is refused. A cut inside the last column, `text2`,
leaves all five in place, so the only mark of it is the missing newline at the end of the last row. A file whose
writer left off the final newline looks the same, and nothing says whether the release's files end with one, so a
last row without a newline is read and a warning names the file, the row and the fix, rather than refusing what may
be a complete file. At most that one row's second document is cut.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from longmixer.data.base import RaggedDataset, SequenceDataModule, label_counts, save_ragged
from longmixer.data.integrity import SourceFileError, SourceFileMissingError, warn_truncated
from longmixer.data.text import BYTE_VOCAB, byte_ids, check_vocab

log = logging.getLogger(__name__)

FILES = {"train": "new_aan_pairs.train.tsv", "val": "new_aan_pairs.eval.tsv", "test": "new_aan_pairs.test.tsv"}
REFETCH = "re-extract the LRA release's tsv_data or point data.source_dir at a complete copy"


def read_aan_tsv(path: Path, max_len: int) -> tuple[list[np.ndarray], list[np.ndarray], list[int]]:
    """One AAN pairs file -> (document-1 ids, document-2 ids, labels), each document truncated to `max_len`.

    Raises:
        FileNotFoundError: the file is missing.
        ValueError: a line without exactly 5 tab-separated columns, or a label other than 0/1.
    """
    path = Path(path)
    if not path.exists():
        raise SourceFileMissingError(f"AAN file {path} is missing; run `python scripts/prepare_data.py retrieval` or "
                                "point data.source_dir at the LRA release's tsv_data folder")
    docs1, docs2, labels, raw_lengths = [], [], [], []
    with open(path, "rb") as f:  # bytes: the documents are byte-encoded anyway, and no decoding can fail
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue  # a blank line (a trailing newline too many): no example
            if not line.endswith(b"\n"):  # only the last line can lack it: see the module docstring
                log.warning("%s:%d: the last row has no newline at its end; if the file was cut short there (a "
                            "download or copy stopped inside that row's second document), %s. A complete file "
                            "needs nothing (`echo >> %s` adds the newline and silences this)", path, line_no,
                            REFETCH, path)
            cols = line.rstrip(b"\r\n").split(b"\t")
            if len(cols) != 5:
                raise SourceFileError(f"{path}:{line_no}: expected 5 tab-separated columns (label, id1, id2, text1, "
                                      f"text2), got {len(cols)}; the file is truncated or not an AAN pairs TSV: "
                                      f"{REFETCH}")
            try:
                label = float(cols[0])
            except ValueError:  # not a number: reported below
                label = -1.0
            if label not in (0.0, 1.0):
                raise SourceFileError(f"{path}:{line_no}: label {cols[0].decode(errors='replace')!r} is not 0 or 1")
            labels.append(int(label))
            docs1.append(byte_ids(cols[3], max_len))
            docs2.append(byte_ids(cols[4], max_len))
            raw_lengths += [len(cols[3]), len(cols[4])]
    if not labels:
        raise SourceFileError(f"{path} holds no examples; the split is empty: {REFETCH}")
    warn_truncated(f"{path.name} documents", np.asarray(raw_lengths), max_len)
    return docs1, docs2, labels


class PairDataset(Dataset):
    """Two aligned ragged stores: items `{"inputs", "inputs2", "labels"}`."""

    def __init__(self, root: Path, split: str, max_len: int):
        self.first = RaggedDataset(root, f"{split}.doc1", max_len=max_len)
        self.second = RaggedDataset(root, f"{split}.doc2", max_len=max_len)

    def __len__(self) -> int:
        return len(self.first)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        a, b = self.first[i], self.second[i]
        return {"inputs": a["inputs"], "inputs2": b["inputs"], "labels": a["labels"]}


class AAN(SequenceDataModule):
    """LRA Retrieval: batches `inputs`, `mask`, `inputs2`, `mask2` (long / bool [B, L <= seq_len]), `labels` [B].

    Args:
        seq_len: bytes kept per document (LRA: 4000); the prepared files are truncated to it.
        vocab_size: 257 (bytes + padding).
        num_classes: 2.
        source_dir: a folder holding the three `new_aan_pairs.*.tsv` (skips the LRA release download).
        **kwargs: `SequenceDataModule` arguments.
    """

    name = "retrieval"
    variable_length = True

    def __init__(self, seq_len: int = 4000, vocab_size: int = BYTE_VOCAB, num_classes: int = 2,
                 source_dir: str | None = None, **kwargs):
        super().__init__(**kwargs)
        check_vocab("AAN retrieval", vocab_size, num_classes, 2)
        if seq_len < 1:
            raise ValueError(f"data.seq_len={seq_len} must be positive (LRA: 4000)")
        self.seq_len, self.vocab_size, self.num_classes = seq_len, vocab_size, num_classes
        self.source_dir = None if source_dir is None else Path(source_dir)

    @property
    def root(self) -> Path:
        # the documents are cut to seq_len when prepared, so each length has its own folder: runs at several lengths
        # (a sweep) neither rebuild each other's data in turn nor read it while another run rebuilds it
        return self.data_dir / self.name / f"len{self.seq_len}"

    def prepare_fingerprint(self) -> dict:
        return {"seq_len": self.seq_len}

    def _source(self) -> Path:
        if self.source_dir is not None:
            return self.source_dir
        from longmixer.data.lra_release import aan_dir, ensure_lra_release

        return aan_dir(ensure_lra_release(self.data_dir / "lra_release", parts=["tsv_data"])["tsv_data"])

    def _prepare(self, root: Path) -> tuple[dict, dict]:
        source = self._source()
        splits = {}
        for split, filename in FILES.items():
            docs1, docs2, labels = read_aan_tsv(source / filename, self.seq_len)
            save_ragged(root, f"{split}.doc1", docs1, labels, dtype=np.int16)
            save_ragged(root, f"{split}.doc2", docs2, labels, dtype=np.int16)
            lengths = np.array([len(d) for d in docs1 + docs2])
            splits[split] = {"count": len(labels), "labels": label_counts(labels),
                             "doc_length_mean": float(lengths.mean()),
                             "doc_full_fraction": float((lengths == self.seq_len).mean())}
        return splits, {"source": str(source), "vocab_size": BYTE_VOCAB, "num_classes": 2}

    def _load(self, root: Path, manifest: dict):
        return {split: PairDataset(root, split, self.seq_len) for split in FILES}
