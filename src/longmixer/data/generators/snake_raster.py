"""Raster primitives of the Pathfinder generator (`generators/pathfinder.py`): coordinates, the anti-aliased paddle
stamp and its occupancy mask, and the two operations whose OpenCV/upstream behaviour decides where seeds may go
(`dilate` with OpenCV's border value, `free_coordinates` with upstream's rule for negative values).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageDraw

if TYPE_CHECKING:
    from longmixer.data.generators.pathfinder import SnakesParams

def translate(coord: Sequence[float], theta: float, dist: float) -> tuple[int, int]:
    """Move (y, x) by `dist` along `theta`; upstream rounds up (`np.ceil`), which biases the walk, and we keep it."""
    return int(math.ceil(coord[0] + dist * math.sin(theta))), int(math.ceil(coord[1] + dist * math.cos(theta)))


def flip(theta: float) -> float:
    return theta + math.pi if theta < 0 else theta - math.pi


def disk(radius: float) -> np.ndarray:
    r = int(radius)
    y, x = np.ogrid[-r:r + 1, -r:r + 1]
    return (x * x + y * y) <= radius * radius  # [2r+1, 2r+1] bool


def bytescale(arr: np.ndarray) -> np.ndarray:
    """`scipy.misc.bytescale`: min-max map to 0..255 with round-half-up (uint8 input passes through)."""
    if arr.dtype == np.uint8:
        return arr
    lo, hi = float(arr.min()), float(arr.max())
    scale = 255.0 / ((hi - lo) or 1.0)
    return (np.clip((arr - lo) * scale, 0, 255) + 0.5).astype(np.uint8)


def imresize(arr: np.ndarray, size: int) -> np.ndarray:
    """`scipy.misc.imresize(arr, (size, size), interp='lanczos')`: bytescale, then a PIL Lanczos resize to uint8."""
    return np.asarray(Image.fromarray(bytescale(arr)).resize((size, size), Image.LANCZOS))


# OpenCV's dilation pads with the lowest value of the dtype (`morphologyDefaultBorderValue`): a pixel whose kernel taps
# all fall outside the image keeps that value. The seed structuring element is one-sided (the paddle leaves its
# tail in one direction), so for most orientations a band along one or two borders comes out at -DBL_MAX.
OUTSIDE = -np.finfo(np.float64).max


def dilate(image: np.ndarray, footprint: np.ndarray) -> np.ndarray:
    """`cv2.dilate(float64 image, footprint)`: the max over the kernel taps that land inside the image (a
    correlation: no reflection of the kernel, anchor at its center), and `OUTSIDE` where no tap lands inside."""
    from scipy.ndimage import maximum_filter

    if not footprint.any():
        raise ValueError("an empty dilation kernel: cv2.dilate would shift the image (never used by the generator)")
    return maximum_filter(image.astype(np.float64), footprint=footprint, mode="constant", cval=OUTSIDE)


@functools.lru_cache(maxsize=8192)
def segment_stamp(theta: float, length: int, thickness: float, margin: int, aa: int) -> tuple[np.ndarray, np.ndarray]:
    """One paddle around its start point: (line [2R+1]^2 in [0, 1], occupancy mask [2R+1]^2 in [0, 1]).

    `snakes.draw_line_n_mask`: draw at `aa` times the resolution with width round(thickness*aa), Lanczos down; the
    mask is the same line dilated by a disk of radius margin*aa before the downsampling.
    """
    if round(thickness * aa) != thickness * aa:
        raise ValueError(f"paddle_thickness={thickness} * antialias_scale={aa} must be an integer")
    R = length + int(math.ceil(thickness)) + margin
    c = R * aa
    head = translate((c, c), theta, length * aa)
    blown = Image.new("F", (2 * c + 1, 2 * c + 1), 0.0)
    ImageDraw.Draw(blown).line([(c, c), (head[1], head[0])], fill=255.0, width=int(round(thickness * aa)))
    blown_arr = np.asarray(blown)
    line = imresize(blown_arr, 2 * R + 1).astype(np.float64) / 255.0
    mask_blown = dilate(blown_arr, disk(margin * aa)).astype(np.uint8)  # 0 / 255
    mask = imresize(mask_blown, 2 * R + 1).astype(np.float64) / 255.0
    line.flags.writeable = False
    mask.flags.writeable = False
    return line, mask  # [2R+1, 2R+1] each


@dataclass(frozen=True)
class Paddle:
    """A paddle placed in the window: its clipped box and the stamp crops (line scaled by contrast, mask)."""

    box: tuple[slice, slice]
    line: np.ndarray
    mask: np.ndarray

    def draw(self, image: np.ndarray) -> None:
        image[self.box] = np.maximum(image[self.box], self.line)

    def occupy(self, mask: np.ndarray) -> None:
        mask[self.box] = np.maximum(mask[self.box], self.mask)

    def overlaps(self, mask: np.ndarray) -> bool:
        """Upstream rejects a paddle when `max(mask + paddle_mask) >= 1.8`; outside the box that sum is <= 1."""
        return self.mask.size > 0 and float(np.max(mask[self.box] + self.mask)) >= 1.8


def place(shape: tuple[int, int], start: Sequence[int], theta: float, p: SnakesParams, margin: int,
           contrast: float = 1.0) -> Paddle:
    """The paddle stamp put at `start`, clipped at the window borders (`draw_line_n_mask`'s placement)."""
    line, mask = segment_stamp(float(theta), p.paddle_length, p.paddle_thickness, margin, p.antialias_scale)
    R = line.shape[0] // 2
    y0, x0 = start[0] - R, start[1] - R
    ys, xs = max(y0, 0), max(x0, 0)
    ye, xe = max(min(start[0] + R, shape[0] - 1) + 1, ys), max(min(start[1] + R, shape[1] - 1) + 1, xs)
    crop = (slice(ys - y0, ye - y0), slice(xs - x0, xe - x0))
    return Paddle((slice(ys, ye), slice(xs, xe)), line[crop] * contrast, mask[crop])


def free_coordinates(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pixels whose occupancy is at most 0.3 (upstream `np.ceil(mask - 0.3) == 0`), and none at all when any value
    is negative: upstream `find_available_coordinates` returns no coordinate for a mask with a negative entry, which
    is what a dilation with `OUTSIDE` border pixels gives (the seed is then not placed)."""
    level = np.ceil(mask - 0.3)
    if level.min() < 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.nonzero(level == 0)


def in_bounds(coord: Sequence[int], shape: tuple[int, int]) -> bool:
    return 0 <= coord[0] < shape[0] and 0 <= coord[1] < shape[1]


@functools.lru_cache(maxsize=16)
def disk_offsets(radius: int) -> tuple[np.ndarray, np.ndarray]:
    dy, dx = np.nonzero(disk(radius))
    return dy - radius, dx - radius  # [K] each


def dilated_at(mask: np.ndarray, coords: np.ndarray, radius: int) -> np.ndarray:
    """`dilate(mask, disk(radius))[coords]` without dilating the whole window: max over the disk around each."""
    dy, dx = disk_offsets(radius)
    H, W = mask.shape
    ys = coords[:, :1] + dy  # [M, K]
    xs = coords[:, 1:] + dx  # [M, K]
    inside = (ys >= 0) & (ys < H) & (xs >= 0) & (xs < W)
    vals = mask.ravel()[np.where(inside, ys * W + xs, 0)] * inside
    return vals.max(axis=1)  # [M]
