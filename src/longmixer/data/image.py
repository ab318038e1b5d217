"""LRA Image: CIFAR-10 in grayscale as a sequence of 1024 pixels (Krizhevsky 2009; LRA, arXiv 2011.04006, 3.5).

Protocol (frameworks.md 2.4): each image goes through TensorFlow's `rgb_to_grayscale` on uint8 (weights 0.2989,
0.5870, 0.1140 on pixels / 255, back to uint8 by `convert_image_dtype`, i.e. floor(x * 255.5)), read row-major
into 1024 positions. Split 45k / 5k / 10k: LRA takes TFDS `train[:90%]` / `train[90%:]`, whose order is TFDS's own
shuffle; we hold out 5,000 training images by a seeded permutation (`split_seed` 42 gives the validation set of
s4 and MEGA, `torch.utils.data.random_split` order) and test on the official 10,000.
Pixels are either tokens 0-255 (LRA: `vocab_size: 256`, embedded) or real values (pixels / 255 - mean) / std as
`[L, 1]` floats (MEGA: `d_input: 1`, mean 0.48, std 0.24); exactly one of `vocab_size` / `d_input` is set.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from longmixer.data.base import SequenceDataModule, label_counts
from longmixer.data.download import download, extract, extracted
from longmixer.data.scifar import CIFAR10_PIN, CIFAR10_URL, holdout_split, read_cifar_split

log = logging.getLogger(__name__)

GRAY_WEIGHTS = (0.2989, 0.5870, 0.1140)  # tf.image.rgb_to_grayscale


def rgb_to_gray(images: np.ndarray) -> np.ndarray:
    """uint8 [N, L, 3] -> uint8 [N, L] as `tf.image.rgb_to_grayscale` on uint8 images."""
    gray = (images.astype(np.float32) / 255.0) @ np.asarray(GRAY_WEIGHTS, dtype=np.float32)  # [N, L]
    return np.clip(np.floor(gray * 255.5), 0, 255).astype(np.uint8)


def pixel_mode(name: str, vocab_size: int | None, d_input: int | None) -> bool:
    """True for token inputs. Exactly one of vocab_size (256) and d_input (1) must be set."""
    if (vocab_size is None) == (d_input is None):
        raise ValueError(f"{name}: set exactly one of data.vocab_size=256 (pixels as tokens) and data.d_input=1 "
                         f"(normalized real values); got vocab_size={vocab_size}, d_input={d_input}")
    if vocab_size is not None and vocab_size != 256:
        raise ValueError(f"{name}: data.vocab_size={vocab_size} but pixels take 256 values; set data.vocab_size=256")
    if d_input is not None and d_input != 1:
        raise ValueError(f"{name}: data.d_input={d_input} but grayscale pixels have 1 channel; set data.d_input=1")
    return vocab_size is not None


class GrayPixelDataset(Dataset):
    """Rows of a uint8 [N, L] array: items `{"inputs": long [L] or float [L, 1], "labels": long}`.

    Args:
        images: uint8 [N, L] (memory-mapped is fine); labels: int [N]; index: the rows of this split (None: all).
        tokens: return pixel values as token ids; else (pixels / 255 - mean) / std.
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, index: np.ndarray | None, tokens: bool,
                 mean: float, std: float):
        self.images, self.labels = images, labels
        self.index = np.arange(len(labels)) if index is None else index
        self.tokens, self.mean, self.std = tokens, mean, std

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = int(self.index[i])
        pixels = torch.from_numpy(np.array(self.images[row]))  # [L] uint8
        if self.tokens:
            inputs = pixels.long()
        else:
            inputs = ((pixels.float() / 255.0 - self.mean) / self.std).unsqueeze(-1)  # [L, 1]
        return {"inputs": inputs, "labels": torch.tensor(int(self.labels[row]))}


class GrayscaleCIFAR(SequenceDataModule):
    """LRA Image: batches `inputs` long [B, 1024] or float [B, 1024, 1], `mask`, `labels` [B] in 0..9.

    Args:
        seq_len: 1024.
        vocab_size: 256 for token pixels, or None.
        d_input: 1 for real-valued pixels, or None.
        num_classes: 10.
        mean, std: normalization of pixels / 255 in real mode (MEGA: 0.48, 0.24).
        val_size: training images held out for validation (5000).
        source_dir: the extracted `cifar-10-batches-py` folder (skips the download).
        **kwargs: `SequenceDataModule` arguments; `split_seed` picks the validation images.
    """

    name = "image"

    def __init__(self, seq_len: int = 1024, vocab_size: int | None = None, d_input: int | None = 1,
                 num_classes: int = 10, mean: float = 0.48, std: float = 0.24, val_size: int = 5000,
                 source_dir: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.tokens = pixel_mode("image", vocab_size, d_input)
        if seq_len != 1024 or num_classes != 10:
            raise ValueError(f"data.seq_len={seq_len}, data.num_classes={num_classes}: LRA Image is 1024 pixels "
                             "and 10 classes")
        self.seq_len, self.vocab_size, self.d_input, self.num_classes = seq_len, vocab_size, d_input, num_classes
        self.mean, self.std, self.val_size = mean, std, val_size
        self.source_dir = None if source_dir is None else Path(source_dir)

    def _prepare(self, root: Path) -> tuple[dict, dict]:
        raw = self.source_dir or root / "raw" / "cifar-10-batches-py"
        if self.source_dir is None and not extracted(root / "raw", "cifar-10-python.tar.gz"):
            extract(download(CIFAR10_URL, root / "raw" / "cifar-10-python.tar.gz", CIFAR10_PIN), root / "raw")
        splits = {}
        for split, files in (("train", [f"data_batch_{i}" for i in range(1, 6)]), ("test", ["test_batch"])):
            parts = read_cifar_split(raw, files, self.source_dir is not None)
            gray = rgb_to_gray(np.concatenate([p[0] for p in parts]))  # [N, 1024]
            labels = np.concatenate([p[1] for p in parts])
            np.save(root / f"{split}.images.npy", gray)
            np.save(root / f"{split}.labels.npy", labels)
            splits[split] = {"count": int(len(labels)), "labels": label_counts(labels),
                             "mean_intensity": float(gray.mean() / 255)}
        return splits, {"source": str(raw), "seq_len": 1024, "num_classes": 10}

    def _load(self, root: Path, manifest: dict) -> dict[str, Dataset]:
        images = {s: np.load(root / f"{s}.images.npy", mmap_mode="r") for s in ("train", "test")}
        labels = {s: np.load(root / f"{s}.labels.npy") for s in ("train", "test")}
        n = len(labels["train"])
        if not 0 < self.val_size < n:
            raise ValueError(f"data.val_size={self.val_size} must be in (0, {n}) (LRA: 5000)")
        train_idx, val_idx = holdout_split(n, self.val_size / n, self.split_seed)
        common = dict(tokens=self.tokens, mean=self.mean, std=self.std)
        return {"train": GrayPixelDataset(images["train"], labels["train"], train_idx, **common),
                "val": GrayPixelDataset(images["train"], labels["train"], val_idx, **common),
                "test": GrayPixelDataset(images["test"], labels["test"], None, **common)}
