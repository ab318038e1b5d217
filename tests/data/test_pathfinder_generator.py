"""The seeded Pathfinder snakes generator: LRA parameters, determinism, layout, label balance, throughput."""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from longmixer.data.generators import pathfinder as gen
from longmixer.data.generators import snake_raster as raster
from longmixer.data.pathfinder import read_metadata
from tests.data.fixtures import orphaned_workers_end

log = logging.getLogger(__name__)


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("resolution, difficulty, contour, distractor, n_distractors", [
    pytest.param(32, "baseline", 6, 2, 10, id="pf32-baseline"),
    pytest.param(32, "9", 9, 3, 6, id="pf32-9"),
    pytest.param(32, "14", 14, 4, 5, id="pf32-14"),
    pytest.param(128, "14", 14, 4, 8, id="pathx-14")])
def test_lra_parameters_use_floor_division(resolution, difficulty, contour, distractor, n_distractors):
    """Upstream is Python 2: `contour_length / 3` and `budget / distractor_length` are floor divisions."""
    p = gen.snakes_params(resolution, difficulty)
    assert (p.contour_length, p.distractor_length, p.num_distractor_snakes) == (contour, distractor, n_distractors)
    assert p.window_size == resolution and p.padding == 1


def test_same_seed_gives_identical_bytes_for_any_worker_count(tmp_path):
    a = gen.generate_pathfinder(tmp_path / "a", 32, "14", 10, seed=3, images_per_batch=4, num_workers=1)
    b = gen.generate_pathfinder(tmp_path / "b", 32, "14", 10, seed=3, images_per_batch=4, num_workers=2)
    c = gen.generate_pathfinder(tmp_path / "c", 32, "14", 10, seed=4, images_per_batch=4, num_workers=1)
    files_a = _files(a)
    assert len(files_a) == 10 + 3  # 10 PNGs, metadata for batches 0, 1, 2
    assert files_a == _files(b)
    assert files_a["metadata/0.npy"] != _files(c)["metadata/0.npy"] or \
        files_a["imgs/0/sample_0.png"] != _files(c)["imgs/0/sample_0.png"]


def test_official_layout_and_metadata(tmp_path):
    folder = gen.generate_pathfinder(tmp_path, 32, "14", 6, seed=0, images_per_batch=3)
    assert folder.name == "curv_contour_length_14"
    rows = [line.split() for line in (folder / "metadata" / "1.npy").read_text().splitlines()]
    assert len(rows) == 3 and all(len(r) == 11 for r in rows)
    assert rows[0][:3] == ["imgs/1", "sample_0.png", "0"]
    assert rows[0][4:9] == ["1.0", "14", "4", "2", "0.5"]  # continuity, contour, distractor, paddle len, thickness
    entries = read_metadata(folder)
    assert [y for _, y in entries] == [gen._label(gen.snakes_params(32, "14"), 0, i) for i in range(6)]
    for path, _ in entries:
        pixels = np.asarray(Image.open(path))
        assert pixels.dtype == np.uint8 and pixels.shape == (32, 32)
        assert pixels.max() == 255 and pixels.min() == 0  # min-max scaled, as scipy.misc.imsave
        assert 0.05 < (pixels > 25).mean() < 0.5  # strokes, not an empty or saturated canvas


def test_label_balance():
    p = gen.snakes_params(32, "14")
    labels = np.array([gen._label(p, 0, i) for i in range(400)])
    assert abs(labels.mean() - 0.5) <= 0.01
    assert (labels[0::2] != labels[1::2]).all()  # pairs are complementary
    assert 0.3 < labels[0::2].mean() < 0.7  # while the first of each pair is still drawn at random


def test_rerun_resumes_only_incomplete_batches(tmp_path):
    folder = gen.generate_pathfinder(tmp_path, 32, "baseline", 4, seed=1, images_per_batch=2)
    before = _files(folder)
    kept = (folder / "metadata" / "0.npy").stat().st_mtime_ns
    (folder / "metadata" / "1.npy").unlink()
    (folder / "imgs" / "1" / "sample_1.png").unlink()
    gen.generate_pathfinder(tmp_path, 32, "baseline", 4, seed=1, images_per_batch=2)
    assert _files(folder) == before
    assert (folder / "metadata" / "0.npy").stat().st_mtime_ns == kept


