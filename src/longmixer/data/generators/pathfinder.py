"""A seeded reimplementation of the Pathfinder "snakes" generator (Linsley et al. 2018; LRA, arXiv 2011.04006).

The procedure follows drewlinsley/pathfinder (`snakes2.py`, `snakes.py`, `snakes2_wrapper.py`, 2019) as described in
shared/research/frameworks.md section 3.2: two target contours grown from seeds `seed_distance` apart, distractor
snakes, a squared-cosine turn penalty, markers chosen by the label, strokes drawn with PIL at `antialias_scale` times
the resolution and Lanczos-downsampled, and a min-max rescaled uint8 PNG. The output is the official layout,
`<root>/<difficulty>/imgs/<batch>/sample_<k>.png` plus the 11-column text metadata `<root>/<difficulty>/metadata/
<batch>.npy`, so `longmixer.data.pathfinder` reads generated and released data with the same code.

Departures from upstream, all deliberate:
- Randomness: one `np.random.Generator` per image, seeded by `SeedSequence(seed, spawn_key=(resolution, contour
  length, image index))`, so the output is byte-identical for a seed whatever the number of worker processes.
  Upstream used unseeded global `np.random` and Python `random`.
- `scipy.misc.imresize` / `imsave` no longer exist; `imresize` and `bytescale` rebuild them (bytescale, then PIL
  Lanczos). `cv2.dilate` is `scipy.ndimage.maximum_filter` with OpenCV's border: positions whose kernel taps all
  fall outside the image get the lowest float, and, as upstream, a dilated mask holding such a value offers no
  free coordinate (`free_coordinates`). OpenCV is therefore not needed at run time.
- Labels come in complementary pairs (`_label`); upstream draws each independently.
- Metadata is written as text, as in the released files (upstream wrote `np.save` arrays).

Equivalence is measured, not assumed: tests/data/test_pathfinder_official_stats.py compares distractors per image,
ink fraction, target-pair attempts and label balance with constants measured from the upstream code (docs/data.md).
"""

from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from multiprocessing.managers import SyncManager
from pathlib import Path

import numpy as np
from PIL import Image

from longmixer.data.generators.snake_raster import (bytescale, dilate, dilated_at, flip, free_coordinates, imresize,
                                                   in_bounds, place, translate)
from longmixer.data.generators.workers import exit_with_parent

log = logging.getLogger(__name__)

# Part of the prepared data's key: a change to what the generator draws must bump it, so that images made by an
# earlier version are regenerated rather than served (2: OpenCV's dilation border and the free-coordinate rule).
GENERATOR_VERSION = 2
DIFFICULTIES = {"baseline": 6, "9": 9, "14": 14}  # difficulty -> contour_length (snakes2_wrapper.py level loop)


def difficulty_dir(difficulty: str) -> str:
    """Folder name of a difficulty in the official layout (`curv_baseline`, `curv_contour_length_{9,14}`)."""
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty={difficulty!r} is not one of {sorted(DIFFICULTIES)}; LRA uses '14'")
    return "curv_baseline" if difficulty == "baseline" else f"curv_contour_length_{difficulty}"


@dataclass(frozen=True)
class SnakesParams:
    """The generator's per-dataset parameters (names as in upstream `snakes2_wrapper.Args`)."""

    window_size: int
    padding: int
    paddle_length: int
    paddle_margin_list: tuple[int, ...]
    marker_radius: float
    paddle_thickness: float
    antialias_scale: int
    seed_distance: int
    continuity: float
    snake_contrast_list: tuple[float, ...]
    paddle_contrast_list: tuple[float, ...]
    contour_length: int
    distractor_length: int
    num_distractor_snakes: int
    use_single_paddles: bool = False
    max_distractor_contour_retrial: int = 4
    max_paddle_retrial: int = 2


