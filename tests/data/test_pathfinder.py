"""Pathfinder / Path-X reader: official layout (PNG + text metadata) -> packed uint8 splits -> batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from longmixer.data.pathfinder import PathX, Pathfinder, read_metadata
from tests.data.fixtures import PATHFINDER_BATCHES, PATHFINDER_PER_BATCH, pathfinder_label, \
    write_pathfinder_fixture

N_IMAGES = PATHFINDER_BATCHES * PATHFINDER_PER_BATCH


def _module(tmp_path, cls=Pathfinder, resolution=32, **overrides):
    fixture = write_pathfinder_fixture(tmp_path / "raw", resolution)
    dm = cls(data_dir=tmp_path / "data", batch_size=4, **{**fixture, **overrides})
    dm.prepare_data()
    dm.setup("fit")
    return dm


def _index_of(pixels: np.ndarray, resolution: int) -> int:
    """The fixture draws a 255 row at row index % resolution."""
    return int(np.flatnonzero((pixels.reshape(resolution, resolution) == 255).all(axis=1))[0])


def test_metadata_label_is_column_3_and_rows_in_batch_order(tmp_path):
    folder = tmp_path / "raw" / "pathfinder32" / "curv_contour_length_14"
    write_pathfinder_fixture(tmp_path / "raw")
    entries = read_metadata(folder)
    assert len(entries) == N_IMAGES + 1
    assert [p.name for p, _ in entries[:2]] == ["sample_0.png", "sample_1.png"]
    assert entries[PATHFINDER_PER_BATCH + 1][0] == folder / "imgs/1/sample_0.png"
    assert [y for _, y in entries[:4]] == [pathfinder_label(i) for i in range(4)]


def test_pack_skips_the_empty_png_and_splits_80_10_10(tmp_path):
    dm = _module(tmp_path)
    splits = dm.manifest["splits"]
    assert [splits[s]["count"] for s in ("train", "val", "test")] == [16, 2, 2]
    assert splits["train"]["skipped_empty"] == 1
    seen = []
    for split in ("train", "val", "test"):
        images = np.load(dm.root / f"{split}.images.npy")
        labels = np.load(dm.root / f"{split}.labels.npy")
        assert images.dtype == np.uint8 and images.shape[1] == 1024
        for pixels, label in zip(images, labels):
            index = _index_of(pixels, 32)
            assert label == pathfinder_label(index)  # image and label stay together through the shuffle
            seen.append(index)
    assert sorted(seen) == list(range(N_IMAGES))


def test_real_and_token_batches(tmp_path):
    batch = next(iter(_module(tmp_path / "real").train_dataloader()))
    assert batch["inputs"].shape == (4, 1024, 1) and batch["inputs"].dtype == torch.float32
    assert batch["inputs"].min() >= -1 and batch["inputs"].max() == 1  # (x / 255 - 0.5) / 0.5
    assert "mask" not in batch and batch["labels"].dtype == torch.long  # fixed length: no key mask
    tokens = _module(tmp_path / "tok", vocab_size=256, d_input=None).datasets["test"][0]["inputs"]
    assert tokens.dtype == torch.long and tokens.shape == (1024,) and tokens.max() == 255


def test_split_is_a_function_of_split_seed(tmp_path):
    first = np.load(_module(tmp_path / "a").root / "val.labels.npy")
    again = np.load(_module(tmp_path / "b").root / "val.images.npy")
    other = np.load(_module(tmp_path / "c", split_seed=7).root / "val.images.npy")
    assert len(first) == 2
    assert np.array_equal(np.load(_module(tmp_path / "a").root / "val.images.npy"), again)
    assert not np.array_equal(again, other)


def test_numpy_metadata_from_the_upstream_generator_is_read(tmp_path):
    folder = tmp_path / "raw" / "pathfinder32" / "curv_contour_length_14"
    write_pathfinder_fixture(tmp_path / "raw")
    rows = [line.split() for line in (folder / "metadata" / "1.npy").read_text().splitlines()]
    with open(folder / "metadata" / "1.npy", "wb") as f:
        np.save(f, np.array(rows))  # what snakes.save_metadata wrote
    entries = read_metadata(folder)
    assert len(entries) == N_IMAGES + 1
    assert entries[-1] == (folder / "imgs/1/sample_9.png", pathfinder_label(N_IMAGES - 1))


@pytest.mark.parametrize("damage, match", [
    pytest.param(lambda path: path.write_bytes(b"imgs/0 sample_0.png 0 \xff\n"), "is not UTF-8 text", id="not-utf8"),
    pytest.param(lambda path: np.save(path, np.array([["imgs/0", "sample_0.png", "0", "1"]] * 50))
                 or path.write_bytes(path.read_bytes()[:150]), "is not a readable Pathfinder metadata array",
                 id="cut-np-save"),
    pytest.param(lambda path: np.save(path, np.array([{"a": 1}], dtype=object)),
                 "is not a readable Pathfinder metadata array", id="object-array"),
    pytest.param(lambda path: np.save(path, np.arange(4)), "is not a readable Pathfinder metadata array",
                 id="numbers"),
])
def test_unreadable_metadata_names_the_file(tmp_path, damage, match):
    """Metadata that is neither text nor a string array escaped as UnicodeDecodeError, numpy's ValueError without
    the file, or a TypeError; each is one line naming the file."""
    from longmixer.data.integrity import SourceFileError

    write_pathfinder_fixture(tmp_path / "raw")
    folder = tmp_path / "raw" / "pathfinder32" / "curv_contour_length_14"
    meta = folder / "metadata" / "0.npy"
    meta.unlink()
    damage(meta)
    with pytest.raises(SourceFileError, match=f"{meta} {match}") as caught:
        read_metadata(folder)
    assert "\n" not in str(caught.value)


def test_path_x_reads_128(tmp_path):
    dm = _module(tmp_path, cls=PathX, resolution=128)
    item = dm.datasets["train"][0]
    assert item["inputs"].shape == (16384, 1)
    assert dm.root.parts[-3:] == ("pathx", "curv_contour_length_14_split0", "res128")


def test_corrupt_png_names_the_file(tmp_path):
    fixture = write_pathfinder_fixture(tmp_path / "raw")
    bad = tmp_path / "raw" / "pathfinder32" / "curv_contour_length_14" / "imgs" / "1" / "sample_3.png"
    bad.write_bytes(b"\x89PNG garbage")
    with pytest.raises(ValueError, match="sample_3.png is not a readable image"):
        Pathfinder(data_dir=tmp_path / "data", **fixture).prepare_data()


def test_missing_png_is_a_clear_error(tmp_path):
    fixture = write_pathfinder_fixture(tmp_path / "raw")
    (tmp_path / "raw" / "pathfinder32" / "curv_contour_length_14" / "imgs" / "0" / "sample_2.png").unlink()
    with pytest.raises(FileNotFoundError, match="1 images listed"):
        Pathfinder(data_dir=tmp_path / "data", **fixture).prepare_data()


def test_wrong_resolution_is_a_clear_error(tmp_path):
    fixture = write_pathfinder_fixture(tmp_path / "raw")
    img = tmp_path / "raw" / "pathfinder32" / "curv_contour_length_14" / "imgs" / "0" / "sample_0.png"
    Image.fromarray(np.zeros((16, 16), np.uint8)).save(img)
    with pytest.raises(ValueError, match="expected 32x32"):
        Pathfinder(data_dir=tmp_path / "data", **fixture).prepare_data()


def test_missing_difficulty_and_bad_metadata(tmp_path):
    fixture = write_pathfinder_fixture(tmp_path / "raw")
    with pytest.raises(FileNotFoundError, match="no metadata"):
        Pathfinder(data_dir=tmp_path / "data", **{**fixture, "difficulty": "9"}).prepare_data()
    meta = tmp_path / "raw" / "pathfinder32" / "curv_contour_length_14" / "metadata" / "0.npy"
    meta.write_text("imgs/0 sample_0.png 0 7\n")
    with pytest.raises(ValueError, match="0.npy:1"):
        Pathfinder(data_dir=tmp_path / "data2", **fixture).prepare_data()


@pytest.mark.parametrize("overrides, match", [
    pytest.param({"seq_len": 1000}, "data.seq_len=1000", id="seq_len"),
    pytest.param({"difficulty": "easy"}, "difficulty='easy'", id="difficulty"),
    pytest.param({"num_classes": 10}, "data.num_classes", id="classes")])
def test_config_errors(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        Pathfinder(data_dir=tmp_path, **overrides)


def test_generated_data_is_keyed_by_every_generator_setting(tmp_path, caplog):
    """A changed generator setting (or generator version) regenerates instead of serving or mixing old images."""
    import json
    import logging

    from longmixer.data.base import DatasetNotPreparedError
    from longmixer.data.generators.pathfinder import GENERATOR_VERSION
    from longmixer.data.pathfinder import GeneratedPathfinder

    common = dict(data_dir=tmp_path, difficulty="baseline", num_images=10, batch_size=2)
    dm = GeneratedPathfinder(images_per_batch=5, **common)
    dm.prepare_data()
    manifest = json.loads((dm.root / "manifest.json").read_text())
    assert manifest["meta"]["generator_version"] == GENERATOR_VERSION
    other = GeneratedPathfinder(images_per_batch=4, **common)
    assert other.root == dm.root  # same folder: the manifest key, not the path, tells them apart
    with pytest.raises(DatasetNotPreparedError, match="images_per_batch"):
        other.setup()
    with caplog.at_level(logging.WARNING):
        other.prepare_data()
    assert "rebuilding" in caplog.text
    raw = sorted(p.name for p in (dm.setting_dir / "raw").iterdir())
    assert raw == [f"v{GENERATOR_VERSION}_per_batch4", f"v{GENERATOR_VERSION}_per_batch5"]
    other.setup()


def test_the_command_an_error_names_prepares_this_difficulty(tmp_path):
    """Regression: the command in the data errors (`delete ... and re-run `python scripts/prepare_data.py ...``,
    and the one a read-only folder's owner is asked to run) named only the task and folders, so for
    `data.difficulty=9` it prepared difficulty 14 (here: failed, the source has no such folder) and left this data
    broken. It now carries the settings that determine the prepared files."""
    import shlex
    import shutil

    from longmixer.data.integrity import DataIntegrityError
    from scripts import prepare_data

    fixture = write_pathfinder_fixture(tmp_path / "raw", difficulty="curv_contour_length_9")
    dm = Pathfinder(data_dir=tmp_path / "data", difficulty="9", split_seed=42, **fixture)
    dm.prepare_data()
    path = dm.root / "val.labels.npy"
    path.write_bytes(path.read_bytes()[:90])
    with pytest.raises(DataIntegrityError, match="re-run `") as caught:
        Pathfinder(data_dir=tmp_path / "data", difficulty="9", split_seed=42, **fixture).setup()
    command = shlex.split(str(caught.value).split("re-run `")[1].split("`")[0])
    assert command[:2] == ["python", "scripts/prepare_data.py"]
    shutil.rmtree(dm.root)
    assert prepare_data.main(command[2:]) == 0
    again = Pathfinder(data_dir=tmp_path / "data", difficulty="9", split_seed=42, **fixture)
    again.setup()
    assert again.verify() > 0


def test_damaged_prepared_data_is_mended_without_deleting_the_generated_images(tmp_path):
    """Regression: a damaged prepared file was reported with "delete <the task's folder> and re-run ...", and that
    folder holds the generated images (core-hours at the LRA size; for the downloaded tasks, the downloads). The fix
    named is now to delete the manifest: the data is packed again from the images already there."""
    from longmixer.data.integrity import DataIntegrityError
    from longmixer.data.pathfinder import GeneratedPathfinder

    common = dict(data_dir=tmp_path, difficulty="baseline", num_images=10, images_per_batch=5, batch_size=2)
    dm = GeneratedPathfinder(**common)
    dm.prepare_data()
    images = {p: p.stat().st_mtime_ns for p in (dm.setting_dir / "raw").rglob("*.png")}
    path = dm.root / "test.images.npy"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(DataIntegrityError, match=f"; delete {dm.root / 'manifest.json'} and re-run `"):
        GeneratedPathfinder(**common).setup()
    (dm.root / "manifest.json").unlink()
    again = GeneratedPathfinder(**common)
    again.prepare_data()
    again.setup()
    assert again.verify() > 0
    assert {p: p.stat().st_mtime_ns for p in (dm.setting_dir / "raw").rglob("*.png")} == images and len(images) == 10


def test_runs_at_two_resolutions_keep_their_own_data(tmp_path, caplog):
    """Regression: every data.resolution shared one folder although the images are packed at prepare time, so runs
    at two resolutions of one LRA release rebuilt it in turn, and a run reading it while another rebuilt it stopped
    with "made with other settings" or "the file was changed". Each resolution now packs into its own `res<R>/`."""
    import logging

    for resolution in (32, 64):  # the release, unpacked by hand: read where it is
        write_pathfinder_fixture(tmp_path / "data" / "lra_release", resolution)
    first = Pathfinder(data_dir=tmp_path / "data", batch_size=4)
    first.setting_dir.mkdir(parents=True)
    (first.setting_dir / "manifest.json").write_text("{}")  # data prepared in the old place, the folder itself
    with caplog.at_level(logging.WARNING):
        first.prepare_data()
    assert "is no longer read" in caplog.text and str(first.root) in caplog.text
    manifest = (first.root / "manifest.json").read_text()
    other = Pathfinder(data_dir=tmp_path / "data", resolution=64, seq_len=4096, batch_size=4)
    other.prepare_data()
    assert other.root == first.setting_dir / "res64"
    caplog.clear()
    again = Pathfinder(data_dir=tmp_path / "data", batch_size=4)
    with caplog.at_level(logging.WARNING):
        again.setup()  # no prepare_data: a run that reads what it prepared before
        again.prepare_data()
    assert "rebuilding" not in caplog.text and (again.root / "manifest.json").read_text() == manifest
    assert again.datasets["train"][0]["inputs"].shape == (1024, 1)
