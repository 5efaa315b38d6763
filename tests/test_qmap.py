"""The tensor-level quantile map (paper Eq. 1) and each tail strategy."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import aqr
from aqr.core.qmap import quantile_levels


def knots(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_channel_quantiles_match_numpy_linear():
    x = torch.randn(3, 1001, dtype=torch.float64)
    got = aqr.channel_quantiles(x, 11).numpy()
    want = np.quantile(x.numpy(), np.linspace(0, 1, 11), axis=1).T
    np.testing.assert_allclose(got, want, atol=1e-12)


def test_channel_quantiles_respect_channel_dim():
    x = torch.randn(8, 3, 4, 4)
    by_dim = aqr.channel_quantiles(x, 5, dim=1)
    manual = aqr.channel_quantiles(x.transpose(0, 1).reshape(3, -1), 5)
    torch.testing.assert_close(by_dim, manual)


def test_eq1_inside_an_interval():
    sq = knots([0.0, 10.0, 30.0])
    tq = knots([0.0, 1.0, 2.0])
    x = torch.tensor([[0.25, 0.5, 1.5, 2.0]])
    # [0,1) -> [0,10) slope 10; [1,2] -> [10,30] slope 20
    torch.testing.assert_close(aqr.quantile_map(x, sq, tq), torch.tensor([[2.5, 5.0, 20.0, 30.0]]))


def test_map_sends_target_knots_to_source_knots():
    sq = torch.sort(torch.randn(4, 101), dim=1).values
    tq = torch.sort(torch.randn(4, 101) * 3 + 1, dim=1).values
    torch.testing.assert_close(aqr.quantile_map(tq, sq, tq), sq)


def test_ties_map_to_the_middle_level_without_nan():
    sq = knots([0.0, 1.0, 2.0, 3.0, 4.0])
    tq = knots([-1.0, 0.0, 0.0, 0.0, 5.0])  # p25 = p50 = p75 = 0: a mass at zero
    y = aqr.quantile_map(torch.tensor([[0.0, -0.5, 2.5]]), sq, tq)
    assert torch.isfinite(y).all()
    assert y[0, 0] == 2.0  # middle of levels 1..3 -> source p50
    assert y[0, 1] == 0.5
    assert y[0, 2] == pytest.approx(3.5)


def test_constant_channel_maps_to_source_median():
    sq = torch.sort(torch.randn(2, 101), dim=1).values
    y = aqr.quantile_map(torch.full((2, 50), 7.0), sq)  # target knots all equal 7
    torch.testing.assert_close(y, sq[:, 50:51].expand(2, 50))


def test_values_outside_target_knots_extrapolate_with_edge_slope():
    sq = knots([0.0, 2.0, 4.0])
    tq = knots([0.0, 1.0, 2.0])
    y = aqr.quantile_map(torch.tensor([[-1.0, 3.0]]), sq, tq)
    torch.testing.assert_close(y, torch.tensor([[-2.0, 6.0]]))


def test_channels_on_another_dim_and_dtype_preserved():
    x = torch.randn(16, 3, 5, 5).to(torch.bfloat16)
    sq = torch.sort(torch.randn(3, 11), dim=1).values
    y = aqr.quantile_map(x, sq, dim=1)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    manual = aqr.quantile_map(x.float().transpose(0, 1).reshape(3, -1), sq).reshape(3, 16, 5, 5).transpose(0, 1)
    torch.testing.assert_close(y.float(), manual, atol=0.05, rtol=0.02)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    k=st.sampled_from([3, 11, 101]),
    scale=st.floats(0.1, 10.0),
    shift=st.floats(-5.0, 5.0),
)
def test_map_is_monotone(seed, k, scale, shift):
    g = torch.Generator().manual_seed(seed)
    sq = torch.sort(torch.randn(2, 5000, generator=g), dim=1).values
    sq = aqr.channel_quantiles(sq, k)
    x = torch.randn(2, 777, generator=g) * scale + shift
    x = torch.sort(x, dim=1).values
    y = aqr.quantile_map(x, sq)
    assert torch.isfinite(y).all()
    assert (y.diff(dim=1) >= -1e-5).all()


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.sampled_from([2000, 20000]))
def test_same_distribution_is_nearly_identity_inside(seed, n):
    g = torch.Generator().manual_seed(seed)
    source = torch.randn(3, 100_000, generator=g) * 2 + 1
    sq = aqr.channel_quantiles(source, 101)
    x = torch.randn(3, n, generator=g) * 2 + 1
    y = aqr.quantile_map(x, sq)
    tq = aqr.channel_quantiles(x, 101)
    inner = (x >= tq[:, 1:2]) & (x <= tq[:, 99:100])
    err = (y - x).abs()[inner]
    # The sd of a sample quantile at level p is sqrt(p(1-p)/n)/f(q_p): at p = 0.01, 3.7 sd/sqrt(n)
    # (sd = 2 here, so 7.4/sqrt(n)); the max over thousands of values stays within ~5 of those
    # (seed 112, n = 20000 reaches 4.2).
    assert err.max() < 37 / n**0.5
    assert err.mean() < 2 * 2.5 / n**0.5  # typical quantile error ~1.3-2 sd/sqrt(n)


def _mse(a, b):
    return float(((a - b) ** 2).mean())


@pytest.mark.parametrize("corruption", [torch.exp, lambda v: v**3 + v, lambda v: torch.sinh(2 * v)])
def test_recovers_monotone_nonaffine_corruption_where_affine_match_cannot(corruption):
    """The paper's one-hidden-layer argument: AQR error -> 0 with n and K; an affine match keeps a bias."""
    g = torch.Generator().manual_seed(0)
    errors = {}
    for n, k in [(2_000, 11), (20_000, 101), (200_000, 1001)]:
        source = torch.randn(2, n, generator=g)
        clean = torch.randn(2, n, generator=g)
        shifted = corruption(clean)
        mapped = aqr.quantile_map(shifted, aqr.channel_quantiles(source, k))
        errors[(n, k)] = _mse(mapped, clean)
    affine = (shifted - shifted.mean(1, keepdim=True)) / shifted.std(1, keepdim=True)
    affine = affine * source.std(1, keepdim=True) + source.mean(1, keepdim=True)
    e = list(errors.values())
    assert e[0] > e[1] > e[2]
    assert e[2] < 1e-3
    assert _mse(affine, clean) > 20 * e[2]


