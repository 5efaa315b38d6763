"""CCC at CIFAR scale: severities between the generator's levels, the walks on a synthetic accuracy table, the
seeded steps with their pair transitions, and the stream made on the fly or read from its cache."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from aqr.data.ccc import (SEVERITY_GRID, AccuracyTable, CCCImages, Step, ccc_corruptions, ccc_steps, ccc_stream,
                          corrupt_pair, find_walk)
from aqr.data.corruption_params import CIFAR_PARAMS
from aqr.data.corruptions import corrupt


def _image(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)


def test_a_whole_float_severity_is_the_tables_level_and_others_interpolate_its_parameters() -> None:
    image = _image()
    for name in ("gaussian_noise", "glass_blur", "contrast", "jpeg_compression"):
        for level in (1, 3, 5):
            a = corrupt(image, name, level, np.random.default_rng(1))
            b = corrupt(image, name, float(level), np.random.default_rng(1))
            assert np.array_equal(a, b)
    assert CIFAR_PARAMS.interpolated("gaussian_noise", 2.5) == pytest.approx((0.06 + 0.08) / 2)
    assert CIFAR_PARAMS.interpolated("contrast", 4.25) == pytest.approx(0.75 * 0.3 + 0.25 * 0.15)
    # shot noise through the reciprocal of its photon count; glass blur's shifts and iterations stay integers
    assert CIFAR_PARAMS.interpolated("shot_noise", 1.5) == pytest.approx(1 / ((1 / 500 + 1 / 250) / 2))
    sigma, delta, iterations = CIFAR_PARAMS.interpolated("glass_blur", 3.5)
    assert sigma == pytest.approx(0.325) and (delta, iterations) == (1, 2)
    assert isinstance(CIFAR_PARAMS.interpolated("jpeg_compression", 1.5), int)
    # a stronger severity moves the image further from the clean one, step by step
    distances = [np.abs(corrupt(image, "contrast", s, np.random.default_rng(0)).astype(float) - image).mean()
                 for s in (0.0, 0.5, 1.0, 1.5, 2.0, 3.5, 5.0)]
    assert distances[0] == 0 and all(a < b for a, b in itertools.pairwise(distances))


def test_below_one_the_severity_one_image_is_mixed_with_the_clean_one() -> None:
    image = _image()
    level_one = corrupt(image, "gaussian_noise", 1, np.random.default_rng(3)).astype(float)
    half = corrupt(image, "gaussian_noise", 0.5, np.random.default_rng(3)).astype(float)
    assert np.abs(half - (image + level_one) / 2).max() <= 0.5
    assert np.array_equal(corrupt(image, "gaussian_noise", 0.0, np.random.default_rng(3)), image)
    for bad in (5.5, -0.5, math.nan):
        with pytest.raises(ValueError, match="severity must be in"):
            corrupt(image, "contrast", bad, np.random.default_rng(0))
    with pytest.raises(ValueError, match="unknown corruption"):
        corrupt(image, "blurr", 0.5, np.random.default_rng(0))


def _synthetic_table(names: tuple[str, ...], seed: int = 0) -> AccuracyTable:
    """A source model whose accuracy falls with each corruption's severity, at a rate of its own."""
    rng = np.random.default_rng(seed)
    rate = {n: rng.uniform(4, 14) for n in names}
    grid = np.asarray(SEVERITY_GRID)
    pairs = {(a, b): np.clip(92 - rate[a] * grid[:, None] - rate[b] * grid[None, :], 5, 100)
             for a in names for b in names if a != b}
    return AccuracyTable(SEVERITY_GRID, pairs, {"model": "synthetic"})


def test_a_walk_fades_the_first_corruption_out_and_the_second_in_near_the_baseline() -> None:
    table = _synthetic_table(("a", "b"))
    for baseline in (30.0, 50.0, 70.0):
        walk = find_walk(table.pairs[("a", "b")], baseline)
        assert walk[0][1] == 0 and walk[0][0] >= 1 and walk[-1][0] == 0
        assert all((i - k, j - m) in ((-1, 0), (0, 1)) for (k, m), (i, j) in itertools.pairwise(walk))
        mean = np.mean([table.pairs[("a", "b")][i, j] for i, j in walk])
        assert abs(mean - baseline) < 6, (baseline, mean, walk)
    # by hand: from (1, 0) (acc 60) down to (0, 0) gives 70; right to (1, 1) gives 50: the baseline 50 goes right
    accuracy = np.array([[80.0, 60.0, 40.0], [60.0, 40.0, 20.0]])
    assert find_walk(accuracy, 50.0) == [(1, 0), (1, 1), (0, 1)]
    assert find_walk(accuracy, 72.0) == [(1, 0), (0, 0)]


