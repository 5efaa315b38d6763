"""aqr's C kernels (aqr.backends.native, built by aqr.backends.build): quantiles within one histogram
bucket of the sorted sample, the map equal to the torch backend's, the BatchNorm fold, and the
fallback when no compiler is found."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import aqr
from aqr.backends import LayerSource, SubsetCache, Targets, TorchBackend, build, choose_backend, native
from aqr.core.qmap import sort_rows, sorted_quantiles
from tests.native_fuzz import has_wide_lookup, lookup

LIB, WHY = build.load_kernels()
needs_kernels = pytest.mark.skipif(LIB is None, reason=f"aqr's C kernels unavailable: {WHY}")


def _sample(x: torch.Tensor, size: int = 8192) -> tuple[SubsetCache, torch.Tensor]:
    cache = SubsetCache(size)
    return cache, torch.take(x, cache.offsets(x))


def _targets(tq: torch.Tensor, mean: torch.Tensor | None = None, std: torch.Tensor | None = None) -> Targets:
    return Targets(tq, mean, std, torch.tensor(True))


@needs_kernels
@pytest.mark.parametrize("shape", [(128, 16, 1024), (64, 24, 1), (40, 12, 7), (3, 5, 200)])
def test_quantiles_within_one_bucket_of_the_sorted_sample(shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=g) * 3 + 1
    x[:, 1] = torch.distributions.StudentT(1.5).sample(x[:, 1].shape)  # heavy tails: outliers stretch the range
    cache, sample = _sample(x)
    want = sorted_quantiles(sort_rows(sample), 101)
    tq, mean, std, finite = native.subset_quantiles(LIB, x, cache.positions(x), 101)
    assert finite
    s = sample.shape[1]
    width = (sample.max(1).values - sample.min(1).values) / max(16, s // 2)
    inner = (tq - want)[:, 1:-1].abs()
    assert bool((inner <= width[:, None] * 1.001 + 1e-6).all())
    assert bool((tq.diff(dim=1) >= 0).all())
    assert torch.equal(tq[:, 0], x.amin((0, 2))) and torch.equal(tq[:, -1], x.amax((0, 2)))  # of every value
    torch.testing.assert_close(mean.squeeze(1), sample.mean(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(std.squeeze(1), sample.std(1, correction=0), atol=1e-5, rtol=1e-5)
    if s <= 512:  # small samples are sorted whole
        assert torch.equal(tq[:, 1:-1], want[:, 1:-1])
    if s == shape[0] * shape[2]:  # every position sampled
        assert torch.equal(tq[:, [0, -1]], want[:, [0, -1]])


@needs_kernels
def test_crowded_buckets_and_ties_are_exact():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 4, 256, generator=g)
    x[:, 0] = torch.randint(0, 3, (64, 256), generator=g).float()  # three values, heavily tied
    x[:, 1, :100] = 0.0  # a spike of zeros inside a continuous channel
    x[:, 2] = 7.0  # constant
    cache, sample = _sample(x)
    want = sorted_quantiles(sort_rows(sample), 101)
    tq = native.subset_quantiles(LIB, x, cache.positions(x), 101, moments=False)[0]
    assert torch.equal(tq[0], want[0]) and torch.equal(tq[2], want[2])
    zeros = want[1] == 0
    assert zeros.sum() > 10 and torch.equal(tq[1][zeros], want[1][zeros])


@needs_kernels
@pytest.mark.parametrize("at", [(5, 1, 7), (5, 1, 298), (31, 2, 299)], ids=["vectors", "row-tail", "last-row-tail"])
def test_nonfinite_values_are_reported_even_outside_the_sample(at):
    """Rows of 300 values: 296 read eight at a time, 4 one by one; a NaN or Inf in either part is found."""
    x = torch.randn(32, 3, 300)
    x[at] = float("nan")
    cache = SubsetCache(1000)  # 1,000 of 9,600 positions: the NaN is most likely not among them
    tq, _, _, finite = native.subset_quantiles(LIB, x, cache.positions(x), 11)
    others = [c for c in range(3) if c != at[1]]
    assert not finite and bool(tq[at[1]].isnan().all()) and bool(tq[others].isfinite().all())
    x[at] = float("inf")
    assert not native.subset_quantiles(LIB, x, cache.positions(x), 11)[3]


@needs_kernels
@pytest.mark.parametrize("tail", aqr.TAILS)
@pytest.mark.parametrize("shape", [(16, 6, 300), (500, 10, 1), (50, 9, 3)])
def test_native_map_equals_the_torch_path(tail, shape):
    """Given the same knots, the C table and map give the torch backend's values (both layouts)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g) * 2 + 1
    x[:, 0] = x[:, 0].round()  # tied knots
    x[:, 1] = 3.0  # constant channel
    c = shape[1]
    sq = torch.randn(c, 4000, generator=g).sort(1).values[:, torch.linspace(0, 3999, 21).long()]
    loc, scale = torch.randn(c, 1, generator=g) * 0.1, torch.rand(c, 1, generator=g) + 0.5
    cache, sample = _sample(x)
    tq = sorted_quantiles(sort_rows(sample), 21)
    mean, std = sample.mean(1, keepdim=True), sample.std(1, correction=0, keepdim=True)
    source = LayerSource.create(sq, tail, loc, scale, 0.01, 64)
    want = TorchBackend(source, cache, compile=False).apply(x, _targets(tq, mean, std))
    got = native.table_map(LIB, x, _targets(tq, mean, std), source)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