def test_k11_is_coarser_than_k101_on_bimodal_source():
    g = torch.Generator().manual_seed(1)
    n = 200_000
    mode = torch.rand(1, n, generator=g) < 0.3
    clean = torch.where(mode, torch.randn(1, n, generator=g) * 0.3 - 2, torch.randn(1, n, generator=g) * 0.6 + 1)
    source = torch.where(mode, torch.randn(1, n, generator=g) * 0.3 - 2, torch.randn(1, n, generator=g) * 0.6 + 1)
    shifted = torch.exp(clean)
    e11 = _mse(aqr.quantile_map(shifted, aqr.channel_quantiles(source, 11)), clean)
    e101 = _mse(aqr.quantile_map(shifted, aqr.channel_quantiles(source, 101)), clean)
    assert e101 < e11 / 3


# ---- tail strategies on hand-made inputs --------------------------------------------------------
# K = 5: levels 0, .25, .5, .75, 1. "p1" is knot 1, "p99" knot 3.
SQ = knots([-10.0, -1.0, 0.0, 1.0, 10.0])
TQ = knots([-4.0, -2.0, 0.0, 2.0, 4.0])
X = torch.tensor([[-4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0]])
LOC, SCALE = torch.tensor([0.5]), torch.tensor([2.0])


def test_standard_and_average_tails_are_eq1_everywhere():
    want = torch.tensor([[-10.0, -5.5, -1.0, -0.5, 0.0, 0.5, 1.0, 5.5, 10.0]])
    for tail in ("standard", "average"):
        torch.testing.assert_close(aqr.quantile_map(X, SQ, TQ, tail=tail), want)


def test_not_calibrated_tail_leaves_edge_values_unchanged():
    y = aqr.quantile_map(X, SQ, TQ, tail="none")
    torch.testing.assert_close(y, torch.tensor([[-4.0, -3.0, -1.0, -0.5, 0.0, 0.5, 2.0, 3.0, 4.0]]))


def test_clip_tail_sets_edges_to_target_p1_p99():
    y = aqr.quantile_map(X, SQ, TQ, tail="clip")
    torch.testing.assert_close(y, torch.tensor([[-2.0, -2.0, -1.0, -0.5, 0.0, 0.5, 2.0, 2.0, 2.0]]))


