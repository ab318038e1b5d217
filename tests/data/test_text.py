"""LRA Text (byte-level IMDB): parquet rows -> prepared ragged arrays -> padded batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from longmixer.data.base import DatasetNotPreparedError
from longmixer.data.text import IMDB, byte_ids
from tests.data.fixtures import REVIEWS, write_text_fixture


@pytest.fixture
def imdb(tmp_path):
    dm = IMDB(data_dir=tmp_path / "data", seq_len=64, batch_size=3, **write_text_fixture(tmp_path / "raw"))
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_byte_ids_are_utf8_bytes_plus_one():
    ids = byte_ids("Café")
    assert ids.tolist() == [ord("C") + 1, ord("a") + 1, ord("f") + 1, 0xC3 + 1, 0xA9 + 1]
    assert byte_ids("abcdef", max_len=3).tolist() == [98, 99, 100]


def test_prepare_counts_and_val_is_test(imdb):
    splits = imdb.manifest["splits"]
    assert splits["train"]["count"] == len(REVIEWS["train"])
    assert splits["test"]["count"] == len(REVIEWS["test"])
    assert imdb.manifest["meta"]["val_is_test"] is True
    assert len(imdb.datasets["val"]) == len(REVIEWS["test"])
    assert imdb.datasets["val"] is imdb.datasets["test"]


def test_batches_shapes_bytes_and_truncation(imdb):
    items = [imdb.datasets["train"][i] for i in range(len(REVIEWS["train"]))]
    for item, text in zip(items, REVIEWS["train"]):
        expected = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)[:64].astype(np.int64) + 1
        assert item["inputs"].tolist() == expected.tolist()
    assert max(len(it["inputs"]) for it in items) == 64  # the long review is cut at seq_len
    batch = next(iter(imdb.val_dataloader()))
    assert batch["inputs"].dtype == torch.long and batch["inputs"].shape[0] == 3
    assert batch["mask"].dtype == torch.bool and batch["mask"].shape == batch["inputs"].shape
    assert batch["labels"].tolist() == [0, 1, 0]
    assert (batch["inputs"][~batch["mask"]] == 0).all() and (batch["inputs"][batch["mask"]] > 0).all()
    sizes = [len(b["labels"]) for b in imdb.val_dataloader()]
    assert sizes == [3, 1]  # eval loaders keep the last batch


def test_setup_before_prepare_names_the_command(tmp_path):
    dm = IMDB(data_dir=tmp_path / "data", **write_text_fixture(tmp_path / "raw"))
    with pytest.raises(DatasetNotPreparedError, match="prepare_data.py text"):
        dm.setup("fit")


def test_source_without_parquet_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    dm = IMDB(data_dir=tmp_path / "data", source_dir=str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="train-\\*.parquet"):
        dm.prepare_data()


def test_bad_labels_are_rejected(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "raw"
    folder.mkdir()
    for split in ("train", "test"):  # the hub's `unsupervised` split has label -1: must not slip in
        pq.write_table(pa.table({"text": ["a", "b"], "label": [0, -1]}), folder / f"{split}-00000-of-00001.parquet")
    with pytest.raises(ValueError, match="outside"):
        IMDB(data_dir=tmp_path / "data", source_dir=str(folder)).prepare_data()


@pytest.mark.parametrize("key, value", [pytest.param("vocab_size", 256, id="vocab"),
                                        pytest.param("num_classes", 3, id="classes")])
def test_config_mismatch_is_rejected(tmp_path, key, value):
    with pytest.raises(ValueError, match=f"data.{key}"):
        IMDB(data_dir=tmp_path, **{key: value})