# Per-resolution parameters from the LRA TFDS builder docstring (frameworks.md 3.2). The distractor recipe is
# (distractor_length = contour_length // 3, num_distractor_snakes = budget // distractor_length): upstream is
# Python 2, where `/` on ints is floor division. paddle_length for 64/128 is not stated anywhere; we keep the
# upstream `Args` default of 5 (our choice, see docs/data.md). paddle_contrast_list is stated only for 32.
_RESOLUTIONS: dict[int, dict] = {
    32: dict(padding=1, paddle_length=2, paddle_margin_list=(1,), marker_radius=1.5, paddle_thickness=0.5,
             antialias_scale=2, seed_distance=7, continuity=1.0, snake_contrast_list=(2.0,),
             paddle_contrast_list=(0.75,), distractor_budget=20),
    64: dict(padding=1, paddle_length=5, paddle_margin_list=(1,), marker_radius=2.5, paddle_thickness=1.0,
             antialias_scale=2, seed_distance=12, continuity=1.8, snake_contrast_list=(0.8,),
             paddle_contrast_list=(1.0,), distractor_budget=22),
    128: dict(padding=1, paddle_length=5, paddle_margin_list=(2, 3), marker_radius=3.0, paddle_thickness=1.5,
              antialias_scale=2, seed_distance=20, continuity=1.8, snake_contrast_list=(0.9,),
              paddle_contrast_list=(1.0,), distractor_budget=35),
}


