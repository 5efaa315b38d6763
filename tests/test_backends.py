"""The backend interface (aqr.backends): one object per layer, the same results from each backend."""

from __future__ import annotations

import pytest
import torch

from aqr.backends import LayerSource, NativeBackend, SubsetCache, TorchBackend, build, choose_backend
from aqr.core.qmap import TAILS, quantile_map

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
    """With its own target knots, each backend's map is the reference map up to the table's grid (on
    the continuous channels; around tied knots the table interpolates across the map's jumps)."""
    source, x = _source(tail, cells=4096), _batch()
    rows = x.transpose(0, 1).reshape(5, -1)
    continuous = [0, 3, 4]
    for backend in _backends(source, SubsetCache(x.shape[0] * x.shape[2])):
        targets = backend.target_knots(x)
        want = quantile_map(rows, source.knots, targets.knots, tail, source_loc=source.loc,
                            source_scale=source.scale, gaussian_p=0.01).reshape(5, x.shape[0], -1).transpose(0, 1)
        y = backend.recalibrate(x)[0]
        torch.testing.assert_close(y[:, continuous], want[:, continuous], atol=2e-3, rtol=2e-3, msg=backend.name)


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
