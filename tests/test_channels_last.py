"""Layer outputs laid out channels-last (``torch.channels_last``: the channels the fastest axis, what a
permuted NHWC array gives): aqr's C kernels read and write them in place of their ``(positions, C)`` rows,
with the bits of the contiguous layout, and the output keeps the input's layout."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import aqr
from aqr.backends import LayerSource, NativeBackend, SubsetCache, TorchBackend, build
from aqr.backends.native import channels_last_rows, subset_quantiles

LIB, WHY = build.load_kernels()
needs_kernels = pytest.mark.skipif(LIB is None, reason=f"aqr's C kernels unavailable: {WHY}")
CL = torch.channels_last


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _layer_output(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A layer output with a heavy-tailed channel, a channel of ties (marked cells) and a constant one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 1.7 - 0.2
    x[:, 0] = torch.distributions.StudentT(1.3).sample(x[:, 0].shape)
    x[:, 1] = (x[:, 1] * 2).round()
    x[:, 2] = 0.75
    return x


def _backend(c: int, tail: str, samples: int, seed: int) -> NativeBackend:
    g = torch.Generator().manual_seed(seed)
    source = LayerSource.create(torch.randn(c, 21, generator=g).sort(1).values, tail, torch.randn(c, generator=g),
                                torch.rand(c, generator=g) + 0.2, 0.01, 256)
    subsets = SubsetCache(samples, 4)
    return NativeBackend(source, subsets, LIB, TorchBackend(source, subsets, compile=False))


@needs_kernels
@pytest.mark.parametrize("tail", aqr.TAILS)
@pytest.mark.parametrize("shape, samples", [((6, 16, 8, 8), 128), ((3, 13, 5, 7), 8192), ((2, 24, 4, 4), 8192),
                                            ((5, 9, 3, 2), 16), ((3, 40, 8, 8), 512), ((2, 37, 5, 3), 8192)],
                         ids=["sampled", "odd-channels", "every", "rows", "tiled", "tiled-odd"])
def test_channels_last_outputs_map_to_the_contiguous_layouts_bits(tail, shape, samples):
    """Sampled or every position, 8+ channels or not, 32+ (mapped in tiles of rows) or not, with a folded
    affine or not: the same bits, in ``torch.channels_last``."""
    x = _layer_output(shape, 3)
    backend = _backend(shape[1], tail, samples, 4)
    g = torch.Generator().manual_seed(5)
    for pre in (None, (torch.randn(shape[1], generator=g), torch.randn(shape[1], generator=g))):
        want, finite_want = backend.recalibrate_output(x, 1, pre)
        got, finite_got = backend.recalibrate_output(x.contiguous(memory_format=CL), 1, pre)
        assert bool(finite_got) and bool(finite_want)
        assert got.is_contiguous(memory_format=CL) and got.shape == x.shape
        assert torch.equal(_bits(got), _bits(want))


@needs_kernels
def test_a_nonfinite_channels_last_output_is_reported_and_left_as_it_is():
    x = _layer_output((4, 10, 6, 6), 6)
    x[3, 7, 5, 1] = float("nan")
    strided = x.contiguous(memory_format=CL)
    y, finite = _backend(10, "standard", 64, 7).recalibrate_output(strided, 1)
    assert not bool(finite) and y is strided


def test_only_channels_fastest_layouts_are_read_as_rows():
    x = torch.randn(2, 5, 3, 4)
    assert channels_last_rows(x) is None
    assert channels_last_rows(x.contiguous(memory_format=CL)).shape == (24, 5, 1)
    assert channels_last_rows(x.permute(0, 1, 3, 2)) is None  # channels not the fastest axis
    assert channels_last_rows(x.contiguous(memory_format=CL)[:, :, :, :2]) is None  # a slice: not one block
    assert channels_last_rows(torch.randn(2, 5, 3, 4, 6).contiguous(memory_format=torch.channels_last_3d)) is not None


@needs_kernels
def test_the_strided_rows_sample_gives_the_portable_builds_knots():
    """The AVX2 build gathers a channels-last sample eight rows by eight channels at a time: the scalar
    build's knots exactly, with channels not a multiple of eight and a folded affine."""
    command = build.compile_command()
    if "-mavx2" not in command:
        pytest.skip("no AVX2 build on this CPU")
    portable = build.load([arg for arg in command if arg not in ("-mavx2", "-mfma")])
    for shape in [(40, 13, 6, 6), (7, 24, 9, 5)]:
        x = _layer_output(shape, 8).contiguous(memory_format=CL)
        rows = channels_last_rows(x)
        g = torch.Generator().manual_seed(9)
        pre = (torch.randn(shape[1], generator=g), torch.randn(shape[1], generator=g))
        positions = SubsetCache(300).strided_positions(x.view(shape[0], shape[1], -1))
        knots = [subset_quantiles(lib, rows, positions, 21, True, pre) for lib in (LIB, portable)]
        for got, want in zip(knots[0][:3], knots[1][:3]):
            assert torch.equal(got, want)


