"""A property test of streaming AQR's C kernels against their torch mirror on extreme inputs; run by
tests/test_stream_kernels.py with the normal build and, in a subprocess, under AddressSanitizer and
UBSan (``python stream_fuzz.py EXAMPLES FLAG...``).

Each case is a small layer output (finite values from the whole float32 range, ties, constant
channels, sometimes a NaN or Inf), knots and source knots (sorted, sometimes tied or spanning
+-FLT_MAX), an optional folded BatchNorm, and a sequence of operations: tables, scan, pushes into a
tail window, tails, a merge, ``target="robust"``'s group merge and mixture, and ``target="mixed"``'s cluster
scan and push. Both implementations run each operation on the same inputs; their
results must agree to float rounding, flags and histograms exactly.
"""

from __future__ import annotations

import math

import ctypes
import sys

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from aqr.adapt.stream.base import (COUNT, IMAGE_COUNT, MAP, PAIRED, PendingGroup, StreamKernels, StreamTable,
                                   TailWindow, cloned)
from aqr.adapt.stream.native_kernels import NativeStreamKernels
from aqr.adapt.stream.torch_kernels import TorchStreamKernels
from aqr.adapt.stream.running import extreme_weights

FLT_MAX = float(np.finfo(np.float32).max)
SPECIAL = [FLT_MAX, -FLT_MAX, 1e38, -1e38, 2e38, -2e38, 1e-45, -1e-45, 0.0, -0.0, 1.0, -1.0, 1e-30]
# (images, rows per image, C, B); 9 and 17 channels: a channels-last layout's vectors of eight channels and a rest
LAYOUTS = [(1, 1, 1, 1), (1, 1, 3, 20), (2, 1, 2, 5), (3, 2, 2, 1), (2, 4, 3, 1), (4, 1, 1, 17), (1, 5, 4, 3),
           (2, 1, 2, 53), (2, 1, 9, 6), (1, 2, 17, 3)]


def floats(special_weight: int = 1) -> st.SearchStrategy[float]:
    return st.one_of(st.floats(width=32, allow_nan=False, allow_infinity=False), *[st.sampled_from(SPECIAL)] * special_weight)


def sorted_rows(draw: st.DrawFn, c: int, k: int, moderate: bool) -> torch.Tensor:
    """``(c, k)`` nondecreasing float32 knots: moderate, or anything finite; some rows tied."""
    values = st.floats(-100, 100, width=32) if moderate else st.one_of(st.floats(-100, 100, width=32), floats())
    a = draw(arrays(np.float32, (c, k), elements=values))
    a.sort(axis=1)
    for row in range(c):
        if draw(st.integers(0, 4)) == 0 and k > 3:  # a run of tied knots (an atom)
            j = draw(st.integers(0, k - 3))
            a[row, j : j + 3] = a[row, j]
    return torch.from_numpy(a)


