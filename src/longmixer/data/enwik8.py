"""enwik8, byte level (frameworks.md section 2.10; CHELA table 5, LongVQ table 4, SeqBoat table 3).

The first 100,000,000 bytes of English Wikipedia, split first 90M train / next 5M valid / last 5M test (awd-lstm-lm
`prep_enwik8.py`, used by Transformer-XL and MEGA). Every byte is one token, newline bytes included: MEGA's fairseq
binarization turns each newline into an end-of-line token, which keeps them in the stream and in the count, whereas
Transformer-XL's loader drops them - we follow MEGA, whose data split CHELA and LongVQ reuse (CHELA appendix A.2).
Token id = byte value + 1, so id 0 stays the framework's padding id and never occurs; vocab_size = 257. The loss
per token is the loss per byte, and the task reports it in bits (`metric: bpc`).

Source: `enwik8.zip` (the file `enwik8`), downloaded once into `<data_dir>/enwik8/raw/`. Prepared:
`<data_dir>/enwik8/eval<eval_bytes>/{train,val,test}.npy`, uint8 byte streams + 1 stored as int16.

Size: with the standard splits (`eval_bytes` = 5,000,000) the file must hold 100,000,000 bytes, the real enwik8's
size, whether downloaded or in `data.source_dir`; another size is refused, not warned about. A copy cut short (or
with bytes added) splits without complaint, but its last 2 x 5M bytes are not the standard valid and test splits, so
its bpc would be reported as enwik8's while measuring other text, and a warning scrolls past in a long run's log.
`data.source_dir` does not signal another file: its usual use is a copy of the real one on a machine without
internet. Another `eval_bytes` does: the splits are not the standard ones anyway, so a byte file of any size that
holds them is taken (a sample for a quick run, as the tests use). `expected_bytes` spells the rule out: "auto" (the
default) is the above, an integer asks for exactly that size, null takes any size. The manifest records the size
the data was prepared from, and `setup()` refuses data prepared from a file of another size for the same reason.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from filelock import FileLock

from longmixer.data.lm_stream import LMDataModule
from longmixer.data.download import download, extract, extracted
from longmixer.data.integrity import DatasetNotPreparedError, SourceFileError, SourceFileMissingError, rebuild_hint

ENWIK8_URL = "https://mattmahoney.net/dc/enwik8.zip"  # no checksum published: recorded at first download
ENWIK8_BYTES = 100_000_000
SPLIT_BYTES = 5_000_000


def expected_size(expected_bytes: int | str | None, eval_bytes: int) -> int | None:
    """The size `expected_bytes` asks for: "auto" is enwik8's with the standard splits and any (None) with others."""
    if expected_bytes == "auto":
        return ENWIK8_BYTES if eval_bytes == SPLIT_BYTES else None
    return expected_bytes


def size_mismatch(size: int, expected_bytes: int | None) -> str | None:
    """None where a byte file of `size` bytes is what `expected_bytes` asks for (None: any size); else what differs."""
    if expected_bytes is None or size == expected_bytes:
        return None
    which = " (enwik8's size)" if expected_bytes == ENWIK8_BYTES else ""
    return (f"{size:,} bytes, not data.expected_bytes={expected_bytes}{which}: a copy cut short or another file, so "
            "its valid and test splits (its last 2 x data.eval_bytes bytes) would not be the expected file's")


def split_bytes(data: np.ndarray, eval_bytes: int, path: Path, fix: str) -> dict[str, np.ndarray]:
    """First len - 2 * eval_bytes to train, the next eval_bytes to val, the last eval_bytes to test.

    Raises:
        SourceFileError: `data` (read from `path`) leaves no training bytes, naming the file and `fix`.
    """
    if data.size <= 2 * eval_bytes:
        raise SourceFileError(f"{path} has {data.size} bytes, too few for two evaluation splits of "
                              f"data.eval_bytes={eval_bytes} and a training split (enwik8 is {ENWIK8_BYTES:,} "
                              f"bytes): {fix}, or lower data.eval_bytes")
    n_train = data.size - 2 * eval_bytes
    return {"train": data[:n_train], "val": data[n_train:n_train + eval_bytes], "test": data[n_train + eval_bytes:]}


