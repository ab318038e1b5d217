"""enwik8 bytes: first / next / last split, byte + 1 ids with newlines kept, split sizes as a fingerprint."""

from __future__ import annotations

import json

import numpy as np
import pytest

from longmixer.data.enwik8 import Enwik8
from longmixer.data.integrity import DatasetNotPreparedError, SourceFileError, SourceFileMissingError
from tests.data.fixtures_extra import ENWIK8_BYTES, ENWIK8_EVAL, LM_SEQ_LEN, enwik8_bytes, write_enwik8_fixture


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


def test_another_split_size_is_prepared_in_its_own_folder(tmp_path):
    first = make(tmp_path)
    dm = make(tmp_path, eval_bytes=1000)
    assert dm.root != first.root and np.load(dm.root / "test.npy").size == 1000


def test_too_small_file_raises(tmp_path):
    with pytest.raises(ValueError, match="data.eval_bytes=3000"):
        make(tmp_path, eval_bytes=3000)


def test_a_missing_byte_file_names_it(tmp_path):
    """A source folder without `enwik8` was a bare `[Errno 2]` traceback; the error names the file and the fix."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceFileMissingError, match=f"{tmp_path / 'empty' / 'enwik8'} is missing"):
        Enwik8(data_dir=tmp_path / "data", source_dir=tmp_path / "empty").prepare_data()


def test_runs_at_two_split_sizes_keep_their_own_data_and_share_the_download(tmp_path, caplog):
    """Regression: every data.eval_bytes shared one folder although the splits are cut at prepare time, so runs at
    two values rebuilt it in turn, and a run reading it while another rebuilt it stopped with "made with other
    settings" or "the file was changed". Each value now has its own folder beside the one download."""
    import logging
    import zipfile

    raw = tmp_path / "data" / "enwik8" / "raw"
    raw.mkdir(parents=True)
    with zipfile.ZipFile(raw / "enwik8.zip", "w") as z:  # a download already there: nothing is fetched
        z.writestr("enwik8", enwik8_bytes())
    (raw.parent / "manifest.json").write_text("{}")  # data prepared in the old place, <data>/enwik8/ itself
    common = dict(data_dir=tmp_path / "data", seq_len=LM_SEQ_LEN, expected_bytes=ENWIK8_BYTES)
    first = Enwik8(eval_bytes=600, **common)
    with caplog.at_level(logging.WARNING):
        first.prepare_data()
    assert "is no longer read" in caplog.text and str(first.root) in caplog.text
    manifest = (first.root / "manifest.json").read_text()
    other = Enwik8(eval_bytes=1000, **common)
    other.prepare_data()
    assert other.root != first.root and np.load(other.root / "test.npy").size == 1000
    caplog.clear()
    again = Enwik8(eval_bytes=600, **common)
    with caplog.at_level(logging.WARNING):
        again.setup()  # no prepare_data: a run that reads what it prepared before
        again.prepare_data()
    assert "rebuilding" not in caplog.text and (again.root / "manifest.json").read_text() == manifest
    assert sorted(p.name for p in raw.parent.iterdir()) == ["eval1000", "eval600", "manifest.json", "raw"]


@pytest.mark.parametrize("size", [pytest.param(0, id="zero-bytes"), pytest.param(900, id="cut")])
def test_a_byte_file_too_short_for_its_splits_is_named(tmp_path, size):
    """Regression: an `enwik8` cut to zero bytes (or to fewer than two evaluation splits) stopped with "the byte file
    has 0 bytes", naming neither the file nor the fix. A file taken at any size (`expected_bytes=None`): under a
    size, the size check refuses it first."""
    overrides = {**write_enwik8_fixture(tmp_path / "raw"), "expected_bytes": None}
    path = tmp_path / "raw" / "enwik8"
    path.write_bytes(enwik8_bytes(size))
    with pytest.raises(SourceFileError, match=rf"{path} has {size} bytes, too few for .*data.eval_bytes="
                                              rf"{ENWIK8_EVAL}.*enwik8.zip"):
        Enwik8(data_dir=tmp_path / "data", batch_size=2, **overrides).prepare_data()


@pytest.mark.parametrize("size", [pytest.param(ENWIK8_BYTES - 700, id="cut-short"),
                                  pytest.param(ENWIK8_BYTES + 700, id="longer")])
