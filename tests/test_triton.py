"""aqr's Triton backend against the torch fast path (same sample) and the exact map.

On CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set here before triton is
imported); on a CUDA machine the same tests run the compiled kernels. In the interpreter every
float32 operation rounds as torch's does, so results equal the torch path's bit for bit; a GPU may
fuse a multiply and an add (FMA), so there the comparison allows float32 rounding and, for rare
values next to a cell or tail boundary, the neighbouring cell's line.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from aqr.backends import LayerSource, SubsetCache, TorchBackend  # noqa: E402
from aqr.backends.base import Targets  # noqa: E402
from aqr.backends import triton_backend  # noqa: E402
from aqr.backends.torch_backend import affine, map_sample  # noqa: E402
from aqr.core.qmap import quantile_map, sorted_quantiles  # noqa: E402

if triton_backend.kernels is None:  # pragma: no cover
    pytest.skip(f"aqr's Triton kernels do not load here: {triton_backend.UNAVAILABLE}", allow_module_level=True)

TritonBackend = triton_backend.TritonBackend
TritonConfig = triton_backend.kernels.TritonConfig
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
TAILS = ("standard", "average", "none", "clip", "interval", "gaussian")
PARAMETRIC = ("interval", "gaussian")
K = 21
GP = 0.01  # gaussian_p


def _source(c: int, k: int = K, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sq = torch.randn(c, 4000, generator=g).sort(1).values[:, torch.linspace(0, 3999, k).long()]
    return sq, torch.randn(c, generator=g) * 0.1, torch.rand(c, generator=g) + 0.5


def _layer(kind: str, c: int = 5, seed: int = 3) -> torch.Tensor:
    """A layer output viewed as (A, C, B) in the layout ``kind``; channel 0 integer-valued (tied
    knots), channel 1 constant, channel 2 with 30 % of its values at 0.3, the rest Gaussian."""
    g = torch.Generator().manual_seed(seed)
    if kind == "nchw":
        x4 = torch.randn(4, c, 5, 9, generator=g) * 2 + 1
    elif kind == "channels_last":
        x4 = (torch.randn(4, c, 5, 9, generator=g) * 2 + 1).to(memory_format=torch.channels_last)
    elif kind == "tokens":
        x4 = (torch.randn(3, 60, c, generator=g) * 2 + 1).permute(0, 2, 1).unsqueeze(-1)  # (N, C, L, 1) view
    else:
        raise ValueError(kind)
    x4[:, 0] = x4[:, 0].round()
    x4[:, 1] = 3.0
    mask = torch.rand(x4[:, 2].shape, generator=g) < 0.3
    x4[:, 2] = torch.where(mask, torch.full_like(x4[:, 2], 0.3), x4[:, 2])
    if kind == "tokens":
        x = x4.squeeze(-1).permute(0, 2, 1).reshape(-1, c, 1)  # (N*L, C, 1), channel fastest
    else:
        x = x4.reshape(x4.shape[0], c, -1)  # a view: channels_last gives strides (HWC, 1, C)
    return x.to(DEVICE)


def _backend(tail: str, c: int, cells: int = 64, samples: int = 64, k: int = K,
             config: TritonConfig | None = None) -> TritonBackend:
    """The backend; by default every channel takes the sorted-sample knots of the torch path."""
    sq, loc, scale = _source(c, k)
    source = LayerSource.create(sq, tail, loc, scale, GP, cells).to(DEVICE)
    subsets = SubsetCache(samples)
    return TritonBackend(source, subsets, TorchBackend(source, subsets, compile=False),
                         config or TritonConfig(sort_max=2**40))


def _want(be: TritonBackend, x: torch.Tensor, pre=None) -> torch.Tensor:
    """The torch fast path on the same sample (on CPU it is the reference implementation), with the
    table the Triton kernels build: without the marked cells of the tie rule (``mark_jumps=False``,
    see aqr.backends.torch_backend), which these kernels do not implement yet."""
    s = be.source.to("cpu")
    xr = x.detach().cpu()
    if pre is not None:  # the map reads scale * x + shift in float32 and writes x's dtype
        xf = affine(xr.float(), tuple(t.cpu() for t in pre))
        y = map_sample(xf.contiguous(), SubsetCache(be.subsets.size).rows(xf.contiguous()), False, s.knots, s.tail,
                       s.loc, s.scale, s.z, s.cells, mark_jumps=False)[0]
        return y.to(x.dtype)
    xr = xr.contiguous()
    return map_sample(xr, SubsetCache(be.subsets.size).rows(xr), False, s.knots, s.tail, s.loc, s.scale, s.z, s.cells,
                      mark_jumps=False)[0]


def assert_map_equal(got: torch.Tensor, want: torch.Tensor, moments: bool = False) -> None:
    got = got.detach().cpu()
    assert got.dtype == want.dtype and got.shape == want.shape
    if not ON_GPU:
        if moments:  # the sample's mean and std are summed in another order
            bound = 1e-5 * (1 + want.float().nan_to_num().abs().max().item())
            torch.testing.assert_close(got, want, atol=bound, rtol=1e-5, equal_nan=True)
        else:
            assert torch.equal(got, want), f"max |diff| {(got.float() - want.float()).abs().max().item()}"
        return
    g, w = got.float(), want.float()
    assert torch.equal(g.isnan(), w.isnan())
    scale = w[w.isfinite()].abs().max().item() if w.isfinite().any() else 1.0
    tol = (1e-4 if want.dtype == torch.float32 else 1e-2) * (scale + 1.0)
    far = ((g - w).abs() > tol) & ~w.isnan()
    assert far.float().mean().item() <= 1e-3, f"{int(far.sum())} of {far.numel()} values differ by more than {tol}"


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("kind", ["nchw", "channels_last", "tokens"])
def test_equals_the_torch_fast_path(tail, kind):
    x = _layer(kind)
    be = _backend(tail, x.shape[1])
    targets = be.target_knots(x)
    y = be.apply(x, targets)
    assert_map_equal(y.contiguous(), _want(be, x), tail in PARAMETRIC)
    assert bool(targets.finite)
    # the knots: type-7 quantiles of the sorted sample, p0/p100 of every value
    xc = x.cpu().contiguous()
    sample = SubsetCache(be.subsets.size).rows(xc)
    tq = sorted_quantiles(sample.sort(1).values, K)
    tq[:, 0], tq[:, -1] = xc.amin((0, 2)), xc.amax((0, 2))
    if ON_GPU:
        torch.testing.assert_close(targets.knots.cpu(), tq, atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(targets.knots, tq)
    if tail in PARAMETRIC:
        torch.testing.assert_close(targets.mean.cpu().squeeze(1), sample.mean(1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(targets.std.cpu().squeeze(1), sample.std(1, correction=0), atol=1e-5, rtol=1e-5)
    else:
        assert targets.mean is None and targets.std is None


@pytest.mark.parametrize("kind", ["nchw", "channels_last", "tokens"])
def test_output_keeps_the_layout_without_copies(kind):
    x = _layer(kind)
    y, _ = _backend("standard", x.shape[1]).recalibrate(x)
    assert y.shape == x.shape and y.stride() == x.stride()


@pytest.mark.parametrize("view", ["channel_slice", "strided_positions"])
def test_strided_views_without_copies(view):
    base = _layer("nchw", c=7)
    x = base[:, 1:6] if view == "channel_slice" else base[:, :5, ::2]
    be = _backend("clip", 5)
    y, _ = be.recalibrate(x)
    assert_map_equal(y, _want(be, x))
    assert y.is_contiguous()


@pytest.mark.parametrize("tail", ["average", "none", "gaussian"])
@pytest.mark.parametrize("kind", ["nchw", "channels_last", "tokens"])
def test_folded_affine_equals_mapping_the_affine_output(tail, kind):
    x = _layer(kind)
    c = x.shape[1]
    g = torch.Generator().manual_seed(11)
    pre = (torch.randn(c, generator=g).to(DEVICE), torch.randn(c, generator=g).to(DEVICE))  # negative scales too
    be = _backend(tail, c)
    y, finite = be.recalibrate(x, pre)
    assert bool(finite)
    assert_map_equal(y.contiguous(), _want(be, x, pre), tail in PARAMETRIC)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", ["nchw", "channels_last"])
def test_half_precision_in_and_out(dtype, kind):
    x = _layer(kind).to(dtype)
    be = _backend("standard", x.shape[1])
    y, finite = be.recalibrate(x)
    assert y.dtype == dtype and bool(finite)
    assert_map_equal(y.contiguous(), _want(be, x))
    c = x.shape[1]
    pre = (torch.linspace(-1.5, 2.0, c).to(DEVICE), torch.linspace(0.5, -0.5, c).to(DEVICE))
    y, _ = be.recalibrate(x, pre)
    assert_map_equal(y.contiguous(), _want(be, x, pre))


@pytest.mark.parametrize("cells", [50, 1024])
def test_grid_sizes(cells):
    x = _layer("nchw")
    be = _backend("standard", x.shape[1], cells=cells)
    y, _ = be.recalibrate(x)
    assert_map_equal(y, _want(be, x))


@pytest.mark.parametrize("shape", [(1, 3, 1), (2, 3, 5), (1, 2, 127)])
def test_tiny_layers_take_every_position(shape):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(5)) * 3).to(DEVICE)
    be = _backend("clip", shape[1], samples=128)
    y, finite = be.recalibrate(x)
    assert bool(finite)
    assert_map_equal(y, _want(be, x))


def test_default_knots_and_a_subsample():
    """K = 101 knots, 1,024 cells, 512 of 1,024 positions sampled."""
    x = (torch.randn(16, 3, 64, generator=torch.Generator().manual_seed(6)) * 2).to(DEVICE)
    x[:, 0] = x[:, 0].round()
    be = _backend("gaussian", 3, cells=1024, samples=512, k=101)
    y, _ = be.recalibrate(x)
    assert_map_equal(y, _want(be, x), moments=True)


@pytest.mark.parametrize("tail", TAILS)
def test_within_one_cell_of_the_exact_map(tail):
    """Every position sampled, so knots and moments are exact: outside [p1, p_{K-2}) the tail lines
    equal the exact map; inside, the table lies between the exact map one cell below and above."""
    x = (torch.randn(4, 3, 30, generator=torch.Generator().manual_seed(8)) * 2 + 0.5).to(DEVICE)
    be = _backend(tail, 3, cells=64, samples=128)
    y, _ = be.recalibrate(x)
    y, xc = y.cpu(), x.cpu()
    s = be.source.to("cpu")
    exact = quantile_map(xc, s.knots, None, tail, dim=1, source_loc=s.loc, source_scale=s.scale, gaussian_p=GP)
    tq = be.target_knots(x).knots.cpu()
    t1, t98 = tq[:, 1].view(1, -1, 1), tq[:, -2].view(1, -1, 1)
    inside = (xc >= t1) & (xc < t98)
    w = (t98 - t1) / s.cells
    tol = 1e-5 * (1 + exact.abs().max())
    assert ((y - exact).abs()[~inside] <= tol).all()
    below = quantile_map(xc - w, s.knots, tq, "standard", dim=1)
    above = quantile_map(xc + w, s.knots, tq, "standard", dim=1)
    assert ((y >= below - tol) & (y <= above + tol))[inside].all()
    assert inside.float().mean() > 0.8


def test_constant_channel_maps_to_the_source_median():
    x = torch.full((8, 2, 20), 2.5, device=DEVICE)
    be = _backend("standard", 2, k=21)
    y, finite = be.recalibrate(x)
    assert bool(finite)
    torch.testing.assert_close(y.cpu(), be.source.knots[:, 10].cpu().view(1, 2, 1).expand(8, 2, 20))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("tail", ["standard", "gaussian"])
def test_nonfinite_channel_comes_out_nan_and_is_reported(bad, tail):
    x = _layer("nchw")
    x[3, 1, 44] = bad  # most likely not a sampled position: only the extremes pass sees it
    be = _backend(tail, x.shape[1], samples=64)
    y, finite = be.recalibrate(x)
    assert not bool(finite)
    assert bool(y[:, 1].isnan().all())
    keep = [0, 2, 3, 4]
    assert_map_equal(y[:, keep].contiguous(), _want(be, x)[:, keep].contiguous(), tail in PARAMETRIC)
    knots = be.target_knots(x).knots
    assert bool(knots[1].isnan().all()) and bool(knots[keep].isfinite().all())


def test_repeated_calls_are_bit_identical():
    x = _layer("channels_last")
    be = _backend("gaussian", x.shape[1])
    assert torch.equal(be.recalibrate(x)[0], be.recalibrate(x.clone())[0])


def test_inputs_the_kernels_do_not_take_go_to_torch():
    x = _layer("nchw").double()
    be = _backend("standard", x.shape[1])
    assert not be.takes(x)
    y, finite = be.recalibrate(x)
    assert y.dtype == torch.float64 and bool(finite)
    xg = _layer("nchw").requires_grad_(True)
    y, _ = be.recalibrate(xg)
    assert y.requires_grad  # the torch path keeps the graph


def test_strided_positions_are_the_contiguous_ones():
    for a, b, size in [(4, 45, 128), (3, 10, 128), (64, 3136, 2048)]:
        x = torch.empty(a, 2, b)
        flat = SubsetCache(size).positions(x)  # offsets of channel 0 in contiguous (A, 2, B)
        assert torch.equal(SubsetCache(size).strided_positions(x), flat)


@pytest.mark.skipif(not ON_GPU, reason="torch.compile of Triton kernels needs a GPU (the interpreter runs eagerly)")
def test_compiled_equals_eager():
    x = _layer("nchw")
    be = _backend("gaussian", x.shape[1])
    pre = (torch.ones(x.shape[1], device=DEVICE) * 1.5, torch.zeros(x.shape[1], device=DEVICE))

    def f(t):
        return be.recalibrate(t, pre)

    y_eager, f_eager = f(x)
    y_comp, f_comp = torch.compile(f)(x)
    torch.testing.assert_close(y_comp, y_eager, atol=1e-5 * (1 + y_eager.abs().max().item()), rtol=1e-5)
    assert bool(f_eager) == bool(f_comp)


def _small_bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.GroupNorm(4, 16), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 10))
    with torch.no_grad():  # running statistics that differ from the defaults
        m[1].running_mean.uniform_(-0.5, 0.5)
        m[1].running_var.uniform_(0.5, 2.0)
    return m.eval().to(DEVICE)


def test_aqr_with_triton_uses_the_kernels_and_matches_the_torch_path():
    """The wrapper end to end: BatchNorm folded into the map, GroupNorm hooked (on CPU under the
    interpreter with ``native=False``; on a GPU as users run it)."""
    import aqr

    model = _small_bn_model()
    g = torch.Generator().manual_seed(1)
    stats = aqr.calibrate(model, [torch.rand(64, 3, 8, 8, generator=g).to(DEVICE) for _ in range(2)])
    x = (torch.rand(2, 3, 8, 8, generator=g) * 1.5).to(DEVICE)
    fast = aqr.AQR(model, stats, triton=True, native=ON_GPU, target_samples=64, samples_per_row=0)
    y = fast(x)
    assert {type(m.backend(x.device)).__name__ for m in fast._maps.values()} == {"TritonBackend"}
    torch.testing.assert_close(y, fast(x), rtol=0, atol=0)  # deterministic
    reference = aqr.AQR(model, stats, native=False, compile=False, target_samples=64, samples_per_row=0)(x)
    torch.testing.assert_close(y, reference, atol=1e-3, rtol=1e-3)
    bad = x.clone()
    bad[1, 1, 2, 2] = float("nan")
    with pytest.raises(aqr.NonFiniteActivationError, match="layer '1'"):
        fast(bad)


def test_kernels_read_no_plain_python_globals():
    """A @triton.jit function may read module globals only if they are tl.constexpr (the compiler
    refuses others; the interpreter does not notice)."""
    import ast
    import builtins
    import inspect

    from aqr.backends import triton_kernels

    tree = ast.parse(inspect.getsource(triton_kernels))
    jitted = [f for f in tree.body if isinstance(f, ast.FunctionDef)
              and any("jit" in ast.unparse(d) for d in f.decorator_list)]
    assert jitted
    jit_names = {f.name for f in jitted}
    for f in jitted:
        local = {a.arg for a in f.args.args} | {n.id for n in ast.walk(f) if isinstance(n, ast.Name)
                                                and isinstance(n.ctx, ast.Store)}
        for node in ast.walk(f):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local:
                if node.id in ("tl", "triton") or node.id in jit_names or hasattr(builtins, node.id):
                    continue
                value = getattr(triton_kernels, node.id, None)
                assert isinstance(value, triton_kernels.tl.constexpr), f"{f.name} reads global {node.id}"


# --- the histogram of every value (channels of more than TritonConfig.sort_max values) ----------------

HIST = TritonConfig(sort_max=0, bins=64)


def _heavy_layer(kind: str, c: int = 4, seed: int = 5) -> torch.Tensor:
    """Channel 0 Gaussian, 1 exponential (skewed), 2 Student-t with 2 dof plus a far outlier, 3
    integer-valued (ties): the histogram's range must stay narrow for all of them."""
    g = torch.Generator().manual_seed(seed)
    x4 = torch.randn(6, c, 7, 11, generator=g) * 3 - 2
    x4[:, 1] = torch.empty(6, 7, 11).exponential_(generator=g) * 0.5
    t = torch.randn(6, 7, 11, generator=g) / (torch.randn(6, 7, 11, generator=g).abs() + 0.05)
    t[2, 3, 4] = 1e30
    x4[:, 2] = t
    x4[:, 3] = (torch.randn(6, 7, 11, generator=g) * 2).round()
    if kind == "channels_last":
        x4 = x4.contiguous(memory_format=torch.channels_last)
    return x4.reshape(6, c, -1).to(DEVICE)


