"""Sequential and permuted MNIST: 784-long pixel sequences, one channel (LaS table 2, copied from the S4 paper).

Protocol (s4 `dataset=mnist`, which LaS's pipeline follows): the 28 x 28 image is read row-major into 784 positions,
pixels / 255 in [0, 1] with no further normalization; 10% of the official 60,000 training images are held out for
validation by a seeded permutation (`split_seed`, 42 as s4); the official 10,000 test images are the test set.
pMNIST applies one fixed pixel permutation to every image: `permutation=random` draws it from
`numpy.random.RandomState(permutation_seed)`; `permutation=bitreversal`
is the bit-reversal order that s4's code uses for its `permute: true` option.

Source: the MNIST idx files (`{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`; big-endian header: magic 2051
for images with dims N, 28, 28, magic 2049 for labels with dim N).
"""

from __future__ import annotations

import gzip
import math
import zlib
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from longmixer.data.base import SequenceDataModule, label_counts
from longmixer.data.download import Pin, download
from longmixer.data.integrity import SourceFileError
from longmixer.data.scifar import PixelSequenceDataset, check_shapes, holdout_split

MNIST_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"
MNIST_MD5 = {  # the md5 values torchvision pins for these files
    "train-images-idx3-ubyte": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
    "train-labels-idx1-ubyte": "d53e105ee54ea40749a09fcbcd1e9432",
    "t10k-images-idx3-ubyte": "9fb629c4189551a2d022fa330f9573f3",
    "t10k-labels-idx1-ubyte": "ec29112dd5afa0611ce80d1b7f02629c",
}
MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
               "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
PERMUTATIONS = ("none", "random", "bitreversal")
IDX_IMAGES, IDX_LABELS = 2051, 2049


def read_idx(path: Path) -> np.ndarray:
    """An idx file (optionally .gz) -> uint8 array of the dims its header gives.

    Raises:
        ValueError: a header or size that is not an idx file's (a SourceFileError where the file does not unpack).
    """
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise SourceFileError(f"{path} does not unpack ({type(err).__name__}: {err}): a damaged or cut download; "
                              "delete it and prepare again to download it afresh, or correct data.source_dir") from None
    magic = int.from_bytes(data[:4], "big")
    if magic not in (IDX_IMAGES, IDX_LABELS):
        raise SourceFileError(f"{path}: idx magic {magic} is neither {IDX_IMAGES} (images) nor {IDX_LABELS} (labels)")
    ndim = magic & 0xFF
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    size = max(len(data) - 4 - 4 * ndim, 0)
    if size != math.prod(dims):
        raise SourceFileError(f"{path}: header dims {dims} need {math.prod(dims)} bytes, file has {size}")
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def bitreversal_permutation(n: int) -> np.ndarray:
    """The indices 0..2^m - 1 (2^m >= n) in bit-reversed order, keeping those < n."""
    m = max(1, math.ceil(math.log2(n)))
    idx = np.arange(1 << m)
    rev = np.zeros_like(idx)
    for bit in range(m):
        rev |= ((idx >> bit) & 1) << (m - 1 - bit)
    return rev[rev < n]


def pixel_permutation(kind: str, n: int, seed: int) -> np.ndarray | None:
    if kind == "none":
        return None
    if kind == "random":
        return np.random.RandomState(seed).permutation(n)
    if kind == "bitreversal":
        return bitreversal_permutation(n)
    raise ValueError(f"data.permutation={kind!r} is not one of {PERMUTATIONS}")


def _find(raw: Path, stem: str, may_download: bool) -> Path:
    if may_download and ((raw / (stem + ".gz")).exists() or not (raw / stem).exists()):
        # the download folder: `download` checks a `.gz` already there (an earlier download, or one put there by
        # hand, e.g. a Fashion-MNIST file of the same name) against its md5 before it is reused, or fetches it. An
        # unpacked file alone has no published digest and is read as it is, as from data.source_dir.
        return download(MNIST_URL + stem + ".gz", raw / (stem + ".gz"), Pin(md5=MNIST_MD5.get(stem)))
    for name in (stem, stem + ".gz"):
        if (raw / name).exists():
            return raw / name
    raise FileNotFoundError(f"data.source_dir={raw} has neither {stem} nor {stem}.gz")