@needs_kernels
def test_the_avx512_lookups_map_exactly_as_the_avx2_lookups():
    """The table lookup chosen by timing when the kernels load changes no bit of any output: tied
    knots (marked cells), NaN and +-inf values, a folded affine, rows of 333 values (not a multiple of 16)."""
    if not has_wide_lookup(LIB):
        pytest.skip("this CPU (or build) has no AVX-512 lookups")
    g = torch.Generator().manual_seed(11)
    x = torch.randn(40, 6, 333, generator=g) * 2
    x[:, 0] = x[:, 0].round()  # tied target knots: marked cells, mapped value by value
    x[:, 1] = torch.distributions.StudentT(1.2).sample(x[:, 1].shape)
    pre = (torch.randn(6, generator=g), torch.randn(6, generator=g))
    cache = SubsetCache(2048)
    outputs = []
    for wide in (False, True):
        with lookup(LIB, wide):
            got = []
            for cells, tail in ((64, "average"), (1024, "standard"), (256, "gaussian")):
                sq = torch.randn(6, 4000, generator=torch.Generator().manual_seed(cells)).sort(1).values
                source = LayerSource.create(sq[:, torch.linspace(0, 3999, 101).long()], tail, torch.zeros(6, 1),
                                            torch.ones(6, 1), 0.01, cells)
                got.append(native.recalibrate(LIB, x, cache.positions(x), source, pre)[0])
                tq, mean, std, _ = native.subset_quantiles(LIB, x, cache.positions(x), 101)
                odd = x.clone()
                odd[0, 2, :5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30])
                got.append(native.table_map(LIB, odd, _targets(tq, mean, std), source, pre))
            outputs.append(got)
    for avx2, avx512 in zip(*outputs):
        torch.testing.assert_close(avx512, avx2, rtol=0, atol=0, equal_nan=True)


@needs_kernels
def test_a_sample_of_every_position_copies_the_rows_and_reads_the_same_knots():
    """Where the sample is every position in order, a channel's rows are copied instead of gathered:
    the knots equal those of the same positions shuffled (which are gathered one by one)."""
    g = torch.Generator().manual_seed(12)
    x = torch.randn(64, 5, 64, generator=g)
    x[:, 1] = x[:, 1].round()
    x[:, 4] = torch.distributions.StudentT(1.5).sample(x[:, 4].shape)
    pre = (torch.randn(5, generator=g), torch.randn(5, generator=g))
    every = SubsetCache(8192).positions(x)
    assert every.numel() == 64 * 64
    shuffled = every[torch.randperm(every.numel(), generator=g)]
    dense = native.subset_quantiles(LIB, x, every, 101, pre=pre)
    gathered = native.subset_quantiles(LIB, x, shuffled, 101, pre=pre)
    assert torch.equal(dense[0], gathered[0])
    torch.testing.assert_close(dense[1], gathered[1], rtol=1e-6, atol=1e-6)  # float64 sums in another order