def _upstream_candidates(center, theta, radius, occupancy, continuity):
    """`snakes.get_coords_cmf`, written out as upstream computes it (truncate after dropping out-of-window)."""
    H, W = occupancy.shape
    rad = np.arange(0, 360, 360.0 / (2 * radius * np.pi)) * np.pi / 180
    ys, xs = center[0] + radius * np.sin(rad), center[1] + radius * np.cos(rad)
    coords = np.stack([ys, xs], axis=1).astype(int)
    coords = np.delete(coords, np.where((ys >= H) | (ys < 0) | (xs >= W) | (xs < 0)), axis=0)
    coords = np.unique(coords, axis=0)
    orient = np.arctan2(coords[:, 0] - center[0], coords[:, 1] - center[1])
    delta = np.minimum(np.abs(orient - theta), 2 * np.pi - np.abs(orient - theta))
    weights = np.maximum(np.cos(np.minimum(delta * continuity, 0.5 * np.pi)), 0) ** 2
    pmf = (1 - occupancy[coords[:, 0], coords[:, 1]]) * weights
    if pmf.sum() < 1e-4:
        return None  # a dead end
    return coords, orient, np.cumsum(pmf / pmf.sum())


@pytest.mark.parametrize("center", [(16, 16), (1, 30), (0, 0), (31, 5), (-2, 12), (34, 12), (33, 30)])
def test_candidates_match_the_upstream_formula(center):
    """Guards the precomputed circle in `_circle` and the local dilation in `_dilated_at` against upstream."""
    rng = np.random.default_rng(sum(center) + 100)
    mask = (rng.random((32, 32)) > 0.85).astype(float) * rng.random((32, 32))
    theta = 0.7
    ours = gen._candidates(center, theta, 3, mask, 1, 1.0)
    ref = _upstream_candidates(center, theta, 3, raster.dilate(mask, raster.disk(1)), 1.0)
    assert (ours is None) == (ref is None)
    if ref is None:
        return
    np.testing.assert_array_equal(ours[0], ref[0])
    np.testing.assert_allclose(ours[1], ref[1])
    np.testing.assert_allclose(ours[2], ref[2])


def test_segment_stamp_is_antialiased_and_checks_thickness():
    line, mask = raster.segment_stamp(0.0, 2, 0.5, 1, 2)
    assert line.shape == mask.shape == (9, 9)
    # a 1-pixel line drawn at 2x and Lanczos-downsampled is grey (about 0.5), as upstream's PF32 strokes
    assert 0.3 < line.max() < 0.8 and mask.max() == 1.0
    assert (mask > 0.3).sum() > 3 * (line > 0.3).sum()  # the occupancy mask is the line dilated by the margin
    with pytest.raises(ValueError, match="must be an integer"):
        raster.segment_stamp(0.0, 2, 0.75, 1, 2)


def test_two_targets_start_seed_distance_apart():
    p = gen.snakes_params(32, "14")
    rng = np.random.default_rng(5)
    for _ in range(200):
        pair = gen._two_snakes(rng, p, 1)
        if pair is not None:
            break
    _, _, origin, terminal = pair
    assert abs(math.dist(origin[0], origin[1]) - p.seed_distance) <= 1  # rounded to pixels
    assert origin != terminal


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_images=0"):
        gen.generate_pathfinder("unused", 32, "14", 0)
    with pytest.raises(ValueError, match="resolution=48"):
        gen.snakes_params(48, "14")
    with pytest.raises(ValueError, match="difficulty='hard'"):
        gen.snakes_params(32, "hard")


def test_throughput_is_measured():
    p = gen.snakes_params(32, "14")
    gen.generate_image(p, gen._image_rng(p, 9, 0))  # warm the stamp caches
    start, n = time.perf_counter(), 10
    for i in range(n):
        gen.generate_image(p, gen._image_rng(p, 9, i + 1))
    rate = n / (time.perf_counter() - start)
    log.info("Pathfinder-32 generator: %.1f images/s on one core", rate)
    assert rate > 0.5, f"generator slowed to {rate:.2f} images/s (about 10 expected on one core)"


