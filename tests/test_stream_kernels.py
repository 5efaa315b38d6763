"""Streaming AQR's C kernels on hostile input: equal to their torch mirror, refusing sizes out of bounds,
and the same fuzz under AddressSanitizer and UBSan."""

from __future__ import annotations

import pytest
import torch

from aqr.backends.native import NativeKernelError
from aqr.adapt.stream.base import COUNT, IMAGE_COUNT, MAP, PAIRED, PendingGroup, StreamKernels, StreamTable, TailWindow
from aqr.adapt.stream.native_kernels import NativeStreamKernels, load_stream_kernels
from aqr.adapt.stream.torch_kernels import TorchStreamKernels
from tests.native_fuzz import has_wide_lookup, lookup
from tests.stream_fuzz import fuzz
from tests.sanitized import run_sanitized

LIB, WHY = load_stream_kernels()
needs_kernels = pytest.mark.skipif(LIB is None, reason=f"aqr's stream C kernels unavailable: {WHY}")


WIDE = pytest.mark.parametrize("wide", [False, True], ids=["avx2-loads", "avx512-gathers"])


def _lookup(wide: bool):
    if wide and not has_wide_lookup(LIB):
        pytest.skip("this CPU (or build) has no AVX-512 lookups")
    return lookup(LIB, wide)


@needs_kernels
@WIDE
def test_stream_kernels_equal_the_torch_mirror(wide: bool) -> None:
    with _lookup(wide):
        fuzz(LIB, examples=60, seed=0)


@pytest.mark.slow
@needs_kernels
@WIDE
def test_stream_kernels_equal_the_torch_mirror_on_many_cases(wide: bool) -> None:
    with _lookup(wide):
        fuzz(LIB, examples=600)


@needs_kernels
def test_the_avx512_lookups_scan_exactly_as_the_avx2_lookups() -> None:
    """The scan's map and extremes are the same bits whichever lookup the library chose when it loaded:
    rows of 333 values (not a multiple of 16), tied knots, values beyond the knots, a folded affine."""
    if not has_wide_lookup(LIB):
        pytest.skip("this CPU (or build) has no AVX-512 lookups")
    native = NativeStreamKernels(LIB)
    g = torch.Generator().manual_seed(5)
    c, k = 6, 21
    x = torch.randn(8, c, 333, generator=g) * 2
    x[:, 0] = x[:, 0].round()
    knots = torch.randn(c, 400, generator=g).sort(1).values[:, torch.linspace(0, 399, k).long()].contiguous()
    knots[0, 5:9] = knots[0, 5]  # tied knots
    source = torch.randn(c, 400, generator=g).sort(1).values[:, torch.linspace(0, 399, k).long()].contiguous()
    pre = (torch.randn(c, generator=g), torch.randn(c, generator=g))
    table = StreamTable.empty(c, 64)
    native.tables(knots, source, table)
    results = []
    for wide in (False, True):
        with lookup(LIB, wide):
            results.append(native.scan(x, 4, pre, knots, source, table, MAP | COUNT, 3, 16))
    for avx2, avx512 in zip(*results):
        if isinstance(avx2, torch.Tensor):
            assert torch.equal(avx2, avx512)
        else:
            assert avx2 == avx512


@needs_kernels
@WIDE
def test_the_tables_are_the_torch_mirrors_bits_at_the_streams_sizes(wide: bool) -> None:
    """The C tables find each knot's first grid point on its own; the mirror searches every grid point: the
    same bits at 101 knots and 512 cells (the stream's defaults) and at small sizes, over 60 orders of
    magnitude, with runs of tied knots, whichever width the cells' lines are computed at. Knots out of order
    take the walk over the intervals, in bounds."""
    with _lookup(wide):
        _check_tables_against_the_mirror()