@needs_kernels
def test_folded_affine_equals_mapping_the_affine_output():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 8, 100, generator=g)
    a, b = torch.randn(8, generator=g), torch.randn(8, generator=g)  # negative scales reverse the order
    y = x * a.view(1, -1, 1) + b.view(1, -1, 1)
    sq = torch.randn(8, 2000, generator=g).sort(1).values[:, torch.linspace(0, 1999, 101).long()]
    cache = SubsetCache(8192)
    tq_y = native.subset_quantiles(LIB, y, cache.positions(y), 101)[0]
    tq_x = native.subset_quantiles(LIB, x, cache.positions(x), 101, pre=(a, b))[0]
    torch.testing.assert_close(tq_x, tq_y, atol=1e-5, rtol=1e-5)
    source = LayerSource.create(sq, "average", None, None, 1e-3, 256)
    want = native.table_map(LIB, y, _targets(tq_y), source)
    got = native.table_map(LIB, x, _targets(tq_x), source, pre=(a, b))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


class _BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.bn_batch = nn.BatchNorm2d(8, track_running_stats=False)  # cannot be folded
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn_batch(self.bn(self.conv(x))))
        return self.head(h.mean((2, 3)))


def _bn_net() -> _BNNet:
    torch.manual_seed(5)
    net = _BNNet()
    with torch.no_grad():
        net.bn.running_mean.uniform_(-0.5, 0.5)
        net.bn.running_var.uniform_(0.5, 2.0)
        net.bn.weight.uniform_(-1.5, 1.5)
    return net.eval()


@needs_kernels
def test_batchnorm_fold_matches_the_hook_path_and_restores_the_model():
    net = _bn_net()
    stats = aqr.calibrate(net, [torch.rand(16, 3, 12, 12) for _ in range(4)])
    x = torch.rand(16, 3, 12, 12) * 1.3
    own_forward = net.bn_batch.forward
    folds = []  # whether each BatchNorm (AQR's copy of it, which the hooks are handed) folds while it runs
    for m in (net.bn, net.bn_batch):
        m.register_forward_pre_hook(lambda mod, _args: folds.append(mod.forward.layer_map.foldable(mod)))
    folded = aqr.AQR(net, stats)(x)
    assert folds == [True, False]  # the running-stats BN is folded, the batch-stats one mapped after it
    folds.clear()
    hooked = aqr.AQR(net, stats, native=False, compile=False)(x)  # (compiled or not alike: test_adapt.py)
    assert folds == [False, False]
    torch.testing.assert_close(folded, hooked, atol=1e-4, rtol=1e-4)
    assert "forward" not in net.bn.__dict__ and net.bn_batch.forward == own_forward
    net.bn.forward = own_user_forward = net.bn.forward  # an instance-level forward survives
    aqr.AQR(net, stats)(x)
    assert net.bn.__dict__["forward"] is own_user_forward


@needs_kernels
def test_folded_layer_nonfinite_policies():
    net = _bn_net()
    stats = aqr.calibrate(net, [torch.rand(16, 3, 12, 12) for _ in range(4)])
    x = torch.rand(16, 3, 12, 12)
    x[0, :, 3, 3] = float("nan")
    with pytest.raises(aqr.NonFiniteActivationError, match="'bn'"):
        aqr.AQR(net, stats)(x)
    with torch.no_grad():
        out = aqr.AQR(net, stats, on_nonfinite="skip")(x)
    assert out.shape == (16, 4)


def test_no_compiler_falls_back_to_torch_with_a_warning(monkeypatch):
    monkeypatch.setattr(build, "load_kernels", lambda: (None, "no C compiler found (set CC)"))
    monkeypatch.setattr(build, "_WARNED", set())
    x = torch.randn(8, 3, 50)
    one = torch.ones(3)
    source = LayerSource.create(torch.randn(3, 11).sort(1).values, "average", one, one, 0.01, 32)
    with pytest.warns(UserWarning, match="no C compiler"):
        backend = choose_backend(source, SubsetCache(400), compile=False)
    assert isinstance(backend, TorchBackend)
    y, finite = backend.recalibrate(x)
    want, _ = choose_backend(source, SubsetCache(400), native=False, compile=False).recalibrate(x)
    assert bool(finite) and torch.equal(y, want)


def test_build_failure_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("AQR_CACHE_DIR", str(tmp_path))
    with pytest.raises(OSError, match="failed"):
        build.build_library(["false"])  # a "compiler" that always fails
    assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob("tmp*"))


@needs_kernels
def test_kernels_run_on_torchs_openmp_team_where_found():
    team = build.openmp_entry_points()
    if team is None:
        pytest.skip("no OpenMP runtime loaded in this process")
    assert all(isinstance(addr, int) and addr for addr in team)


