"""Our Pathfinder generator against statistics measured once from the official generator (drewlinsley/pathfinder).

The constants below were measured by running the upstream code itself (commit 7b538865667dfe16f949ed3b7c8dc6a65ca87099,
`snakes2.from_wrapper`) with OpenCV, at LRA's settings, with `scipy.misc.imresize`/`imsave` restored as bytescale +
PIL Lanczos; docs/data.md ("Pathfinder: measured against the official generator") gives the exact procedure.
Quantities per image: distractor snakes completed, ink fraction (pixels >= 64 of the saved uint8 image), calls of
the two-target step until it succeeds, and the label.
"""

from __future__ import annotations

import numpy as np

from longmixer.data.generators import pathfinder as gen
from longmixer.data.generators import snake_raster as raster

# Pathfinder-32, contour length 14: 1,200 official images (np.random.seed 0 and 1, 600 each).
PF32 = {"distractors": 1.20, "ink": 0.1262, "pair_attempts": 315.0, "label1": 0.481}
# Path-X (128), contour length 14: 80 official images (seeds 0 and 1, 40 each).
PATHX = {"distractors": 7.68, "ink": 0.0410, "pair_attempts": 483.0}


def _measure(resolution: int, count: int) -> dict[str, float]:
    p = gen.snakes_params(resolution, "14")
    distractors, ink, attempts, labels = [], [], [], []
    for i in range(count):
        stats: dict[str, int] = {}
        image, label, _ = gen.generate_image(p, gen._image_rng(p, 0, i), label=gen._label(p, 0, i), stats=stats)
        distractors.append(stats["distractors"])
        attempts.append(stats["pair_attempts"])
        ink.append(float((image >= 64).mean()))
        labels.append(label)
    return {"distractors": float(np.mean(distractors)), "ink": float(np.mean(ink)),
            "pair_attempts": float(np.mean(attempts)), "label1": float(np.mean(labels))}


def test_pathfinder32_matches_the_official_generator():
    ours = _measure(32, 160)
    # tolerances: about 3 standard errors of a 160-image mean (official per-image std: distractors 0.95,
    # ink 0.013; the attempt count is heavy-tailed, median 202)
    assert abs(ours["distractors"] - PF32["distractors"]) <= 0.25, ours
    assert abs(ours["ink"] - PF32["ink"]) <= 0.006, ours
    assert 0.6 <= ours["pair_attempts"] / PF32["pair_attempts"] <= 1.6, ours
    assert abs(ours["label1"] - 0.5) <= 0.05 and abs(PF32["label1"] - 0.5) <= 0.05


def test_pathx_matches_the_official_generator():
    ours = _measure(128, 3)  # about 3 s per image
    assert abs(ours["distractors"] - PATHX["distractors"]) <= 1.0, ours
    assert abs(ours["ink"] - PATHX["ink"]) <= 0.005, ours


def test_opencv_border_rule():
    """cv2.dilate pads a float image with the dtype's lowest value: a pixel whose taps are all outside keeps it,
    and upstream then finds no free coordinate at all."""
    mask = np.zeros((6, 6))
    mask[2, 2] = 0.5
    kernel = np.zeros((3, 3), dtype=bool)
    kernel[2, 2] = True  # one tap, one pixel down-right of the anchor
    out = raster.dilate(mask, kernel)
    assert out[1, 1] == 0.5 and out[0, 0] == 0.0
    assert (out[5, :] == raster.OUTSIDE).all() and (out[:, 5] == raster.OUTSIDE).all()
    assert len(raster.free_coordinates(out)[0]) == 0
    assert len(raster.free_coordinates(out[:5, :5])[0]) == 24  # no border value: every pixel but the 0.5 one


def test_seed_structuring_element_is_one_sided_for_most_orientations():
    """Why the border rule matters at 32 x 32: for most orientations some border pixel sees no tap."""
    resolution = 32
    p = gen.snakes_params(resolution, "14")
    margin = p.paddle_margin_list[0]
    blocked = 0
    for degrees in range(-180, 180, 10):
        struct = gen._seed_struct(np.deg2rad(degrees), p, margin)
        dilated = raster.dilate(np.zeros((resolution, resolution)), struct)
        blocked += int((dilated == raster.OUTSIDE).any())
    assert blocked >= 18
