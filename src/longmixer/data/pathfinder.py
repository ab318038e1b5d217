"""LRA Pathfinder (32 x 32 -> 1024) and Path-X (128 x 128 -> 16384) (Linsley et al. 2018; LRA, arXiv 2011.04006,
sections 3.6-3.7): are the two marked dots connected by a dashed contour?

Layout (the LRA release, and what `generators/pathfinder.py` writes; frameworks.md 2.6):
`pathfinder<R>/<difficulty>/imgs/<batch>/sample_<k>.png` with `pathfinder<R>/<difficulty>/metadata/<batch>.npy`,
which despite the suffix is text with one space-separated row per image: column 0 the sub-folder (`imgs/<batch>`),
1 the file name, **3 the label** (1 = connected). Difficulty `baseline`, `9` or `14` (contour length); LRA uses 14
for both tasks. Zero-byte PNGs are skipped, as LRA's TFDS builder does (the release has one:
`pathfinder32/curv_baseline/imgs/0/sample_172.png`). Metadata files are read in numeric batch order, the images are
split 80 / 10 / 10 by a permutation seeded with `split_seed` (LRA slices TFDS order; s4 and MEGA use
`random_split`), and every split is packed once into a uint8 [N, R*R] array, so the 200k small files are read once
(into `<data_dir>/<task>/<difficulty>_split<split_seed>/res<R>/`, one folder per resolution).
Pixels are real values (pixels / 255 - mean) / std as [L, 1] (MEGA: mean 0.5, std 0.5, i.e. [-1, 1]; s4: [0, 1]) or
tokens 0-255 (`vocab_size: 256`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from longmixer.data.base import SequenceDataModule, label_counts
from longmixer.data.download import progress
from longmixer.data.generators.pathfinder import GENERATOR_VERSION, difficulty_dir, generate_pathfinder
from longmixer.data.image import GrayPixelDataset, pixel_mode
from longmixer.data.integrity import SourceFileError

log = logging.getLogger(__name__)

SPLITS = ("train", "val", "test")
NPY_MAGIC = b"\x93NUMPY"


def _batch_order(path: Path) -> tuple[int, str]:
    return (int(path.stem), "") if path.stem.isdigit() else (1 << 62, path.stem)


def read_metadata(folder: Path) -> list[tuple[Path, int]]:
    """(image path, label) for every row of `folder/metadata/*.npy`, in numeric batch order.

    Raises:
        FileNotFoundError: no metadata files.
        ValueError: a row with fewer than 4 columns or a label other than 0/1.
    """
    files = sorted(Path(folder).glob("metadata/*.npy"), key=_batch_order)
    if not files:
        raise FileNotFoundError(f"{folder} has no metadata/*.npy; is it a Pathfinder difficulty folder such as "
                                "pathfinder32/curv_contour_length_14?")
    entries = []
    for meta in files:
        rows = _metadata_rows(meta)
        for line_no, row in enumerate(rows, start=1):
            if len(row) < 4 or str(row[3]) not in ("0", "1"):
                raise SourceFileError(f"{meta}:{line_no}: expected `imgs/<batch> sample_<k>.png <k> <label 0|1> ...`, "
                                 f"got {row!r}")
            entries.append((Path(folder) / str(row[0]) / str(row[1]), int(row[3])))
    return entries


def _metadata_rows(meta: Path) -> list:
    """The rows of one metadata file: text (the release) or an np.save string array (the upstream generator).

    Raises:
        SourceFileError: neither, naming the file (a cut np.save, an object array, bytes that are not UTF-8).
    """
    with open(meta, "rb") as f:
        is_array = f.read(len(NPY_MAGIC)) == NPY_MAGIC
    fix = "delete the folder and re-extract or regenerate it"
    try:
        if is_array:
            rows = np.load(meta, allow_pickle=False).tolist()
            if not isinstance(rows, list) or any(not isinstance(row, (list, tuple)) for row in rows):
                raise ValueError("not a 2-d array of strings")
            return rows
        return [line.split() for line in meta.read_text(encoding="utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError as err:
        raise SourceFileError(f"{meta} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset "
                              f"{err.start}); Pathfinder metadata is text rows: {fix}") from None
    except (ValueError, EOFError, OSError) as err:
        raise SourceFileError(f"{meta} is not a readable Pathfinder metadata array ({' '.join(str(err).split())}); "
                              f"{fix}") from None


def decode_png(path: Path, resolution: int) -> np.ndarray:
    """A grayscale PNG -> uint8 [resolution * resolution], row-major.

    Raises:
        ValueError: unreadable, or not resolution x resolution.
    """
    try:
        with Image.open(path) as img:
            pixels = np.asarray(img.convert("L"))
    except (UnidentifiedImageError, OSError) as err:
        raise SourceFileError(f"{path} is not a readable image ({err}); delete the folder and re-extract or "
                         "regenerate it") from err
    if pixels.shape != (resolution, resolution):
        raise SourceFileError(f"{path} is {pixels.shape[1]}x{pixels.shape[0]}, expected {resolution}x{resolution}; "
                         f"is data.resolution={resolution} right for this folder?")
    return pixels.reshape(-1)


def pack_pathfinder(folder: Path, root: Path, resolution: int, split_seed: int, on_progress=None) -> dict:
    """Read the official layout under `folder` (one difficulty) and write `root/{split}.images.npy` (uint8
    [N, R*R]) and `root/{split}.labels.npy`; returns the manifest's per-split statistics."""
    entries = read_metadata(folder)
    missing = [p for p, _ in entries if not p.exists()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} images listed in {folder}/metadata are missing (first: "
                                f"{missing[0]}); re-extract or regenerate the folder")
    kept = [(p, y) for p, y in entries if p.stat().st_size > 0]
    if len(kept) < len(entries):
        log.warning("skipping %d empty PNG(s) in %s", len(entries) - len(kept), folder)
    if len(kept) < 10:
        raise SourceFileError(f"{folder} has {len(kept)} images; at least 10 are needed for an 80/10/10 split")
    order = np.random.default_rng(split_seed).permutation(len(kept))
    n_train, n_val = len(kept) * 8 // 10, len(kept) // 10
    bounds = {"train": (0, n_train), "val": (n_train, n_train + n_val), "test": (n_train + n_val, len(kept))}
    stats = {}
    for split, (lo, hi) in bounds.items():
        rows = order[lo:hi]
        images = np.lib.format.open_memmap(root / f"{split}.images.npy", mode="w+", dtype=np.uint8,
                                           shape=(len(rows), resolution * resolution))
        labels = np.array([kept[r][1] for r in rows], dtype=np.int64)
        for i, r in enumerate(rows):
            images[i] = decode_png(kept[r][0], resolution)
            if on_progress is not None:
                on_progress(1)
        images.flush()
        ink = float((images > 25).mean()) if len(rows) else 0.0
        np.save(root / f"{split}.labels.npy", labels)
        stats[split] = {"count": int(len(rows)), "labels": label_counts(labels),
                        "mean_intensity": float(images.mean() / 255), "ink_fraction_gt25": ink}
        del images
    stats["train"]["skipped_empty"] = len(entries) - len(kept)
    return stats