def test_gradients_still_flow_where_autograd_is_on():
    """Under ``recalibrating`` with autograd on, the map stays in torch (the C kernels keep no graph)."""
    net = _bn_net()
    stats = aqr.calibrate(net, [torch.rand(16, 3, 12, 12) for _ in range(4)])
    x = torch.rand(16, 3, 12, 12, requires_grad=True)
    with aqr.recalibrating(net, stats, compile=False):  # (the compiled graph is the same function's)
        out = net(x)
    out.square().sum().backward()
    assert x.grad is not None and float(x.grad.abs().sum()) > 0


@needs_kernels
def test_portable_build_matches_the_avx2_build():
    """Without -mavx2 (another CPU) the kernels' scalar loops give the same results."""
    command = build.compile_command()
    portable = build.load([arg for arg in command if arg not in ("-mavx2", "-mfma")])
    g = torch.Generator().manual_seed(6)
    for shape in [(20, 5, 203), (300, 9, 1)]:
        x = torch.randn(shape, generator=g)
        cache = SubsetCache(8192)
        want = native.subset_quantiles(LIB, x, cache.positions(x), 21)
        got = native.subset_quantiles(portable, x, cache.positions(x), 21)
        torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-6)
        source = LayerSource.create(torch.randn(shape[1], 21, generator=g).sort(1).values, "average", None, None,
                                    1e-3, 128)
        torch.testing.assert_close(
            native.table_map(portable, x, _targets(got[0]), source),
            native.table_map(LIB, x, _targets(got[0]), source),
            atol=1e-6, rtol=1e-6,
        )


@needs_kernels
@pytest.mark.parametrize("levels", [101, 21, 5])
def test_the_simd_paths_give_the_portable_builds_bits(levels):
    """The AVX2 build's histogram walk and table grid values (read from a window of eight knots, or
    gathered where the knots crowd the grid or a tie run reaches below the window) are the scalar
    loops' bits: quantiles, one-pass map and two-step map, with a folded affine."""
    command = build.compile_command()
    if "-mavx2" not in command:
        pytest.skip("no AVX2 build on this CPU")
    portable = build.load([arg for arg in command if arg not in ("-mavx2", "-mfma")])
    g = torch.Generator().manual_seed(12)
    x = torch.randn(64, 6, 256, generator=g)
    x[:, 1] = torch.distributions.StudentT(1.1).sample(x[:, 1].shape)  # knots crowd the grid's middle
    x[:, 2] = (x[:, 2] * 3).round()  # tie runs of many knots
    x[:, 3] = torch.where(torch.rand(x[:, 3].shape, generator=g) < 0.3, 0.25, x[:, 3])  # one long tie run
    x[:, 4] = x[:, 4].abs() ** 3  # skewed, with a long upper tail
    x[:, 5] = 2.0  # constant
    pre = (torch.randn(6, generator=g), torch.randn(6, generator=g))
    pos = SubsetCache(8192).positions(x)
    for cells in (1024, 64):
        sq = torch.randn(6, 4000, generator=g).sort(1).values[:, torch.linspace(0, 3999, levels).long()]
        source = LayerSource.create(sq, "standard", None, None, 1e-3, cells)
        for affine in (None, pre):
            knots = [native.subset_quantiles(lib, x, pos, levels, False, affine)[0] for lib in (LIB, portable)]
            assert torch.equal(knots[0], knots[1])
            one_pass = [native.recalibrate(lib, x, pos, source, affine)[0] for lib in (LIB, portable)]
            assert torch.equal(one_pass[0], one_pass[1])
            mapped = [native.table_map(lib, x, _targets(knots[0]), source, affine) for lib in (LIB, portable)]
            assert torch.equal(mapped[0], mapped[1])
    # grid points on runs of tied knots (p1 = -3, p19 = 3, 48 cells: the grid steps by 1/8), and the
    # marked cells around them
    tq = torch.tensor([[-4, -3, -2, -2, -2, -2, -2, -1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4]], dtype=torch.float32)
    values = torch.linspace(-5, 5, 4001).view(1, 1, -1)
    source = LayerSource.create(torch.linspace(-2, 2, 21).view(1, -1), "standard", None, None, 1e-3, 48)
    mapped = [native.table_map(lib, values, _targets(tq), source) for lib in (LIB, portable)]
    assert torch.equal(mapped[0], mapped[1])