def snakes_params(resolution: int, difficulty: str) -> SnakesParams:
    """The LRA parameters of `pathfinder<resolution>/<difficulty_dir(difficulty)>`."""
    if resolution not in _RESOLUTIONS:
        raise ValueError(f"resolution={resolution} is not one of {sorted(_RESOLUTIONS)} (32: Pathfinder, 128: Path-X)")
    difficulty_dir(difficulty)  # validates
    contour_length = DIFFICULTIES[difficulty]
    spec = dict(_RESOLUTIONS[resolution])
    budget = spec.pop("distractor_budget")
    distractor_length = contour_length // 3
    return SnakesParams(window_size=resolution, contour_length=contour_length, distractor_length=distractor_length,
                        num_distractor_snakes=budget // distractor_length, **spec)


# ------------------------------------------------------------------------------------------------ snake growth
# Canvases are float [W, W]: `image` (stroke intensities) and `mask` (occupancy in [0, 1], the padding border set).
# Functions that grow a snake work on copies made by their caller and return None on failure.

@functools.lru_cache(maxsize=4096)
def _seed_struct(theta: float, p: SnakesParams, margin: int) -> np.ndarray:
    """The paddle's own footprint around its tail: dilating the occupancy by it blocks every tail whose paddle
    would overlap a stroke. Upstream casts the [0, 1] mask to uint8, keeping only fully covered pixels."""
    n = (p.paddle_length + margin) * 2 + 1
    head = p.paddle_length + margin + 1
    struct = np.zeros((n, n))
    place((n, n), (head, head), theta, p, margin).occupy(struct)
    return struct.astype(np.uint8).astype(bool)  # [n, n]


def _blank_window(p: SnakesParams) -> np.ndarray:
    """A new empty occupancy canvas: zeros with the padding frame set ([W, W])."""
    W, b = p.window_size, p.padding
    mask = np.zeros((W, W))
    mask[:b], mask[W - b:], mask[:, :b], mask[:, W - b:] = 1, 1, 1, 1
    return mask


def _seed_tails(mask: np.ndarray, theta: float, p: SnakesParams, margin: int, border: int):
    """Tails where a seed paddle of orientation `theta` fits: free pixels of the occupancy, with a `border`-wide
    frame set, dilated by the paddle's footprint."""
    shape = mask.shape
    lined = mask.copy()
    lined[:border], lined[shape[0] - border:], lined[:, :border], lined[:, shape[1] - border:] = 1, 1, 1, 1
    return free_coordinates(dilate(lined, _seed_struct(theta, p, margin)))


@functools.lru_cache(maxsize=4096)
def _blank_seed_tails(degrees: int, p: SnakesParams, margin: int, border: int):
    """`_seed_tails` on the empty window (only the padding frame occupied), where the first seed of every
    `_two_snakes` attempt is placed: it depends on the orientation alone, so it is computed once per degree instead
    of once per attempt (about 280 attempts an image at 32x32, difficulty 14). The same tails, so the same images."""
    free_y, free_x = _seed_tails(_blank_window(p), degrees * math.pi / 180, p, margin, border)
    free_y.flags.writeable = False
    free_x.flags.writeable = False
    return free_y, free_x


def _place_seed(rng: np.random.Generator, mask: np.ndarray, p: SnakesParams, margin: int, contrast: float,
                border: int, stop_with_availability: float | None, blank: bool = False):
    """First paddle of a snake (`initialize_two_seeds` seed 1, `seed_snake`): (paddle, pivot, orientation, tail),
    or None when too little is free, no tail fits, or the paddle leaves the window `max_paddle_retrial` times.
    `blank`: `mask` is the empty window (only the padding frame set), whose tails are cached per orientation."""
    shape = mask.shape
    L = p.paddle_length
    if stop_with_availability is not None and len(free_coordinates(mask)[0]) / mask.size < stop_with_availability:
        return None
    for _ in range(p.max_paddle_retrial + 1):
        degrees = int(rng.integers(-180, 180))
        theta = degrees * math.pi / 180
        if blank:
            free_y, free_x = _blank_seed_tails(degrees, p, margin, border)
        else:
            free_y, free_x = _seed_tails(mask, theta, p, margin, border)
        if len(free_y) == 0:
            return None
        k = int(rng.integers(len(free_y)))
        tail = (int(free_y[k]), int(free_x[k]))
        head = translate(tail, theta, L)
        pivot = translate(head, flip(theta), L + margin)
        if in_bounds(head, shape) and in_bounds(pivot, shape):
            return place(shape, tail, theta, p, margin, contrast), pivot, theta, tail
    return None


@functools.lru_cache(maxsize=64)
def _circle(radius: int) -> tuple[np.ndarray, np.ndarray]:
    """Head offsets on a circle of `radius`, one sample per pixel of arc, truncated to ints and deduplicated in
    `np.unique` order, with their orientations. Upstream truncates `center + offset` after dropping out-of-window
    samples; with an integer center that equals `center + floor(offset)` filtered by the window, so the offsets
    can be computed once per radius."""
    rad = np.arange(0, 360, 360.0 / (2 * radius * math.pi)) * math.pi / 180
    offsets = np.unique(np.floor(np.stack([radius * np.sin(rad), radius * np.cos(rad)], axis=1)).astype(int),
                        axis=0)  # [M, 2]
    orient = np.arctan2(offsets[:, 0], offsets[:, 1])  # [M], in (-pi, pi]
    offsets.flags.writeable = False
    orient.flags.writeable = False
    return offsets, orient


def _candidates(center: tuple[int, int], theta: float, radius: int, mask: np.ndarray, margin: int,
                continuity: float):
    """Candidate heads around the pivot with their CMF (`snakes.get_coords_cmf`).

    Weight = (1 - occupancy dilated by `margin`) * max(cos(min(|dtheta| * continuity, pi/2)), 0)^2: the turn
    penalty (a larger `continuity` gives straighter contours).
    """
    offsets, orient = _circle(radius)
    coords = offsets + np.asarray(center)  # [M, 2]
    keep = (coords[:, 0] >= 0) & (coords[:, 0] < mask.shape[0]) & (coords[:, 1] >= 0) & (coords[:, 1] < mask.shape[1])
    if not keep.any():
        return None
    coords, orient = coords[keep], orient[keep]
    delta = np.abs(orient - theta)
    delta = np.minimum(np.minimum(delta, 2 * math.pi - delta) * continuity, 0.5 * math.pi)
    pmf = (1 - dilated_at(mask, coords, margin)) * np.maximum(np.cos(delta), 0) ** 2
    total = pmf.sum()
    if total < 1e-4:
        return None
    return coords, orient, np.cumsum(pmf / total)


@functools.lru_cache(maxsize=65536)
def _blank_candidates(center: tuple[int, int], theta: float, p: SnakesParams, margin: int):
    """`_candidates` on the empty window (only the padding frame occupied), where the first extension of every
    `_two_snakes` attempt is drawn: most attempts end there, and on the empty window the candidates depend on the
    pivot and the orientation alone. The same candidates, so the same images."""
    cand = _candidates(center, theta, p.paddle_length + margin, _blank_window(p), margin, p.continuity)
    if cand is not None:
        for arr in cand:
            arr.flags.writeable = False
    return cand


def _extend(rng: np.random.Generator, pivot, theta: float, mask: np.ndarray, p: SnakesParams, margin: int,
            contrast: float, blank: bool = False):
    """Choose the next paddle (`snakes.extend_snake`): (paddle, pivot, orientation, head) or None. The paddle is
    drawn from the sampled head back toward the pivot. `blank`: `mask` is the empty window (only the padding frame
    set), whose candidates are cached."""
    new_pivot = translate(pivot, theta, p.paddle_length + 2 * margin)
    if blank:
        cand = _blank_candidates(new_pivot, theta, p, margin)
    else:
        cand = _candidates(new_pivot, theta, p.paddle_length + margin, mask, margin, p.continuity)
    if cand is None:
        return None
    coords, orient, cmf = cand
    for _ in range(p.max_paddle_retrial + 1):
        k = int(np.argmax(cmf - rng.random() > 0))
        head = (int(coords[k, 0]), int(coords[k, 1]))
        paddle = place(mask.shape, head, flip(float(orient[k])), p, margin, contrast)
        if not paddle.overlaps(mask):
            return paddle, new_pivot, float(orient[k]), head
    return None


def _pick(rng: np.random.Generator, values: Sequence[float], always_draw: bool) -> float:
    """Upstream draws a contrast index only when there is a choice in some places and always in others."""
    return values[int(rng.integers(len(values)))] if always_draw or len(values) > 1 else values[0]


def _second_seed(rng: np.random.Generator, tail1: tuple[int, int], mask: np.ndarray, p: SnakesParams, margin: int,
                 contrast: float):
    """Seed 2 sits exactly `seed_distance` from seed 1 (so distance never tells the label); only the window
    bounds are checked (`initialize_two_seeds`)."""
    for _ in range(p.max_paddle_retrial + 1):
        theta = int(rng.integers(-180, 180)) * math.pi / 180
        phi = int(rng.integers(0, 360)) * math.pi / 180
        tail = (int(np.round(tail1[0] + p.seed_distance * math.sin(phi))),
                int(np.round(tail1[1] + p.seed_distance * math.cos(phi))))
        head = translate(tail, theta, p.paddle_length)
        pivot = translate(head, flip(theta), p.paddle_length + margin)
        if in_bounds(head, mask.shape) and in_bounds(pivot, mask.shape):
            return place(mask.shape, tail, theta, p, margin, contrast), pivot, theta, tail
    return None


def _two_snakes(rng: np.random.Generator, p: SnakesParams, margin: int):
    """The two target contours (`snakes2.two_snakes`): (image, mask, origin tips, terminal tips) or None."""
    W = p.window_size
    mus = rng.permutation(np.asarray(list(p.snake_contrast_list) * 2, dtype=np.float64))[:2]
    mask = _blank_window(p)
    first = _place_seed(rng, mask, p, margin, _pick(rng, p.paddle_contrast_list, False) * mus[0],
                        border=2 * p.seed_distance, stop_with_availability=None, blank=True)
    if first is None:
        return None
    second = _second_seed(rng, first[3], mask, p, margin, _pick(rng, p.paddle_contrast_list, False) * mus[1])
    if second is None:
        return None
    image = np.zeros((W, W))
    snakes = [list(first), list(second)]  # per snake: [last paddle, pivot, orientation, tip]
    origin = [first[3], second[3]]
    for s in snakes:
        s[0].draw(image)
    for step in range(p.contour_length - 1):
        contrast = _pick(rng, p.paddle_contrast_list, True)
        for i, (s, mu) in enumerate(zip(snakes, mus)):
            # the occupancy is still the empty window at the first snake's first extension (the seeds are drawn,
            # not occupied, until their successors are placed)
            grown = _extend(rng, s[1], s[2], mask, p, margin, contrast * mu, blank=step == 0 and i == 0)
            if grown is None:
                return None
            grown[0].draw(image)
            s[0].occupy(mask)  # the occupancy gains the previous paddle only, so a paddle never blocks its successor
            s[:] = grown
    snakes[1][0].occupy(mask)  # upstream adds only the second snake's last paddle here; kept
    return image, mask, origin, [snakes[0][3], snakes[1][3]]


def _make_snake(rng, image, mask, num_segments: int, p: SnakesParams, margin: int, stop_with_availability):
    """One distractor (`snakes.make_snake`): new (image, mask) with the snake, or None if it was not completed."""
    seed = _place_seed(rng, mask, p, margin, _pick(rng, p.snake_contrast_list, True), border=1,
                       stop_with_availability=stop_with_availability)
    if seed is None:
        return None
    image, mask = image.copy(), mask.copy()
    paddle, pivot, theta, _ = seed
    paddle.draw(image)
    for _ in range(num_segments - 1):
        grown = _extend(rng, pivot, theta, mask, p, margin, _pick(rng, p.snake_contrast_list, True))
        if grown is None:
            return None
        grown[0].draw(image)
        paddle.occupy(mask)
        paddle, pivot, theta, _ = grown
    paddle.occupy(mask)
    return image, mask


def _many_snakes(rng, image, mask, num_snakes: int, max_trial: int, num_segments: int, p: SnakesParams,
                 margin: int):
    """Distractors (`snakes.make_many_snakes` with allow_incomplete=True, stop_with_availability=0.01):
    (image, mask, number of snakes completed)."""
    placed = 0
    for _ in range(num_snakes):
        for _ in range(max_trial + 1):
            made = _make_snake(rng, image, mask, num_segments, p, margin, stop_with_availability=0.01)
            if made is not None:
                image, mask = made
                placed += 1
                break
    return image, mask, placed


def _marker(p: SnakesParams, coord: Sequence[int]) -> np.ndarray:
    """An anti-aliased disk of `marker_radius` at `coord` (`snakes2.draw_circle`), uint8 [W, W]."""
    W, aa = p.window_size, p.antialias_scale
    y, x = np.ogrid[-coord[0] * aa:(W - coord[0]) * aa, -coord[1] * aa:(W - coord[1]) * aa]
    return imresize((x * x + y * y <= (p.marker_radius * aa) ** 2).astype(np.float64), W)


def generate_image(p: SnakesParams, rng: np.random.Generator, label: int | None = None,
                   max_attempts: int = 100_000, stats: dict[str, int] | None = None) -> tuple[np.ndarray, int, int]:
    """One Pathfinder image (`snakes2.from_wrapper`, one loop iteration).

    Args:
        label: force the label (the draw that upstream uses is still consumed); None draws it.
        max_attempts: upstream retries the two target snakes forever (see docs/data.md for the measured means).
        stats: if given, receives `pair_attempts` (calls of the two-target step) and `distractors` (distractor
            snakes completed), the quantities docs/data.md compares with the official generator.
    Returns:
        image: uint8 [W, W], min-max scaled as `scipy.misc.imsave` did; label: 1 if both markers lie on the same
        contour, else 0; margin: the paddle margin sampled for this image (metadata column 9).
    """
    drawn = int(rng.integers(2))
    label = drawn if label is None else int(label)
    margin = int(p.paddle_margin_list[int(rng.integers(len(p.paddle_margin_list)))])
    for attempt in range(1, max_attempts + 1):
        pair = _two_snakes(rng, p, margin)
        if pair is not None:
            break
    else:
        raise RuntimeError(f"could not place two target snakes in {max_attempts} attempts with {p}; "
                           "lower contour_length or seed_distance")
    image, mask, origin, terminal = pair
    distractors = 0
    if p.num_distractor_snakes > 0:
        image, mask, distractors = _many_snakes(rng, image, mask, p.num_distractor_snakes,
                                                p.max_distractor_contour_retrial, p.distractor_length, p, margin)
    if p.use_single_paddles:
        total = int(150 / ((7.5 + 13 * margin + 4 * margin * margin) / 123.5))
        n_single = total - 2 * p.contour_length - p.num_distractor_snakes * p.distractor_length
        image, mask, _ = _many_snakes(rng, image, mask, n_single, p.max_paddle_retrial, 1, p, margin)
    if stats is not None:
        stats["pair_attempts"], stats["distractors"] = attempt, distractors
    origin_idx = int(rng.integers(2))
    terminal_idx = origin_idx if label == 1 else 1 - origin_idx
    markers = np.maximum(_marker(p, origin[origin_idx]), _marker(p, terminal[terminal_idx])) / 255.0
    return bytescale(np.maximum(image, markers)), label, margin


# ------------------------------------------------------------------------------------------- sharded writing

def _metadata_row(p: SnakesParams, batch_id: int, k: int, label: int, margin: int) -> str:
    """The 11 columns of the released text metadata (frameworks.md 2.6); the label is column 3."""
    cols = [f"imgs/{batch_id}", f"sample_{k}.png", k, label, p.continuity, p.contour_length, p.distractor_length,
            p.paddle_length, p.paddle_thickness, margin, len(p.paddle_contrast_list)]
    return " ".join(str(c) for c in cols)


def _image_rng(p: SnakesParams, seed: int, index: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(p.window_size, p.contour_length, index)))


