"""sCIFAR: CIFAR-10 as RGB pixel sequences, length 1024 x 3 channels (frameworks.md section 2.5).

Protocol (s4 `dataset=cifar grayscale=false`, followed by CHELA table 3 and LongVQ table 1): the 32 x 32 image is read
row-major into 1024 positions with the 3 colour channels as features, pixels / 255 are normalized per channel with
mean (0.4914, 0.4822, 0.4465) and std (0.247, 0.243, 0.261); 10% of the official training set (5,000 images) is held
out for validation by a seeded permutation (`split_seed`, 42 as s4's `random_split`); the official 10,000 test
images are the test set. Augmentation (random crop with 4-pixel symmetric padding and horizontal flip, s4's option)
is off by default.

Source: the CIFAR-10 python tarball (`cifar-10-batches-py/{data_batch_1..5, test_batch}`, pickled dicts with
`b"data"` uint8 [10000, 3072] as R, G, B planes of 1024 row-major pixels each, and `b"labels"`).
"""

from __future__ import annotations

import io
import logging
import pickle
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from longmixer.data.base import SequenceDataModule, label_counts
from longmixer.data.download import Pin, download, extract, extracted
from longmixer.data.integrity import SourceFileError, SourceFileMissingError

log = logging.getLogger(__name__)

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_PIN = Pin(size=170_498_071, md5="c58f30108f718f92721af3b95e74349a")  # the md5 published on the CIFAR page
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.247, 0.243, 0.261)
SIDE = 32


class _BatchUnpickler(pickle.Unpickler):
    """Unpickles the CIFAR python batches (dicts of bytes, str, lists, ints and numpy arrays) and nothing else: any
    other global (a function a crafted file would call) is refused, so reading a download cannot run code."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
               ("numpy._core.multiarray", "scalar"), ("builtins", "bytes"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR batch")
        return super().find_class(module, name)


def read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """One pickled CIFAR-10 batch -> (images uint8 [N, 1024, 3] row-major pixels x RGB, labels int64 [N]).

    Raises:
        ValueError: the file is not a CIFAR batch, or it references a global a batch never holds.
    """
    unreadable = (f"{path} is not a readable CIFAR-10 python batch ({{}}); delete the extracted folder and prepare "
                  "again (the archive is re-checked against its md5)")
    try:
        # a damaged pickle fails in any of these ways (an opcode's argument cut short or out of range, a memo
        # index that is not there, a length field read as gigabytes)
        batch = _BatchUnpickler(io.BytesIO(Path(path).read_bytes()), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, LookupError, AttributeError, MemoryError,
            OverflowError) as err:
        raise SourceFileError(unreadable.format(f"{type(err).__name__}: {err}")) from None
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise SourceFileError(f"{path} holds no b'data' / b'labels' dict; is it a cifar-10-batches-py file?")
    try:
        data = np.asarray(batch[b"data"], dtype=np.uint8)
        labels = np.asarray(batch[b"labels"], dtype=np.int64)
    except (ValueError, TypeError, OverflowError, MemoryError) as err:
        raise SourceFileError(unreadable.format(f"its b'data' or b'labels' is no array of numbers: {err}")) from None
    if data.ndim != 2 or data.shape[1] != 3 * SIDE * SIDE:
        raise SourceFileError(f"{path}: expected b'data' of shape [N, 3072], got {data.shape}")
    images = data.reshape(-1, 3, SIDE * SIDE).transpose(0, 2, 1)  # [N, 1024, 3]
    if labels.shape != (len(images),) or (labels.size and not 0 <= labels.min() <= labels.max() < 10):
        raise SourceFileError(f"{path}: expected {len(images)} labels in [0, 10), got shape {labels.shape} with values "
                         f"{labels.min() if labels.size else '-'}..{labels.max() if labels.size else '-'}; is it "
                         "a CIFAR-10 batch (not CIFAR-100)?")
    return np.ascontiguousarray(images), labels


def read_cifar_split(raw: Path, files: list[str], from_source: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """`read_cifar_batch` of each of `files` in `raw`, after checking that all are there.

    Raises:
        SourceFileMissingError: naming the missing batches and the fix (`from_source`: the folder was given as
            data.source_dir; else it came from the download).
    """
    missing = [f for f in files if not (Path(raw) / f).exists()]
    if missing:
        fix = ("point data.source_dir at a complete extracted cifar-10-batches-py folder, or leave it unset to "
               "download" if from_source else
               f"delete {Path(raw).parent} and run the same command again to download and unpack it afresh")
        raise SourceFileMissingError(f"{raw} lacks {missing}; {fix}")
    return [read_cifar_batch(Path(raw) / f) for f in files]


def holdout_split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) indices: a `torch.randperm(n)` seeded by `seed`, the first n - round(fraction n) for training
    (the order of `torch.utils.data.random_split(ds, [n - k, k], generator=Generator().manual_seed(seed))`)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"data.val_fraction={fraction} must be in (0, 1)")
    k = int(round(fraction * n))
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).numpy()
    return order[:n - k], order[n - k:]


class PixelSequenceDataset(Dataset):
    """Images as pixel sequences: items `{"inputs": float [L, C], "labels": long}`.

    Args:
        images: uint8 [N, L, C] (memory-mapped is fine).
        labels: int [N].
        index: the rows of this split.
        mean, std: per-channel normalization of pixels / 255.
        permutation: [L] pixel order (pMNIST), or None.
        augment_side: if set, random-crop (4-pixel symmetric padding) and horizontally flip the side x side image.
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, index: np.ndarray, mean, std,
                 permutation: np.ndarray | None = None, augment_side: int | None = None):
        self.images, self.labels, self.index = images, labels, index
        self.mean = torch.tensor(mean, dtype=torch.float32)
        self.std = torch.tensor(std, dtype=torch.float32)
        self.permutation = None if permutation is None else torch.as_tensor(permutation, dtype=torch.long)
        self.augment_side = augment_side

    def __len__(self) -> int:
        return len(self.index)

    def _augment(self, x: torch.Tensor) -> torch.Tensor:
        side = self.augment_side
        img = x.view(side, side, -1).permute(2, 0, 1)  # [C, H, W]
        # symmetric padding by 4 (the edge pixel repeats, torchvision's padding_mode="symmetric"), then a crop
        idx = torch.arange(-4, side + 4)
        idx = torch.where(idx < 0, -idx - 1, torch.where(idx >= side, 2 * side - idx - 1, idx))
        top, left = torch.randint(0, 9, (2,)).tolist()
        img = img[:, idx[top:top + side]][:, :, idx[left:left + side]]
        if torch.rand(()) < 0.5:
            img = img.flip(-1)
        return img.permute(1, 2, 0).reshape(side * side, -1)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = int(self.index[i])
        x = torch.from_numpy(np.array(self.images[row], dtype=np.float32))  # [L, C]
        if self.augment_side is not None:
            x = self._augment(x)
        x = (x / 255.0 - self.mean) / self.std
        if self.permutation is not None:
            x = x[self.permutation]
        return {"inputs": x, "labels": torch.tensor(int(self.labels[row]))}


