"""LRA Image: CIFAR-10 python batches -> TF grayscale -> token or real-valued pixel sequences."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from longmixer.data.image import GrayscaleCIFAR, rgb_to_gray
from tests.data.fixtures import write_image_fixture
from tests.data.fixtures_extra import cifar_image


def _module(tmp_path, **overrides):
    dm = GrayscaleCIFAR(data_dir=tmp_path / "data", batch_size=8, **write_image_fixture(tmp_path / "raw"),
                        **overrides)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_gray_matches_tensorflow_rgb_to_grayscale():
    """tf.image.rgb_to_grayscale on uint8: floor((0.2989 r + 0.5870 g + 0.1140 b) / 255 * 255.5)."""
    pixels = np.array([[[255, 0, 0], [0, 255, 0], [0, 0, 255], [255, 255, 255], [0, 0, 0], [12, 200, 99]]],
                      dtype=np.uint8)
    expected = [76, 149, 29, 255, 0, 132]  # 0.2989*12 + 0.587*200 + 0.114*99 = 132.27 -> 132.53
    assert rgb_to_gray(pixels)[0].tolist() == expected


def test_real_valued_batches_and_split(tmp_path):
    dm = _module(tmp_path)
    assert {s: len(d) for s, d in dm.datasets.items()} == {"train": 50, "val": 10, "test": 10}
    batch = next(iter(dm.train_dataloader()))
    assert batch["inputs"].shape == (8, 1024, 1) and batch["inputs"].dtype == torch.float32
    assert "mask" not in batch and batch["labels"].dtype == torch.long  # fixed length: no key mask
    # the first test image, converted independently from the fixture's RGB planes
    rgb = cifar_image(0).reshape(3, 1024).T[None]  # [1, 1024, 3]
    expected = (torch.from_numpy(rgb_to_gray(rgb)[0]).float() / 255 - 0.48) / 0.24
    torch.testing.assert_close(dm.datasets["test"][0]["inputs"][:, 0], expected)
    train_rows = set(dm.datasets["train"].index.tolist())
    assert not train_rows & set(dm.datasets["val"].index.tolist())


def test_token_pixels(tmp_path):
    dm = _module(tmp_path, vocab_size=256, d_input=None)
    item = dm.datasets["test"][3]
    assert item["inputs"].dtype == torch.long and item["inputs"].shape == (1024,)
    assert 0 <= item["inputs"].min() and item["inputs"].max() <= 255
    assert item["labels"].item() == 3


def test_split_follows_split_seed(tmp_path):
    a = _module(tmp_path / "a", split_seed=1).datasets["val"].index
    b = _module(tmp_path / "b", split_seed=2).datasets["val"].index
    assert sorted(a.tolist()) != sorted(b.tolist())


def test_missing_batch_file_is_a_clear_error(tmp_path):
    source = write_image_fixture(tmp_path / "raw")["source_dir"]
    (tmp_path / "raw" / "cifar-10-batches-py" / "data_batch_3").unlink()
    dm = GrayscaleCIFAR(data_dir=tmp_path / "data", source_dir=source, val_size=10)
    with pytest.raises(FileNotFoundError, match="data_batch_3"):
        dm.prepare_data()


def test_corrupt_batch_is_a_clear_error(tmp_path):
    source = write_image_fixture(tmp_path / "raw")["source_dir"]
    with open(tmp_path / "raw" / "cifar-10-batches-py" / "test_batch", "wb") as f:
        pickle.dump({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]}, f)
    with pytest.raises(ValueError, match=r"\[N, 3072\]"):
        GrayscaleCIFAR(data_dir=tmp_path / "data", source_dir=source, val_size=10).prepare_data()


@pytest.mark.parametrize("vocab_size, d_input", [pytest.param(None, None, id="neither"),
                                                 pytest.param(256, 1, id="both"),
                                                 pytest.param(255, None, id="vocab255")])
def test_pixel_mode_must_be_one_of_the_two(tmp_path, vocab_size, d_input):
    with pytest.raises(ValueError, match="data.vocab_size"):
        GrayscaleCIFAR(data_dir=tmp_path, vocab_size=vocab_size, d_input=d_input)