def _label(p: SnakesParams, seed: int, index: int) -> int:
    """Images 2j and 2j+1 get opposite labels, the first drawn as upstream does: the label balance is exact
    (upstream draws every label independently; our choice, so that any subset of pairs is balanced)."""
    first = int(_image_rng(p, seed, index - index % 2).integers(2))
    return first if index % 2 == 0 else 1 - first


_progress_queue = None  # in worker processes: where each finished image is reported


def _init_worker(queue, parent: int) -> None:
    global _progress_queue
    _progress_queue = queue
    exit_with_parent(parent)


def _write_batch(job: tuple[str, SnakesParams, int, int, int, int], on_image=None) -> int:
    """Generate images [start, start + count) as batch `batch_id`; metadata is written last (atomic rename), so a
    batch with a metadata file is complete and is skipped on a rerun. Each image is reported to `on_image` (or,
    in a worker process, to the progress queue)."""
    out_dir, p, seed, batch_id, start, count = job
    if on_image is None and _progress_queue is not None:
        on_image = _progress_queue.put
    out = Path(out_dir)
    meta_path = out / "metadata" / f"{batch_id}.npy"
    if meta_path.exists():
        if on_image is not None:
            on_image(count)
        return 0
    img_dir = out / "imgs" / str(batch_id)
    img_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for k in range(count):
        image, label, margin = generate_image(p, _image_rng(p, seed, start + k), label=_label(p, seed, start + k))
        Image.fromarray(image, mode="L").save(img_dir / f"sample_{k}.png", optimize=False)
        rows.append(_metadata_row(p, batch_id, k, label, margin))
        if on_image is not None:
            on_image(1)
    meta_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = meta_path.with_suffix(".tmp")
    tmp.write_text("\n".join(rows) + "\n")
    os.replace(tmp, meta_path)
    return count


