"""LRA Retrieval (AAN): 5-column TSVs with literal quotes -> two-document batches."""

from __future__ import annotations

import logging

import pytest
import torch

from longmixer.data.integrity import SourceFileError
from longmixer.data.retrieval import AAN, read_aan_tsv
from tests.data.fixtures import AAN_ROWS, write_retrieval_fixture


@pytest.fixture
def aan(tmp_path):
    dm = AAN(data_dir=tmp_path / "data", seq_len=48, batch_size=2, **write_retrieval_fixture(tmp_path / "raw"))
    dm.prepare_data()
    dm.setup("fit")
    return dm


def _decode(ids: torch.Tensor) -> str:
    return bytes((ids - 1).tolist()).decode("utf-8", errors="ignore")


def test_quotes_stay_literal_and_columns_align(tmp_path):
    folder = write_retrieval_fixture(tmp_path)["source_dir"]
    docs1, docs2, labels = read_aan_tsv(f"{folder}/new_aan_pairs.train.tsv", max_len=10_000)
    assert labels == [1, 0, 1, 0, 0, 1, 0, 1]
    for d1, d2, row in zip(docs1, docs2, AAN_ROWS["train"]):
        assert bytes((d1 - 1).astype("uint8")).decode() == row[3]
        assert bytes((d2 - 1).astype("uint8")).decode() == row[4]


def test_batches_hold_both_documents(aan):
    assert {s: aan.manifest["splits"][s]["count"] for s in ("train", "val", "test")} == {"train": 8, "val": 2,
                                                                                          "test": 2}
    batch = next(iter(aan.val_dataloader()))
    assert set(batch) == {"inputs", "mask", "inputs2", "mask2", "labels"}
    assert batch["inputs"].dtype == torch.long and batch["inputs2"].dtype == torch.long
    assert batch["mask"].shape == batch["inputs"].shape and batch["mask2"].shape == batch["inputs2"].shape
    assert batch["labels"].tolist() == [1, 0]
    assert _decode(batch["inputs"][0][batch["mask"][0]]) == AAN_ROWS["eval"][0][3]
    assert _decode(batch["inputs2"][1][batch["mask2"][1]]) == AAN_ROWS["eval"][1][4]


def test_documents_are_truncated_to_seq_len(aan):
    item = aan.datasets["train"][2]  # its first document is 540 bytes
    assert len(item["inputs"]) == 48 and len(item["inputs2"]) == len("Graph-based parsing")


def test_truncation_is_counted_in_a_warning(tmp_path, caplog):
    folder = write_retrieval_fixture(tmp_path)["source_dir"]
    with caplog.at_level("WARNING", logger="longmixer.data.integrity"):
        read_aan_tsv(f"{folder}/new_aan_pairs.train.tsv", max_len=20)
    long_docs = sum(len(row[3].encode()) > 20 for row in AAN_ROWS["train"]) + \
        sum(len(row[4].encode()) > 20 for row in AAN_ROWS["train"])
    assert f"new_aan_pairs.train.tsv documents: {long_docs} of 16 examples are longer than data.seq_len=20" \
        in caplog.text


def test_wrong_column_count_names_the_line(tmp_path):
    path = tmp_path / "new_aan_pairs.train.tsv"
    path.write_text("1.0\ta\tb\ttext one\ttext two\n0.0\ta\tb\tonly four columns\n")
    with pytest.raises(ValueError, match=r"train\.tsv:2: expected 5 tab-separated columns"):
        read_aan_tsv(path, max_len=100)