def test_the_steps_are_seeded_and_change_pair_where_a_walk_ends() -> None:
    names = ("gaussian_noise", "contrast", "fog", "pixelate")
    table = _synthetic_table(names)
    steps = ccc_steps(table, 40.0, speed=100, n_images=5050, seed=1, corruptions=names)
    assert steps == ccc_steps(table, 40.0, speed=100, n_images=5050, seed=1, corruptions=names)
    assert steps != ccc_steps(table, 40.0, speed=100, n_images=5050, seed=2, corruptions=names)
    assert sum(s.count for s in steps) == 5050 and steps[-1].count == 50 and len(steps) == 51
    pairs = [k for k, _ in itertools.groupby(steps, key=lambda s: (s.first, s.second))]
    assert len(pairs) >= 3
    for (a, b), (c, d) in itertools.pairwise(pairs):
        assert a != b and c == b and d != c  # the faded-in corruption leads the next pair
    for pair, group in itertools.groupby(steps, key=lambda s: (s.first, s.second)):
        run = list(group)
        walk = find_walk(table.pairs[pair], 40.0)
        assert [(s.first_severity, s.second_severity) for s in run] == [
            (SEVERITY_GRID[i], SEVERITY_GRID[j]) for i, j in walk][: len(run)]
    # twice as slow: each walk's steps hold twice the images
    slow = ccc_steps(table, 40.0, speed=200, n_images=10100, seed=1, corruptions=names)
    assert [(s.first, s.first_severity, s.second, s.second_severity) for s in slow] == \
        [(s.first, s.first_severity, s.second, s.second_severity) for s in steps]
    with pytest.raises(ValueError, match="lacks the pairs"):
        ccc_steps(table, 40.0, 100, 1000, 0, corruptions=(*names, "snow"))
    with pytest.raises(ValueError, match="speed must be an integer"):
        ccc_steps(table, 40.0, 0, 1000, 0, corruptions=names)
    assert ccc_corruptions(40) == ccc_corruptions(55) and "jpeg_compression" not in ccc_corruptions(25)
    assert ccc_corruptions(10) == ("gaussian_noise", "shot_noise", "impulse_noise", "contrast")


def test_the_stream_is_made_the_same_in_parts_and_whole() -> None:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (20, 32, 32, 3), dtype=np.uint8)
    labels = np.arange(20) % 10
    steps = [Step("gaussian_noise", 2.5, "contrast", 0.0, 7), Step("gaussian_noise", 2.0, "contrast", 0.5, 7),
             Step("gaussian_noise", 0.0, "contrast", 1.5, 7)]
    whole = list(ccc_stream(images, labels, steps, seed=3, chunk=5))
    x = np.concatenate([c[0] for c in whole])
    y = np.concatenate([c[1] for c in whole])
    assert x.shape == (21, 32, 32, 3) and [len(c[1]) for c in whole] == [5, 5, 5, 5, 1]
    part = list(ccc_stream(images, labels, steps, seed=3, start=6, stop=16))
    assert np.array_equal(np.concatenate([c[0] for c in part]), x[6:16])
    assert np.array_equal(np.concatenate([c[1] for c in part]), y[6:16])
    again = np.concatenate([c[0] for c in ccc_stream(images, labels, steps, seed=4)])
    assert not np.array_equal(again, x)
    # each image is a drawn test image under the step's corruptions: the last step's are contrast alone
    index = next(k for k in range(20) if labels[k] == y[20] and (
        np.array_equal(x[20], corrupt_pair(images[k], steps[2], np.random.default_rng(0)))
        or np.array_equal(x[20], corrupt_pair(np.ascontiguousarray(images[k][:, ::-1]), steps[2],
                                              np.random.default_rng(0)))))
    assert labels[index] == y[20]
    with pytest.raises(ValueError, match="outside the stream of 21"):
        list(ccc_stream(images, labels, steps, seed=3, start=0, stop=22))