def generate_pathfinder(root: str | os.PathLike, resolution: int, difficulty: str, num_images: int, *,
                        seed: int = 0, images_per_batch: int = 1000, num_workers: int = 1,
                        params: SnakesParams | None = None, on_progress=None) -> Path:
    """Write `num_images` images in the official layout under `<root>/<difficulty_dir(difficulty)>`.

    Args:
        root: the `pathfinder<resolution>` folder to write into.
        resolution: 32 (Pathfinder), 64 or 128 (Path-X).
        difficulty: "baseline", "9" or "14" (contour length; LRA uses "14").
        num_images: total images; batch `b` holds images [b * images_per_batch, ...) as `imgs/<b>/sample_<k>.png`.
        seed: the output is a function of (seed, resolution, difficulty, image index) only, not of num_workers.
        num_workers: processes; batches are the unit of work.
        params: override `snakes_params(resolution, difficulty)` (tests use this for tiny settings).
        on_progress: called with the number of images finished, image by image (batches already on disk count at
            once), also from worker processes.
    Returns:
        The difficulty folder.
    """
    if num_images < 1 or images_per_batch < 1:
        raise ValueError(f"num_images={num_images} and images_per_batch={images_per_batch} must be positive")
    p = params if params is not None else snakes_params(resolution, difficulty)
    p = replace(p, window_size=resolution) if p.window_size != resolution else p
    out = Path(root) / difficulty_dir(difficulty)
    jobs = [(str(out), p, seed, b, start, min(images_per_batch, num_images - start))
            for b, start in enumerate(range(0, num_images, images_per_batch))]
    log.info("generating %d Pathfinder images (%dx%d, difficulty %s) into %s with %d workers",
             num_images, resolution, resolution, difficulty, out, num_workers)
    if num_workers <= 1:
        for job in jobs:
            _write_batch(job, on_progress)
        return out
    # the Manager (which serves the progress queue) and the workers end with this process, also when it is killed
    # with SIGKILL and cannot shut them down (generators/workers.py)
    manager = SyncManager()
    manager.start(exit_with_parent, (os.getpid(),))
    with manager:
        queue = manager.Queue()
        with ProcessPoolExecutor(max_workers=num_workers, initializer=_init_worker,
                                 initargs=(queue, os.getpid())) as pool:
            pending = {pool.submit(_write_batch, job) for job in jobs}
            while pending:
                finished, pending = wait(pending, timeout=0.5)
                for future in finished:
                    future.result()  # re-raise a worker's error
                while not queue.empty():
                    n = queue.get()
                    if on_progress is not None:
                        on_progress(n)
        while not queue.empty():
            n = queue.get()
            if on_progress is not None:
                on_progress(n)
    return out
