"""Class-balanced streaming AQR (``target="robust"``): its estimate, its kernels' pieces, and the wrapper."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import aqr
from aqr.backends import Targets
from aqr.adapt.stream.base import COUNT, IMAGE_COUNT, MAP, StreamTable
from aqr.adapt.stream.torch_kernels import TorchStreamKernels, cdf_at, curve_quantiles
from aqr.core.layers import NonFiniteActivationError
from aqr.adapt.stream.robust import (FLOAT_EXACT, MARGINAL_WINDOW, MAX_GROUP_STEP, MIXTURE_GRID, RUN_WINDOW,
                                     RobustLayerStream, RobustSettings, add_counts, compact_counts, group_step,
                                     own_batch_share, shift_ratio, shift_share)
from aqr.adapt.stream.running import LayerStream, StreamSettings
from aqr.adapt.stream.stream_maps import stream_kernels
from aqr.methods import create
from tests.models_tiny import bn_cnn, images
from tests.test_stream_aqr import calibrated, check_reset_round_trip, same, shifted, state

pytestmark = pytest.mark.usefixtures("one_thread")
KERNELS = [TorchStreamKernels(), stream_kernels(torch.device("cpu"), True)]


@pytest.mark.parametrize("kern", KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("mode", [IMAGE_COUNT, MAP | IMAGE_COUNT])
def test_per_image_counts_are_each_images_own_histogram(kern, mode: int) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * 3, 5, 7, generator=g)  # 4 images of 3 rows each
    knots = torch.sort(torch.randn(5, 11, generator=g) * 2, dim=1).values
    pre = (torch.rand(5, generator=g) + 0.5, torch.randn(5, generator=g))
    table = StreamTable.empty(5, 8)
    kern.tables(knots, knots, table)
    r = kern.scan(x, 4, pre, knots, knots, table, mode, 5, 16)
    assert r.counts.shape == (4, 5, 16 + 4)
    for i in range(4):
        own = kern.scan(x[3 * i : 3 * i + 3], 1, pre, knots, knots, table, COUNT, 5, 16).counts
        assert torch.equal(r.counts[i], own)
    assert int(r.counts.sum()) == 4 * 5 * len(range(0, 3 * 7, 5))
    if mode & MAP:  # the map is the one MAP alone gives
        assert torch.equal(r.y, kern.scan(x, 4, pre, knots, knots, table, MAP, 5, 16).y)
    with pytest.raises(ValueError, match="scan mode"):
        kern.scan(x, 4, pre, knots, knots, table, COUNT | IMAGE_COUNT, 5, 16)


def _exact_mixture(knots: torch.Tensor, k: int) -> torch.Tensor:
    c = knots.shape[1]
    z = torch.sort(knots.permute(1, 0, 2).reshape(c, -1), dim=1).values
    levels = (torch.arange(k, dtype=torch.float64) / (k - 1)).expand(c, -1).contiguous()
    parts = [cdf_at(g.contiguous(), levels, z) for g in knots]
    return curve_quantiles(z, sum(p[0] for p in parts) / len(parts), sum(p[1] for p in parts) / len(parts), k)


@pytest.mark.parametrize("kern", KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("groups", [1, 3, 10])
def test_the_mixture_of_group_cdfs_matches_its_exact_quantiles(kern, groups: int) -> None:
    g = torch.Generator().manual_seed(groups)
    k = 41
    values = torch.randn(groups, 6, 4000, generator=g, dtype=torch.float64) * (torch.rand(groups, 6, 1, generator=g,
                                                                                        dtype=torch.float64) + 0.2)
    values = values + 3 * torch.randn(groups, 6, 1, generator=g, dtype=torch.float64)
    values[:, :2] = values[:, :2].clamp(min=0)  # atoms at 0 in two channels
    knots = torch.quantile(values, torch.linspace(0, 1, k, dtype=torch.float64), dim=-1).permute(1, 2, 0).contiguous()
    mixed = torch.zeros(6, k)
    kern.mixture(knots.float(), mixed, MIXTURE_GRID)
    got, exact = mixed[:, 1 : k - 1].double(), _exact_mixture(knots.float().double(), k).double()
    span = knots[:, :, k - 2].amax(0) - knots[:, :, 1].amin(0)
    assert float(((got - exact).abs().amax(1) / span).max()) < 3e-3
    if groups == 1:  # one group: its own inner knots
        assert float(((got - knots[0, :, 1 : k - 1]).abs().amax(1) / span).max()) < 3e-3


@pytest.mark.parametrize("kern", KERNELS, ids=lambda k: k.name)
def test_a_weighted_mixture_repeats_its_groups_by_weight(kern) -> None:
    g = torch.Generator().manual_seed(5)
    k = 21
    values = torch.randn(3, 4, 2000, generator=g, dtype=torch.float64) + torch.arange(3.0, dtype=torch.float64)[:, None, None] * 2
    knots = torch.quantile(values, torch.linspace(0, 1, k, dtype=torch.float64), dim=-1).permute(1, 2, 0).float().contiguous()
    weighted, repeated, alone = torch.zeros(4, k), torch.zeros(4, k), torch.zeros(4, k)
    kern.mixture(knots, weighted, MIXTURE_GRID, torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64))
    kern.mixture(knots[[0, 0, 1]].contiguous(), repeated, MIXTURE_GRID)
    kern.mixture(knots, alone, MIXTURE_GRID, torch.tensor([0.0, 0.0, 5.0], dtype=torch.float64))
    span = float(knots[:, :, k - 2].max() - knots[:, :, 1].min())
    # the grid differs (the zero-weight group's knots are still among its points): close, not equal
    assert float((weighted - repeated)[:, 1:-1].abs().max()) < 3e-3 * span
    assert float((alone - knots[2])[:, 1:-1].abs().max()) < 3e-3 * span
    with pytest.raises(ValueError, match="weights"):
        kern.mixture(knots, alone, MIXTURE_GRID, torch.tensor([1.0, 1.0], dtype=torch.float64))


def test_a_groups_step_is_capped_once_it_has_a_state() -> None:
    assert group_step(64, 0, 16.0) == 1.0
    assert group_step(64, 10, 16.0) == MAX_GROUP_STEP
    assert group_step(1, 100, 16.0) == pytest.approx(1 / 16)


def _quantile_knots(k: int):
    levels = torch.linspace(0, 1, k)

    def batch_knots(x: torch.Tensor, pre: object) -> Targets:
        v = x.permute(1, 0, 2).reshape(x.shape[1], -1)
        return Targets(torch.quantile(v, levels, dim=1).t().contiguous(), None, None, torch.tensor(True))

    return batch_knots


@pytest.mark.parametrize("kernels", KERNELS, ids=lambda k: k.name)
def test_runs_of_one_class_leave_the_target_balanced_where_the_stream_follows_the_run(kernels) -> None:
    """Two classes, one at -2, one at +2: after runs of 160 images of each, the balanced target's median
    stays near 0 (the 50/50 mixture) while streaming AQR's follows the class of the current run."""
    k, c = 21, 2
    g = torch.Generator().manual_seed(3)
    source = torch.quantile(torch.randn(20000, generator=g), torch.linspace(0, 1, k))[None].repeat(c, 1).contiguous()
    robust = RobustLayerStream(source, StreamSettings(), RobustSettings(groups=2), kernels, _quantile_knots(k))
    stream = LayerStream(source, StreamSettings(horizon=32.0), kernels, _quantile_knots(k))
    medians: list[tuple[float, ...]] = []
    for cls in (0, 1, 0):
        for _ in range(20):
            x = torch.randn(8, c, 30, generator=g) * 0.5 + (4 * cls - 2)
            for layer in (robust, stream):
                _, staged = layer.step(x, 8)
                if layer is robust:
                    layer.commit(staged, torch.full((8,), cls))
                else:
                    layer.commit(staged)
        quartiles = (robust.knots[:, k // 4], robust.knots[:, 3 * k // 4], stream.knots[:, k // 4], stream.knots[:, 3 * k // 4])
        medians.append(tuple(float(q.mean()) for q in quartiles))
    for i, (r25, r75, s25, s75) in enumerate(medians):
        run = -2 if i != 1 else 2
        assert abs(s25 - run) < 0.7 and abs(s75 - run) < 0.7  # the stream is the current run
        if i > 0:  # both classes seen: a quarter below -1.5, a quarter above 1.5, whichever the run
            assert r25 < -1.5 and r75 > 1.5
    # per channel the marginal's knots; per group and channel: its knots, and its pending histogram (64 + 4
    # counts) and two extremes; per group its recent share (float64)
    assert robust.memory_bytes() == stream.memory_bytes() + c * k * 4 + 2 * c * (k + 68 + 2) * 4 + 2 * 8


@pytest.mark.parametrize("kernels", KERNELS, ids=lambda k: k.name)
def test_without_runs_the_target_is_the_running_estimate_of_every_image(kernels) -> None:
    """Three images of class 0 (at -2) for one of class 1 (at +2), in i.i.d. order: without runs the target
    is the stream's 3:1 mixture (its median in class 0), with runs the classes' equal mixture (median between
    them); half the runs, the marginal and the groups half each."""
    k, c = 21, 2
    g = torch.Generator().manual_seed(4)
    source = torch.quantile(torch.randn(20000, generator=g), torch.linspace(0, 1, k))[None].repeat(c, 1).contiguous()
    layers = {runs: RobustLayerStream(source, StreamSettings(), RobustSettings(groups=2), kernels, _quantile_knots(k))
              for runs in (0.0, 0.5, 1.0)}
    for _ in range(60):
        labels = (torch.rand(8, generator=g) < 0.25).long()
        x = torch.randn(8, c, 30, generator=g) * 0.5 + (4 * labels - 2)[:, None, None]
        for runs, layer in layers.items():
            layer.commit(layer.step(x, 8)[1], labels, runs=runs)
    median = {runs: float(layer.knots[:, k // 2].mean()) for runs, layer in layers.items()}
    assert median[0.0] < -1.5 and abs(median[1.0]) < 1.0
    assert layers[0.5].component_weights([0, 1]).tolist() == pytest.approx([0.5, 0.25, 0.25])
    assert layers[0.0].component_weights([0, 1]).tolist() == pytest.approx([1.0, 0.0, 0.0])
    marginal = layers[0.0].marginal[0, :, 1:-1]  # the target's inner knots are the marginal's, as they are
    assert torch.equal(layers[0.0].knots[:, 1:-1], marginal)


@pytest.mark.parametrize("kernels", KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("batch", [4, 16])
def test_without_runs_the_groups_follow_the_marginal_and_start_from_it_once_runs_appear(kernels, batch: int) -> None:
    """With runs the two groups learn their classes (at -2 and +2); once the runs end (``runs`` 0) and the
    stream moves by +3, both groups are copies of the marginal (not the classes they held before), and
    with runs again each group moves from it towards its own class, the target their equal mixture."""
    k, c = 21, 2
    g = torch.Generator().manual_seed(7)
    source = torch.quantile(torch.randn(20000, generator=g), torch.linspace(0, 1, k))[None].repeat(c, 1).contiguous()
    layer = RobustLayerStream(source, StreamSettings(), RobustSettings(groups=2), kernels, _quantile_knots(k))

    def feed(batches: int, runs: float, shift: float) -> None:
        for _ in range(batches):
            labels = torch.randint(0, 2, (batch,), generator=g)
            x = torch.randn(batch, c, 30, generator=g) * 0.5 + (4 * labels - 2 + shift)[:, None, None]
            layer.commit(layer.step(x, batch)[1], labels, runs=runs)

    feed(512 // batch, 1.0, 0.0)
    medians = layer.group_knots[:, :, k // 2].mean(1)
    assert medians[0] < -1.5 and medians[1] > 1.5  # each group holds its class
    feed(1024 // batch, 0.0, 3.0)
    assert layer.pending == 0 or batch < StreamSettings().rebuild_every
    for group in layer.group_knots:
        assert torch.equal(group, layer.marginal[0])  # not the classes held before the runs ended
    assert torch.equal(layer.knots[:, 1:-1], layer.marginal[0, :, 1:-1])
    assert float(layer.marginal[0, :, 1:-1].mean()) > 2.0  # the marginal followed the shift (by 86 %: 1,024 images at 512)
    feed(64 // batch, 1.0, 3.0)
    medians = layer.group_knots[:, :, k // 2].mean(1)
    start = float(layer.marginal[0, :, k // 2].mean())
    assert medians[0] < start - 0.5 and medians[1] > start + 0.5  # each moved from the marginal to its class


@pytest.mark.parametrize("kernels", KERNELS, ids=lambda k: k.name)
def test_the_marginal_follows_a_shift_the_test_sees_at_the_streams_pace(kernels) -> None:
    """After 40 steady batches the stream jumps by +3: with the own-batch share open the shift test sees it
    and the marginal moves at the stream's pace (39 % of the way for 64 images at horizon 128), with it
    shut only at its own long horizon (12 % at 512 images)."""
    k, c = 21, 3
    g = torch.Generator().manual_seed(6)
    source = torch.quantile(torch.randn(20000, generator=g), torch.linspace(0, 1, k))[None].repeat(c, 1).contiguous()
    layers = {own: RobustLayerStream(source, StreamSettings(), RobustSettings(), kernels, _quantile_knots(k))
              for own in (0.0, 1.0)}
    for shift in [0.0] * 40 + [3.0]:
        x = torch.randn(64, c, 40, generator=g) + shift
        labels = torch.randint(0, 10, (64,), generator=g)
        for own, layer in layers.items():
            before = float(layer.marginal[0, :, k // 2].mean())
            _, staged = layer.step(x, 64, own=own)
            layer.commit(staged, labels, runs=0.0)
    assert abs(before) < 0.2
    moved = {own: float(layer.marginal[0, :, k // 2].mean()) - before for own, layer in layers.items()}
    assert 0.6 < moved[1.0] < 2.0 and moved[0.0] < 0.4


def test_small_batches_pool_until_the_rebuild_as_one_batch_would() -> None:
    """Batches of fewer than rebuild_every images wait in their groups' pending histograms: two batches of
    4 after the first leave the state one batch of the same 8 images leaves."""
    k, c = 11, 3
    g = torch.Generator().manual_seed(8)
    source = torch.sort(torch.randn(c, k, generator=g), dim=1).values
    x = [torch.randn(8, c, 9, generator=g) for _ in range(2)]
    labels = [torch.tensor([0, 1, 1, 2, 0, 0, 3, 1]), torch.tensor([2, 2, 1, 0, 3, 3, 1, 0])]
    layers = [RobustLayerStream(source, StreamSettings(), RobustSettings(groups=4), TorchStreamKernels(),
                                _quantile_knots(k)) for _ in range(2)]
    for layer, split in zip(layers, (8, 4)):
        layer.commit(layer.step(x[0], 8)[1], labels[0])
        for i in range(0, 8, split):
            _, staged = layer.step(x[1][i : i + split], split)
            layer.commit(staged, labels[1][i : i + split])
            if i + split < 8:
                assert layer.pending == split and sum(layer.group_pending) == split
    assert layers[1].pending == 0 and layers[0].group_seen == layers[1].group_seen == [5, 5, 3, 3]
    assert torch.equal(layers[0].group_knots, layers[1].group_knots)
    assert torch.equal(layers[0].knots, layers[1].knots)


def test_each_image_joins_the_group_of_its_predicted_class() -> None:
    k, c = 11, 3
    g = torch.Generator().manual_seed(5)
    source = torch.sort(torch.randn(c, k, generator=g), dim=1).values
    layer = RobustLayerStream(source, StreamSettings(), RobustSettings(groups=4), TorchStreamKernels(), _quantile_knots(k))
    x = torch.randn(5, c, 9, generator=g)
    _, staged = layer.step(x, 5)
    layer.commit(staged, torch.tensor([0, 1, 7, 7, 9]))  # classes 7 and 9 fold into groups 3 and 1
    assert layer.group_seen == [1, 2, 0, 2]
    assert torch.equal(layer.group_knots[2], torch.zeros(c, k))
    with pytest.raises(ValueError, match="predicted classes"):
        layer.commit(layer.step(x, 5)[1])


def test_reset_restores_the_initial_state_bit_for_bit_and_the_model_is_untouched() -> None:
    model, stats = calibrated("bn")
    adapter = check_reset_round_trip(model, stats, batch=4, target="robust")
    fewer = aqr.AQR(model, stats, target="robust", groups=2)
    fewer(shifted(4, seed=4))
    assert adapter.memory_bytes() > fewer.memory_bytes() > 0


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_batch_with_nan_leaves_the_state_unchanged(policy: str) -> None:
    model, stats = calibrated("bn")
    adapter = aqr.AQR(model, stats, target="robust", on_nonfinite=policy)
    for i in range(4):
        adapter(shifted(4, seed=10 + i))
    saved = state(adapter)
    bad = shifted(4, seed=20)
    bad[1, 0, 3, 3] = float("nan")
    if policy == "raise":
        with pytest.raises(NonFiniteActivationError, match="layer"):
            adapter(bad)
    else:
        assert not torch.isfinite(adapter(bad)).all()
    assert same(state(adapter), saved)


def test_a_model_without_logits_is_refused_and_the_state_is_unchanged() -> None:
    model = nn.Sequential(bn_cnn(), nn.Unflatten(1, (5, 1))).eval()
    stats = aqr.calibrate(model, [images(64, seed=s) for s in range(2)], num_quantiles=21, compile=False)
    adapter = aqr.AQR(model, stats, target="robust")
    with pytest.raises(ValueError, match=r"logits \(N, classes\)"):
        adapter(shifted(4, seed=1))
    after = state(adapter)
    adapter.reset()
    assert after and same(state(adapter), after)  # the refused batch left the initial state


def test_two_passes_map_the_batch_with_the_state_it_updated() -> None:
    model, stats = calibrated("bn")
    one, two = aqr.AQR(model, stats, target="robust"), aqr.AQR(model, stats, target="robust", passes=2)
    x = shifted(16, seed=2)
    for batch in (x[:8], x[8:]):
        once = one(batch)
        twice = two(batch)
        assert same(state(one), state(two))  # the second pass stages nothing
        assert torch.equal(twice, one(batch))  # mapped with the state the batch left
        assert not torch.equal(twice, once)
        two(batch)  # the two streams in step again


def test_options_are_checked() -> None:
    model, stats = calibrated("bn")
    for bad in ({"target": "robust", "mode": "exact"}, {"target": "robust", "groups": 0},
                {"target": "robust", "groups": 2.5}, {"target": "robust", "class_horizon": 0},
                {"target": "robust", "passes": 3}, {"target": "stream", "passes": 2},
                {"target": "robust", "match": "moments"}, {"target": "robust", "own_batch": 1}):
        with pytest.raises(ValueError):
            aqr.AQR(model, stats, **bad)
    with pytest.raises(ValueError, match="tail"):
        aqr.AQR(model, stats, target="robust", tail="gaussian")
    with pytest.raises(ValueError, match="aqr.AQR"):
        with aqr.recalibrating(model, stats, target="robust"):
            pass
    assert "target='robust'" in repr(aqr.AQR(model, stats, target="robust"))
    assert "own_batch=False" in repr(aqr.AQR(model, stats, target="robust", own_batch=False))


def test_the_method_keeps_its_state_online_and_restarts_it_episodically() -> None:
    model, stats = calibrated("bn")
    x = shifted(8, seed=6)
    online = create("aqr", model, stats=stats, target="robust", protocol="online")
    episodic = create("aqr", model, stats=stats, target="robust", protocol="episodic")
    first = episodic(x[:4])
    assert torch.equal(online(x[:4]), first)
    second = episodic(x[4:])
    assert torch.equal(second, aqr.AQR(model, stats, target="robust")(x[4:]))
    assert not torch.equal(online(x[4:]), second)
    online.reset()
    assert torch.equal(online(x[:4]), first)


def _runs(n: int, length: int, classes: int, wrong: float, seed: int) -> list[int]:
    """Predicted classes of a stream whose true classes come in runs of ``length`` (1: i.i.d.), a share
    ``wrong`` of them replaced by a uniformly drawn class."""
    g = torch.Generator().manual_seed(seed)
    true = torch.randint(classes, ((n + length - 1) // length,), generator=g).repeat_interleave(length)[:n]
    noise = torch.rand(n, generator=g) < wrong
    return torch.where(noise, torch.randint(classes, (n,), generator=g), true).tolist()


def test_the_own_batch_share_is_open_on_iid_predictions_and_shut_on_runs() -> None:
    """Consecutive predictions that repeat no more than independent draws open the share, whatever the
    histogram (skewed, 10 or 1,000 classes); runs shut it, even with a third of the predictions wrong."""
    skewed = [[c for c in _runs(MARGINAL_WINDOW, 1, 10, 0.0, seed) for c in (c if c < 5 else c // 5,)]
              for seed in range(20)]
    assert sum(own_batch_share(r) == 1.0 for r in skewed) >= 18
    assert sum(own_batch_share(_runs(MARGINAL_WINDOW, 1, 1000, 0.0, s)) == 1.0 for s in range(20)) >= 18
    assert own_batch_share([3] * MARGINAL_WINDOW) == 1.0  # one class throughout: no run to tell apart
    for length, classes in ((5, 10), (21, 10), (49, 10), (3, 1000)):
        for seed in range(5):
            assert own_batch_share(_runs(MARGINAL_WINDOW, length, classes, 0.33, seed)) == 0.0, (length, classes)
    assert own_batch_share(_runs(RUN_WINDOW - 1, 1, 10, 0.0, 0)) == 0.0  # too few predictions yet


def test_the_own_share_maps_the_batch_towards_its_own_histogram_and_stages_the_same_update() -> None:
    """A batch shifted by +3 after a state at 0: with its own share it is mapped closer to the source
    (its own histogram is part of its target); the update it stages does not depend on the share."""
    k, c = 21, 2
    g = torch.Generator().manual_seed(4)
    source = torch.quantile(torch.randn(20000, generator=g), torch.linspace(0, 1, k))[None].repeat(c, 1).contiguous()
    layers = [RobustLayerStream(source, StreamSettings(), RobustSettings(groups=2), TorchStreamKernels(),
                                _quantile_knots(k)) for _ in range(2)]
    warm = [torch.randn(16, c, 30, generator=g) for _ in range(4)]
    shifted_batch = torch.randn(16, c, 30, generator=g) + 3
    for layer in layers:
        for x in warm:
            layer.commit(layer.step(x, 16)[1], torch.arange(16) % 2)
    (y0, staged0), (y1, staged1) = layers[0].step(shifted_batch, 16, own=0.0), layers[1].step(shifted_batch, 16, own=1.0)
    assert float(y1.median()) < float(y0.median()) - 0.5
    assert torch.equal(staged0.counts, staged1.counts) and torch.equal(staged0.lo, staged1.lo)
    for layer, staged in zip(layers, (staged0, staged1)):
        layer.commit(staged, torch.arange(16) % 2)
    assert same([layers[0].snapshot()], [layers[1].snapshot()])
    y_small, _ = layers[1].step(shifted_batch[:4], 4, own=1.0)  # fewer than rebuild_every images: no own share
    assert torch.equal(y_small, layers[0].step(shifted_batch[:4], 4)[0])


@pytest.mark.parametrize("kern", KERNELS, ids=lambda k: k.name)
def test_a_batch_absorbed_alone_counts_its_halves_only_and_commits_the_same_state(kern) -> None:
    """Without runs and nothing pending, a batch of 16 is counted as its even and odd images' sums alone
    (its groups' histograms would not be read): the same map and the same state after the commit as
    counted image by image; committed with runs after all, it is refused and the state stays."""
    k, c = 21, 2
    g = torch.Generator().manual_seed(6)
    source = torch.quantile(torch.randn(20000, generator=g), torch.linspace(0, 1, k))[None].repeat(c, 1).contiguous()
    layers = [RobustLayerStream(source, StreamSettings(), RobustSettings(groups=2), kern, _quantile_knots(k))
              for _ in range(2)]
    warm = [torch.randn(16, c, 30, generator=g) for _ in range(4)]
    for layer in layers:
        for x in warm:
            layer.commit(layer.step(x, 16, own=0.5, runs=0.0)[1], torch.arange(16) % 2, runs=0.0)
    batch = torch.randn(16, c, 30, generator=g) + 1
    (y0, halves), (y1, each) = layers[0].step(batch, 16, own=1.0, runs=0.0), layers[1]._step_own(batch, 16, None, 1.0)
    assert halves.paired and not each.paired and tuple(halves.counts.shape[:2]) == (2, c)
    assert torch.equal(y0, y1) and torch.equal(halves.total, each.total)
    before = layers[0].snapshot()
    with pytest.raises(RuntimeError, match="marginal alone"):
        layers[0].commit(halves, torch.arange(16) % 2, runs=0.5)
    assert same([before], [layers[0].snapshot()])
    for layer, staged in zip(layers, (halves, each)):
        layer.commit(staged, torch.arange(16) % 2, runs=0.0)
    assert same([layers[0].snapshot()], [layers[1].snapshot()])


@pytest.mark.parametrize("kern", KERNELS, ids=lambda k: k.name)
def test_the_shift_ratio_is_about_one_for_a_batch_from_the_target_and_grows_with_a_shift(kern) -> None:
    """Batches drawn from the target distribution (normal, per-image offsets that make the images differ)
    give ratios near 1 at every batch size, so the share beyond sampling stays small; a shift of 0.4
    standard deviations shows at 64 images, of one at 8."""
    k, c = 101, 6
    g = torch.Generator().manual_seed(11)
    knots = torch.quantile(torch.randn(400_000, generator=g) * 1.25, torch.linspace(0, 1, k))[None].repeat(c, 1)
    knots = knots.contiguous()
    table = StreamTable.empty(c, 64, "cpu")
    kern.tables(knots, knots, table)

    def ratio(n: int, shift: float) -> float:
        offsets = torch.randn(n, 1, c, 1, generator=g) * 0.75  # total sd 1.25, as the knots
        x = (torch.randn(n, 20, c, 1, generator=g) + offsets + shift).reshape(n * 20, c, 1)
        return shift_ratio(kern.shift_distances(kern.scan(x, n, None, knots, knots, table, IMAGE_COUNT, 1, 32).counts,
                                                knots), n)

    for n in (8, 16, 64):
        null = torch.tensor([ratio(n, 0.0) for _ in range(30)])
        assert 0.8 < float(null.mean()) < 1.25 and float(null.max()) < 3.0, (n, null)
        assert sum(shift_share(float(r)) for r in null) / len(null) < 0.25
    assert min(ratio(64, 0.5) for _ in range(10)) > 2.5
    assert min(shift_share(ratio(8, 1.25)) for _ in range(10)) > 0.75
    assert shift_ratio(kern.shift_distances(torch.zeros(1, c, 36, dtype=torch.int32), knots), 1) == float("inf")
    assert kern.shift_distances(torch.zeros(4, c, 36, dtype=torch.int32), knots) == (0.0, 0.0)  # nothing counted


def test_the_shift_share_is_the_part_of_the_distance_sampling_does_not_explain() -> None:
    assert shift_share(0.0) == shift_share(1.0) == shift_share(float("nan")) == 0.0
    assert shift_share(2.0) == pytest.approx(0.75) and shift_share(float("inf")) == 1.0
    assert all(shift_share(a) <= shift_share(b) for a, b in zip((0.5, 1.1, 1.5, 3), (1.1, 1.5, 3, 10)))


def test_a_batch_as_close_to_the_target_as_sampling_is_mapped_with_the_target_alone() -> None:
    """An open own share changes nothing for a batch drawn from the state's own distribution when its
    ratio is below 1; a shifted batch is mapped differently (its share is near 1)."""
    k, c = 21, 2
    g = torch.Generator().manual_seed(5)
    source = torch.quantile(torch.randn(20000, generator=g), torch.linspace(0, 1, k))[None].repeat(c, 1).contiguous()
    layer = RobustLayerStream(source, StreamSettings(), RobustSettings(groups=2), TorchStreamKernels(),
                              _quantile_knots(k))
    for _ in range(16):
        x = torch.randn(16, c, 30, generator=g)
        layer.commit(layer.step(x, 16)[1], torch.arange(16) % 2)
    tried = 0
    for _ in range(20):
        x = torch.randn(16, c, 30, generator=g)
        counts = layer.kernels.scan(x, 16, None, layer.knots, layer.source, layer.table, IMAGE_COUNT, 5, 64).counts
        if shift_ratio(layer.kernels.shift_distances(counts, layer.knots), 16) <= 1:
            tried += 1
            assert torch.equal(layer.step(x, 16, own=1.0)[0], layer.step(x, 16)[0])
    assert tried >= 3
    shifted_batch = torch.randn(16, c, 30, generator=g) + 1.0
    assert not torch.equal(layer.step(shifted_batch, 16, own=1.0)[0], layer.step(shifted_batch, 16)[0])


def test_the_wrapper_opens_the_own_share_after_its_window_and_reset_forgets_the_predictions() -> None:
    model, stats = calibrated("bn")
    x = shifted(RUN_WINDOW + 64, seed=9)
    gated, never = aqr.AQR(model, stats, target="robust"), aqr.AQR(model, stats, target="robust", own_batch=False)
    outs = [(gated(x[i : i + 16]), never(x[i : i + 16])) for i in range(0, len(x), 16)]
    assert all(torch.equal(a, b) for a, b in outs[: RUN_WINDOW // 16])  # no share before RUN_WINDOW predictions
    assert not all(torch.equal(a, b) for a, b in outs[RUN_WINDOW // 16 :])
    assert len(gated._batch.recent) == len(x) and gated.memory_bytes() == never.memory_bytes()
    gated.reset()
    assert gated._batch.recent == [] and gated.memory_bytes() < never.memory_bytes()
    again = [gated(x[i : i + 16]) for i in range(0, len(x), 16)]
    assert all(torch.equal(a, b) for a, b in zip(again, (o[0] for o in outs)))


@pytest.mark.parametrize("top", [300, FLOAT_EXACT // 4])  # float32 sums, then the int32 path's sizes
def test_group_counts_add_exactly_like_an_int32_index_add(top: int) -> None:
    gen = torch.Generator().manual_seed(top)
    counts = torch.randint(0, top, (37, 5, 9), generator=gen, dtype=torch.int32)
    counts[3, 2, 1] = top - 1  # the largest value in every draw
    index = torch.randint(0, 6, (37,), generator=gen)
    totals = torch.randint(0, 1000, (6, 5, 9), generator=gen, dtype=torch.int32)
    want = totals.clone().index_add_(0, index, counts)
    add_counts(totals, index, counts)
    assert torch.equal(totals, want)


@pytest.mark.parametrize("per_image", [64, (1 << 15) - 1, 1 << 15])
def test_staged_counts_are_int16_only_where_every_count_fits(per_image: int) -> None:
    """Each count is at most the values of one image and channel: int16 below 2^15 of them, the same sums."""
    images, channels = 3, 2
    x = torch.zeros(images, channels, per_image)
    counts = torch.full((images, channels, 9), per_image - 1, dtype=torch.int32)
    counts[:, :, 0] = torch.arange(images * channels, dtype=torch.int32).view(images, channels)
    staged = compact_counts(counts, x, images)
    assert staged.dtype == (torch.int16 if per_image < (1 << 15) else torch.int32)
    assert torch.equal(staged.to(torch.int32), counts)
    index = torch.tensor([0, 1, 0])
    want = torch.zeros(2, channels, 9, dtype=torch.int32).index_add_(0, index, counts)
    totals = torch.zeros(2, channels, 9, dtype=torch.int32)
    add_counts(totals, index, staged)
    assert torch.equal(totals, want)
