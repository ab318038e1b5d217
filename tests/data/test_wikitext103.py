"""WikiText-103 word level: `<eos>` per line, training-count vocabulary order, `<unk>` for unseen words, streams."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from longmixer.data.integrity import SourceFileError, SourceFileMissingError
from longmixer.data.wikitext103 import WikiText103
from tests.data.fixtures_extra import WIKI_TEXT, write_wikitext_fixture


@pytest.fixture
def wt(tmp_path):
    overrides = write_wikitext_fixture(tmp_path / "raw")
    dm = WikiText103(data_dir=tmp_path / "data", batch_size=2, k_min=1, k_max=2, eval_context=8, **overrides)
    dm.prepare_data()
    dm.setup()
    return dm


def words_with_eos(split):
    return [w for line in WIKI_TEXT[split] for w in line.split() + ["<eos>"]]


def test_vocabulary_order(wt):
    vocab = (wt.root / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    assert vocab[:2] == ["<pad>", "<eos>"] and len(vocab) == wt.vocab_size
    counts = Counter(words_with_eos("train"))
    freqs = [counts[w] for w in vocab[2:]]
    assert freqs == sorted(freqs, reverse=True)  # descending training count: what the adaptive cutoffs assume
    first_seen = {w: i for i, w in reversed(list(enumerate(words_with_eos("train"))))}
    for a, b in zip(vocab[2:], vocab[3:]):
        if counts[a] == counts[b]:
            assert first_seen[a] < first_seen[b]  # ties by first appearance


def test_streams_decode_to_the_text(wt):
    vocab = (wt.root / "vocab.txt").read_text(encoding="utf-8").split("\n")[:-1]
    train = np.load(wt.root / "train.npy")
    assert [vocab[i] for i in train] == words_with_eos("train")  # empty lines are a lone <eos>
    valid = [vocab[i] for i in np.load(wt.root / "val.npy")]
    expected = [w if w in set(vocab) else "<unk>" for w in words_with_eos("valid")]
    assert valid == expected and "<unk>" in valid


def test_loaders(wt):
    batch = next(iter(wt.train_dataloader()))
    assert batch["inputs"].shape[0] == 2 and batch["inputs"].shape[1] in (16, 32)
    assert batch["targets"].shape == batch["inputs"].shape and "mask" not in batch
    tokens = np.load(wt.root / "test.npy")
    scored = [t for b in wt.test_dataloader() for t in b["targets"][b["targets"] != -100].tolist()]
    assert scored == tokens[1:].tolist()  # every test token scored once


def test_vocab_size_mismatch_names_the_fix(tmp_path):
    overrides = write_wikitext_fixture(tmp_path / "raw")
    overrides["vocab_size"] += 1
    dm = WikiText103(data_dir=tmp_path / "data", **overrides)
    dm.prepare_data()
    with pytest.raises(ValueError, match=f"set data.vocab_size={overrides['vocab_size'] - 1}"):
        dm.setup()


def test_a_missing_split_file_names_the_files_and_folder(tmp_path):
    """A missing `wiki.valid.tokens` was a bare `[Errno 2]` traceback; the error names the folder and the files."""
    overrides = write_wikitext_fixture(tmp_path / "raw")
    (tmp_path / "raw" / "wiki.valid.tokens").unlink()
    with pytest.raises(SourceFileMissingError, match=r"lacks \['wiki.valid.tokens'\] \(WikiText-103 needs"):
        WikiText103(data_dir=tmp_path / "data", **overrides).prepare_data()


def test_a_byte_that_is_not_utf8_is_located(tmp_path):
    """A non-UTF-8 byte escaped as a UnicodeDecodeError traceback; it is one line naming the file, line and column."""
    overrides = write_wikitext_fixture(tmp_path / "raw")
    path = tmp_path / "raw" / "wiki.train.tokens"
    path.write_bytes(path.read_bytes().replace(b"\n", b"\n ab\xffc\n", 1))
    with pytest.raises(SourceFileError, match=rf"{path}:2:4: byte 0xff is not UTF-8"):
        WikiText103(data_dir=tmp_path / "data", **overrides).prepare_data()