class Pathfinder(SequenceDataModule):
    """LRA Pathfinder: batches `inputs` float [B, R*R, 1] (or long [B, R*R]), `mask`, `labels` [B] in {0, 1}.

    Args:
        resolution: 32 (Pathfinder) or 128 (Path-X).
        difficulty: "baseline", "9" or "14" (LRA: "14").
        seq_len: resolution ** 2.
        vocab_size: 256 for token pixels, or None; d_input: 1 for real pixels, or None.
        num_classes: 2.
        mean, std: normalization of pixels / 255 in real mode (MEGA: 0.5, 0.5).
        source_dir: a `pathfinder<R>` folder holding `curv_*` (skips the LRA release download).
        **kwargs: `SequenceDataModule` arguments; `split_seed` fixes the 80/10/10 split.
    """

    name = "pathfinder"

    def __init__(self, resolution: int = 32, difficulty: str = "14", seq_len: int = 1024,
                 vocab_size: int | None = None, d_input: int | None = 1, num_classes: int = 2, mean: float = 0.5,
                 std: float = 0.5, source_dir: str | None = None, **kwargs):
        super().__init__(**kwargs)
        self.tokens = pixel_mode(self.name, vocab_size, d_input)
        self.difficulty = str(difficulty)
        difficulty_dir(self.difficulty)  # validates
        if seq_len != resolution * resolution:
            raise ValueError(f"data.seq_len={seq_len} but a {resolution}x{resolution} image has "
                             f"{resolution * resolution} pixels; set data.seq_len={resolution * resolution}")
        if num_classes != 2:
            raise ValueError(f"data.num_classes={num_classes}: Pathfinder has 2 classes")
        self.resolution, self.seq_len, self.vocab_size, self.d_input = resolution, seq_len, vocab_size, d_input
        self.num_classes, self.mean, self.std = num_classes, mean, std
        self.source_dir = None if source_dir is None else Path(source_dir)

    @property
    def root(self) -> Path:
        # the images are packed at one resolution, so each has its own folder (as Retrieval's len<seq_len>): runs at
        # two resolutions neither rebuild each other's arrays in turn nor read them while another run rebuilds them
        return self.setting_dir / f"res{self.resolution}"

    @property
    def setting_dir(self) -> Path:
        """The folder of this difficulty and split: one `res<R>/` of packed arrays per resolution."""
        return self.data_dir / self.name / f"{difficulty_dir(self.difficulty)}_split{self.split_seed}"

    def prepare_fingerprint(self) -> dict:
        return {"resolution": self.resolution, "difficulty": self.difficulty, "split_seed": self.split_seed}

    def _source(self) -> Path:
        if self.source_dir is not None:
            return self.source_dir / difficulty_dir(self.difficulty)
        from longmixer.data.lra_release import ensure_lra_release, pathfinder_dir

        part = f"pathfinder{self.resolution}"
        release = ensure_lra_release(self.data_dir / "lra_release", parts=[part])[part]
        return pathfinder_dir(release, self.resolution, difficulty_dir(self.difficulty))

    def _pack(self, folder: Path, root: Path) -> dict:
        total = len(read_metadata(folder))
        with progress(f"packing {folder.name}", total, unit="images") as advance:
            return pack_pathfinder(folder, root, self.resolution, self.split_seed, on_progress=advance)

    def _prepare(self, root: Path) -> tuple[dict, dict]:
        self.note_old_layout(self.setting_dir, "data.resolution")
        folder = self._source()
        splits = self._pack(folder, root)
        return splits, {"source": str(folder), "seq_len": self.seq_len, "num_classes": 2}

    def _load(self, root: Path, manifest: dict):
        common = dict(tokens=self.tokens, mean=self.mean, std=self.std)
        return {s: GrayPixelDataset(np.load(root / f"{s}.images.npy", mmap_mode="r"),
                                    np.load(root / f"{s}.labels.npy"), None, **common) for s in SPLITS}


