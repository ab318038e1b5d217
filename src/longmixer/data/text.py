"""LRA Text: IMDB sentiment at byte level (Maas et al. 2011; LRA, arXiv 2011.04006, section 3.3).

Protocol (LRA `lra_benchmarks/text_classification`, frameworks.md 2.2): the 25k training reviews train; the 25k test
reviews serve as **both validation and test**, as in LRA (there is no held-out validation set). Each review is its
UTF-8 bytes, id = byte + 1 with 0 the padding id (vocabulary 257, as `ByteTextEncoder`), truncated to `seq_len`
(4096 in the papers' tables; 1000 is LRA's code default, 2000 also appears: `text_1k`, `text_2k`). No EOS is
appended. The prepared arrays keep whole reviews, so every length variant reads the same files.

Source: the Hugging Face `stanfordnlp/imdb` dataset through `datasets` (columns `text`, `label` in {0, 1}), or a
folder of its parquet files (`train-*.parquet`, `test-*.parquet`) given as `source_dir`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from longmixer.data.base import RaggedDataset, SequenceDataModule, label_counts, save_ragged
from longmixer.data.download import DataDownloadError, download_hint
from longmixer.data.integrity import SourceFileError

log = logging.getLogger(__name__)

HF_NAME = "stanfordnlp/imdb"
BYTE_VOCAB = 257  # 256 byte values shifted by one + padding id 0


def byte_ids(text: str | bytes, max_len: int | None = None) -> np.ndarray:
    """UTF-8 bytes of `text` shifted by one (0 is padding), truncated to `max_len`: int16 [<= max_len]."""
    raw = np.frombuffer(text if isinstance(text, bytes) else text.encode("utf-8"), dtype=np.uint8)
    if max_len is not None:
        raw = raw[:max_len]
    return raw.astype(np.int16) + 1


def check_vocab(name: str, vocab_size: int, num_classes: int, classes: int) -> None:
    if vocab_size != BYTE_VOCAB:
        raise ValueError(f"data.vocab_size={vocab_size} but {name} is byte-level with {BYTE_VOCAB} ids "
                         f"(256 bytes + padding); set data.vocab_size={BYTE_VOCAB}")
    if num_classes != classes:
        raise ValueError(f"data.num_classes={num_classes} but {name} has {classes} classes; "
                         f"set data.num_classes={classes}")


def check_parquet(split: str, paths: list[Path]) -> None:
    """Read the footer of each of a split's parquet files, before `datasets` reads them: it reports a damaged file
    as "An error occurred while generating the dataset", naming neither the file nor the fix.

    Raises:
        SourceFileError: a file that is not a readable parquet file (cut, empty, another format), or a split whose
            files hold no rows.
    """
    import pyarrow
    import pyarrow.parquet as pq

    rows = 0
    for path in paths:
        try:
            rows += pq.ParquetFile(path).metadata.num_rows
        except (pyarrow.ArrowException, OSError) as err:
            raise SourceFileError(f"{path} is not a readable parquet file ({' '.join(str(err).split())}): a cut or "
                                  f"damaged copy; replace it with the {HF_NAME} file of that name in "
                                  "data.source_dir, or set data.source_dir to null to download") from None
    if rows == 0:
        raise SourceFileError(f"the IMDB {split} split is empty (no rows in {', '.join(map(str, paths))}); put the "
                              f"{HF_NAME} {split} files in data.source_dir, or set it to null to download")


def load_imdb(source_dir: Path | None, cache_dir: Path) -> dict[str, tuple[list[str], list[int]]]:
    """{"train", "test"} -> (texts, labels) from the hub (or a folder of its parquet files).

    Raises:
        DataDownloadError: the hub cannot be reached (one line, as scripts/prepare_data.py prints it).
        FileNotFoundError: `source_dir` holds no `train-*.parquet` / `test-*.parquet`.
        SourceFileError: one of them is not a readable parquet file, or a split's files hold no rows.
        ValueError: a row has no `text`/`label` column or a label outside {0, 1}.
    """
    import datasets  # only needed to prepare the data

    if source_dir is not None:
        files = {split: sorted(str(p) for p in Path(source_dir).rglob(f"{split}-*.parquet")) for split in
                 ("train", "test")}
        empty = [split for split, found in files.items() if not found]
        if empty:
            raise FileNotFoundError(f"data.source_dir={source_dir} holds no {empty[0]}-*.parquet; point it at the "
                                    f"folder of the {HF_NAME} parquet files or set it to null to download")
        for split, paths in files.items():
            check_parquet(split, [Path(p) for p in paths])
        ds = datasets.load_dataset("parquet", data_files=files, cache_dir=str(cache_dir))
    else:
        try:
            ds = datasets.load_dataset(HF_NAME, cache_dir=str(cache_dir))
        except ConnectionError as err:  # datasets reports an unreachable hub as ConnectionError
            raise DataDownloadError(download_hint(f"text ({HF_NAME} from the Hugging Face hub)", err)) from None
    out = {}
    for split in ("train", "test"):
        table = ds[split]
        missing = {"text", "label"} - set(table.column_names)
        if missing:
            raise ValueError(f"IMDB {split} split lacks columns {sorted(missing)} (has {table.column_names})")
        labels = [int(v) for v in table["label"]]
        bad = sorted({v for v in labels if v not in (0, 1)})
        if bad:
            raise ValueError(f"IMDB {split} split has labels {bad[:5]} outside {{0, 1}}; is this the imdb dataset?")
        out[split] = (list(table["text"]), labels)
    return out


class IMDB(SequenceDataModule):
    """LRA Text (byte-level IMDB): batches `inputs` long [B, L <= seq_len], `mask`, `labels` [B] in {0, 1}.

    Args:
        seq_len: truncation length in bytes (4096; `text_1k` / `text_2k` set 1000 / 2000).
        vocab_size: 257 (bytes + padding).
        num_classes: 2.
        source_dir: a folder of the dataset's parquet files (skips the hub download); None downloads.
        **kwargs: `SequenceDataModule` arguments (data_dir, batch_size, eval_batch_size, num_workers, seed,
            split_seed, pin_memory).
    """

    name = "text"
    variable_length = True

    def __init__(self, seq_len: int = 4096, vocab_size: int = BYTE_VOCAB, num_classes: int = 2,
                 source_dir: str | None = None, **kwargs):
        super().__init__(**kwargs)
        check_vocab("IMDB", vocab_size, num_classes, 2)
        if seq_len < 1:
            raise ValueError(f"data.seq_len={seq_len} must be positive (LRA: 4096)")
        self.seq_len, self.vocab_size, self.num_classes = seq_len, vocab_size, num_classes
        self.source_dir = None if source_dir is None else Path(source_dir)

    def _prepare(self, root: Path) -> tuple[dict, dict]:
        rows = load_imdb(self.source_dir, root / "hf_cache")
        splits = {}
        for split, (texts, labels) in rows.items():
            sequences = [byte_ids(t) for t in texts]
            save_ragged(root, split, sequences, labels, dtype=np.int16)
            lengths = np.array([len(s) for s in sequences])
            splits[split] = {"count": len(labels), "labels": label_counts(labels),
                             "length_mean": float(lengths.mean()), "length_max": int(lengths.max()),
                             "truncated_at_4096": float((lengths > 4096).mean())}
        source = str(self.source_dir) if self.source_dir is not None else HF_NAME
        return splits, {"source": source, "vocab_size": BYTE_VOCAB, "num_classes": 2, "val_is_test": True}

    def _load(self, root: Path, manifest: dict):
        test = RaggedDataset(root, "test", max_len=self.seq_len)
        # LRA validates on the test split (frameworks.md 2.2); the same reviews, so the same dataset object
        return {"train": RaggedDataset(root, "train", max_len=self.seq_len), "val": test, "test": test}