class Enwik8(LMDataModule):
    """enwik8 byte-level LM: training segments and evaluation windows of byte ids (byte + 1); see `LMDataModule`.

    Args:
        eval_bytes: bytes in each of valid and test (5,000,000; train is the rest, 90M of the 100M).
        source_dir: a folder holding the file `enwik8` (skips the download); None: download into
            `<data_dir>/enwik8/raw`.
        expected_bytes: the size the file must have: "auto" (100,000,000, enwik8's, with the standard
            `eval_bytes`; any size with another), an integer, or None (any size that holds the splits); see the
            module docstring.
        seq_len, vocab_size, k_min, k_max, eval_window, eval_context, metric, roll, data_dir, batch_size,
            eval_batch_size, num_workers, seed, split_seed, pin_memory: see `LMDataModule`.
    """

    name = "enwik8"

    def __init__(self, eval_bytes: int = SPLIT_BYTES, seq_len: int = 2048, vocab_size: int = 257, k_min: int = 1,
                 k_max: int = 1, eval_window: int | None = None, eval_context: int = 0, metric: str = "bpc",
                 roll: bool = True, source_dir: str | Path | None = None, expected_bytes: int | str | None = "auto",
                 data_dir: str | Path | None = None, batch_size: int = 8, eval_batch_size: int | None = None,
                 num_workers: int | None = None, seed: int = 0, split_seed: int = 0, pin_memory: bool | None = None,
                 persistent_workers: bool | None = None):
        super().__init__(seq_len=seq_len, vocab_size=vocab_size, k_min=k_min, k_max=k_max, eval_window=eval_window,
                         eval_context=eval_context, metric=metric, roll=roll, data_dir=data_dir,
                         batch_size=batch_size, eval_batch_size=eval_batch_size, num_workers=num_workers, seed=seed,
                         split_seed=split_seed, pin_memory=pin_memory,
                         persistent_workers=persistent_workers)
        if not (expected_bytes is None or expected_bytes == "auto"
                or (isinstance(expected_bytes, int) and not isinstance(expected_bytes, bool) and expected_bytes >= 1)):
            raise ValueError(f"data.expected_bytes={expected_bytes} must be auto, a positive size (enwik8: "
                             f"{ENWIK8_BYTES}) or "
                             "null (any size)")
        self.eval_bytes, self.expected_bytes = eval_bytes, expected_size(expected_bytes, eval_bytes)
        self.source_dir = None if source_dir is None else Path(source_dir)

    @property
    def root(self) -> Path:
        # the splits are cut at prepare time, so each eval_bytes has its own folder (as Retrieval's len<seq_len>):
        # runs at two values neither rebuild each other's data in turn nor read it while another run rebuilds it
        return self.data_dir / self.name / f"eval{self.eval_bytes}"

    def prepare_fingerprint(self) -> dict:
        return {"eval_bytes": self.eval_bytes}

    def _download(self) -> Path:
        """`<data_dir>/enwik8/raw/enwik8`, downloaded and unzipped once for every eval_bytes. Each value's prepare
        holds only its own folder's lock, so the shared download takes a lock of its own: two runs at two values
        would otherwise append to the same `enwik8.zip.part`."""
        raw = self.data_dir / self.name / "raw"
        if not extracted(raw, "enwik8.zip"):
            raw.mkdir(parents=True, exist_ok=True)
            with FileLock(str(raw / ".lock")):
                if not extracted(raw, "enwik8.zip"):  # again under the lock: another run may have unzipped it
                    extract(download(ENWIK8_URL, raw / "enwik8.zip"), raw)
        return raw / "enwik8"

    def _prepare(self, root: Path) -> tuple[dict, dict]:
        self.note_old_layout(self.root.parent, "data.eval_bytes")
        raw = self.source_dir / "enwik8" if self.source_dir is not None else self._download()
        if not raw.is_file():
            raise SourceFileMissingError(f"{raw} is missing (enwik8 is the one file `enwik8`, 100,000,000 bytes, in "
                                         f"{raw.parent}): point data.source_dir at the folder of the unzipped "
                                         "enwik8.zip, or leave it unset to download it")
        fix = (f"put the file from enwik8.zip in data.source_dir={self.source_dir}" if self.source_dir is not None
               else f"delete {raw.parent} and prepare again to download it afresh")
        mismatch = size_mismatch(raw.stat().st_size, self.expected_bytes)
        if mismatch is not None:
            raise SourceFileError(f"{raw} has {mismatch}; {fix}, or set data.expected_bytes=null to split this file "
                                  "as it is")
        data = np.fromfile(raw, dtype=np.uint8)
        splits = {}
        for split, part in split_bytes(data, self.eval_bytes, raw, fix).items():
            np.save(root / f"{split}.npy", part.astype(np.int16) + 1)
            splits[split] = {"count": int(part.size)}
        return splits, {"vocab_size": 257, "tokenizer": "bytes+1", "total_bytes": int(data.size)}

    def _load(self, root: Path, manifest: dict):
        """`LMDataModule._load`, once the size the data was prepared from passes the size check."""
        mismatch = size_mismatch(manifest["meta"]["total_bytes"], self.expected_bytes)
        if mismatch is not None:
            raise DatasetNotPreparedError(f"{root} was prepared from a byte file of {mismatch}; "
                                          f"{rebuild_hint(root, self.prepare_hint)} with a file of that size in "
                                          "place, or set data.expected_bytes=null to use this data as it is")
        return super()._load(root, manifest)