@st.composite
def cases(draw: st.DrawFn) -> dict:
    images, rows, c, b = draw(st.sampled_from(LAYOUTS))
    x = draw(arrays(np.float32, (images * rows, c, b), elements=floats(2)))
    for ch in range(c):
        kind = draw(st.sampled_from(["drawn", "normal", "constant"]))
        if kind == "normal":
            x[:, ch] = np.random.default_rng(draw(st.integers(0, 2**16))).normal(size=(images * rows, b))
        elif kind == "constant":
            x[:, ch] = x[0, ch, 0]
    if draw(st.integers(0, 9)) == 0:
        x.reshape(-1)[draw(st.integers(0, x.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    k = draw(st.sampled_from([3, 4, 11]))
    moderate = draw(st.booleans())
    knots, source = sorted_rows(draw, c, k, moderate), sorted_rows(draw, c, k, True)
    pre = None
    if draw(st.booleans()):
        values = st.one_of(st.floats(-10, 10, width=32), floats())
        pre = tuple(torch.from_numpy(draw(arrays(np.float32, (c,), elements=values))) for _ in range(2))
    pushes = [torch.from_numpy(np.sort(draw(arrays(np.float32, (2, n, c), elements=floats())), axis=0))
              for n in draw(st.lists(st.integers(0, 9), min_size=1, max_size=5))]
    return {"x": torch.from_numpy(x), "images": images, "knots": knots, "source": source, "pre": pre,
            "grid": draw(st.sampled_from([1, 2, 7, 64])), "cells": draw(st.sampled_from([1, 3, 8])),
            "stride": draw(st.sampled_from([1, 2, 5])), "window": draw(st.sampled_from([1, 3, 8])),
            "weight": draw(st.sampled_from([0.0, 1e-3, 0.3, 1.0])), "pushes": pushes,
            "drawn_counts": _drawn_counts(draw(st.integers(0, 2**16)))}


def _drawn_counts(seed: int):
    """Counts of any shape, some negative or huge, some all zero, from ``seed``."""
    def make(shape: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng(seed)
        counts = rng.integers(-3, 50, size=shape).astype(np.int32)
        counts[rng.random(shape) < 0.05] = np.iinfo(np.int32).max
        counts[:, rng.random(shape[1]) < 0.3] = 0
        return counts
    return make


def _close(got: torch.Tensor, want: torch.Tensor, what: str, scale: float | None = None) -> None:
    """Equal to float rounding of ``scale`` (default: the largest ``want``), NaN where NaN."""
    if scale is None:
        scale = float(want.double().abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * max(scale, 1.0), equal_nan=True,
                               msg=lambda m: f"{what}: {m}")


def check_against_torch(native: NativeStreamKernels, case: dict) -> None:
    """Every stream operation of the C kernels equals its torch mirror on ``case``."""
    ref = TorchStreamKernels()
    x, knots, source, pre = case["x"], case["knots"], case["source"], case["pre"]
    c, g, cells = x.shape[1], case["grid"], case["cells"]
    tables = [StreamTable.empty(c, g), StreamTable.empty(c, g)]
    native.tables(knots, source, tables[0])
    ref.tables(knots, source, tables[1])
    for name in ("pairs", "glo", "ginv"):
        _close(getattr(tables[0], name), getattr(tables[1], name), f"table {name}")
    mode = MAP | COUNT
    got = native.scan(x, case["images"], pre, knots, source, tables[0], mode, case["stride"], cells)
    want = ref.scan(x, case["images"], pre, knots, source, tables[1], mode, case["stride"], cells)
    assert got.finite == want.finite, "finite flags differ"
    if want.finite:  # otherwise the rest is documented as meaningless
        assert torch.equal(got.lo, want.lo) and torch.equal(got.hi, want.hi), "per-image extremes differ"
        _close(got.y, want.y, "map")
        assert torch.equal(got.counts, want.counts), "histograms differ"
        per_image = [k.scan(x, case["images"], pre, knots, source, t, IMAGE_COUNT, case["stride"], cells)
                     for k, t in ((native, tables[0]), (ref, tables[1]))]
        assert torch.equal(per_image[0].counts, per_image[1].counts), "per-image histograms differ"
        paired = [k.scan(x, case["images"], pre, knots, source, t, IMAGE_COUNT | PAIRED, case["stride"], cells)
                  for k, t in ((native, tables[0]), (ref, tables[1]))]
        halves = torch.stack([per_image[1].counts[0::2].sum(0), per_image[1].counts[1::2].sum(0)]).int()
        assert torch.equal(paired[0].counts, paired[1].counts) and torch.equal(paired[0].counts, halves), \
            "the even and odd images' histograms differ"
        if case["stride"] == 1:  # every value counted: the images' histograms add up to the batch's
            assert torch.equal(per_image[0].counts.sum(0), want.counts), "per-image histograms do not add up"
        # target="robust"'s shift test on those histograms (and on counts drawn at random, negatives too)
        drawn = torch.from_numpy(case["drawn_counts"](per_image[1].counts.shape))
        for counts in (per_image[1].counts, drawn):
            got_d, want_d = native.shift_distances(counts, knots), ref.shift_distances(counts, knots)
            assert all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(got_d, want_d)), \
                f"shift distances differ: {got_d} vs {want_d}"
            assert all(0.0 <= d <= 1.0 for d in want_d), want_d
            small = bool(counts.abs().max() < 2**15) if counts.numel() else True
            one, apart = native.shift_test(counts, knots, small), StreamKernels.shift_test(native, counts, knots, small)
            assert one[0] == apart[0] and torch.equal(one[1], apart[1]) and torch.equal(one[2], apart[2]), \
                "shift_test differs"
    check_bound(native, case, tables[0])
    check_clusters(native, case, tables[0])
    check_rows(native, case, tables[0])
    windows = [TailWindow.empty(c, case["window"]) for _ in range(2)]
    groups = [PendingGroup.empty(c, cells) for _ in range(2)]
    counts = want.counts if want.finite else torch.zeros(c, cells + 4, dtype=torch.int32)
    for extremes in case["pushes"]:
        lo, hi = extremes[0], extremes[1]
        native.push(windows[0], groups[0], counts, lo, hi)
        ref.push(windows[1], groups[1], counts, lo, hi)
    f = windows[1].filled
    assert (windows[0].filled, windows[0].head) == (f, windows[1].head)
    for name in ("ring_lo", "ring_hi"):
        assert torch.equal(getattr(windows[0], name)[:f], getattr(windows[1], name)[:f]), name
    for name in ("sorted_lo", "sorted_hi"):  # equal values (+0 and -0 may trade places)
        assert bool((getattr(windows[0], name)[:, :f] == getattr(windows[1], name)[:, :f]).all()), name
    assert torch.equal(groups[0].counts, groups[1].counts) and torch.equal(groups[0].gmin, groups[1].gmin)
    # a large batch in one C call: the bits of the same C operations called one by one, on this state
    held = min(f + case["images"], windows[0].size)
    tail_weights = extreme_weights(held, max(1, held // 2))
    args = (x, case["images"], pre, knots, source, tables[0], windows[0], groups[0], case["weight"], tail_weights,
            case["stride"], cells)
    one, apart = native.large(*args), StreamKernels.large(native, *args)
    assert (one is None) == (apart is None) == (not want.finite), "large: finite flags differ"
    if one is not None:
        bits = lambda t: t.view(torch.int32)  # noqa: E731 (NaN where NaN: the same bits, not equal values)
        assert torch.equal(bits(one[0]), bits(apart[0])) and torch.equal(bits(one[1]), bits(apart[1])), \
            "large: map or knots differ"
        for name in ("ring_lo", "sorted_lo", "ring_hi", "sorted_hi"):
            assert torch.equal(bits(getattr(one[2], name)), bits(getattr(apart[2], name))), f"large: window {name} differs"
        # target="robust"'s form: a batch counted already, into an empty group (None)
        args = (x, case["images"], pre, knots, source, g, windows[0], None, want.counts, want.lo, want.hi,
                case["weight"], tail_weights, case["stride"], cells)
        one, apart = native.merge_map(*args), StreamKernels.merge_map(native, *args)
        assert torch.equal(bits(one[0]), bits(apart[0])) and torch.equal(bits(one[1]), bits(apart[1])), \
            "merge_map: map or knots differ"
        assert torch.equal(bits(one[2].sorted_hi), bits(apart[2].sorted_hi)), "merge_map: window differs"
    if f == 0:
        return
    weights = extreme_weights(f, max(1, f // 2))
    if want.finite:  # target="robust"'s idle rebuild in one C call: the bits of the C operations one by one
        bits = lambda t: t.view(torch.int32)  # noqa: E731
        rebuilt = []
        for run in (native.idle_rebuild, lambda *a: StreamKernels.idle_rebuild(native, *a)):
            marginal, target = source.clone(), knots.clone()
            run(marginal, target, want.counts, want.lo.amin(0), want.hi.amax(0), case["weight"], windows[0], weights)
            rebuilt.append((bits(marginal), bits(target)))
        assert all(torch.equal(a, b) for a, b in zip(*rebuilt)), "idle_rebuild differs"
    tails = native.tails(windows[0], weights), ref.tails(windows[1], weights)
    # weighted sums in another order (torch's matrix product): where large extremes cancel, the
    # difference is bounded by the sum of the terms' magnitudes, not by the result's
    k = len(weights)
    for i, (name, values) in enumerate((("p0", windows[1].sorted_lo), ("p100", windows[1].sorted_hi))):
        terms = float((values[:, :k].double().abs() @ weights.double().abs()).max())
        _close(tails[0][i], tails[1][i], name, scale=max(terms, float(tails[1][i].double().abs().max())))
    merged = [knots.clone(), knots.clone()]
    native.merge(merged[0], groups[0], case["weight"], *tails[1])
    ref.merge(merged[1], groups[1], case["weight"], *tails[1])
    _close(merged[0], merged[1], "merged knots")
    assert bool((merged[1][:, 1:] >= merged[1][:, :-1]).all()), "merged knots must stay sorted"
    # target="robust": the pending group into group knots counted on other knots' bins, then the mixture
    weights = torch.full((c,), case["weight"], dtype=torch.float64)
    weights[-1] = 0.5
    rows = [source.clone(), source.clone()]
    native.group_merge(rows[0], knots, groups[0].counts, groups[0].gmin, groups[0].gmax, weights)
    ref.group_merge(rows[1], knots, groups[1].counts, groups[1].gmin, groups[1].gmax, weights)
    _close(rows[0], rows[1], "group knots")
    if case["weight"] == 0:  # rows of weight 0 (all but the last) stay as they were, whatever their extremes
        assert torch.equal(rows[0][:-1], source[:-1]) and torch.equal(rows[1][:-1], source[:-1]), "weight 0 moved knots"
    assert bool((rows[1][:, 1:] >= rows[1][:, :-1]).all()), "group knots must stay sorted"
    members = torch.stack([knots, source, rows[1], merged[1]])
    if bool(torch.isfinite(members).all()):
        mixed = [merged[1].clone(), merged[1].clone()]
        grid = max(2, case["grid"])
        # equal, then weighted (one weight 0, the others from the case: the same kernel at any scale)
        for w in (None, torch.tensor([case["weight"], 0.0, 1.0, 3.0 * case["weight"] + 1e-3], dtype=torch.float64)):
            native.mixture(members, mixed[0], grid, w)
            ref.mixture(members, mixed[1], grid, w)
            _close(mixed[0], mixed[1], "mixture knots")
            inner = mixed[1][:, 1:-1]  # (the ends are the tails', set after the mixture)
            assert bool((inner[:, 1:] >= inner[:, :-1]).all()), "the mixture's inner knots must be sorted"


def check_clusters(native: NativeStreamKernels, case: dict, table: StreamTable) -> None:
    """``target="mixed"``'s two calls: the C kernels' one-call cluster scan is, bit for bit, its images scanned one
    by one on their clusters' states (the base form, on the C scan) and, to float rounding, the torch mirror's;
    the torch kernels' gathered scan (which never reads the clusters on the host) is the torch base form bit for
    bit; the one-call push is the clusters' pushes one by one."""
    x, knots, source, images, pre = case["x"], case["knots"], case["source"], case["images"], case["pre"]
    c, cells, stride = x.shape[1], case["cells"], case["stride"]
    rng = np.random.default_rng(case["stride"] * 7 + images)
    other = StreamTable.empty(c, table.grid)
    native.tables(source, source, other)
    states = [(knots, table), (source, other), (knots, table)]
    maps = [True, True, False]
    of = torch.from_numpy(rng.integers(-1, len(states), size=images)).long()
    ref = TorchStreamKernels()
    start = torch.from_numpy(rng.normal(size=tuple(x.shape)).astype(np.float32))
    ys = [start.clone() for _ in range(4)]
    one = native.cluster_scan(x, images, pre, source, of, states, maps, 0.3, ys[0], stride, cells)
    apart = StreamKernels.cluster_scan(native, x, images, pre, source, of, states, maps, 0.3, ys[1], stride, cells)
    mirror = StreamKernels.cluster_scan(ref, x, images, pre, source, of, states, maps, 0.3, ys[2], stride, cells)
    gathered = ref.cluster_scan(x, images, pre, source, of, states, maps, 0.3, ys[3], stride, cells)
    assert one.finite == apart.finite == mirror.finite == gathered.finite, "cluster scan: finite flags differ"
    if not one.finite:
        return
    bits = lambda t: t.view(torch.int32)  # noqa: E731
    took = of >= 0
    assert torch.equal(bits(ys[0]), bits(ys[1])) and torch.equal(one.counts, apart.counts) and \
        torch.equal(bits(one.lo[took]), bits(apart.lo[took])) and torch.equal(bits(one.hi[took]), bits(apart.hi[took])), \
        "cluster scan: one call differs from the images one by one"
    assert torch.equal(one.counts, mirror.counts), "cluster scan: histograms differ from the torch mirror"
    assert torch.equal(bits(ys[2]), bits(ys[3])) and torch.equal(mirror.counts, gathered.counts) and \
        torch.equal(bits(mirror.lo[took]), bits(gathered.lo[took])) and \
        torch.equal(bits(mirror.hi[took]), bits(gathered.hi[took])), "cluster scan: the gathered torch form differs"
    _close(ys[0], ys[2], "cluster scan map")
    assert torch.equal(ys[0][~took.repeat_interleave(x.shape[0] // images)], start[~took.repeat_interleave(
        x.shape[0] // images)]), "cluster scan: an image of no cluster was changed"
    pushed = [[(TailWindow.empty(c, case["window"]), PendingGroup.empty(c, cells)) for _ in states] for _ in range(2)]
    for extremes in case["pushes"][:2]:  # windows part filled first, so the counters wrap
        if len(extremes[0]):
            for w, g in pushed[0] + pushed[1]:
                native.push(w, g, None, extremes[0], extremes[1])
    sizes = [native.cluster_push(of, one.lo, one.hi, one.counts, pushed[0]),
             StreamKernels.cluster_push(native, of, one.lo, one.hi, one.counts, pushed[1])]
    assert sizes[0] == sizes[1] == torch.bincount(of + 1, minlength=4)[1:].tolist()
    for (w0, g0), (w1, g1) in zip(*pushed):
        assert (w0.filled, w0.head) == (w1.filled, w1.head), "cluster push: window counters differ"
        for name in ("ring_lo", "sorted_lo", "ring_hi", "sorted_hi"):
            assert torch.equal(bits(getattr(w0, name)), bits(getattr(w1, name))), f"cluster push: window {name}"
        assert torch.equal(g0.counts, g1.counts) and torch.equal(bits(g0.gmin), bits(g1.gmin)) and \
            torch.equal(bits(g0.gmax), bits(g1.gmax)), "cluster push: groups differ"


def channels_last(x: torch.Tensor) -> torch.Tensor:
    """``x`` (A, C, B) laid out as a channels-last layer output's rows: each position's C values side by side."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def in_rows(t: torch.Tensor) -> bool:
    """Whether ``t`` (A, C, B) is laid out as :func:`channels_last` lays it out."""
    return t.transpose(1, 2).is_contiguous()


def same_values(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The same shape and values, NaN where NaN (an extreme of +0 and -0 may come out either way in either layout)."""
    return got.shape == want.shape and bool(((got == want) | (got.isnan() & want.isnan())).all())


def check_rows(native: NativeStreamKernels, case: dict, table: StreamTable) -> None:
    """The kernels read a channels-last ``x`` (strided rows, as ``torch.channels_last`` gives) in place and write its
    map in that layout: every scan mode, ``large`` and ``merge_map`` give the contiguous ``x``'s values."""
    x, knots, source, images, pre = case["x"], case["knots"], case["source"], case["images"], case["pre"]
    cells, stride = case["cells"], case["stride"]
    rows = channels_last(x)
    for mode in (0, MAP, COUNT, MAP | COUNT, IMAGE_COUNT, MAP | IMAGE_COUNT, IMAGE_COUNT | PAIRED,
                 MAP | IMAGE_COUNT | PAIRED):
        want = native.scan(x, images, pre, knots, source, table, mode, stride, cells)
        got = native.scan(rows, images, pre, knots, source, table, mode, stride, cells)
        assert got.finite == want.finite, f"rows scan {mode}: finite flags differ"
        if not want.finite:
            return
        assert same_values(got.lo, want.lo) and same_values(got.hi, want.hi), f"rows scan {mode}: extremes differ"
        assert (got.counts is None) == (want.counts is None), f"rows scan {mode}: counts"
        assert got.counts is None or torch.equal(got.counts, want.counts), f"rows scan {mode}: histograms differ"
        if mode & MAP:
            assert in_rows(got.y), f"rows scan {mode}: the map is not in the input's layout"
            assert same_values(got.y, want.y), f"rows scan {mode}: maps differ"
    window = TailWindow.empty(x.shape[1], case["window"])
    group = PendingGroup.empty(x.shape[1], cells)
    for extremes in case["pushes"][:2]:
        if len(extremes[0]):
            native.push(window, group, None, extremes[0], extremes[1])
    held = min(window.filled + images, window.size)
    tail_weights = extreme_weights(held, max(1, held // 2))
    both = [native.large(t, images, pre, knots, source, table, window, group, case["weight"], tail_weights, stride,
                         cells) for t in (x, rows)]
    assert both[0] is not None and both[1] is not None, "large: a finite batch was not mapped"
    assert in_rows(both[1][0]) and same_values(both[1][0], both[0][0]), "rows large: maps differ"
    assert same_values(both[1][1], both[0][1]), "rows large: knots differ"
    counted = native.scan(x, images, pre, knots, source, table, COUNT, stride, cells)
    both = [native.merge_map(t, images, pre, knots, source, table.grid, window, None, counted.counts, counted.lo,
                             counted.hi, case["weight"], tail_weights, stride, cells) for t in (x, rows)]
    assert both[0] is not None and both[1] is not None, "merge_map: a finite batch was not mapped"
    assert in_rows(both[1][0]) and same_values(both[1][0], both[0][0]), "rows merge_map: maps differ"


def check_bound(native: NativeStreamKernels, case: dict, table: StreamTable) -> None:
    """A small batch through the bound kernels (a scan, then a commit that pushes and, on some batches,
    rebuilds) leaves the bits of the separate operations: scan; push; tails, merge, tables, group cleared."""
    x, knots, source, images = case["x"], case["knots"], case["source"], case["images"]
    c, cells, stride = x.shape[1], case["cells"], case["stride"]
    pre = case["pre"] or (torch.ones(c), torch.zeros(c))
    bits = lambda t: t.view(torch.int32)  # noqa: E731 (NaN where NaN: the same bits, not equal values)
    states = [(knots.clone(), cloned(table), TailWindow.empty(c, case["window"]), PendingGroup.empty(c, cells))
              for _ in range(2)]
    bound = native.bind(states[0][0], source, states[0][1], states[0][2], states[0][3], stride, cells)
    for step in range(3):
        own, apart = states
        y, stage, finite = bound.map_count(x, images, pre)
        want = native.scan(x, images, pre, apart[0], source, apart[1], MAP | COUNT, stride, cells)
        assert finite == want.finite, "bound scan: finite flags differ"
        if not finite:
            return
        lo, hi, counts = bound.staged_parts(stage, images)
        assert torch.equal(bits(y), bits(want.y)) and torch.equal(bits(lo), bits(want.lo)) and \
            torch.equal(bits(hi), bits(want.hi)) and torch.equal(counts, want.counts), "bound scan differs"
        held = min(apart[2].filled + images, apart[2].size)
        rebuild = None if step == 1 else (case["weight"], extreme_weights(held, max(1, held // 2)))
        bound.commit(stage, images, rebuild)
        native.push(apart[2], apart[3], want.counts, want.lo, want.hi)
        if rebuild is not None:
            p0, p100 = native.tails(apart[2], rebuild[1])
            native.merge(apart[0], apart[3], rebuild[0], p0, p100)
            native.tables(apart[0], source, apart[1])
            apart[3].clear()
        assert (own[2].filled, own[2].head) == (apart[2].filled, apart[2].head), "bound commit: window counters"
        for name, a, b in (("knots", own[0], apart[0]), ("pairs", own[1].pairs, apart[1].pairs),
                           ("glo", own[1].glo, apart[1].glo), ("ginv", own[1].ginv, apart[1].ginv),
                           *((f"window {f}", getattr(own[2], f), getattr(apart[2], f))
                             for f in ("ring_lo", "sorted_lo", "ring_hi", "sorted_hi")),
                           ("group counts", own[3].counts, apart[3].counts), ("gmin", own[3].gmin, apart[3].gmin),
                           ("gmax", own[3].gmax, apart[3].gmax)):
            assert torch.equal(bits(a) if a.is_floating_point() else a, bits(b) if b.is_floating_point() else b), \
                f"bound commit: {name} differs at batch {step}"


def fuzz(lib: ctypes.CDLL, examples: int, seed: int | None = None) -> None:
    """Run :func:`check_against_torch` on ``examples`` generated cases (raises on the first failure)."""
    native = NativeStreamKernels(lib)

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is not None,
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def run(case: dict) -> None:
        check_against_torch(native, case)

    run()


if __name__ == "__main__":  # the sanitizer run: python stream_fuzz.py EXAMPLES FLAG...
    from aqr.adapt.stream import native_kernels
    from aqr.backends import build

    from tests.native_fuzz import has_wide_lookup, lookup

    examples, flags = int(sys.argv[1]), sys.argv[2:]
    for simd in (False, True):
        command = build.compile_command(flags, simd=simd)
        lib = native_kernels.load(command, name="aqr_stream_kernels_sanitized")
        for wide in (False, True) if has_wide_lookup(lib) else (False,):
            with lookup(lib, wide):
                fuzz(lib, examples, seed=0)
    print("sanitized stream fuzz passed")