def _check_tables_against_the_mirror() -> None:
    native, mirror = NativeStreamKernels(LIB), TorchStreamKernels()
    g = torch.Generator().manual_seed(11)
    for trial in range(64):
        c, k, grid = 8, (3, 4, 11, 101)[trial % 4], (1, 2, 7, 512)[trial // 4 % 4]
        knots = (torch.randn(c, k, generator=g) * 10.0 ** torch.randint(-30, 30, (c, 1), generator=g)).sort(1).values
        if trial % 3 == 0 and k > 5:
            knots[:, 2:6] = knots[:, 2:3]  # an atom
        source = torch.randn(c, k, generator=g).sort(1).values
        tables = [StreamTable.empty(c, grid), StreamTable.empty(c, grid)]
        native.tables(knots, source, tables[0])
        mirror.tables(knots, source, tables[1])
        for name in ("pairs", "glo", "ginv"):
            assert torch.equal(getattr(tables[0], name), getattr(tables[1], name)), (trial, name)
    knots = torch.tensor([[-1.0, 0, 1, 2, 2, 3, 4, 5, 6, 7, 8, 9]] * 3)  # knots and an atom on grid points
    knots[1] *= 1e-3
    knots[2, 4:7] = 2.0
    source = torch.randn(3, 12, generator=g).sort(1).values
    tables = [StreamTable.empty(3, 16), StreamTable.empty(3, 16)]
    native.tables(knots, source, tables[0])
    mirror.tables(knots, source, tables[1])
    assert torch.equal(tables[0].pairs, tables[1].pairs)
    knots = torch.randn(4, 11, generator=g)  # out of order: no reference, but a finite table of the right size
    table = StreamTable.empty(4, 64)
    native.tables(knots, knots.sort(1).values, table)
    assert bool(torch.isfinite(table.pairs).all())


@needs_kernels
def test_the_strided_counts_are_the_torch_mirrors_at_the_layers_widths() -> None:
    """The counts, eight strided values a step, equal the mirror's exactly on rows as wide as the ResNet's
    (1,024, 256 and 64 values) and odd ones, per batch and per image, with values beyond every edge bin."""
    native, mirror = NativeStreamKernels(LIB), TorchStreamKernels()
    g = torch.Generator().manual_seed(12)
    c, k = 5, 101
    knots = torch.randn(c, 2000, generator=g).sort(1).values[:, torch.linspace(0, 1999, k).long()].contiguous()
    knots[1, 10:20] = knots[1, 10]
    table = StreamTable.empty(c, 512)
    native.tables(knots, knots, table)
    pre = (torch.rand(c, generator=g) + 0.5, torch.randn(c, generator=g) * 0.1)
    for width, images, stride in ((1024, 2, 5), (256, 3, 5), (64, 4, 5), (333, 2, 7), (41, 3, 2)):
        x = torch.randn(images * 2, c, width, generator=g) * 1.5
        for mode in (MAP | COUNT, COUNT, IMAGE_COUNT):
            got = native.scan(x, images, pre, knots, knots, table, mode, stride, 64)
            want = mirror.scan(x, images, pre, knots, knots, table, mode, stride, 64)
            assert torch.equal(got.counts, want.counts), (width, stride, mode)
            assert torch.equal(got.lo, want.lo) and torch.equal(got.hi, want.hi)


@needs_kernels
def test_a_large_batch_in_one_call_is_the_composition_of_the_five_operations() -> None:
    """``aqr_stream_large`` (a batch counted, pushed into copies of the window and group, merged into a copy of
    the knots and mapped) gives the bits of the same operations called one by one, leaves the state as it
    was, and gives ``None`` for a batch holding NaN or Inf."""
    native = NativeStreamKernels(LIB)
    g = torch.Generator().manual_seed(13)
    c, k, w, grid, cells = 7, 21, 12, 64, 16
    for images, rows, width, filled, group_images in ((8, 1, 333, 0, 0), (16, 2, 64, 5, 3), (9, 1, 40, 12, 0)):
        source = torch.randn(c, 300, generator=g).sort(1).values[:, torch.linspace(0, 299, k).long()].contiguous()
        knots = (source * 1.3 + 0.2).contiguous()
        table = StreamTable.empty(c, grid)
        native.tables(knots, source, table)
        window = TailWindow.empty(c, w)
        group = PendingGroup.empty(c, cells)
        if filled:
            ext = torch.randn(2, filled, c, generator=g).sort(0).values
            native.push(window, None, None, ext[0] - 2, ext[1] + 2)
        if group_images:
            before = torch.randn(group_images * rows, c, width, generator=g)
            counted = native.scan(before, group_images, None, knots, source, table, COUNT, 5, cells)
            group.counts += counted.counts
            group.gmin.copy_(counted.lo.min(0).values - 50)  # further out than the batch's: they set the ends
            group.gmax.copy_(counted.hi.max(0).values + 50)
            group.images = group_images
        x = torch.randn(images * rows, c, width, generator=g) * 4 + 0.3  # wider than the knots: mass beyond both ends
        pre = (torch.rand(c, generator=g) + 0.5, torch.randn(c, generator=g) * 0.1)
        weights = torch.rand(min(filled + images, w), generator=g, dtype=torch.float64)
        state = [t.clone() for t in (knots, window.ring_lo, window.sorted_lo, group.counts, group.gmin)]
        one = native.large(x, images, pre, knots, source, table, window, group, 0.3, weights, 5, cells)
        apart = StreamKernels.large(native, x, images, pre, knots, source, table, window, group, 0.3, weights, 5, cells)
        assert torch.equal(one[0], apart[0]) and torch.equal(one[1], apart[1])
        for name in ("ring_lo", "sorted_lo", "ring_hi", "sorted_hi", "filled", "head"):
            mine, theirs = getattr(one[2], name), getattr(apart[2], name)
            assert torch.equal(mine, theirs) if isinstance(mine, torch.Tensor) else mine == theirs, name
        after = (knots, window.ring_lo, window.sorted_lo, group.counts, group.gmin)
        assert all(torch.equal(a, b) for a, b in zip(state, after))
        x[0, 1, 2] = float("nan")
        assert native.large(x, images, pre, knots, source, table, window, group, 0.3, weights, 5, cells) is None
    with pytest.raises(ValueError, match="tail weights"):
        native.large(x, images, pre, knots, source, table, window, group, 0.3, torch.ones(w + 1, dtype=torch.float64),
                     5, cells)
    # target="robust"'s form: a batch counted already, into an empty group (None), here all of it above 0 and
    # below the knots' start, so the group's extremes set where its histogram begins
    x = torch.rand(images * rows, c, width, generator=g) + 0.5
    knots = (source + 10).contiguous()
    native.tables(knots, source, table)
    counted = native.scan(x, images, None, knots, source, table, COUNT, 5, cells)
    args = (x, images, None, knots, source, grid, window, None, counted.counts, counted.lo, counted.hi, 0.6, weights, 5,
            cells)
    none, empty = native.merge_map(*args), native.merge_map(*args[:7], PendingGroup.empty(c, cells), *args[8:])
    apart = StreamKernels.merge_map(native, *args)
    assert torch.equal(none[1], empty[1]) and torch.equal(none[1], apart[1]) and torch.equal(none[0], apart[0])


@needs_kernels
def test_sizes_and_counters_out_of_bounds_are_refused() -> None:
    native = NativeStreamKernels(LIB)
    c, k = 3, 11
    knots = torch.linspace(-1, 1, k).expand(c, k).contiguous()
    table = StreamTable.empty(c, 8)
    native.tables(knots, knots, table)
    with pytest.raises(ValueError, match="cannot hold 3 images"):
        native.scan(torch.zeros(4, c, 5), 3, None, knots, knots, table, MAP, 5, 8)
    with pytest.raises(ValueError, match="channels"):
        native.scan(torch.zeros(4, c + 1, 5), 2, None, knots, knots, table, MAP, 5, 8)
    with pytest.raises(ValueError, match="PAIRED with it"):  # the even and odd images' sums of per-image counts only
        native.scan(torch.zeros(4, c, 5), 2, None, knots, knots, table, COUNT | PAIRED, 5, 8)
    window = TailWindow.empty(c, 4)
    window.head = 2  # a window that is not full must have its head at its end
    with pytest.raises(NativeKernelError, match="out of bounds"):
        native.push(window, None, None, torch.zeros(1, c), torch.zeros(1, c))
    window = TailWindow.empty(c, 4)
    with pytest.raises(ValueError, match="tail weights"):
        native.tails(window, torch.ones(2, dtype=torch.float64))
    lib = native.lib
    structs = lib.structs
    assert lib.aqr_stream_merge(structs["aqr_stream_merge_args"].of(
        C=c, K=k, kn=knots.data_ptr(), counts=None, GC=8, gmin=None, gmax=None, w=1.5,
        p0=knots[:, 0].contiguous().data_ptr(), p100=knots[:, -1].contiguous().data_ptr()), 1) == -2  # a weight outside [0, 1]
    assert lib.aqr_stream_tables(structs["aqr_stream_tables_args"].of(
        C=c, K=2, kn=knots.data_ptr(), sq=knots.data_ptr(), G=8, pairs=table.pairs.data_ptr(), glo=table.glo.data_ptr(),
        ginv=table.ginv.data_ptr()), 1) == -2  # K < 3
    x, counts, lo, hi = torch.zeros(2, c, 5), torch.zeros(2, c, 12, dtype=torch.int32), torch.zeros(2, c), torch.zeros(2, c)

    def scan(y: torch.Tensor | None, mode: int) -> int:
        return lib.aqr_stream_scan(structs["aqr_stream_scan_args"].of(
            x=x.data_ptr(), y=None if y is None else y.data_ptr(), A=2, C=c, B=5, N=2, pre_scale=None, pre_shift=None,
            K=k, kn=knots.data_ptr(), sq=knots.data_ptr(), pairs=table.pairs.data_ptr(), G=8, glo=table.glo.data_ptr(),
            ginv=table.ginv.data_ptr(), stride=5, GC=8, counts=counts.data_ptr(), lo=lo.data_ptr(), hi=hi.data_ptr(),
            mode=mode), 1)

    for mode in (COUNT | PAIRED, MAP | PAIRED, 32):  # PAIRED without IMAGE_COUNT, a mode out of range (16: ROWS)
        assert scan(x, mode) == -2, mode
    groups = torch.zeros(2, c, k)
    assert lib.aqr_stream_mixture(2, c, k, groups.data_ptr(), None, 1, knots.data_ptr(), 1) == -2  # a grid of one point
    assert lib.aqr_stream_mixture(0, c, k, groups.data_ptr(), None, 8, knots.data_ptr(), 1) == -2  # no group
    assert lib.aqr_stream_mixture(2, 1 << 60, k, groups.data_ptr(), None, 8, knots.data_ptr(), 1) == -2  # sizes overflow
    for bad in ([0.0, 0.0], [1.0, -0.5], [1.0, float("nan")], [float("inf"), 1.0], [1e308, 1e308]):
        w = torch.tensor(bad, dtype=torch.float64)  # all 0, negative, NaN, Inf, a sum that overflows
        assert lib.aqr_stream_mixture(2, c, k, groups.data_ptr(), w.data_ptr(), 8, knots.data_ptr(), 1) == -2, bad
    groups[1, 0, 3] = float("nan")
    assert lib.aqr_stream_mixture(2, c, k, groups.data_ptr(), None, 8, knots.data_ptr(), 1) == -2  # a NaN knot
    rows = torch.zeros(c, k)
    weights = torch.tensor([0.5, 1.5, 0.5], dtype=torch.float64)  # a weight outside [0, 1]
    empty = torch.zeros(c, 12, dtype=torch.int32)
    assert lib.aqr_stream_group_merge(structs["aqr_stream_group_merge_args"].of(
        R=c, K=k, gk=rows.data_ptr(), bk=knots.data_ptr(), counts=empty.data_ptr(), GC=8,
        gmin=rows[:, 0].contiguous().data_ptr(), gmax=rows[:, 0].contiguous().data_ptr(), w=weights.data_ptr()), 1) == -2
    out = torch.zeros(2, dtype=torch.float64)
    hist = torch.zeros(4, c, 12, dtype=torch.int32)
    shift = lib.aqr_stream_shift_distances
    assert shift(4, c, k, knots.data_ptr(), hist.data_ptr(), 8, out.data_ptr()) == 0  # nothing counted
    assert shift(0, c, k, knots.data_ptr(), hist.data_ptr(), 8, out.data_ptr()) == -2  # no image
    assert shift(4, c, k, knots.data_ptr(), hist.data_ptr(), 0, out.data_ptr()) == -2  # no cell
    assert shift(1 << 40, 1 << 20, k, knots.data_ptr(), hist.data_ptr(), 8, out.data_ptr()) == -2  # sizes overflow
    assert shift(4, c, k, knots.data_ptr(), hist.data_ptr(), 8, None) == -2
    nan_knots = knots.clone()
    nan_knots[2, 5] = float("nan")
    assert shift(4, c, k, nan_knots.data_ptr(), hist.data_ptr(), 8, out.data_ptr()) == -2  # a NaN knot
    for mode in (COUNT | IMAGE_COUNT, 8, -1):  # both counts at once, or no such mode
        assert scan(None, mode) == -2, mode
    # target="mixed": a cluster index at or past the clusters, a blend outside [0, 1], a missing state address
    states = [(knots, table), (knots, table)]
    y = torch.zeros(2, c, 5)
    with pytest.raises(ValueError, match="not below 2"):
        native.cluster_scan(x, 2, None, knots, torch.tensor([0, 2]), states, [True, True], 0.3, y, 5, 8)
    with pytest.raises(ValueError, match="blend"):
        native.cluster_scan(x, 2, None, knots, torch.tensor([0, 1]), states, [True, True], 1.5, y, 5, 8)
    pairs = [[t.data_ptr() for t in (knots, table.pairs, table.glo, table.ginv)]] * 2
    flags = torch.ones(2, dtype=torch.int32)

    def cluster_scan(of: list[int], addresses: list[list[int]], blend: float = 0.3) -> int:
        of_t, at = torch.tensor(of), torch.tensor(addresses, dtype=torch.int64)
        return lib.aqr_stream_cluster_scan(structs["aqr_stream_cluster_scan_args"].of(
            x=x.data_ptr(), y=y.data_ptr(), A=2, C=c, B=5, N=2, pre_scale=None, pre_shift=None, K=k,
            sq=knots.data_ptr(), G=8, stride=5, GC=8, M=2, cluster=of_t.data_ptr(), states=at.data_ptr(),
            maps=flags.data_ptr(), blend=blend, counts=hist.data_ptr(), lo=lo.data_ptr(), hi=hi.data_ptr()), 1)

    assert cluster_scan([0, -1], pairs) == 0
    assert cluster_scan([0, 2], pairs) == -2 and cluster_scan([0, 1], pairs, blend=float("nan")) == -2
    assert cluster_scan([0, 1], [pairs[0], [pairs[0][0], 0, *pairs[0][2:]]]) == -2
    window, group = TailWindow.empty(c, 4), PendingGroup.empty(c, 8)
    with pytest.raises(ValueError, match="not below 1"):
        native.cluster_push(torch.tensor([0, 1]), lo, hi, hist[:1], [(window, group)])
    buffers = [[t.data_ptr() for t in (group.counts, group.gmin, group.gmax, window.ring_lo, window.sorted_lo,
                                       window.ring_hi, window.sorted_hi)]]
    counters = torch.zeros(1, dtype=torch.int64)

    def cluster_push(of: list[int], addresses: list[list[int]]) -> int:
        of_t, at = torch.tensor(of), torch.tensor(addresses, dtype=torch.int64)
        return lib.aqr_stream_cluster_push(structs["aqr_stream_cluster_push_args"].of(
            C=c, bins=12, W=4, M=1, N=2, cluster=of_t.data_ptr(), lo=lo.data_ptr(), hi=hi.data_ptr(),
            counts=hist.data_ptr(), states=at.data_ptr(), filled=counters.data_ptr(), head=counters.data_ptr()), 1)

    assert cluster_push([0, 1], buffers) == -2 and cluster_push([0, -1], [[0, *buffers[0][1:]]]) == -2
    assert cluster_push([0, -1], buffers) == 0


@needs_kernels
@pytest.mark.parametrize("size", [9, 128, 512, 513, 700])
def test_the_sorted_window_is_the_sorted_ring_one_image_at_a_time(size: int) -> None:
    """Images pushed one at a time into a window, past full (each replaces the oldest in the sorted copies in
    place: ranks counted up to 512 entries, found by halving beyond), with ties: the copies stay the ring
    sorted, as the torch mirror sorts it, bit for bit."""
    native, mirror = NativeStreamKernels(LIB), TorchStreamKernels()
    c = 3
    windows = [TailWindow.empty(c, size) for _ in range(2)]
    g = torch.Generator().manual_seed(size)
    for _ in range(size + 200):
        lo = (torch.randn(1, c, generator=g) * 4).round() / 4 + 0.0  # ties (and no -0.0)
        hi = lo + torch.rand(1, c, generator=g).round()
        native.push(windows[0], None, None, lo, hi)
        mirror.push(windows[1], None, None, lo, hi)
    for name in ("ring_lo", "sorted_lo", "ring_hi", "sorted_hi"):
        assert torch.equal(getattr(windows[0], name), getattr(windows[1], name)), name
    assert (windows[0].filled, windows[0].head) == (windows[1].filled, windows[1].head) == (size, 200 % size)


@needs_kernels
def test_a_bound_commit_refuses_a_stage_that_is_not_one_block_of_its_size() -> None:
    """The C side reads a stage (and the next scan writes it) as one contiguous float32 block of the batch's
    size: another size, an expanded (one-value) tensor or float64 is refused, the state unchanged."""
    native = NativeStreamKernels(LIB)
    c, k, cells = 3, 11, 8
    knots = torch.linspace(-1, 1, k).expand(c, k).contiguous()
    table = StreamTable.empty(c, 8)
    native.tables(knots, knots, table)
    window, group = TailWindow.empty(c, 4), PendingGroup.empty(c, cells)
    bound = native.bind(knots.clone(), knots, table, window, group, 5, cells)
    _, stage, finite = bound.map_count(torch.randn(1, c, 7), 1, (torch.ones(c), torch.zeros(c)))
    assert finite
    for bad in (stage[:-1], torch.zeros(1).expand(stage.numel()), stage.double()):
        with pytest.raises(ValueError, match="one contiguous float32 CPU block"):
            bound.commit(bad, 1, None)
    assert window.filled == 0 and int(group.counts.sum()) == 0
    bound.commit(stage, 1, None)
    assert window.filled == 1 and int(group.counts.sum()) > 0


@needs_kernels
def test_a_bound_scan_of_a_channels_last_batch_maps_it_as_the_contiguous_one() -> None:
    """Another layout than contiguous is copied before the bound scan: the same map (in the contiguous layout)
    and the same stage."""
    native = NativeStreamKernels(LIB)
    c, k, cells = 4, 11, 8
    knots = torch.linspace(-2, 2, k).expand(c, k).contiguous()
    table = StreamTable.empty(c, 8)
    native.tables(knots, knots * 0.5, table)
    x = torch.randn(2, c, 3, 5, generator=torch.Generator().manual_seed(3))
    outs = []
    for t in (x, x.contiguous(memory_format=torch.channels_last)):
        bound = native.bind(knots.clone(), knots * 0.5, table, TailWindow.empty(c, 4), PendingGroup.empty(c, cells),
                            5, cells)
        outs.append(bound.map_count(t, 2, (torch.ones(c), torch.zeros(c))))
    (y, stage, finite), (y_cl, stage_cl, finite_cl) = outs
    assert finite and finite_cl and y_cl.shape == x.shape
    assert torch.equal(y_cl, y) and torch.equal(stage_cl, stage)


@pytest.mark.slow
@needs_kernels
def test_stream_fuzz_under_address_and_undefined_behaviour_sanitizers() -> None:
    run_sanitized("stream_fuzz.py", 150, "sanitized stream fuzz passed")