@pytest.mark.parametrize("cut", [
    pytest.param(lambda row: row.rindex(b"cited"), id="inside-text2"),
    pytest.param(lambda row: row.rindex(b"\t") + 1, id="after-the-last-tab"),
    pytest.param(lambda row: len(row) - 1, id="only-the-newline"),
    pytest.param(lambda row: row.index(b"parsing"), id="inside-text1"),
])
def test_a_file_cut_inside_its_last_row_is_named(tmp_path, cut, caplog):
    """Regression: a file cut inside its last row's second document (an interrupted download or copy) still has five
    columns there, and was read as if complete without a word. A cut that leaves fewer columns is refused; a last row
    without its newline (a cut in text2, or a writer that left it off) is read with a warning naming the file, the
    line and the fix."""
    folder = write_retrieval_fixture(tmp_path)["source_dir"]
    whole = open(f"{folder}/new_aan_pairs.train.tsv", "rb").read()
    last = whole.rindex(b"\n", 0, len(whole) - 1) + 1  # the 8th row starts here
    path = tmp_path / "new_aan_pairs.train.tsv"
    path.write_bytes(whole[:last + cut(whole[last:])])
    if whole[last:last + cut(whole[last:])].count(b"\t") < 4:
        with pytest.raises(SourceFileError, match=r"train\.tsv:8: expected 5 tab-separated columns.*re-extract"):
            read_aan_tsv(path, max_len=100)
        return
    with caplog.at_level(logging.WARNING, logger="longmixer.data.retrieval"):
        docs1, _, _ = read_aan_tsv(path, max_len=100)
    assert len(docs1) == 8
    assert any("train.tsv:8: the last row has no newline at its end" in r.getMessage()
               and "re-extract the LRA release's tsv_data" in r.getMessage() and f"echo >> {path}" in r.getMessage()
               for r in caplog.records)


def test_bad_label_is_rejected(tmp_path):
    path = tmp_path / "x.tsv"
    path.write_text("yes\ta\tb\tc\td\n")
    with pytest.raises(ValueError, match="label 'yes'"):
        read_aan_tsv(path, max_len=100)


def test_missing_file_names_the_fix(tmp_path):
    dm = AAN(data_dir=tmp_path / "data", source_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="prepare_data.py retrieval"):
        dm.prepare_data()


def test_another_seq_len_needs_a_new_prepare(aan):
    other = AAN(data_dir=aan.data_dir, seq_len=16, source_dir=str(aan.source_dir))
    with pytest.raises(Exception, match="no prepared data.*data.seq_len=16"):
        other.setup("fit")
    other.prepare_data()  # prepares the new length beside the old
    other.setup("fit")
    assert max(len(other.datasets["train"][i]["inputs"]) for i in range(4)) == 16


def test_blank_lines_are_not_examples(tmp_path):
    """A trailing newline too many (an editor's, a concatenation's) is not a truncated row."""
    folder = write_retrieval_fixture(tmp_path)["source_dir"]
    path = tmp_path / "padded.tsv"
    path.write_bytes(open(f"{folder}/new_aan_pairs.train.tsv", "rb").read() + b"\n\r\n")
    assert read_aan_tsv(path, max_len=100)[2] == [1, 0, 1, 0, 0, 1, 0, 1]


def test_runs_at_two_lengths_keep_their_own_data(tmp_path, caplog):
    """Regression: every seq_len shared one folder, so runs at two lengths (a sweep) rebuilt it in turn, and a run
    reading it while another rebuilt it stopped with "the file was changed" or a missing file. Each length now has
    its own folder: a run finds its data as it left it."""
    import logging

    source = write_retrieval_fixture(tmp_path / "raw")["source_dir"]
    first = AAN(data_dir=tmp_path / "data", source_dir=source, seq_len=40)
    first.prepare_data()
    manifest = (first.root / "manifest.json").read_text()
    AAN(data_dir=tmp_path / "data", source_dir=source, seq_len=50).prepare_data()
    again = AAN(data_dir=tmp_path / "data", source_dir=source, seq_len=40)
    with caplog.at_level(logging.WARNING):
        again.setup("fit")  # no prepare_data: a run that reads what it prepared before
        again.prepare_data()
    assert "rebuilding" not in caplog.text
    assert (again.root / "manifest.json").read_text() == manifest
    assert max(len(again.datasets["train"][i]["inputs"]) for i in range(8)) == 40
