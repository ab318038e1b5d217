"""sCIFAR from CIFAR-10 python batches: 1024 x RGB layout, per-channel normalization, seeded hold-out, augmentation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from longmixer.data.base import DatasetNotPreparedError
from longmixer.data.scifar import CIFAR_MEAN, CIFAR_STD, SCIFAR, holdout_split, read_cifar_batch
from tests.data.fixtures_extra import CIFAR_PER_BATCH, CIFAR_TEST, cifar_image, write_scifar_fixture


@pytest.fixture
def scifar(tmp_path):
    overrides = write_scifar_fixture(tmp_path / "raw")
    dm = SCIFAR(data_dir=tmp_path / "data", batch_size=4, **overrides)
    dm.prepare_data()
    dm.setup()
    return dm


def expected_sequence(i: int) -> torch.Tensor:
    planes = cifar_image(i).reshape(3, 1024).astype(np.float64) / 255.0  # R, G, B planes, row-major
    mean, std = np.array(CIFAR_MEAN)[:, None], np.array(CIFAR_STD)[:, None]
    return torch.from_numpy(((planes - mean) / std).T).float()  # [1024, 3]


def test_read_cifar_batch_layout(tmp_path):
    write_scifar_fixture(tmp_path)
    images, labels = read_cifar_batch(tmp_path / "cifar-10-batches-py" / "test_batch")
    assert images.shape == (CIFAR_TEST, 1024, 3) and images.dtype == np.uint8
    raw = cifar_image(0)
    assert images[0, 33, 1] == raw[1024 + 33]  # pixel (row 1, col 1), green plane
    assert labels.tolist() == [i % 10 for i in range(CIFAR_TEST)]


def test_splits_counts_and_manifest(scifar):
    n_train = 5 * CIFAR_PER_BATCH
    assert len(scifar.datasets["val"]) == round(0.1 * n_train)
    assert len(scifar.datasets["train"]) + len(scifar.datasets["val"]) == n_train
    assert len(scifar.datasets["test"]) == CIFAR_TEST
    manifest = json.loads((scifar.root / "manifest.json").read_text())
    assert manifest["splits"]["train"]["count"] == n_train and manifest["splits"]["test"]["count"] == CIFAR_TEST
    source = str((scifar.source_dir).resolve())
    assert manifest["meta"] == {"seq_len": 1024, "d_input": 3, "num_classes": 10, "source_dir": source}


def test_test_item_is_normalized_rgb_sequence(scifar):
    item = scifar.datasets["test"][3]
    torch.testing.assert_close(item["inputs"], expected_sequence(3))
    assert int(item["labels"]) == 3


def test_batch_shape_and_last_batch_kept(scifar):
    batch = next(iter(scifar.train_dataloader()))
    assert batch["inputs"].shape == (4, 1024, 3) and batch["inputs"].dtype == torch.float32
    assert "mask" not in batch  # fixed length: no key mask
    assert batch["labels"].dtype == torch.long
    sizes = [b["inputs"].shape[0] for b in scifar.test_dataloader()]
    assert sum(sizes) == CIFAR_TEST and sizes[-1] == CIFAR_TEST % 4


def test_holdout_matches_torch_random_split():
    train, val = holdout_split(50, 0.1, seed=42)
    ref_train, ref_val = torch.utils.data.random_split(range(50), [45, 5],
                                                       generator=torch.Generator().manual_seed(42))
    assert train.tolist() == list(ref_train.indices) and val.tolist() == list(ref_val.indices)


def test_augmentation_is_a_symmetric_padded_crop_or_flip(tmp_path):
    overrides = write_scifar_fixture(tmp_path / "raw")
    dm = SCIFAR(data_dir=tmp_path / "data", augment=True, **overrides)
    dm.prepare_data()
    dm.setup()
    dataset = dm.datasets["train"]
    row = int(dataset.index[0])
    img = np.asarray(dm.datasets["train"].images[row], dtype=np.float64).reshape(32, 32, 3)
    padded = np.pad(img, ((4, 4), (4, 4), (0, 0)), mode="symmetric")
    candidates = [padded[t:t + 32, s:s + 32] for t in range(9) for s in range(9)]
    candidates += [c[:, ::-1] for c in candidates]
    torch.manual_seed(0)
    for _ in range(3):
        x = dataset[0]["inputs"].double().numpy()
        pixels = (x * np.array(CIFAR_STD) + np.array(CIFAR_MEAN)) * 255.0
        assert min(np.abs(pixels.reshape(32, 32, 3) - c).max() for c in candidates) < 1e-3
    assert dm.datasets["val"].augment_side is None  # evaluation is never augmented


def test_missing_data_and_wrong_shapes(tmp_path):
    with pytest.raises(DatasetNotPreparedError, match="prepare_data.py scifar"):
        SCIFAR(data_dir=tmp_path / "nothing").setup()
    overrides = write_scifar_fixture(tmp_path / "raw")
    dm = SCIFAR(data_dir=tmp_path / "data", d_input=1, **overrides)
    dm.prepare_data()
    with pytest.raises(ValueError, match="data.d_input=1 does not match"):
        dm.setup()


def test_a_crafted_pickle_with_a_forbidden_global_is_refused(tmp_path):
    """Reading a download must not run code: a pickle that calls os.system is refused before anything runs."""
    import os
    import pickle

    class Exploit:
        def __reduce__(self):
            return os.system, (f"touch {tmp_path / 'pwned'}",)

    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps({b"data": Exploit(), b"labels": [0]}))
    with pytest.raises(ValueError, match=r"global posix\.system is not allowed|global os\.system is not allowed"):
        read_cifar_batch(path)
    assert not (tmp_path / "pwned").exists()
    path.write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="not a readable CIFAR-10 python batch"):
        read_cifar_batch(path)


def test_labels_outside_cifar10_name_the_batch(tmp_path):
    """A label outside 0-9 (a CIFAR-100 batch, a damaged file) is refused while reading, naming the file, before
    anything is marked prepared."""
    import pickle

    import numpy as np

    path = tmp_path / "test_batch"
    path.write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"labels": [3, 10]}))
    with pytest.raises(ValueError, match=r"test_batch: expected 2 labels in \[0, 10\), got shape \(2,\) with values 3..10"):
        read_cifar_batch(path)


def test_a_missing_batch_names_the_fix_for_where_it_came_from(tmp_path):
    from longmixer.data.integrity import SourceFileMissingError
    from longmixer.data.scifar import read_cifar_split

    with pytest.raises(SourceFileMissingError, match="lacks \\['test_batch'\\]; point data.source_dir"):
        read_cifar_split(tmp_path, ["test_batch"], from_source=True)
    with pytest.raises(SourceFileMissingError, match="lacks \\['test_batch'\\]; delete .* download and unpack"):
        read_cifar_split(tmp_path / "raw" / "cifar-10-batches-py", ["test_batch"], from_source=False)


def test_a_damaged_batch_is_one_line_naming_the_file(tmp_path):
    """Bytes flipped in a CIFAR batch let the unpickler's LookupError (an unknown encoding), AttributeError,
    OverflowError and MemoryError escape as tracebacks. Every damaged copy (a seeded sample of flips that meets
    these) either reads or fails with one line naming the file."""
    import pickle
    import random

    from longmixer.data.integrity import SourceFileError

    batch = {b"labels": [1, 2], b"data": np.random.RandomState(0).randint(0, 256, (2, 3072)).astype(np.uint8)}
    whole = pickle.dumps(batch, protocol=2)
    path = tmp_path / "data_batch_1"
    flips = random.Random(0)
    for _ in range(4000):
        damaged = bytearray(whole)
        for _ in range(flips.randint(1, 4)):
            damaged[flips.randrange(len(damaged))] = flips.randrange(256)
        path.write_bytes(bytes(damaged))
        try:
            read_cifar_batch(path)
        except SourceFileError as err:  # one line naming the file, whichever check refused it
            assert str(err).startswith(str(path)) and "\n" not in str(err), err