@pytest.mark.parametrize("kind", ["nchw", "channels_last"])
@pytest.mark.parametrize("folded", [False, True])
def test_histogram_knots_within_one_bucket_of_the_exact_quantiles(kind, folded):
    """Every value counted: each inner knot within one bucket of the exact type-7 quantile of all
    values, p0/p100 exact, the moments those of all values."""
    x = _heavy_layer(kind)
    c = x.shape[1]
    be = _backend("gaussian", c, k=K, config=HIST)
    assert be.histogram(x)
    pre = None
    v = x.cpu()
    if folded:
        pre = (torch.tensor([1.5, -0.5, 2.0, 1.0]).to(DEVICE), torch.tensor([0.1, 0.0, -3.0, 0.5]).to(DEVICE))
        v = affine(v.float(), tuple(t.cpu() for t in pre))
    targets = be.target_knots(x, pre)
    rows = v.transpose(0, 1).reshape(c, -1).double()
    exact = sorted_quantiles(rows.sort(1).values, K)
    got = targets.knots.cpu().double()
    ends = exact[:, [0, -1]].float().double()
    if ON_GPU:  # the folded affine step may be fused (FMA) on a GPU: one rounding apart
        torch.testing.assert_close(got[:, [0, -1]], ends, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got[:, [0, -1]], ends)
    err = (got - exact).abs()[:, 1:-1]
    # every channel, outliers or not: within a small share of the inner knots' spread (a fine
    # bucket is at most a few percent of the window that holds them)
    inner = (exact[:, -2] - exact[:, 1])[:, None]
    assert (err <= 0.05 * inner).all(), (err / inner).amax(1)
    # on average far less, except where values tie (channel 3, integers): a bucket's values are
    # spread evenly across it, so tied knots move by up to a bucket
    assert (err.mean(1)[:3] <= 0.005 * inner[:3, 0]).all() and err.mean(1)[3] <= 0.02 * inner[3, 0], \
        err.mean(1) / inner[:, 0]
    # moments of every value; channel 2's outlier (1e30) overflows the float32 squares, where half
    # the range stands in for the std: finite, within a factor 20
    keep = [0, 1, 3]
    mean, std = targets.mean.cpu().squeeze(1).double(), targets.std.cpu().squeeze(1).double()
    torch.testing.assert_close(mean[keep], rows.mean(1)[keep], rtol=1e-4, atol=1e-4 * rows.std(1)[keep].max().item())
    torch.testing.assert_close(std[keep], rows.std(1, correction=0)[keep], rtol=1e-3, atol=0)
    assert mean.isfinite().all() and std.isfinite().all()
    assert 1 / 20 < std[2] / rows[2].std(correction=0) < 20


