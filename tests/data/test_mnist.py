"""s/pMNIST from idx files: 784-long pixel sequences, the seeded fixed permutation, the seeded hold-out."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from longmixer.data.integrity import SourceFileError
from longmixer.data.mnist import MNIST, bitreversal_permutation, read_idx
from tests.data.fixtures_extra import MNIST_TEST, MNIST_TRAIN, mnist_images, write_mnist_fixture


def make(tmp_path, **kw):
    overrides = write_mnist_fixture(tmp_path / "raw")
    dm = MNIST(data_dir=tmp_path / "data", batch_size=8, **overrides, **kw)
    dm.prepare_data()
    dm.setup()
    return dm


def test_read_idx_plain_and_gzip(tmp_path):
    write_mnist_fixture(tmp_path)
    images = read_idx(tmp_path / "train-images-idx3-ubyte.gz")
    assert images.shape == (MNIST_TRAIN, 28, 28) and np.array_equal(images, mnist_images(MNIST_TRAIN, 1))
    labels = read_idx(tmp_path / "t10k-labels-idx1-ubyte")
    assert labels.tolist() == [i % 10 for i in range(MNIST_TEST)]
    (tmp_path / "bad").write_bytes(b"\x00\x00\x08\x01" + (5).to_bytes(4, "big") + b"\x00" * 4)
    with pytest.raises(ValueError, match="need 5 bytes"):
        read_idx(tmp_path / "bad")


def test_smnist_sequences_and_splits(tmp_path):
    dm = make(tmp_path)
    assert len(dm.datasets["train"]) == MNIST_TRAIN - 4 and len(dm.datasets["val"]) == 4
    assert len(dm.datasets["test"]) == MNIST_TEST
    item = dm.datasets["test"][2]
    assert item["inputs"].shape == (784, 1)
    expected = torch.from_numpy(mnist_images(MNIST_TEST, 2)[2].reshape(784, 1) / 255.0).float()
    torch.testing.assert_close(item["inputs"], expected)
    batch = next(iter(dm.train_dataloader()))
    assert batch["inputs"].shape == (8, 784, 1) and "mask" not in batch  # fixed length: no key mask


def test_pmnist_applies_one_fixed_seeded_permutation(tmp_path):
    plain = make(tmp_path / "a").datasets["test"]
    permuted = make(tmp_path / "b", permutation="random", permutation_seed=3).datasets["test"]
    perm = torch.from_numpy(np.random.RandomState(3).permutation(784))
    for i in (0, 5):
        torch.testing.assert_close(permuted[i]["inputs"], plain[i]["inputs"][perm])
    other = make(tmp_path / "c", permutation="random", permutation_seed=4).datasets["test"]
    assert not torch.equal(other[0]["inputs"], permuted[0]["inputs"])


def test_bitreversal_permutation():
    assert bitreversal_permutation(8).tolist() == [0, 4, 2, 6, 1, 5, 3, 7]
    perm = bitreversal_permutation(784)
    assert sorted(perm.tolist()) == list(range(784))


def test_unknown_permutation_raises(tmp_path):
    with pytest.raises(ValueError, match="data.permutation='shuffle'"):
        MNIST(data_dir=tmp_path, permutation="shuffle")


def test_a_cut_gzip_file_is_named_in_one_line(tmp_path):
    """A truncated `.gz` escaped as gzip's EOFError traceback; it is one line naming the file."""
    overrides = write_mnist_fixture(tmp_path / "raw")
    path = tmp_path / "raw" / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(SourceFileError, match=f"{path} does not unpack \\(EOFError"):
        MNIST(data_dir=tmp_path / "data", **overrides).prepare_data()


def test_train_and_test_images_of_other_sizes_are_refused(tmp_path):
    """Test images of another size than the training images were packed into one dataset with the training
    images' sequence length; they are refused, naming both sizes."""
    overrides = write_mnist_fixture(tmp_path / "raw")
    for name in ("t10k-images-idx3-ubyte", "t10k-images-idx3-ubyte.gz"):
        (tmp_path / "raw" / name).unlink(missing_ok=True)
    small = np.zeros((MNIST_TEST, 14, 14), dtype=np.uint8)
    header = (2051).to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in small.shape)
    (tmp_path / "raw" / "t10k-images-idx3-ubyte").write_bytes(header + small.tobytes())
    with pytest.raises(ValueError, match="the test images are 14x14, the training images 28x28"):
        MNIST(data_dir=tmp_path / "data", **overrides).prepare_data()


def test_the_prepare_command_keeps_the_source_folder(tmp_path):
    """Regression: MNIST's command in the data errors dropped `data.source_dir`, so following it downloaded MNIST
    (or failed without a network) instead of preparing from the user's idx files."""
    dm = make(tmp_path, permutation="random")
    assert dm.prepare_hint == (f"python scripts/prepare_data.py pmnist paths.data_dir={tmp_path / 'data'} "
                               f"data.source_dir={tmp_path / 'raw'}")


def test_a_source_dir_that_is_a_file_or_absent_is_one_line_and_nothing_is_made(tmp_path):
    """Regression: preparing made the folder `data.source_dir` names: a file there (the `.gz` itself) stopped with
    a FileExistsError traceback, and a mistyped path was created empty before the error."""
    from scripts import prepare_data

    write_mnist_fixture(tmp_path / "raw")
    for source in (tmp_path / "raw" / "train-images-idx3-ubyte.gz", tmp_path / "typo" / "mnist"):
        with pytest.raises(FileNotFoundError, match=f"data.source_dir={source} has neither train-images-idx3"):
            MNIST(data_dir=tmp_path / "data", source_dir=source).prepare_data()
        assert prepare_data.main(["smnist", f"paths.data_dir={tmp_path / 'data'}", f"data.source_dir={source}"]) == 2
    assert not (tmp_path / "typo").exists()


def test_a_gz_in_the_download_folder_is_checked_against_its_md5(tmp_path):
    """Regression: a `.gz` already in `<data>/mnist/raw` (put there by hand, as the download error suggests, or a
    Fashion-MNIST file of the same name) was read without its pinned md5, and the data was recorded as the
    download's. It is checked as `download` checks every file it reuses."""
    import gzip

    from longmixer.data.download import DataDownloadError

    raw = tmp_path / "data" / "mnist" / "raw"
    write_mnist_fixture(raw)
    for path in [p for p in raw.iterdir() if p.suffix != ".gz"]:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(path.read_bytes()))
        path.unlink()
    with pytest.raises(DataDownloadError, match=r"train-images-idx3-ubyte\.gz has md5 \w+, expected f68b3c2d"):
        MNIST(data_dir=tmp_path / "data").prepare_data()
    assert not (tmp_path / "data" / "mnist" / "manifest.json").exists()


def test_a_read_only_data_folder_names_a_command_that_runs(tmp_path, monkeypatch):
    """Regression: the read-only data folder's message named `prepare_data.py mnist`, the folder's name, which is no
    data config (smnist and pmnist are), so the command it gave stopped with "no data config 'mnist'"."""
    import errno

    from longmixer.data import base
    from longmixer.data.integrity import DatasetNotPreparedError

    def refused(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(base, "FileLock", refused)
    source = write_mnist_fixture(tmp_path / "raw")["source_dir"]
    with pytest.raises(DatasetNotPreparedError) as caught:
        MNIST(data_dir=tmp_path / "data", source_dir=source).prepare_data()
    assert (f"`python scripts/prepare_data.py smnist paths.data_dir=<writable folder> data.source_dir={source}`"
            in str(caught.value))
