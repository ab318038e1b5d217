"""Prepared data that is checked: every row of the data-integrity table, on small ListOps/IMDB files in the real
formats (a damaged array, edited labels or manifest, bad source bytes, an empty split, a changed source folder,
silent truncation, a download that cannot happen)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from longmixer.data import integrity
from longmixer.data.base import DataIntegrityError, DatasetNotPreparedError
from longmixer.data.download import DataDownloadError
from longmixer.data.listops import ListOps

ROWS = {"train": [("( ( [MAX 2 9 ) 4 ] )", 9), ("( [MIN 3 1 ] )", 1), ("( ( [SM 5 6 ) 1 ] )", 2),
                  ("( [MED 1 7 3 ] )", 3)] * 3,
        "val": [("( [MAX 1 2 ] )", 2), ("( ( [MIN 8 ( [MAX 2 3 ] ) ) 9 ] )", 3)],
        "test": [("( [SM 1 1 ] )", 2), ("( [MAX 0 5 ] )", 5), ("( [MIN 4 6 ] )", 4)]}


def write_listops(folder: Path, rows=ROWS) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for split, examples in rows.items():
        lines = ["Source\tTarget"] + [f"{src}\t{label}" for src, label in examples]
        (folder / f"basic_{split}.tsv").write_bytes(("\n".join(lines) + "\n").encode())
    return folder


@pytest.fixture
def prepared(tmp_path):
    dm = ListOps(data_dir=tmp_path / "data", source_dir=str(write_listops(tmp_path / "src")), batch_size=2)
    dm.prepare_data()
    return dm


def fresh(dm: ListOps, **overrides) -> ListOps:
    kwargs = dict(data_dir=dm.data_dir, source_dir=dm.source_dir, batch_size=2, seq_len=dm.seq_len)
    return ListOps(**{**kwargs, **overrides})


def test_intact_data_passes_both_checks(prepared):
    prepared.setup()
    assert prepared.verify() == len(prepared.manifest["files"])


def test_truncated_array_is_named(prepared):
    path = prepared.root / "train.tokens.npy"
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(DataIntegrityError, match=r"train\.tokens\.npy is unreadable.*re-run `python scripts/prep"):
        fresh(prepared).setup()


def test_zero_byte_array_is_named(prepared):
    (prepared.root / "val.labels.npy").write_bytes(b"")
    with pytest.raises(DataIntegrityError, match=r"val\.labels\.npy is unreadable"):
        fresh(prepared).setup()


def test_out_of_vocabulary_token_is_named_with_its_index(prepared):
    path = prepared.root / "test.tokens.npy"
    tokens = np.load(path)
    tokens[3] = 40  # the vocabulary has 17 ids
    np.save(path, tokens)
    with pytest.raises(DataIntegrityError, match=r"test\.tokens\.npy: token 40 at index 3 is outside \[0, "
                                                 r"data\.vocab_size=17\)"):
        fresh(prepared).setup()


def test_out_of_range_label_is_named_with_its_index(prepared):
    path = prepared.root / "train.labels.npy"
    labels = np.load(path)
    labels[5] = 12
    np.save(path, labels)
    with pytest.raises(DataIntegrityError, match=r"train\.labels\.npy: label 12 at index 5 is outside \[0, "
                                                 r"data\.num_classes=10\)"):
        fresh(prepared).setup()


def test_labels_changed_in_place_are_caught_cheaply_and_by_sha256(prepared):
    path = prepared.root / "test.labels.npy"
    np.save(path, np.zeros_like(np.load(path)))  # same shape and dtype, every label 0
    with pytest.raises(DataIntegrityError, match=r"test\.labels\.npy: label counts \{'0': 3\} differ"):
        fresh(prepared).setup()
    with pytest.raises(DataIntegrityError, match=r"test\.labels\.npy has another sha256"):
        integrity.verify_files(prepared.root, json.loads((prepared.root / "manifest.json").read_text()), "hint")


def test_edited_manifest_is_refused(prepared):
    path = prepared.root / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["splits"]["test"]["labels"] = {"0": 3}
    path.write_text(json.dumps(manifest))
    with pytest.raises(DataIntegrityError, match="manifest.json was edited after it was written"):
        fresh(prepared).setup()


def test_a_prepared_file_that_is_gone_is_rebuilt_by_the_command_setup_names(prepared, capsys, caplog):
    """Regression: a manifest whose settings matched was taken as prepared even when a file it lists was gone, so
    `setup()`'s "incomplete ... re-run `python scripts/prepare_data.py ...`" sent the user round in a loop: the
    command skipped preparing and stopped with the same line. An edited manifest was skipped the same way."""
    from scripts import prepare_data

    (prepared.root / "val.tokens.npy").unlink()
    with pytest.raises(DatasetNotPreparedError, match=r"incomplete \(missing \['val\.tokens\.npy'\]\); re-run"):
        fresh(prepared).setup()
    args = ["listops", f"paths.data_dir={prepared.data_dir}", f"data.source_dir={prepared.source_dir}"]
    with caplog.at_level(logging.WARNING):
        assert prepare_data.main(args) == 0, capsys.readouterr().err
    assert "is not usable as it is" in caplog.text and "rebuilding" in caplog.text
    dm = fresh(prepared)
    dm.setup()
    assert dm.verify() == len(dm.manifest["files"]) and len(dm.datasets["val"]) == 2
    path = prepared.root / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["splits"]["test"]["labels"] = {"0": 3}
    path.write_text(json.dumps(manifest))
    again = fresh(prepared)
    again.prepare_data()
    again.setup()
    assert again.manifest["splits"]["test"]["labels"] == {"2": 1, "4": 1, "5": 1}


def test_a_prepare_killed_while_writing_its_manifest_is_completed_by_the_next_run(tmp_path):
    """Regression: a prepare killed while it wrote `manifest.json.tmp` (the manifest's scratch copy, renamed over
    `manifest.json` when complete) left that file behind, and the next prepare hashed it into the manifest it then
    wrote as one of the data's files: the rename removed it, so the fresh data read as incomplete ("missing
    ['manifest.json.tmp']") and `prepare_data.py` failed its own check until a second rebuild."""
    from scripts import prepare_data

    src = write_listops(tmp_path / "src")
    dm = ListOps(data_dir=tmp_path / "data", source_dir=src)
    dm.root.mkdir(parents=True)
    (dm.root / "train.tokens.npy").write_bytes(b"\x93NUMPY half an array")
    (dm.root / "manifest.json.tmp").write_text('{"version": 2, "splits": {"tr')  # what the kill left
    args = ["listops", f"paths.data_dir={dm.data_dir}", f"data.source_dir={src}"]
    assert prepare_data.main(args) == 0
    again = ListOps(data_dir=tmp_path / "data", source_dir=src)
    again.setup()
    assert "manifest.json.tmp" not in again.manifest["files"] and again.verify() == len(again.manifest["files"])
    assert sorted(p.name for p in dm.root.iterdir() if p.name.startswith("manifest")) == ["manifest.json"]


