"""Class-conditional source knots (``calibrate(groups=G)``) and ``target="robust"`` with ``balance < 1``:
a run of one class is mapped onto its class's source knots, not onto the source's mixture of classes."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import aqr
from aqr.adapt.stream.torch_kernels import TorchStreamKernels
from aqr.adapt.stream.robust import RobustLayerStream, RobustSettings
from aqr.core.stats import StatsError
from aqr.adapt.stream.running import StreamSettings
from aqr.adapt.stream.stream_maps import stream_kernels
from tests.models_tiny import bn_cnn, images
from tests.test_robust import _quantile_knots
from tests.test_stream_aqr import check_reset_round_trip, shifted, state

pytestmark = pytest.mark.usefixtures("one_thread")
KERNELS = [TorchStreamKernels(), stream_kernels(torch.device("cpu"), True)]


def _two_classes(k: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Source knots of two classes at -2 and +2 (sd 0.5): their mixture's, and each class's ``(2, C, K)``."""
    g = torch.Generator().manual_seed(1)
    levels = torch.linspace(0, 1, k)
    per_class = torch.stack([torch.quantile(torch.randn(20000, generator=g) * 0.5 + m, levels) for m in (-2.0, 2.0)])
    mixture = torch.quantile(torch.cat([torch.randn(20000, generator=g) * 0.5 + m for m in (-2.0, 2.0)]), levels)
    return mixture[None].repeat(c, 1).contiguous(), per_class[:, None].repeat(1, c, 1).contiguous()


@pytest.mark.parametrize("kernels", KERNELS, ids=lambda k: k.name)
def test_a_run_of_one_class_is_mapped_onto_its_class_with_balance_below_one(kernels) -> None:
    """A corruption moves both classes by +1. Through a run of class 0, then one of class 1, the recent
    weights (balance 0) map the run onto its own class (median -2, then +2); the balanced target (balance
    1) maps the first run onto the mixture of both classes (its median between them): its content mapped away."""
    k, c = 21, 2
    source, per_class = _two_classes(k, c)
    groups = torch.cat([per_class, source[None].repeat(2, 1, 1)])  # 4 groups: classes 0 and 1, two unused
    recent = RobustLayerStream(source, StreamSettings(), RobustSettings(groups=4, balance=0.0), kernels,
                               _quantile_knots(k), groups)
    balanced = RobustLayerStream(source, StreamSettings(), RobustSettings(groups=4), kernels, _quantile_knots(k))
    g = torch.Generator().manual_seed(2)
    medians = {}
    for cls in (0, 1):
        for _ in range(12):
            x = torch.randn(8, c, 30, generator=g) * 0.5 + (4 * cls - 2) + 1.0
            for name, layer in (("recent", recent), ("balanced", balanced)):
                y, staged = layer.step(x, 8)
                layer.commit(staged, torch.full((8,), cls))
                medians[name, cls] = float(y.median())
    assert abs(medians["recent", 0] + 2) < 0.3 and abs(medians["recent", 1] - 2) < 0.3
    assert medians["balanced", 0] > -1.5  # one group seen: mapped onto the mixture's middle, between the classes
    # the source side is its own copy: the statistics' knots are untouched
    assert torch.equal(recent.base_source, source) and not torch.equal(recent.source, source)
    # memory: the groups' source knots and their mixture's, float32
    assert recent.memory_bytes() == balanced.memory_bytes() + (4 + 1) * c * k * 4


def test_the_group_weights_share_balance_equally_and_the_rest_by_recent_share() -> None:
    k, c = 11, 2
    source, per_class = _two_classes(k, c)
    layer = RobustLayerStream(source, StreamSettings(), RobustSettings(groups=2, balance=0.25, recent_horizon=32.0),
                              TorchStreamKernels(), _quantile_knots(k), per_class)
    x = torch.randn(8, c, 5, generator=torch.Generator().manual_seed(0))
    layer.commit(layer.step(x, 8)[1], torch.tensor([0] * 6 + [1] * 2))  # the first batch sets the shares
    assert layer.group_recent.tolist() == pytest.approx([0.75, 0.25])
    assert layer.group_weights([0, 1]).tolist() == pytest.approx([0.125 + 0.75 * 0.75, 0.125 + 0.75 * 0.25])
    layer.commit(layer.step(x, 8)[1], torch.ones(8, dtype=torch.long))  # a running mean over the first images
    assert layer.group_recent.tolist() == pytest.approx([0.375, 0.625])
    zero = 0.375
    for seen in (16, 24, 32, 40):  # then an EMA over 32 images
        layer.commit(layer.step(x, 8)[1], torch.ones(8, dtype=torch.long))
        zero *= 1 - max(1 - (1 - 1 / 32) ** 8, 8 / (seen + 8))
    assert layer.group_recent.tolist() == pytest.approx([zero, 1 - zero])
    assert zero < 0.375 * (1 - 1 / 32) ** 32  # faster than an EMA from the start
    layer.reset()
    assert not layer.group_recent.any() and torch.equal(layer.source, source)