def check_shapes(name: str, manifest: dict, **expected) -> None:
    """Compare config shape values (seq_len, d_input, num_classes, vocab_size) with the prepared manifest."""
    meta = manifest.get("meta", {})
    for key, value in expected.items():
        if key in meta and meta[key] != value:
            raise ValueError(f"data.{key}={value} does not match the prepared {name} data ({key}={meta[key]}); "
                             f"set data.{key}={meta[key]}")


class SCIFAR(SequenceDataModule):
    """sCIFAR classification: batches `inputs` float [B, 1024, 3], `mask`, `labels`.

    Args:
        seq_len, d_input, num_classes: 1024, 3, 10 (checked against the prepared data).
        val_fraction: share of the training images held out for validation (0.1).
        augment: random crop + horizontal flip on the training split.
        source_dir: a folder holding the extracted batches `data_batch_1..5`, `test_batch` (skips the
            download); None: download into `<data_dir>/scifar/raw`.
        split_seed: the validation hold-out seed (42, as s4).
        data_dir, batch_size, eval_batch_size, num_workers, seed, pin_memory: see `SequenceDataModule`.
    """

    name = "scifar"

    def __init__(self, seq_len: int = 1024, d_input: int = 3, num_classes: int = 10, val_fraction: float = 0.1,
                 augment: bool = False, source_dir: str | Path | None = None, data_dir: str | Path | None = None,
                 batch_size: int = 50, eval_batch_size: int | None = None, num_workers: int | None = None,
                 seed: int = 0, split_seed: int = 42, pin_memory: bool | None = None,
                 persistent_workers: bool | None = None):
        super().__init__(data_dir=data_dir, batch_size=batch_size, eval_batch_size=eval_batch_size,
                         num_workers=num_workers, seed=seed, split_seed=split_seed, pin_memory=pin_memory,
                         persistent_workers=persistent_workers)
        self.seq_len, self.d_input, self.num_classes = seq_len, d_input, num_classes
        self.val_fraction, self.augment = val_fraction, augment
        self.source_dir = None if source_dir is None else Path(source_dir)

    def _prepare(self, root: Path) -> tuple[dict, dict]:
        raw = self.source_dir or root / "raw" / "cifar-10-batches-py"
        if self.source_dir is None and not extracted(root / "raw", "cifar-10-python.tar.gz"):
            extract(download(CIFAR10_URL, root / "raw" / "cifar-10-python.tar.gz", CIFAR10_PIN), root / "raw")
        splits = {}
        for split, files in (("train", [f"data_batch_{i}" for i in range(1, 6)]), ("test", ["test_batch"])):
            parts = read_cifar_split(raw, files, self.source_dir is not None)
            images = np.concatenate([p[0] for p in parts])
            labels = np.concatenate([p[1] for p in parts])
            np.save(root / f"{split}.images.npy", images)
            np.save(root / f"{split}.labels.npy", labels)
            splits[split] = {"count": int(len(labels)), "labels": label_counts(labels)}
        return splits, {"seq_len": SIDE * SIDE, "d_input": 3, "num_classes": 10}

    def _load(self, root: Path, manifest: dict) -> dict[str, Dataset]:
        check_shapes(self.name, manifest, seq_len=self.seq_len, d_input=self.d_input, num_classes=self.num_classes)
        images = {s: np.load(root / f"{s}.images.npy", mmap_mode="r") for s in ("train", "test")}
        labels = {s: np.load(root / f"{s}.labels.npy") for s in ("train", "test")}
        train_idx, val_idx = holdout_split(len(labels["train"]), self.val_fraction, self.split_seed)
        side = SIDE if self.augment else None
        return {
            "train": PixelSequenceDataset(images["train"], labels["train"], train_idx, CIFAR_MEAN, CIFAR_STD,
                                          augment_side=side),
            "val": PixelSequenceDataset(images["train"], labels["train"], val_idx, CIFAR_MEAN, CIFAR_STD),
            "test": PixelSequenceDataset(images["test"], labels["test"], np.arange(len(labels["test"])),
                                         CIFAR_MEAN, CIFAR_STD),
        }
