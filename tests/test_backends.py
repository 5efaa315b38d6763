"""The backend interface (aqr.backends): one object per layer, the same results from each backend."""

from __future__ import annotations

import pytest
import torch

from aqr.backends import LayerSource, NativeBackend, SubsetCache, Targets, TorchBackend, build, choose_backend
from aqr.core.qmap import TAILS, channel_quantiles, quantile_map

LIB, WHY = build.load_kernels()
needs_kernels = pytest.mark.skipif(LIB is None, reason=f"aqr's C kernels unavailable: {WHY}")


def _source(tail: str, c: int = 5, k: int = 21, cells: int = 128) -> LayerSource:
    g = torch.Generator().manual_seed(11)
    sq = torch.randn(c, 5000, generator=g).sort(1).values[:, torch.linspace(0, 4999, k).long()]
    return LayerSource.create(sq, tail, torch.randn(c, generator=g) * 0.1, torch.rand(c, generator=g) + 0.5, 0.01, cells)


def _batch(shape: tuple[int, int, int] = (16, 5, 120), seed: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 1.7 + 0.4
    x[:, 1] = x[:, 1].round()  # tied knots
    x[:, 2] = -1.0  # a constant channel
    return x


def _backends(source: LayerSource, subsets: SubsetCache) -> list:
    found = [TorchBackend(source, subsets, compile=False)]
    if LIB is not None:
        found.append(NativeBackend(source, subsets, LIB, found[0]))
    return found


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("shape", [(16, 5, 120), (300, 5, 1)])
def test_target_knots_then_apply_is_recalibrate(tail, shape):
    source, x = _source(tail), _batch(shape)
    for backend in _backends(source, SubsetCache(512)):
        targets = backend.target_knots(x)
        assert targets.knots.shape == (5, 21) and bool(targets.finite)
        assert (targets.mean is not None) == (tail in ("interval", "gaussian"))
        y, finite = backend.recalibrate(x)
        assert bool(finite)
        torch.testing.assert_close(backend.apply(x, targets), y, atol=0, rtol=0, msg=backend.name)


@pytest.mark.parametrize("tail", TAILS)
def test_each_backend_follows_the_reference_map_with_its_knots(tail):
    """With its own target knots, each backend's map is the reference map up to the table's grid, on
    every channel: around tied knots (channel 1) and on a constant channel (2) too."""
    source, x = _source(tail, cells=4096), _batch()
    rows = x.transpose(0, 1).reshape(5, -1)
    for backend in _backends(source, SubsetCache(x.shape[0] * x.shape[2])):
        targets = backend.target_knots(x)
        want = quantile_map(rows, source.knots, targets.knots, tail, source_loc=source.loc,
                            source_scale=source.scale, gaussian_p=0.01).reshape(5, x.shape[0], -1).transpose(0, 1)
        y = backend.recalibrate(x)[0]
        torch.testing.assert_close(y, want, atol=2e-3, rtol=2e-3, msg=backend.name)


def _tied_batch(shape: tuple[int, int, int], tie: float = 0.3, seed: int = 21) -> torch.Tensor:
    """Gaussian channels; in channel 0, 30 % of the values (spread over the batch) equal ``tie``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    channel = x[:, 0].reshape(-1)
    channel[torch.randperm(channel.numel(), generator=g)[: channel.numel() * 3 // 10]] = tie
    x[:, 0] = channel.reshape(x[:, 0].shape)
    return x


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("shape", [(32, 3, 64), (2000, 3, 1)])  # channel-major and channels-last
def test_tied_values_and_their_neighbours_follow_the_tie_rule(tail, shape):
    """A value equal to a run of tied target knots maps to the source at the run's middle level, as in
    the exact map; values within a cell of it follow the exact map too (a table that draws a line
    across the jump is 0.18 source std off on the tie and 1.3 beside it)."""
    tie = 0.3
    source, x = _source(tail, c=3, k=101, cells=1024), _tied_batch(shape, tie)
    rows = x.transpose(0, 1).reshape(3, -1)
    tq = channel_quantiles(rows, 101, dim=0)
    run = (tq[0] == tie).nonzero().squeeze(1)
    assert len(run) > 20 and 1 < run[0] and run[-1] < 98  # a long run of tied inner knots
    # probe values: every tenth value of channel 0 moved to within two table cells of the tie
    cell = float(tq[0, 98] - tq[0, 1]) / 1024
    channel = x[:, 0].reshape(-1).clone()
    g = torch.Generator().manual_seed(22)
    channel[::10] = tie + (torch.rand(channel[::10].shape, generator=g) - 0.5) * 4 * cell
    x[:, 0] = channel.reshape(x[:, 0].shape)
    probe = x.transpose(0, 1).reshape(3, -1)
    var, mean = torch.var_mean(probe.double(), dim=1, correction=0, keepdim=True)  # as the reference's tails
    targets = Targets(tq, mean.float(), var.sqrt().float(), torch.tensor(True))
    want = quantile_map(probe, source.knots, tq, tail, source_loc=source.loc, source_scale=source.scale,
                        gaussian_p=0.01).reshape(3, shape[0], shape[2]).transpose(0, 1)
    level = (run[0] + run[-1]) / 2  # the documented rule, spelled out
    low = int(level)
    middle = source.knots[0, low] + (source.knots[0, low + 1] - source.knots[0, low]) * (level - low)
    at_tie, close_by = x[:, 0] == tie, ((x[:, 0] - tie).abs() < cell) & (x[:, 0] != tie)
    assert int(at_tie.sum()) > 100 and int(close_by.sum()) > 50
    for backend in _backends(source, SubsetCache(8192)):
        got = backend.apply(x, targets)
        torch.testing.assert_close(got[:, 0][at_tie], middle.expand(int(at_tie.sum())), atol=1e-5, rtol=1e-5,
                                   msg=backend.name)
        torch.testing.assert_close(got[:, 0][at_tie], want[:, 0][at_tie], atol=1e-5, rtol=1e-5, msg=backend.name)
        torch.testing.assert_close(got[:, 0][close_by], want[:, 0][close_by], atol=1e-5, rtol=1e-5, msg=backend.name)
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3, msg=backend.name)  # and everywhere else


def test_pre_maps_the_affine_output_in_every_backend():
    source, x = _source("average"), _batch()
    g = torch.Generator().manual_seed(13)
    pre = (torch.randn(5, generator=g), torch.randn(5, generator=g))  # negative scales reverse the order
    shifted = x * pre[0].view(1, -1, 1) + pre[1].view(1, -1, 1)
    for backend in _backends(source, SubsetCache(8192)):
        want, _ = backend.recalibrate(shifted)
        got, finite = backend.recalibrate(x.contiguous(), pre)
        assert bool(finite)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=backend.name)


def test_targets_from_elsewhere_are_applied_as_given():
    """A caller may bring its own target knots (e.g. running estimates): apply uses them, not the batch's."""
    source = _source("standard")
    x, other = _batch(seed=1), _batch(seed=2) * 2.0
    for backend in _backends(source, SubsetCache(8192)):
        theirs = backend.target_knots(other)
        mapped = backend.apply(x, theirs)
        assert not torch.equal(mapped, backend.recalibrate(x)[0])
        torch.testing.assert_close(mapped, backend.apply(x.clone(), theirs), msg=backend.name)


def test_layer_source_checks_what_the_tail_reads():
    sq = torch.randn(3, 11).sort(1).values
    with pytest.raises(ValueError, match="unknown tail"):
        LayerSource.create(sq, "median", None, None, 0.01, 16)
    with pytest.raises(ValueError, match="gaussian"):
        LayerSource.create(sq, "gaussian", None, torch.ones(3), 0.01, 16)
    with pytest.raises(ValueError, match="cell"):
        LayerSource.create(sq, "standard", None, None, 0.01, 0)
    source = LayerSource.create(sq.double(), "gaussian", torch.zeros(3, 1), torch.ones(3, 1), 0.01, 16)
    assert source.knots.dtype == torch.float32 and source.loc.shape == (3,) and source.z is not None
    assert LayerSource.create(sq, "clip", None, None, 0.01, 16).z is None


def test_choose_backend_once_per_layer_and_device():
    source = _source("standard")
    assert isinstance(choose_backend(source, SubsetCache(64), native=False), TorchBackend)
    backend = choose_backend(source, SubsetCache(64))
    assert isinstance(backend, NativeBackend if LIB is not None else TorchBackend)


def test_a_tail_the_triton_kernels_lack_runs_in_torch(monkeypatch):
    from aqr.backends import TRITON_TAILS, triton_backend
    from aqr.backends.base import TAIL_CODES

    class FakeTriton:  # stands in for the kernels, which need triton and a GPU
        def __init__(self, source, subsets, fallback) -> None:
            self.source = source

    monkeypatch.setattr(triton_backend, "available", lambda device: True)
    monkeypatch.setattr(triton_backend, "TritonBackend", FakeTriton)
    assert max(TAIL_CODES[t] for t in TRITON_TAILS) == 4 and set(TAILS) - set(TRITON_TAILS) == {"clip-source"}
    for tail in TAILS:
        backend = choose_backend(_source(tail), SubsetCache(64), native=False, triton=True, compile=False)
        assert isinstance(backend, FakeTriton if tail in TRITON_TAILS else TorchBackend), tail


@needs_kernels
def test_native_backend_hands_what_it_cannot_take_to_torch():
    source = _source("standard")
    subsets = SubsetCache(8192)
    native = NativeBackend(source, subsets, LIB, TorchBackend(source, subsets, compile=False))
    x = _batch()
    assert native.folds(x) and not native.folds(x.double())
    y64, finite = native.recalibrate(x.double())
    assert y64.dtype == torch.float64 and bool(finite)
    torch.testing.assert_close(y64, native.fallback.recalibrate(x.double())[0])
    with pytest.raises(ValueError, match="CPU"):
        NativeBackend(source.to("meta"), subsets, LIB, native.fallback)


def test_the_sample_grows_with_the_batch() -> None:
    grow, fixed = SubsetCache(8192, 64), SubsetCache(8192)
    # ResNet-20's first layers at batch 128 and 512 (32 x 32 positions), its last at batch 512 (8 x 8)
    assert grow.count(128, 128 * 1024) == fixed.count(128, 128 * 1024) == 8192
    assert grow.count(512, 512 * 1024) == 32768 and fixed.count(512, 512 * 1024) == 8192
    assert grow.count(512, 512 * 64) == 512 * 64  # every position, as at batch 128
    assert grow.count(4, 10) == 10
    x = torch.randn(512, 3, 256)
    assert grow.positions(x).shape == (32768,) and fixed.positions(x).shape == (8192,)
    assert torch.equal(grow.positions(x), torch.unique(grow.positions(x)))  # sorted, no repeats
    # within one shape the draw is fixed, and at or below the floor both rules draw the same positions
    assert torch.equal(grow.positions(x), SubsetCache(8192, 64).positions(x))
    small = torch.randn(128, 3, 256)
    assert torch.equal(grow.positions(small), fixed.positions(small))
    with pytest.raises(ValueError, match="per_row"):
        SubsetCache(8192, -1)