def test_histogram_tokens_layout_and_map():
    """Tokens (channel fastest, more channels than one histogram call holds): the knots as close to
    the exact ones, and the map with them equals the torch table map with the same knots."""
    g = torch.Generator().manual_seed(11)
    c = 40
    x = (torch.randn(10, 12, c, generator=g) * torch.linspace(0.1, 4, c)).reshape(-1, c, 1).to(DEVICE)
    be = _backend("average", c, k=K, config=TritonConfig(sort_max=0, bins=128))
    targets = be.target_knots(x)
    rows = x.cpu().squeeze(2).t().double()
    exact = sorted_quantiles(rows.sort(1).values, K)
    inner = (exact[:, -2] - exact[:, 1])[:, None]
    assert ((targets.knots.cpu().double() - exact).abs() <= 0.02 * inner).all()
    y = be.apply(x, targets)
    s = be.source.to("cpu")
    ref = TorchBackend(s, SubsetCache(128), compile=False).apply(
        x.cpu().contiguous(), Targets(targets.knots.cpu(), None, None, targets.finite.cpu()))
    assert_map_equal(y.contiguous(), ref)


def test_histogram_constant_nonfinite_and_huge_channels():
    x = torch.randn(5, 4, 300, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    x[:, 0] = 2.5  # constant
    x[:, 1, :7] = 3e38  # a range beyond the float32 maximum
    x[:, 1, 7:14] = -3e38
    x[1, 2, 17] = float("nan")
    be = _backend("standard", 4, k=K, config=HIST)
    targets = be.target_knots(x)
    tq = targets.knots.cpu()
    assert not bool(targets.finite)
    assert bool(tq[2].isnan().all())
    assert torch.equal(tq[0], torch.full((K,), 2.5))
    assert bool(tq[1].isfinite().all()) and bool((tq[1].diff() >= 0).all())
    assert tq[1, 0] == -3e38 and tq[1, -1] == 3e38
    y, finite = be.recalibrate(x)
    assert not bool(finite) and bool(y[:, 2].isnan().all()) and bool(y[:, [0, 1, 3]].isfinite().all())
    torch.testing.assert_close(y[:, 0].cpu(), be.source.knots[0, K // 2].cpu().expand(5, 300))


def test_histogram_is_deterministic_and_takes_half_precision():
    x = _heavy_layer("nchw").to(torch.bfloat16)
    be = _backend("interval", x.shape[1], config=HIST)
    y1, _ = be.recalibrate(x)
    y2, _ = be.recalibrate(x.clone())
    assert y1.dtype == torch.bfloat16 and torch.equal(y1, y2)


@pytest.mark.parametrize("histogram", [False, True])
def test_knots_spanning_more_than_the_float32_maximum_map_to_finite_values(histogram):
    """Attack 1 of the hardening issue: +-2e38 and +-FLT_MAX in a channel. The table's grid is then
    computed in float64 (as on the torch path), so every output is finite."""
    x = torch.randn(8, 3, 200, generator=torch.Generator().manual_seed(0))
    x[0, 1, 0], x[1, 1, 3] = 2e38, -2e38
    x[2, 2, :], x[3, 2, :] = 3.4028234663852886e38, -3.4028234663852886e38
    x = x.to(DEVICE)
    be = _backend("standard", 3, config=TritonConfig(sort_max=0) if histogram else None)
    y, finite = be.recalibrate(x)
    assert bool(finite) and bool(y.isfinite().all())
    if not histogram:
        assert_map_equal(y, _want(be, x))