def test_an_accuracy_table_survives_its_file_and_a_wrong_file_is_named(tmp_path: Path) -> None:
    table = _synthetic_table(("a", "b", "c"))
    table.save(tmp_path / "t.json")
    back = AccuracyTable.load(tmp_path / "t.json")
    assert back.grid == table.grid and set(back.pairs) == set(table.pairs)
    assert all(np.allclose(back.pairs[k], table.pairs[k], atol=1e-4) for k in table.pairs)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="bad.json is not a CCC accuracy table"):
        AccuracyTable.load(tmp_path / "bad.json")


def test_a_cached_stream_gives_the_images_made_on_the_fly_and_makes_each_shard_once(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, (12, 16, 16, 3), dtype=np.uint8)
    steps = [Step("gaussian_noise", 2.5, "contrast", 1.0, 9), Step("gaussian_noise", 1.0, "contrast", 2.5, 9)]
    plain = CCCImages(images, steps, seed=5)
    whole = plain[0:18]
    cached = CCCImages(images, steps, seed=5, cache=tmp_path / "s", shard=4)
    # slices across shard boundaries, in any order, come out as made on the fly
    assert np.array_equal(cached[6:13], whole[6:13]) and cached.made == 12  # shards 1-3, whole
    assert np.array_equal(cached[0:18], whole) and cached.made == 18  # shards 0 and 4 (2 images)
    assert sorted(p.name for p in (tmp_path / "s").glob("*.npy")) == [f"{s:06d}-4.npy" for s in range(5)]
    again = CCCImages(images, steps, seed=5, cache=tmp_path / "s", shard=4)
    assert np.array_equal(again[3:18], whole[3:]) and again.made == 0
    assert again[5:5].shape == (0, 16, 16, 3) and again[17:40].shape == (1, 16, 16, 3) and again.made == 0
    # another shard size keeps files of its own: the same images, none read from the other size's shards
    halves = CCCImages(images, steps, seed=5, cache=tmp_path / "s", shard=2)
    assert np.array_equal(halves[8:10], whole[8:10]) and halves.made == 2
    # a shard that is not the stream's (cut short, another dtype, empty) is made again, not read
    np.save(tmp_path / "s" / "000002-4.npy", whole[8:10])
    np.save(tmp_path / "s" / "000003-4.npy", whole[12:16].astype(np.int16))
    (tmp_path / "s" / "000004-4.npy").write_bytes(b"")
    (tmp_path / "s" / ".000001-4.npy.x.tmp").write_bytes(b"left by a writer killed mid-file")
    (tmp_path / "s" / "000001-4.npy").unlink()
    fresh = CCCImages(images, steps, seed=5, cache=tmp_path / "s", shard=4)
    assert np.array_equal(fresh[0:18], whole) and fresh.made == 14
    assert not list((tmp_path / "s").glob(".*.tmp"))
    with pytest.raises(ValueError, match="shard must be an integer >= 1"):
        CCCImages(images, steps, seed=5, cache=tmp_path / "s", shard=0)


def test_a_cache_that_cannot_be_written_makes_the_images_in_memory_with_one_warning(tmp_path: Path) -> None:
    images = np.random.default_rng(3).integers(0, 256, (6, 16, 16, 3), dtype=np.uint8)
    steps = [Step("contrast", 2.0, "shot_noise", 1.0, 10)]
    (tmp_path / "file").write_text("not a folder")
    stream = CCCImages(images, steps, seed=2, cache=tmp_path / "file" / "s", shard=4)
    with pytest.warns(RuntimeWarning, match="cannot be written"):
        got = stream[2:10]
    assert np.array_equal(got, CCCImages(images, steps, seed=2)[2:10]) and stream.cache is None


def test_readers_of_one_cached_stream_at_once_make_each_shard_once(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    images = np.random.default_rng(2).integers(0, 256, (10, 16, 16, 3), dtype=np.uint8)
    steps = [Step("shot_noise", 3.0, "contrast", 1.5, 24)]
    whole = CCCImages(images, steps, seed=1)[0:24]
    readers = [CCCImages(images, steps, seed=1, cache=tmp_path / "s", shard=8) for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:
        out = list(pool.map(lambda r: r[0:24], readers))
    assert all(np.array_equal(o, whole) for o in out) and sum(r.made for r in readers) == 24