def test_non_utf8_byte_names_file_line_and_column(tmp_path):
    folder = write_listops(tmp_path / "src")
    path = folder / "basic_val.tsv"
    lines = path.read_bytes().split(b"\n")
    lines[2] = lines[2][:4] + b"\xff" + lines[2][4:]
    path.write_bytes(b"\n".join(lines))
    dm = ListOps(data_dir=tmp_path / "data", source_dir=str(folder))
    with pytest.raises(ValueError, match=r"basic_val\.tsv:3:5: byte 0xff is not UTF-8"):
        dm.prepare_data()


def test_empty_split_names_the_file(tmp_path):
    folder = write_listops(tmp_path / "src", {**ROWS, "val": []})
    dm = ListOps(data_dir=tmp_path / "data", source_dir=str(folder))
    with pytest.raises(ValueError, match=r"basic_val\.tsv has a header but no examples"):
        dm.prepare_data()


def test_changed_source_dir_rebuilds_or_is_refused(prepared, tmp_path, caplog):
    other = write_listops(tmp_path / "other", {**ROWS, "test": [("( [MAX 7 8 ] )", 8)]})
    # setup() alone (a training run that skipped prepare_data) refuses to serve the old data
    with pytest.raises(DatasetNotPreparedError, match="was made with other settings.*source_dir"):
        fresh(prepared, source_dir=str(other)).setup()
    # prepare_data() rebuilds from the new folder, saying so
    dm = fresh(prepared, source_dir=str(other))
    with caplog.at_level(logging.WARNING):
        dm.prepare_data()
    assert "rebuilding" in caplog.text
    dm.setup()
    assert len(dm.datasets["test"]) == 1
    assert dm.manifest["meta"]["source_dir"] == str(other.resolve())