class PathX(Pathfinder):
    """LRA Path-X: Pathfinder at 128 x 128 (length 16384); the same reader, other defaults."""

    name = "pathx"

    def __init__(self, resolution: int = 128, seq_len: int = 16384, **kwargs):
        super().__init__(resolution=resolution, seq_len=seq_len, **kwargs)


class GeneratedPathfinder(Pathfinder):
    """Pathfinder written by our seeded snakes generator in the official layout, then read by the same packer.

    Args:
        num_images: images to generate (LRA: 200,000 per difficulty).
        generator_seed: the images are a function of (generator_seed, resolution, difficulty, index).
        images_per_batch: images per `imgs/<batch>` folder (upstream: 1000 per machine).
        generator_workers: processes for generation (0: one per CPU core).
        **kwargs: `Pathfinder` arguments (not source_dir).
    """

    name = "pathfinder_gen"

    def __init__(self, num_images: int = 200_000, generator_seed: int = 0, images_per_batch: int = 1000,
                 generator_workers: int = 1, **kwargs):
        super().__init__(**kwargs)
        if self.source_dir is not None:
            raise ValueError(f"data.source_dir={self.source_dir} is not used by {self.name}, which generates its "
                             "images; use data=pathfinder (or pathx) to read a folder")
        if num_images < 10:
            raise ValueError(f"data.num_images={num_images} must be >= 10 for an 80/10/10 split")
        self.num_images, self.generator_seed = num_images, generator_seed
        self.images_per_batch, self.generator_workers = images_per_batch, generator_workers

    @property
    def setting_dir(self) -> Path:
        """Also the home of the generated images (`raw/`), which every resolution's `res<R>/` is packed from."""
        return (self.data_dir / self.name / f"{difficulty_dir(self.difficulty)}_n{self.num_images}"
                f"_seed{self.generator_seed}_split{self.split_seed}")

    @property
    def prepare_hint(self) -> str:
        return (f"python scripts/prepare_data.py {self.name} paths.data_dir={self.data_dir} (with the same data.* "
                "settings), or let the training run prepare it")

    def prepare_fingerprint(self) -> dict:
        return {**super().prepare_fingerprint(), "num_images": self.num_images,
                "generator_seed": self.generator_seed, "images_per_batch": self.images_per_batch,
                "generator_version": GENERATOR_VERSION}

    def _source(self) -> Path:
        # finished batches are reused on a rerun, so the folder is keyed by everything that shapes them
        raw = (self.setting_dir / "raw" / f"v{GENERATOR_VERSION}_per_batch{self.images_per_batch}"
               / f"pathfinder{self.resolution}")
        with progress(f"generating {self.name}", self.num_images, unit="images") as advance:
            return generate_pathfinder(raw, self.resolution, self.difficulty, self.num_images,
                                       seed=self.generator_seed, images_per_batch=self.images_per_batch,
                                       num_workers=self.generator_workers or os.cpu_count() or 1,
                                       on_progress=advance)


class GeneratedPathX(GeneratedPathfinder):
    """Path-X (128 x 128) from the generator."""

    name = "pathx_gen"

    def __init__(self, resolution: int = 128, seq_len: int = 16384, **kwargs):
        super().__init__(resolution=resolution, seq_len=seq_len, **kwargs)
