"""LRA Text (byte-level IMDB): parquet rows -> prepared ragged arrays -> padded batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from longmixer.data.base import DatasetNotPreparedError
from longmixer.data.integrity import SourceFileError
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


@pytest.mark.parametrize("damage", [pytest.param(lambda b: b[:len(b) // 2], id="cut"),
                                    pytest.param(lambda b: b"", id="zero-bytes"),
                                    pytest.param(lambda b: b"text\tlabel\nGreat\t1\n", id="not-parquet")])
def test_an_unreadable_parquet_file_is_named(tmp_path, damage):
    """Regression: a cut, empty or non-parquet file in data.source_dir stopped in `datasets` with "An error occurred
    while generating the dataset" (a traceback from prepare_data.py), naming neither the file nor the fix."""
    from scripts import prepare_data

    source = write_text_fixture(tmp_path / "raw")["source_dir"]
    path = tmp_path / "raw" / "imdb" / "plain_text" / "test-00000-of-00001.parquet"
    path.write_bytes(damage(path.read_bytes()))
    dm = IMDB(data_dir=tmp_path / "data", source_dir=source)
    with pytest.raises(SourceFileError, match=rf"{path} is not a readable parquet file .*data.source_dir"):
        dm.prepare_data()
    assert not (dm.root / "manifest.json").exists()
    assert prepare_data.main(["text", f"paths.data_dir={tmp_path / 'data'}", f"data.source_dir={source}"]) == 2


def test_a_split_without_rows_is_named(tmp_path):
    """Regression: a test parquet file with the columns but no rows failed inside `datasets` ("An error occurred
    while generating the dataset"); it is an empty split, named with its files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = write_text_fixture(tmp_path / "raw")["source_dir"]
    path = tmp_path / "raw" / "imdb" / "plain_text" / "test-00000-of-00001.parquet"
    pq.write_table(pa.table({"text": pa.array([], pa.string()), "label": pa.array([], pa.int64())}), path)
    with pytest.raises(SourceFileError, match=rf"test split is empty \(no rows in {path}\)"):
        IMDB(data_dir=tmp_path / "data", source_dir=source).prepare_data()
