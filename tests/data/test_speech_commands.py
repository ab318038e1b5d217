"""SC10 from WAV files: the 10 words only, full-length clips only, train-split normalization, both split rules, and the
half-resolution evaluation."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from longmixer.data.integrity import SourceFileError, SourceFileMissingError
from longmixer.data.speech_commands import SC10_CLASSES, SpeechCommands, read_wav, stratified_split
from tests.data.fixtures_extra import SC10_PER_WORD, sc10_clip, write_sc10_fixture


@pytest.fixture(scope="module")
def sc10_source(tmp_path_factory):
    root = tmp_path_factory.mktemp("sc10")
    return root, write_sc10_fixture(root / "raw")


def make(sc10_source, tmp_path, **kw):
    root, overrides = sc10_source
    dm = SpeechCommands(data_dir=root / "data", batch_size=5, **overrides, **kw)
    dm.prepare_data()
    dm.setup()
    return dm


def test_read_wav_returns_written_samples(sc10_source):
    root, overrides = sc10_source
    samples, rate = read_wav(root / "raw" / "up" / "00000003_nohash_0.wav")
    assert rate == 16000 and np.array_equal(samples, sc10_clip(SC10_CLASSES.index("up"), 3))


def test_only_sc10_words_and_full_length_clips_are_kept(sc10_source, tmp_path):
    dm = make(sc10_source, tmp_path)
    manifest = json.loads((dm.root / "manifest.json").read_text())
    assert manifest["splits"]["all"]["count"] == 10 * SC10_PER_WORD  # "bed" and the short clips are left out
    assert manifest["splits"]["all"]["dropped_short"] == 10
    assert manifest["splits"]["all"]["labels"] == {str(i): SC10_PER_WORD for i in range(10)}
    files = (dm.root / "files.txt").read_text().split()
    labels = np.load(dm.root / "labels.npy")
    assert [SC10_CLASSES[c] for c in labels] == [f.split("/")[0] for f in files]


def test_stratified_split_is_seeded_disjoint_and_70_15_15():
    labels = np.repeat(np.arange(10), 20)
    parts = stratified_split(labels, seed=0)
    assert [len(parts[s]) for s in ("train", "val", "test")] == [140, 30, 30]
    for s in parts:
        assert np.bincount(labels[parts[s]]).tolist() == [{"train": 14, "val": 3, "test": 3}[s]] * 10
    assert sorted(np.concatenate(list(parts.values())).tolist()) == list(range(200))
    assert all(np.array_equal(parts[s], stratified_split(labels, seed=0)[s]) for s in parts)
    assert not np.array_equal(parts["val"], stratified_split(labels, seed=1)["val"])


def test_training_split_is_normalized_and_batches_have_shape(sc10_source, tmp_path):
    dm = make(sc10_source, tmp_path)
    train = np.stack([dm.datasets["train"][i]["inputs"].numpy()[:, 0] for i in range(len(dm.datasets["train"]))])
    assert abs(train.mean()) < 1e-4 and abs(train.std(ddof=1) - 1.0) < 1e-3
    batch = next(iter(dm.train_dataloader()))
    assert batch["inputs"].shape == (5, 16000, 1) and "mask" not in batch and batch["labels"].shape == (5,)


def test_official_lists_split(sc10_source, tmp_path):
    dm = make(sc10_source, tmp_path, split="official")
    files = np.array((dm.root / "files.txt").read_text().split())
    val = files[dm.datasets["val"].index]
    test = files[dm.datasets["test"].index]
    assert all(f.startswith(tuple(SC10_CLASSES)) and f.split("/")[1].startswith("00000000") for f in val)
    assert all(f.split("/")[1].startswith("00000001") for f in test)
    assert len(dm.datasets["train"]) == 10 * (SC10_PER_WORD - 2)


def test_half_resolution_evaluation(sc10_source, tmp_path):
    full = make(sc10_source, tmp_path)
    half = make(sc10_source, tmp_path, eval_resolution=2)
    x_full, x_half = full.datasets["test"][0]["inputs"], half.datasets["test"][0]["inputs"]
    assert x_half.shape == (8000, 1)
    assert np.allclose(x_half.numpy(), x_full.numpy()[::2])
    assert half.datasets["train"][0]["inputs"].shape == (16000, 1)  # training stays at 16 kHz
    with pytest.raises(ValueError, match="data.eval_resolution=4"):
        SpeechCommands(data_dir=tmp_path, eval_resolution=4)


def test_a_missing_word_folder_is_refused(tmp_path):
    """With one word folder missing SC10 was prepared as a 10-class task whose class 'go' never occurs; it is
    refused, naming the folder."""
    overrides = write_sc10_fixture(tmp_path / "raw")
    shutil.rmtree(tmp_path / "raw" / "go")
    dm = SpeechCommands(data_dir=tmp_path / "data", **overrides)
    with pytest.raises(SourceFileMissingError, match=f"{tmp_path / 'raw' / 'go'} holds no full-length 16 kHz clip"):
        dm.prepare_data()
    assert not (dm.root / "manifest.json").exists()


def test_a_corrupt_wav_is_named_in_one_line(tmp_path):
    """A damaged WAV escaped as soundfile's LibsndfileError traceback; it is one line naming the file."""
    overrides = write_sc10_fixture(tmp_path / "raw")
    bad = tmp_path / "raw" / "up" / "00000002_nohash_0.wav"
    bad.write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunk")
    with pytest.raises(SourceFileError, match=f"{bad} is not a readable WAV file") as caught:
        SpeechCommands(data_dir=tmp_path / "data", **overrides).prepare_data()
    assert "\n" not in str(caught.value)


def test_a_cut_wav_is_named_not_dropped_as_a_short_clip(tmp_path):
    """Regression: a full-length clip cut short (an interrupted copy into data.source_dir) still opened, with the
    samples that were left, so it was dropped with the dataset's genuinely short clips ("dropped N shorter ones")
    and the data was prepared without it. Its header declares more audio than the file holds: it is named."""
    overrides = write_sc10_fixture(tmp_path / "raw")
    cut = tmp_path / "raw" / "go" / "00000004_nohash_0.wav"
    cut.write_bytes(cut.read_bytes()[:-1000])
    dm = SpeechCommands(data_dir=tmp_path / "data", **overrides)
    with pytest.raises(SourceFileError, match=rf"{cut} is cut short: its header declares 32000 bytes of audio, the "
                                              "file holds 31000"):
        dm.prepare_data()
    assert not (dm.root / "manifest.json").exists()