@needs_kernels
@pytest.mark.parametrize("tail", aqr.TAILS)
def test_one_pass_recalibrate_equals_quantiles_then_map(tail):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(24, 7, 400, generator=g) * 1.5 - 0.3
    x[:, 2] = 1.0  # constant channel
    a, b = torch.randn(7, generator=g), torch.randn(7, generator=g)
    sq = torch.randn(7, 3000, generator=g).sort(1).values[:, torch.linspace(0, 2999, 101).long()]
    loc, scale = torch.randn(7, 1, generator=g) * 0.1, torch.rand(7, 1, generator=g) + 0.5
    source = LayerSource.create(sq, tail, loc, scale, 0.01, 256)
    pos = SubsetCache(4096).positions(x)
    for pre in (None, (a, b)):
        tq, mean, std, finite = native.subset_quantiles(LIB, x, pos, 101, True, pre)
        want = native.table_map(LIB, x, _targets(tq, mean, std), source, pre)
        got, ok = native.recalibrate(LIB, x, pos, source, pre)
        assert ok and finite
        assert torch.equal(got, want)
    x[3, 4, 5] = float("inf")
    assert not native.recalibrate(LIB, x, pos, source)[1]


@needs_kernels
@pytest.mark.parametrize("tail", ["average", "gaussian"])
def test_recalibrate_returns_how_many_channels_it_left_unmapped(tail):
    """The knots, moments and finite flags are outputs a caller may leave to the C side (NULL): the map
    is the same, and the return value counts the channels with a non-finite value."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(16, 6, 300, generator=g)
    x[2, 1, 7], x[5, 4, 299] = float("nan"), float("-inf")  # two channels, one value each
    sq = torch.randn(6, 2000, generator=g).sort(1).values[:, torch.linspace(0, 1999, 101).long()]
    source = LayerSource.create(sq, tail, torch.zeros(6), torch.ones(6), 0.01, 128)
    pos = SubsetCache(1024).positions(x)
    s = pos.shape[0]
    rank_lo, frac = native._ranks(s, 101)
    zs = native._probits(source)  # held: the C side reads it

    def call(outputs: tuple[torch.Tensor | None, ...]) -> tuple[int, torch.Tensor]:
        y = torch.full_like(x, 12345.0)
        nbins, crowded = native._histogram(s)
        tq, moments, finite = (None if t is None else t.data_ptr() for t in outputs)
        described = LIB.structs["aqr_recalibration"].of(
            A=16, C=6, B=300, pos=pos.data_ptr(), S=s, K=101, rank_lo=rank_lo.data_ptr(), frac=frac.data_ptr(),
            nbins=nbins, crowded=crowded, sq=sq.data_ptr(), tail=native.TAIL_CODES[tail], loc=source.loc.data_ptr(),
            scale=source.scale.data_ptr(), z=None if zs is None else zs.data_ptr(), cells=128, tq=tq, moments=moments,
            finite=finite)
        status = LIB.aqr_recalibrate(described, x.data_ptr(), y.data_ptr(), None, None, 1)
        return status, y

    tq, moments, finite = torch.empty(6, 101), torch.empty(6, 2), torch.empty(6, dtype=torch.int32)
    given, y_given = call((tq, moments, finite))
    left, y_left = call((None, None, None))
    assert given == left == 2
    assert finite.tolist() == [1, 0, 1, 1, 0, 1]
    assert torch.equal(y_given, y_left)
    assert bool((y_left[:, [1, 4]] == 12345.0).all()) and not bool((y_left[:, [0, 2, 3, 5]] == 12345.0).any())
    kept = [0, 2, 3, 5]
    x_kept = x[:, kept].contiguous()
    want = native.subset_quantiles(LIB, x_kept, SubsetCache(1024).positions(x_kept), 101)
    assert torch.equal(tq[kept], want[0])
    kept_source = LayerSource.create(sq[kept], tail, torch.zeros(4), torch.ones(4), 0.01, 128)
    two_steps = native.table_map(LIB, x_kept, _targets(*want[:3]), kept_source)  # the quantiles, then the map
    assert torch.equal(y_left[:, kept], two_steps)


@needs_kernels
def test_a_bound_recalibrate_refuses_a_batch_of_another_shape():
    x = torch.randn(8, 3, 64)
    source = LayerSource.create(torch.randn(3, 11).sort(1).values, "average", None, None, 0.01, 32)
    bound = native.BoundRecalibrate(LIB, x.shape, SubsetCache(256).positions(x), source)
    assert torch.equal(bound(x)[0], native.recalibrate(LIB, x, SubsetCache(256).positions(x), source)[0])
    for other in (torch.randn(9, 3, 64), torch.randn(8, 3, 8, 8), torch.randn(4, 3, 64)):
        with pytest.raises(ValueError, match="bound to batches of shape"):
            bound(other)
    for other in (x.double(), x.half(), torch.randn(8, 64, 3).transpose(1, 2), torch.randn(1, 1, 64).expand(8, 3, 64)):
        with pytest.raises(ValueError, match="contiguous float32"):
            bound(other)
    with pytest.raises(ValueError, match="channel-major"):
        native.BoundRecalibrate(LIB, torch.Size((8, 3, 2, 7)), SubsetCache(256).positions(x), source)


@needs_kernels
def test_recalibrate_output_maps_a_layer_output_in_its_own_shape():
    """A contiguous (N, C, H, W) output goes to its shape's bound call without views; the same values
    as the (A, C, B) path, and a channels-last or channel-dim-last output takes that path."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(12, 5, 9, 9, generator=g)
    source = LayerSource.create(torch.randn(5, 101, generator=g).sort(1).values, "average", None, None, 0.01, 256)
    backend = choose_backend(source, SubsetCache(512), compile=False)
    assert isinstance(backend, native.NativeBackend)
    want, finite = backend.recalibrate(x.reshape(12, 5, 81))
    got, ok = backend.recalibrate_output(x, 1)
    assert ok is True and bool(finite) and got.shape == x.shape and torch.equal(got.reshape(12, 5, 81), want)
    assert list(backend._bound) == [torch.Size((12, 5, 81)), x.shape]  # one bound call per shape seen
    got_cl, ok = backend.recalibrate_output(x.contiguous(memory_format=torch.channels_last), 1)
    assert bool(ok) and torch.equal(got_cl, got)
    moved = x.movedim(1, -1).contiguous()  # channels last in the shape: the (A, C, B) view, B = 1
    got_last, ok = backend.recalibrate_output(moved, -1)
    want_last, _ = backend.recalibrate(moved.reshape(-1, 5, 1))
    assert bool(ok) and torch.equal(got_last, want_last.reshape(moved.shape))
    assert list(backend._bound) == [torch.Size((12, 5, 81)), x.shape]  # neither took a bound call of its own
    x[3, 2, 4, 4] = float("nan")
    y, ok = backend.recalibrate_output(x, 1)
    assert ok is False and y is x