def test_clip_source_tail_sets_edges_to_source_p1_p99_and_stays_continuous():
    y = aqr.quantile_map(X, SQ, TQ, tail="clip-source")
    torch.testing.assert_close(y, torch.tensor([[-1.0, -1.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.0, 1.0]]))


def test_interval_tail_rescales_by_batch_std_and_gamma():
    std = float(X.std(correction=0))
    y = aqr.quantile_map(X, SQ, TQ, tail="interval", source_scale=SCALE)
    low = (X[0, :2] - (-4.0)) / std * 2.0 + (-10.0)
    high = (X[0, 6:] - 2.0) / std * 2.0 + 1.0
    torch.testing.assert_close(y[0, :2], low)
    torch.testing.assert_close(y[0, 6:], high)
    torch.testing.assert_close(y[0, 2:6], torch.tensor([-1.0, -0.5, 0.0, 0.5]))


@pytest.mark.parametrize("p", [1e-4, 1e-3, 1e-2, 0.25])  # 0.25 is the level of p1 here: z(p1) = z(p0)
def test_gaussian_tail_is_affine_and_independent_of_p(p):
    mean, std = float(X.mean()), float(X.std(correction=0))
    y = aqr.quantile_map(X, SQ, TQ, tail="gaussian", source_loc=LOC, source_scale=SCALE, gaussian_p=p)
    low = 0.5 + (X[0, :2] - mean) * 2.0 / std
    z75 = float(torch.special.ndtri(torch.tensor(0.75, dtype=torch.float64)))
    high = 1.0 + (X[0, 6:] - (mean + std * z75)) * 2.0 / std
    torch.testing.assert_close(y[0, :2], low, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(y[0, 6:], high, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(y[0, 2:6], torch.tensor([-1.0, -0.5, 0.0, 0.5]))


@pytest.mark.parametrize("tail", ["interval", "gaussian"])
def test_parametric_tails_need_source_moments(tail):
    with pytest.raises(ValueError, match="source_"):
        aqr.quantile_map(X, SQ, TQ, tail=tail)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown tail"):
        aqr.quantile_map(X, SQ, TQ, tail="bogus")
    with pytest.raises(ValueError, match="channels"):
        aqr.quantile_map(torch.zeros(2, 4), SQ, TQ)
    with pytest.raises(ValueError, match="target_q has shape"):
        aqr.quantile_map(X, SQ, TQ[:, :3])
    with pytest.raises(ValueError, match=">= 3"):
        quantile_levels(2)


def test_branch_free_levels_match_the_branching_ones_with_tied_knots():
    from aqr.core.qmap import interp_levels

    tq = torch.tensor([[0.0, 1.0, 1.0, 1.0, 2.0, 3.0], [0.0, 0.0, 1.0, 2.0, 2.0, 5.0]])
    x = torch.tensor([[-1.0, 0.5, 1.0, 1.5, 2.0, 4.0], [0.0, 0.5, 2.0, 3.0, 5.0, 6.0]])
    branching = interp_levels(x, tq)
    assert branching[0, 2] == 2.0 and branching[1, 2] == 3.5  # the middle of each tied run
    torch.testing.assert_close(interp_levels(x, tq, branch_free=True), branching)


def test_levels_far_beyond_the_knots_extrapolate_the_last_interval():
    """floor(u) beyond int64 used to convert to INT64_MIN, which the clamp turned into interval 0
    (found by the native fuzz: +inf mapped through the first interval in torch, the last in C)."""
    from aqr.core.qmap import eval_levels

    sq = torch.tensor([[0.0, 1.0, 3.0]])
    got = eval_levels(torch.tensor([[1e30, -1e30, float("nan")]]), sq)
    assert got[0, 0] == 1.0 + 2.0 * (1e30 - 1.0) and got[0, 1] == -1e30 and got[0, 2].isnan()


def test_knots_between_extreme_values_do_not_overflow():
    """b - a overflows float32 for a = -b = 3e38: the interpolated knot used to be inf (or NaN)."""
    x = torch.tensor([[-3.0e38, 3.0e38]])
    q = aqr.channel_quantiles(x, 5)
    assert torch.isfinite(q).all() and q[0, 2] == 0.0
    assert torch.equal(aqr.channel_quantiles(torch.full((1, 7), 2.5), 11), torch.full((1, 11), 2.5))
