"""WikiText-103, word level (frameworks.md section 2.9; CHELA table 4, LongVQ table 3, LaS appendix C).

Tokenization (Transformer-XL's `Vocab`, reused by s4): each line of `wiki.{train,valid,test}.tokens` is split on
whitespace (case kept; `<unk>` is an ordinary word of the text) and gets `<eos>` appended, so an empty line becomes a
lone `<eos>`. The vocabulary is counted on train only: id 0 is `<pad>` (the framework's padding id, never in the
stream), id 1 is `<eos>`, then the words by descending training count, ties in order of first appearance. This
frequency order is what the adaptive input / softmax cutoffs (20000, 60000 as MEGA; 20000, 40000, 200000 as
Transformer-XL) assume. 267,735 types + `<pad>` = 267,736 ids. A valid/test word missing from the vocabulary maps to
`<unk>` (none is missing in the released data).

Source: `wikitext-103-v1.zip` (its `wikitext-103/wiki.*.tokens`). Prepared: `{train,val,test}.npy` int32 token
streams and `vocab.txt` (one word per line, in id order).
"""

from __future__ import annotations

import logging
from array import array
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from longmixer.data.lm_stream import LMDataModule
from longmixer.data.download import download, extract, extracted
from longmixer.data.integrity import SourceFileError, SourceFileMissingError, locate_bad_utf8

log = logging.getLogger(__name__)

WT103_URL = "https://wikitext.smerity.com/wikitext-103-v1.zip"
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPLIT_FILES = {"train": "wiki.train.tokens", "val": "wiki.valid.tokens", "test": "wiki.test.tokens"}


def read_lines(path: Path) -> Iterable[list[str]]:
    """The whitespace-split words of each line, with `<eos>` appended (Transformer-XL `add_eos=True`).

    Raises:
        SourceFileError: a byte that is not UTF-8, naming the file, line and column.
    """
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                yield line.split() + [EOS]
    except UnicodeDecodeError:
        line_no, col, byte = locate_bad_utf8(path)
        raise SourceFileError(f"{path}:{line_no}:{col}: byte 0x{byte:02x} is not UTF-8; WikiText-103 files are "
                              "UTF-8 text: replace the file with the archive's copy (delete the folder and prepare "
                              "again to download it, or correct data.source_dir)") from None


def build_vocab(path: Path) -> list[str]:
    """`<pad>`, `<eos>`, then the training words by descending count (ties: first appearance)."""
    counts: Counter[str] = Counter()
    for words in read_lines(path):
        counts.update(words)
    counts.pop(EOS, None)
    return [PAD, EOS] + [word for word, _ in sorted(counts.items(), key=lambda kv: -kv[1])]  # stable: first seen


def encode(path: Path, index: dict[str, int]) -> np.ndarray:
    """The whole file as one int32 stream of ids."""
    unk = index.get(UNK)
    ids = array("i")  # 4 bytes per token: the 103M training tokens stay around 400 MB while encoding
    for words in read_lines(path):
        for word in words:
            i = index.get(word, unk)
            if i is None:
                raise ValueError(f"{path}: word {word!r} is not in the training vocabulary and there is no {UNK}")
            ids.append(i)
    return np.frombuffer(ids, dtype=np.int32).copy()


class WikiText103(LMDataModule):
    """WikiText-103 word-level LM: training segments and evaluation windows of token ids; see `LMDataModule`.

    Args:
        source_dir: a folder holding `wiki.{train,valid,test}.tokens` (skips the download); None: download into
            `<data_dir>/wikitext103/raw`.
        seq_len, vocab_size, k_min, k_max, eval_window, eval_context, metric, roll, data_dir, batch_size,
            eval_batch_size, num_workers, seed, split_seed, pin_memory: see `LMDataModule`.
    """

    name = "wikitext103"

    def __init__(self, seq_len: int = 1024, vocab_size: int = 267_736, k_min: int = 1, k_max: int = 1,
                 eval_window: int | None = None, eval_context: int = 0, metric: str = "ppl", roll: bool = True,
                 source_dir: str | Path | None = None, data_dir: str | Path | None = None, batch_size: int = 8,
                 eval_batch_size: int | None = None, num_workers: int | None = None, seed: int = 0, split_seed: int = 0,
                 pin_memory: bool | None = None,
                 persistent_workers: bool | None = None):
        super().__init__(seq_len=seq_len, vocab_size=vocab_size, k_min=k_min, k_max=k_max, eval_window=eval_window,
                         eval_context=eval_context, metric=metric, roll=roll, data_dir=data_dir,
                         batch_size=batch_size, eval_batch_size=eval_batch_size, num_workers=num_workers, seed=seed,
                         split_seed=split_seed, pin_memory=pin_memory,
                         persistent_workers=persistent_workers)
        self.source_dir = None if source_dir is None else Path(source_dir)

    def _prepare(self, root: Path) -> tuple[dict, dict]:
        raw = self.source_dir or root / "raw" / "wikitext-103"
        if self.source_dir is None and not extracted(root / "raw", "wikitext-103-v1.zip"):
            extract(download(WT103_URL, root / "raw" / "wikitext-103-v1.zip"), root / "raw")
        missing = [name for name in SPLIT_FILES.values() if not (raw / name).is_file()]
        if missing:
            raise SourceFileMissingError(f"{raw} lacks {missing} (WikiText-103 needs {list(SPLIT_FILES.values())}): "
                                         "point data.source_dir at the folder of the extracted wikitext-103-v1.zip, "
                                         "or leave it unset to download it")
        log.info("counting the WikiText-103 training vocabulary")
        vocab = build_vocab(raw / SPLIT_FILES["train"])
        index = {word: i for i, word in enumerate(vocab)}
        (root / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
        splits = {}
        for split, name in SPLIT_FILES.items():
            tokens = encode(raw / name, index)
            np.save(root / f"{split}.npy", tokens)
            splits[split] = {"count": int(tokens.size)}
        return splits, {"vocab_size": len(vocab), "tokenizer": "wt103-word-eos"}