def test_tiny_custom_parameters_generate(tmp_path):
    """`params` overrides the LRA settings (e.g. shorter contours for quick experiments)."""
    p = replace(gen.snakes_params(32, "baseline"), contour_length=3, num_distractor_snakes=1)
    folder = gen.generate_pathfinder(tmp_path, 32, "baseline", 2, params=p)
    assert len(read_metadata(folder)) == 2


def test_progress_is_reported_per_image_also_from_workers(tmp_path):
    calls = []
    gen.generate_pathfinder(tmp_path / "one", 32, "baseline", 4, images_per_batch=4, on_progress=calls.append)
    assert calls == [1, 1, 1, 1]
    calls = []
    gen.generate_pathfinder(tmp_path / "two", 32, "baseline", 4, images_per_batch=2, num_workers=2,
                            on_progress=calls.append)
    assert sum(calls) == 4 and len(calls) == 4
    calls = []  # batches already on disk count at once
    gen.generate_pathfinder(tmp_path / "one", 32, "baseline", 4, images_per_batch=4, on_progress=calls.append)
    assert calls == [4]


@pytest.mark.parametrize("resolution", [32, 128])
def test_cached_blank_window_steps_equal_the_general_ones(resolution):
    """The first seed and the first extension of every two-snake attempt are cached per orientation (and pivot):
    the cached values must be what the general functions give on the empty window."""
    p = gen.snakes_params(resolution, "14")
    margin, border, blank = p.paddle_margin_list[0], 2 * p.seed_distance, gen._blank_window(p)
    for degrees in (-180, -91, -3, 0, 45, 179):
        theta = degrees * math.pi / 180
        for got, want in zip(gen._blank_seed_tails(degrees, p, margin, border),
                             gen._seed_tails(blank, theta, p, margin, border)):
            np.testing.assert_array_equal(got, want)
        for center in [(resolution // 2, resolution // 2), (3, resolution - 4), (0, 7)]:
            got = gen._blank_candidates(center, theta, p, margin)
            want = gen._candidates(center, theta, p.paddle_length + margin, blank, margin, p.continuity)
            assert (got is None) == (want is None)
            for a, b in zip(got or (), want or ()):
                np.testing.assert_array_equal(a, b)


def test_blank_steps_are_taken_only_on_the_empty_window(monkeypatch):
    """The cached steps assume the occupancy is still the empty window when they run; check it on real images."""
    p = gen.snakes_params(32, "14")
    seen = {"seed": 0, "extend": 0}
    place_seed, extend = gen._place_seed, gen._extend

    def checked_place_seed(rng, mask, *args, blank=False, **kwargs):
        if blank:
            seen["seed"] += 1
            np.testing.assert_array_equal(mask, gen._blank_window(p))
        return place_seed(rng, mask, *args, blank=blank, **kwargs)

    def checked_extend(rng, pivot, theta, mask, *args, blank=False, **kwargs):
        if blank:
            seen["extend"] += 1
            np.testing.assert_array_equal(mask, gen._blank_window(p))
        return extend(rng, pivot, theta, mask, *args, blank=blank, **kwargs)

    monkeypatch.setattr(gen, "_place_seed", checked_place_seed)
    monkeypatch.setattr(gen, "_extend", checked_extend)
    for i in range(3):
        gen.generate_image(p, gen._image_rng(p, 4, i))
    assert seen["seed"] > 0 and seen["extend"] > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("start_method", ["fork", "spawn", "forkserver"])
def test_workers_end_when_the_generating_process_is_killed(tmp_path, start_method):
    """`kill -9` of prepare_data (or of a training run) during generation left the Manager and the workers alive,
    still writing images into the folder. They watch their owner and end within a second of its death, under each
    start method (forkserver, Python 3.14's default on Linux, makes the fork server their parent; the first watch
    compared the parent with the owner and ended every such worker at once, breaking the pool)."""
    script = ("import sys, multiprocessing\n"
              "multiprocessing.set_start_method(sys.argv[2])\n"
              "from longmixer.data.generators import pathfinder as gen\n"
              "def first(n, said=[]):\n"
              "    if not said: said.append(print('started', flush=True))\n"
              "gen.generate_pathfinder(sys.argv[1], 32, 'baseline', 100_000, images_per_batch=2, num_workers=2,"
              " on_progress=first)\n")
    started, running = orphaned_workers_end(script, [str(tmp_path), start_method])
    assert len(started) >= 3  # the Manager and two workers
    assert running == []