def test_balance_below_one_needs_the_groups_source_knots() -> None:
    k, c = 11, 2
    source, per_class = _two_classes(k, c)
    with pytest.raises(ValueError, match="source knots"):
        RobustLayerStream(source, StreamSettings(), RobustSettings(groups=2, balance=0.5), TorchStreamKernels(),
                          _quantile_knots(k))
    with pytest.raises(ValueError, match="shape"):
        RobustLayerStream(source, StreamSettings(), RobustSettings(groups=3, balance=0.5), TorchStreamKernels(),
                          _quantile_knots(k), per_class)
    for bad in ({"balance": -0.1}, {"balance": 1.5}, {"balance": True}, {"recent_horizon": 0}):
        with pytest.raises(ValueError):
            RobustSettings(**bad)


def _labelled(n: int, classes: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of 16 images whose brightness depends on their class (so the classes' knots differ)."""
    labels = torch.arange(n) % classes
    x = images(n, seed=seed) + labels[:, None, None, None] * 0.5
    return [(x[i : i + 16], labels[i : i + 16]) for i in range(0, n, 16)]


def test_calibrate_with_groups_keeps_each_groups_knots_as_if_calibrated_alone() -> None:
    model = bn_cnn().eval()
    batches = _labelled(96, 3, seed=0)
    stats = aqr.calibrate(model, batches, num_quantiles=21, compile=False, groups=4, max_samples=1 << 20)
    assert stats.groups == 4 and stats.group_images == (32, 32, 32, 0)
    for g in range(3):  # every value kept: each group's knots are those of its images alone
        alone = aqr.calibrate(model, [(x[y == g], y[y == g]) for x, y in batches], num_quantiles=21, compile=False,
                              max_samples=1 << 20)
        for name, layer in stats.layers.items():
            assert torch.allclose(layer.group_quantiles[g], alone.layers[name].quantiles, atol=1e-6)
    for layer in stats.layers.values():  # a group without source images holds the layer's knots
        assert torch.equal(layer.group_quantiles[3], layer.quantiles)
    plain = aqr.calibrate(model, batches, num_quantiles=21, compile=False, max_samples=1 << 20)
    assert all(torch.equal(plain.layers[n].quantiles, stats.layers[n].quantiles) for n in stats.layers)


def test_calibrate_with_groups_refuses_batches_without_integer_labels() -> None:
    model = bn_cnn().eval()
    x = images(16, seed=1)
    for batches, match in (([x], "no labels"), ([(x, torch.rand(16))], "integer label"),
                           ([(x, torch.zeros(8, dtype=torch.long))], "integer label"),
                           ([(x, -torch.ones(16, dtype=torch.long))], "negative")):
        with pytest.raises(ValueError, match=match):
            aqr.calibrate(model, batches, num_quantiles=11, compile=False, groups=2)
    with pytest.raises(ValueError, match="groups"):
        aqr.calibrate(model, [x], num_quantiles=11, compile=False, groups=0)


def test_grouped_statistics_round_trip_and_bad_ones_are_refused(tmp_path) -> None:
    model = bn_cnn().eval()
    stats = aqr.calibrate(model, _labelled(64, 2, seed=3), num_quantiles=11, compile=False, groups=2)
    back = aqr.SourceStats.load(stats.save(tmp_path / "g.aqr.safetensors"))
    assert back.groups == 2 and back.group_images == stats.group_images
    assert all(torch.equal(back.layers[n].group_quantiles, stats.layers[n].group_quantiles) for n in stats.layers)
    with pytest.raises(StatsError, match="group_images"):
        dataclasses.replace(stats, group_images=(64,))
    with pytest.raises(StatsError, match="group_quantiles groups"):
        dataclasses.replace(stats, groups=3, group_images=(1, 1, 1))
    with pytest.raises(StatsError, match="statistics none"):
        dataclasses.replace(stats, groups=None, group_images=None)
    bare = {n: dataclasses.replace(layer, group_quantiles=None) for n, layer in stats.layers.items()}
    with pytest.raises(StatsError, match="group_images is set"):
        dataclasses.replace(stats, layers=bare, groups=None)
    layer = next(iter(stats.layers.values()))
    with pytest.raises(StatsError, match="decrease"):
        dataclasses.replace(layer, group_quantiles=layer.group_quantiles.flip(-1) - 1)
    with pytest.raises(StatsError, match="NaN"):
        dataclasses.replace(layer, group_quantiles=torch.full_like(layer.group_quantiles, float("nan")))


def test_the_wrapper_maps_onto_the_groups_and_leaves_the_model_as_it_was() -> None:
    model = bn_cnn().eval()
    plain = aqr.calibrate(model, _labelled(64, 5, seed=4), num_quantiles=21, compile=False)
    grouped = aqr.calibrate(model, _labelled(64, 5, seed=4), num_quantiles=21, compile=False, groups=16)
    with pytest.raises(ValueError, match="groups=16"):
        aqr.AQR(model, plain, target="robust", balance=0.5)
    with pytest.raises(ValueError, match="groups=4"):
        aqr.AQR(model, grouped, target="robust", groups=4, balance=0.5)
    before = copy.deepcopy(model.state_dict())
    adapter = check_reset_round_trip(model, grouped, batch=8, target="robust", balance=0.5)
    assert "balance=0.5" in repr(adapter)
    balanced = aqr.AQR(model, grouped, target="robust")
    x = shifted(32, seed=7)
    outs = [(adapter(x[i : i + 8]), balanced(x[i : i + 8])) for i in range(0, 32, 8)]
    assert not torch.equal(outs[-1][0], outs[-1][1])  # the recent weights changed the map
    assert all(torch.equal(v, model.state_dict()[n]) for n, v in before.items())
    assert state(adapter)