@needs_kernels
def test_missing_tail_inputs_are_named_not_dereferenced():
    x = torch.randn(4, 3, 64)
    pos = SubsetCache(256).positions(x)
    sq = torch.randn(3, 11).sort(1).values
    with pytest.raises(ValueError, match="gaussian"):  # no loc, no z (a LayerSource built around create's checks)
        native.recalibrate(LIB, x, pos, LayerSource(sq, "gaussian", None, torch.ones(3), None, 32))
    with pytest.raises(ValueError, match="interval"):  # no sample moments
        native.table_map(LIB, x, _targets(sq), LayerSource(sq, "interval", None, torch.ones(3), None, 32))
    with pytest.raises(ValueError, match="unknown tail"):
        native.recalibrate(LIB, x, pos, LayerSource(sq, "median", None, None, None, 32))


@needs_kernels
def test_the_kernels_refuse_tail_codes_they_do_not_know(monkeypatch):
    """The C entry points check the code themselves (past the last one, clip-source's 5, or negative)."""
    x = torch.randn(4, 3, 64)
    pos = SubsetCache(256).positions(x)
    sq = torch.randn(3, 11).sort(1).values
    clip_source = LayerSource(sq, "clip-source", None, None, None, 32)  # reads no moments: NULLs are fine
    y, finite = native.recalibrate(LIB, x, pos, clip_source)
    assert finite and torch.equal(y, native.table_map(LIB, x, _targets(native.subset_quantiles(LIB, x, pos, 11)[0]),
                                                      clip_source))
    for code in (6, -1):
        monkeypatch.setitem(native.TAIL_CODES, "bogus", code)
        bogus = LayerSource(sq, "bogus", None, None, None, 32)
        with pytest.raises(native.NativeKernelError):
            native.recalibrate(LIB, x, pos, bogus)
        with pytest.raises(native.NativeKernelError):
            native.table_map(LIB, x, _targets(sq), bogus)