class MNIST(SequenceDataModule):
    """s/pMNIST classification: batches `inputs` float [B, 784, 1], `mask`, `labels`.

    Args:
        seq_len, d_input, num_classes: 784, 1, 10 (checked against the prepared data).
        permutation: "none" (sMNIST) | "random" (pMNIST, seeded) | "bitreversal".
        permutation_seed: the seed of the random permutation.
        val_fraction: share of the training images held out for validation (0.1).
        split_seed: the validation hold-out seed (42, as s4).
        source_dir: a folder holding the idx files, plain or .gz (skips the download); None: download into
            `<data_dir>/mnist/raw`.
        data_dir, batch_size, eval_batch_size, num_workers, seed, pin_memory: see `SequenceDataModule`.
    """

    name = "mnist"

    def __init__(self, seq_len: int = 784, d_input: int = 1, num_classes: int = 10, permutation: str = "none",
                 permutation_seed: int = 0, val_fraction: float = 0.1, source_dir: str | Path | None = None,
                 data_dir: str | Path | None = None,
                 batch_size: int = 50, eval_batch_size: int | None = None, num_workers: int | None = None,
                 seed: int = 0, split_seed: int = 42, pin_memory: bool | None = None,
                 persistent_workers: bool | None = None):
        super().__init__(data_dir=data_dir, batch_size=batch_size, eval_batch_size=eval_batch_size,
                         num_workers=num_workers, seed=seed, split_seed=split_seed, pin_memory=pin_memory,
                         persistent_workers=persistent_workers)
        if permutation not in PERMUTATIONS:
            raise ValueError(f"data.permutation={permutation!r} is not one of {PERMUTATIONS}")
        self.seq_len, self.d_input, self.num_classes = seq_len, d_input, num_classes
        self.permutation, self.permutation_seed, self.val_fraction = permutation, permutation_seed, val_fraction
        self.source_dir = None if source_dir is None else Path(source_dir)

    @property
    def prepare_hint(self) -> str:
        return self._prepare_command("smnist" if self.permutation == "none" else "pmnist")

    def _prepare(self, root: Path) -> tuple[dict, dict]:
        raw = self.source_dir or root / "raw"  # `download` makes the folder it downloads into
        splits, side = {}, None
        for split, (images_stem, labels_stem) in MNIST_FILES.items():
            images = read_idx(_find(raw, images_stem, self.source_dir is None))
            labels = read_idx(_find(raw, labels_stem, self.source_dir is None)).astype(np.int64)
            if images.ndim != 3 or labels.shape != (images.shape[0],):
                raise SourceFileError(f"{raw}: {split} images {images.shape} and labels {labels.shape} do not match")
            if side is not None and images.shape[1:] != side:
                raise SourceFileError(f"{raw}: the test images are {images.shape[1]}x{images.shape[2]}, the training "
                                 f"images {side[0]}x{side[1]}; the idx files come from different datasets: point "
                                 "data.source_dir at one MNIST copy")
            side = images.shape[1:]
            np.save(root / f"{split}.images.npy", images.reshape(len(images), -1, 1))
            np.save(root / f"{split}.labels.npy", labels)
            splits[split] = {"count": int(len(labels)), "labels": label_counts(labels)}
        return splits, {"seq_len": int(side[0] * side[1]), "d_input": 1, "num_classes": 10}

    def _load(self, root: Path, manifest: dict) -> dict[str, Dataset]:
        check_shapes(self.name, manifest, seq_len=self.seq_len, d_input=self.d_input, num_classes=self.num_classes)
        images = {s: np.load(root / f"{s}.images.npy", mmap_mode="r") for s in MNIST_FILES}
        labels = {s: np.load(root / f"{s}.labels.npy") for s in MNIST_FILES}
        perm = pixel_permutation(self.permutation, self.seq_len, self.permutation_seed)
        train_idx, val_idx = holdout_split(len(labels["train"]), self.val_fraction, self.split_seed)
        plain = dict(mean=(0.0,), std=(1.0,), permutation=perm)  # pixels / 255, as s4's ToTensor
        return {
            "train": PixelSequenceDataset(images["train"], labels["train"], train_idx, **plain),
            "val": PixelSequenceDataset(images["train"], labels["train"], val_idx, **plain),
            "test": PixelSequenceDataset(images["test"], labels["test"], np.arange(len(labels["test"])), **plain),
        }