def _bn_model(c: int = 12, side: int = 6) -> nn.Module:
    torch.manual_seed(10)
    model = nn.Sequential(nn.BatchNorm2d(c), nn.ReLU(), nn.BatchNorm2d(c), nn.Flatten(), nn.Linear(c * side * side, 10))
    with torch.no_grad():
        for bn in (model[0], model[2]):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.uniform_(-1.5, 1.5)
            bn.bias.uniform_(-0.3, 0.3)
    return model.eval()


@needs_kernels
@pytest.mark.parametrize("target", ["batch", "stream", "robust"])
def test_aqr_on_channels_last_images_gives_the_contiguous_images_logits(target):
    """A model of BatchNorms (folded into the maps) and a linear head: the logits of every batch in a
    stream, bit for bit, whether the images come contiguous or channels-last, small batches and large."""
    model = _bn_model()
    g = torch.Generator().manual_seed(11)
    stats = aqr.calibrate(model, [torch.randn(32, 12, 6, 6, generator=g) for _ in range(4)])
    layouts = [aqr.AQR(model, stats, target=target) for _ in range(2)]
    for size in (1, 3, 1, 40, 2, 64, 1):
        x = torch.randn(size, 12, 6, 6, generator=g) * 1.4 + 0.3
        want = layouts[0](x)
        got = layouts[1](x.contiguous(memory_format=CL))
        assert torch.equal(_bits(got), _bits(want)), f"batch of {size}"


@needs_kernels
def test_rows_of_many_channels_map_in_tiles_to_the_bits_of_fewer_channels():
    """Rows of 32+ channels are mapped in tiles (transposed in cache), rows of fewer one row at a time with
    every channel's table: each channel's map is its own, so the 40 channels mapped at once give the bits of
    the same channels mapped 20 at a time (contiguous ``(A, C, 1)`` rows, as a transformer's layers give)."""
    from aqr.backends.base import Targets
    from aqr.backends.native import table_map

    g = torch.Generator().manual_seed(13)
    x = _layer_output((333, 40, 1), 14)
    x[5, 7, 0], x[9, 33, 0] = float("nan"), float("inf")  # mapped value by value, in both
    tq = torch.randn(40, 21, generator=g).sort(1).values
    tq[3, 5:9] = tq[3, 5]  # tied knots: marked cells
    source = LayerSource.create(torch.randn(40, 21, generator=g).sort(1).values, "gaussian", torch.randn(40, generator=g),
                                torch.rand(40, generator=g) + 0.2, 0.01, 256)
    mean, std = torch.randn(40, 1, generator=g), torch.rand(40, 1, generator=g) + 0.5
    pre = (torch.randn(40, generator=g), torch.randn(40, generator=g))
    whole = table_map(LIB, x, Targets(tq, mean, std, torch.tensor(True)), source, pre)
    parts = []
    for c in (slice(0, 20), slice(20, 40)):
        part = LayerSource.create(source.knots[c], "gaussian", source.loc[c], source.scale[c], 0.01, 256)
        parts.append(table_map(LIB, x[:, c].contiguous(), Targets(tq[c], mean[c], std[c], torch.tensor(True)), part,
                               (pre[0][c].contiguous(), pre[1][c].contiguous())))
    assert torch.equal(_bits(whole), _bits(torch.cat(parts, 1)))


class _Layout(nn.Module):
    """The identity, noting whether each input it sees is channels-last."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.is_contiguous(memory_format=CL) and not x.is_contiguous())
        return x


@needs_kernels
@pytest.mark.parametrize("target", ["stream", "robust"])
def test_streaming_maps_of_large_batches_keep_the_channels_last_layout(target):
    """The general step (batches of ``rebuild_every`` images or more, and every batch of robust AQR's) reads a
    channels-last layer output in place and writes its map in that layout (the next convolution runs on it as
    in the plain model), with the contiguous images' logits bit for bit, between small steps (which copy it)."""
    model = _bn_model()
    model.insert(1, _Layout())
    g = torch.Generator().manual_seed(15)
    stats = aqr.calibrate(model, [torch.randn(32, 12, 6, 6, generator=g) for _ in range(4)])
    layouts = [aqr.AQR(model, stats, target=target, rebuild_every=8) for _ in range(2)]
    probe = next(m for m in layouts[1]._twin.modules() if isinstance(m, _Layout))
    for size in (16, 8, 1, 40, 3, 9, 1):
        x = torch.randn(size, 12, 6, 6, generator=g) * 1.4 + 0.3
        want = layouts[0](x)
        probe.seen.clear()
        got = layouts[1](x.contiguous(memory_format=CL))
        if size >= 8 or target == "robust":
            assert probe.seen == [True], f"batch of {size}: the first map's output is not channels-last"
        assert torch.equal(_bits(got), _bits(want)), f"batch of {size}"