def test_truncation_warns_once_with_counts(prepared, caplog):
    lengths = np.diff(np.load(prepared.root / "train.offsets.npy"))
    cut = int((lengths > 4).sum())
    assert 0 < cut < len(lengths)
    with caplog.at_level(logging.WARNING, logger="longmixer.data.integrity"):
        dm = fresh(prepared, seq_len=4)
        dm.setup()
        fresh(prepared, seq_len=4).setup()
    lines = [r.getMessage() for r in caplog.records if "train:" in r.getMessage()]
    assert lines == [f"{prepared.root.name} train: {cut} of {len(lengths)} examples are longer than data.seq_len=4 "
                     "and are truncated"]
    assert all(len(dm.datasets["train"][i]["inputs"]) <= 4 for i in range(len(lengths)))


def test_a_run_without_network_ends_with_the_same_line_as_prepare_data(tmp_path, monkeypatch, capsys):
    import datasets

    from longmixer.data.text import IMDB
    from scripts import prepare_data

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'stanfordnlp/imdb' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    dm = IMDB(data_dir=tmp_path / "data")
    with pytest.raises(DataDownloadError) as caught:
        dm.prepare_data()
    message = str(caught.value)
    assert "\n" not in message and "data.source_dir=<folder>" in message
    assert caught.value.__cause__ is None and caught.value.__suppress_context__  # no library traceback chained
    assert prepare_data.main(["text", f"paths.data_dir={tmp_path / 'data'}"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"


def test_verify_reports_a_damaged_file_through_prepare_data_script(prepared, capsys):
    from scripts import prepare_data

    source = prepared.source_dir
    path = prepared.root / "val.tokens.npy"
    data = bytearray(path.read_bytes())
    data[-2] ^= 1  # the last token's low bit: same size, header and vocabulary range; only the sha256 tells
    path.write_bytes(bytes(data))
    code = prepare_data.main(["listops", f"paths.data_dir={prepared.data_dir}", f"data.source_dir={source}"])
    assert code == 2
    assert "val.tokens.npy has another sha256" in capsys.readouterr().err
    shutil.rmtree(prepared.root)
    assert prepare_data.main(["listops", f"paths.data_dir={prepared.data_dir}", f"data.source_dir={source}"]) == 0


def test_a_training_run_with_missing_source_data_prints_one_line(tmp_path):
    """Regression: a run whose data cannot be prepared ended in a library traceback of 47-75 lines; it now logs the
    message that names the fix and exits 2."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    cmd = [sys.executable, "-m", "longmixer.train", "data=listops", f"data.source_dir={tmp_path / 'empty'}",
           f"paths.data_dir={tmp_path / 'data'}", f"paths.log_dir={tmp_path / 'logs'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-2000:]
    assert "Traceback" not in output
    assert "basic_train.tsv is missing: point data.source_dir" in output


def test_prepared_data_needs_no_lock_to_be_used(tmp_path):
    """A current manifest is read before any lock is taken, so a prepared copy on a read-only disk (a shared data
    folder) can be trained on: `prepare_data` writes nothing there."""
    dm = ListOps(data_dir=tmp_path / "data", source_dir=write_listops(tmp_path / "src"))
    dm.prepare_data()
    (dm.root / ".lock").unlink(missing_ok=True)
    before = sorted(p.name for p in dm.root.iterdir())
    ListOps(data_dir=tmp_path / "data", source_dir=tmp_path / "src").prepare_data()
    assert sorted(p.name for p in dm.root.iterdir()) == before


def test_a_source_that_fails_the_checks_is_not_marked_prepared(tmp_path):
    """The cheap checks run at the end of preparing too: a source whose labels are out of range gets no manifest
    (so no later run takes it for complete), and the error names the source and the fix."""
    from longmixer.data.base import SequenceDataModule, label_counts

    class _Toy(SequenceDataModule):
        name = "toy"
        num_classes = 3

        def _prepare(self, root):
            labels = np.array([0, 1, 5])
            np.save(root / "train.labels.npy", labels)
            return {"train": {"count": 3, "labels": label_counts(labels)}}, {}

    dm = _Toy(data_dir=tmp_path / "data")
    dm.source_dir = tmp_path / "src"
    with pytest.raises(DataIntegrityError) as err:
        dm.prepare_data()
    message = str(err.value)
    assert "label 5 at index 2 is outside [0, data.num_classes=3)" in message and "not marked prepared" in message
    assert f"correct the files in data.source_dir={tmp_path / 'src'}" in message and "re-run" not in message
    assert not (dm.root / "manifest.json").exists()


def test_a_failed_rebuild_for_other_settings_keeps_the_data_prepared_before(tmp_path):
    """Asking for other settings rebuilds the task's folder; the old files are set aside until the new ones are
    complete, so a rebuild that fails (here: the new source folder is missing) or is killed leaves the old data in
    place, and a run with the old settings goes on without preparing again."""
    src = write_listops(tmp_path / "src")
    dm = ListOps(data_dir=tmp_path / "data", source_dir=src)
    dm.prepare_data()
    manifest = (dm.root / "manifest.json").read_text()
    with pytest.raises(FileNotFoundError, match="basic_train.tsv is missing"):
        ListOps(data_dir=tmp_path / "data", source_dir=tmp_path / "moved").prepare_data()
    assert (dm.root / "manifest.json").read_text() == manifest and not (dm.root / ".previous").exists()
    again = ListOps(data_dir=tmp_path / "data", source_dir=src)
    again.prepare_data()
    again.setup()
    assert again.verify() > 0
    # a rebuild killed midway: the old files set aside, a half-written array in their place
    (dm.root / ".previous").mkdir()
    for path in [p for p in dm.root.iterdir() if p.is_file() and p.name != ".lock"]:
        path.rename(dm.root / ".previous" / path.name)
    (dm.root / "train.labels.npy").write_bytes(b"half")
    resumed = ListOps(data_dir=tmp_path / "data", source_dir=src)
    resumed.prepare_data()
    assert (dm.root / "manifest.json").read_text() == manifest and not (dm.root / ".previous").exists()
    resumed.setup()
    assert resumed.verify() > 0


def test_a_rebuild_or_restore_killed_anywhere_is_finished_by_the_next_run(tmp_path):
    """The steps of setting aside and restoring can be cut by a kill at any point; the next locked run finishes
    them: a restore cut short completes (not deleting the files it had already moved back), and a `.previous` left
    beside a complete rebuild's manifest (a kill while it was being deleted) is dropped, not restored over it."""
    from longmixer.data.base import SET_ASIDE, _set_prepared_aside

    a, b = write_listops(tmp_path / "a"), write_listops(tmp_path / "b")
    dm = ListOps(data_dir=tmp_path / "data", source_dir=a)
    dm.prepare_data()
    manifest_a = (dm.root / "manifest.json").read_text()
    # a rebuild for b set a aside and wrote part of its files; then its restore moved one file back and was killed
    aside = dm.root / SET_ASIDE
    _set_prepared_aside(dm.root, aside)
    (dm.root / "train.labels.npy").write_bytes(b"half")
    (dm.root / "stray.npy").write_bytes(b"only the rebuild wrote this")
    moved_back = sorted(p for p in aside.iterdir() if p.suffix == ".npy")[0]
    moved_back.rename(dm.root / moved_back.name)
    again = ListOps(data_dir=tmp_path / "data", source_dir=a)
    again.prepare_data()
    assert (dm.root / "manifest.json").read_text() == manifest_a and not aside.exists()
    assert not (dm.root / "stray.npy").exists()
    again.setup()
    assert again.verify() > 0
    # a complete rebuild for b, killed while deleting a's set-aside copy: b's data stays
    ListOps(data_dir=tmp_path / "data", source_dir=b).prepare_data()
    manifest_b = (dm.root / "manifest.json").read_text()
    aside.mkdir()
    (aside / "train.labels.npy").write_bytes(b"what was left of a")
    with pytest.raises(FileNotFoundError):  # another rebuild, which fails: b comes back, not a's remains
        ListOps(data_dir=tmp_path / "data", source_dir=tmp_path / "missing").prepare_data()
    assert (dm.root / "manifest.json").read_text() == manifest_b and not aside.exists()
    kept = ListOps(data_dir=tmp_path / "data", source_dir=b)
    kept.setup()
    assert kept.verify() > 0


def test_a_read_only_data_folder_that_needs_preparing_is_one_line(tmp_path, monkeypatch):
    """Data still to be prepared in a read-only data_dir (a shared copy without this setting) stopped with a
    PermissionError traceback on `<data>/<task>/.lock`; it is the not-prepared error, naming the folder and the fix.
    (Tests run as root, who may write anywhere: the lock's refusal is simulated.)"""
    import errno

    from longmixer.data import base

    def refused(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(base, "FileLock", refused)
    dm = ListOps(data_dir=tmp_path / "data", source_dir=write_listops(tmp_path / "src"))
    with pytest.raises(DatasetNotPreparedError) as caught:
        dm.prepare_data()
    message = str(caught.value)
    assert "\n" not in message and f"{dm.root / '.lock'} gives Permission denied" in message
    assert "paths.data_dir=<writable folder>" in message


def test_a_full_disk_is_one_line_naming_the_folder_and_the_fix(tmp_path, monkeypatch, capsys):
    """Regression: a disk that filled while the data was prepared (the LRA release needs about 27 GB) stopped
    `prepare_data.py` and training with an OSError traceback; it is one line naming the folder and the ways out."""
    import errno

    from longmixer.data import listops

    def full(root, split, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(root / f"{split}.tokens.npy"))

    monkeypatch.setattr(listops, "save_ragged", full)
    _assert_full_disk_line(tmp_path, capsys, "stopped: No space left on device")


def _assert_full_disk_line(tmp_path, capsys, stopped: str) -> Path:
    """Prepare ListOps on the (patched) full disk: one line naming the file and both fixes, and `prepare_data.py`
    exits 2 with it; returns the source folder."""
    from scripts import prepare_data

    source = write_listops(tmp_path / "src")
    with pytest.raises(DatasetNotPreparedError) as caught:
        ListOps(data_dir=tmp_path / "data", source_dir=source).prepare_data()
    message = str(caught.value)
    assert "\n" not in message and stopped in message
    assert str(tmp_path / "data" / "listops" / "train.tokens.npy") in message
    assert "paths.data_dir=<folder with room>" in message and f"data.source_dir={source}" in message
    assert prepare_data.main(["listops", f"paths.data_dir={tmp_path / 'data'}", f"data.source_dir={source}"]) == 2
    assert capsys.readouterr().err.startswith("error: preparing the listops data at")
    return source


def test_a_disk_that_fills_while_numpy_saves_an_array_is_the_same_one_line(tmp_path, monkeypatch, capsys):
    """Regression: `np.save` to a path writes the array with `ndarray.tofile`, which reports a disk that fills under
    it as `OSError('2280000 requested and 524224 written')`, without an errno (seen on a 1 MB tmpfs); that is how
    a real full disk meets a prepare step, and it stopped `prepare_data.py` and training with that traceback
    instead of the full-disk line naming the file and the fixes."""
    import os
    import re

    reader, writer = os.pipe()  # numpy's own short write, from a pipe nobody reads
    os.close(reader)
    with pytest.raises(OSError) as real, open(writer, "wb", buffering=0) as sink:
        np.zeros(1 << 20, np.uint8).tofile(sink)  # more than stdio buffers, so that fwrite itself fails
    assert real.value.errno is None and re.fullmatch(r"1048576 requested and \d+ written", str(real.value))

    save = np.save

    def fills_the_disk(file, array, *args, **kwargs):  # what np.save does on a disk with room for half the array
        if not str(file).endswith("train.tokens.npy"):
            return save(file, array, *args, **kwargs)
        with open(file, "wb") as fid:
            np.lib.format.write_array(fid, np.asarray(array)[:len(array) // 2])
            raise OSError(f"{np.asarray(array).nbytes} requested and {np.asarray(array).nbytes // 2} written")

    monkeypatch.setattr(np, "save", fills_the_disk)
    source = _assert_full_disk_line(tmp_path, capsys, "stopped: No space left on device (a write of")
    monkeypatch.setattr(np, "save", save)
    ListOps(data_dir=tmp_path / "data", source_dir=source).prepare_data()  # room again: the rerun completes it
    assert ListOps(data_dir=tmp_path / "data", source_dir=source).verify() > 0