def test_a_byte_file_of_another_size_is_refused(tmp_path, size):
    """Regression: an `enwik8` of another size than the real file's (a copy cut short, or one with bytes added) was
    split as it was, so its valid and test splits were other bytes than enwik8's, without a word. It is refused,
    naming the file, both sizes and the fixes."""
    overrides = write_enwik8_fixture(tmp_path / "raw")
    path = tmp_path / "raw" / "enwik8"
    path.write_bytes(enwik8_bytes(size))
    with pytest.raises(SourceFileError, match=rf"{path} has {size:,} bytes, not data.expected_bytes={ENWIK8_BYTES}: "
                                              rf"a copy cut short or another file.*put the file from enwik8.zip in "
                                              rf"data.source_dir=.*, or set data.expected_bytes=null"):
        Enwik8(data_dir=tmp_path / "data", batch_size=2, **overrides).prepare_data()
    assert not (tmp_path / "data" / "enwik8" / f"eval{ENWIK8_EVAL}" / "manifest.json").exists()


def test_the_download_must_have_enwik8s_size(tmp_path):
    """Regression: by default (the download, the standard splits, `expected_bytes: auto`) a byte file of another size
    was prepared as enwik8; the error names the real size and how to download it afresh."""
    import zipfile

    raw = tmp_path / "data" / "enwik8" / "raw"
    raw.mkdir(parents=True)
    with zipfile.ZipFile(raw / "enwik8.zip", "w") as z:  # a download already there: nothing is fetched
        z.writestr("enwik8", enwik8_bytes())
    with pytest.raises(SourceFileError, match=rf"{raw / 'enwik8'} has {ENWIK8_BYTES:,} bytes, not "
                                              rf"data.expected_bytes=100000000 \(enwik8's size\).*delete {raw} and "
                                              rf"prepare again to download it afresh"):
        Enwik8(data_dir=tmp_path / "data", seq_len=LM_SEQ_LEN).prepare_data()


def test_with_other_splits_auto_takes_a_sample_file_of_any_size(tmp_path):
    """`expected_bytes: auto` asks for enwik8's size only with the standard `eval_bytes`: another split size says
    the file is a sample (a quick run's, a test's), and a file of any size that holds the splits is prepared."""
    root = tmp_path / "raw"
    root.mkdir()
    (root / "enwik8").write_bytes(enwik8_bytes(ENWIK8_BYTES - 700))
    dm = Enwik8(data_dir=tmp_path / "data", source_dir=root, eval_bytes=ENWIK8_EVAL, seq_len=LM_SEQ_LEN)
    dm.prepare_data()
    dm.setup()
    assert np.load(dm.root / "test.npy").size == ENWIK8_EVAL


@pytest.mark.parametrize("value", [0, -5, "100M", True])
def test_a_bad_expected_bytes_names_the_key(value):
    with pytest.raises(ValueError, match=rf"data.expected_bytes={value} must be auto, a positive size"):
        Enwik8(expected_bytes=value)


def test_expected_bytes_null_takes_another_file_and_setup_then_checks_its_size(tmp_path):
    """`data.expected_bytes=null` splits a byte file of any size as it is; data prepared so is refused by `setup()`
    where a size is asked for again, since the manifest records the size it was made from."""
    overrides = write_enwik8_fixture(tmp_path / "raw")
    (tmp_path / "raw" / "enwik8").write_bytes(enwik8_bytes(ENWIK8_BYTES - 700))
    dm = Enwik8(data_dir=tmp_path / "data", batch_size=2, **{**overrides, "expected_bytes": None})
    dm.prepare_data()
    dm.setup()
    assert np.load(dm.root / "train.npy").size == ENWIK8_BYTES - 700 - 2 * ENWIK8_EVAL
    sized = Enwik8(data_dir=tmp_path / "data", batch_size=2, **overrides)
    sized.prepare_data()  # the same settings that determine the files: nothing to prepare
    with pytest.raises(DatasetNotPreparedError, match=rf"{dm.root} was prepared from a byte file of "
                                                      rf"{ENWIK8_BYTES - 700:,} bytes, not data.expected_bytes="
                                                      rf"{ENWIK8_BYTES}.*manifest.json.*data.expected_bytes=null"):
        sized.setup()
