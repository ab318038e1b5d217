"""enwik8 bytes: first / next / last split, byte + 1 ids with newlines kept, split sizes as a fingerprint."""

from __future__ import annotations

import json

import numpy as np
import pytest

from longmixer.data.enwik8 import Enwik8
from longmixer.data.integrity import SourceFileMissingError
from tests.data.fixtures_extra import ENWIK8_BYTES, ENWIK8_EVAL, enwik8_bytes, write_enwik8_fixture


def make(tmp_path, **kw):
    overrides = {**write_enwik8_fixture(tmp_path / "raw"), **kw}
    dm = Enwik8(data_dir=tmp_path / "data", batch_size=2, **overrides)
    dm.prepare_data()
    dm.setup()
    return dm


def test_split_first_next_last_as_byte_ids(tmp_path):
    dm = make(tmp_path)
    raw = np.frombuffer(enwik8_bytes(), dtype=np.uint8).astype(np.int64)
    n_train = ENWIK8_BYTES - 2 * ENWIK8_EVAL
    parts = {s: np.load(dm.root / f"{s}.npy").astype(np.int64) - 1 for s in ("train", "val", "test")}
    assert np.array_equal(parts["train"], raw[:n_train])
    assert np.array_equal(parts["val"], raw[n_train:n_train + ENWIK8_EVAL])
    assert np.array_equal(parts["test"], raw[-ENWIK8_EVAL:])
    assert (parts["train"] == ord("\n")).any()  # newline bytes stay in the stream
    manifest = json.loads((dm.root / "manifest.json").read_text())
    assert manifest["meta"]["vocab_size"] == 257 and manifest["splits"]["test"]["count"] == ENWIK8_EVAL


def test_batches_are_byte_ids_in_range(tmp_path):
    dm = make(tmp_path)
    batch = next(iter(dm.train_dataloader()))
    assert batch["inputs"].shape == (2, 16) and batch["inputs"].min() >= 1 and batch["inputs"].max() <= 256
    windows = list(dm.val_dataloader())
    assert sum(int((b["targets"] != -100).sum()) for b in windows) == ENWIK8_EVAL - 1


def test_changing_the_split_size_rebuilds(tmp_path):
    make(tmp_path)
    dm = make(tmp_path, eval_bytes=1000)
    assert np.load(dm.root / "test.npy").size == 1000


def test_too_small_file_raises(tmp_path):
    with pytest.raises(ValueError, match="data.eval_bytes=3000"):
        make(tmp_path, eval_bytes=3000)


def test_a_missing_byte_file_names_it(tmp_path):
    """A source folder without `enwik8` was a bare `[Errno 2]` traceback; the error names the file and the fix."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceFileMissingError, match=f"{tmp_path / 'empty' / 'enwik8'} is missing"):
        Enwik8(data_dir=tmp_path / "data", source_dir=tmp_path / "empty").prepare_data()
