"""target="mixed": the clusters' seeding, assignment and update on hand-checkable descriptors, its equality with
target="robust" at blend 0, its state continuing bit for bit, and its options."""

from __future__ import annotations

import pytest
import torch

import aqr
from aqr.adapt.config import AQRConfig
from aqr.adapt.stream.mixed import SEED_IMAGES, ComponentRouter, seed_centres, squared_distances
from aqr.adapt.stream.robust import RUN_WINDOW
from aqr.core.descriptors import DescriptorStats, image_descriptors
from aqr.methods import plan
from tests.models_tiny import bn_cnn, gn_cnn, images, tiny_vit

BUILDERS = {"bn": bn_cnn, "gn": gn_cnn, "ln": tiny_vit}


def calibrated(name: str) -> tuple[torch.nn.Module, aqr.SourceStats]:
    model = BUILDERS[name]().eval()
    return model, aqr.calibrate(model, [images(64, seed=s) for s in range(2)], num_quantiles=21, compile=False,
                                descriptors=True)


def same(a: object, b: object) -> bool:
    """Whether two states (dicts, lists, tensors, plain values) hold the same values, bit for bit."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def shifted(n: int, seed: int) -> torch.Tensor:
    """Images of two domains in turn: the odd seeds brighter, of more contrast and noisy."""
    x = images(n, seed=seed)
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
    return x * 3 + 1 + 2 * noise if seed % 2 else x


def router(components: int, width: int = 2, scale: float = 1.0) -> ComponentRouter:
    """A router of one descriptor layer ``"a"`` of ``width`` values, whitened by ``scale`` times the identity."""
    stats = DescriptorStats(("a",), torch.zeros(width), scale * torch.eye(width), images=100)
    return ComponentRouter(stats, components)


def blobs(n: int, centres: list[list[float]], seed: int) -> torch.Tensor:
    """``n`` rows around each of ``centres`` (spread 0.1), in turn."""
    g = torch.Generator().manual_seed(seed)
    c = torch.tensor(centres)
    return c.repeat(n, 1) + 0.1 * torch.randn(n * len(centres), c.shape[1], generator=g)


def test_seeding_takes_one_row_of_each_far_blob_and_the_same_seed_the_same_rows() -> None:
    z = blobs(20, [[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]], seed=0).double()
    centres = seed_centres(z, 3, torch.Generator().manual_seed(0))
    nearest = squared_distances(torch.tensor([[0.0, 0.0], [10.0, 0.0], [0.0, 10.0]]).double(), centres)
    assert sorted(nearest.argmin(dim=1).tolist()) == [0, 1, 2]  # a centre in each blob
    assert torch.equal(centres, seed_centres(z, 3, torch.Generator().manual_seed(0)))


def test_the_router_seeds_after_its_images_assigns_the_nearest_whitened_centre_and_moves_it_by_a_running_mean() -> None:
    r = router(2, scale=2.0)
    first = blobs(SEED_IMAGES // 2, [[0.0, 0.0], [5.0, 5.0]], seed=1)
    r.begin()
    r.record("a", first[:10])
    assert r.assignment() is None  # not seeded: the shared state maps every image
    r.commit()
    assert not r.seeded and len(r.pending) == 10
    r.begin()
    r.record("a", first[10:])
    r.commit()
    assert r.seeded and len(r.pending) == 0 and float(r.counts.sum()) == len(first)
    # the centres are the whitened blob means (whitening 2 x identity)
    order = r.centres[:, 0].argsort()
    means = torch.stack([2 * first[i::2].double().mean(0) for i in range(2)])
    assert torch.allclose(r.centres[order], means, atol=1e-9)
    before, counts = r.centres[order].clone(), r.counts[order].clone()
    batch = torch.tensor([[0.2, 0.0], [4.0, 5.0], [5.0, 5.2]])
    r.begin()
    r.record("a", batch)
    a = r.assignment()
    assert a is not None and [int(order.argsort()[k]) for k in a.tolist()] == [0, 1, 1]
    r.commit()
    moved = r.centres[order]
    z = 2 * batch.double()
    assert torch.allclose(moved[0], before[0] + (z[0] - before[0]) / (counts[0] + 1))
    assert torch.allclose(moved[1], before[1] + (z[1:].sum(0) - 2 * before[1]) / (counts[1] + 2))


def seeded(components: int, seed: int) -> ComponentRouter:
    """A router of :func:`router` seeded from two blobs of images (its first :data:`SEED_IMAGES`)."""
    r = router(components)
    r.begin()
    r.record("a", blobs(SEED_IMAGES // 2, [[0.0, 0.0], [5.0, 5.0]], seed=seed))
    r.commit()
    return r


def test_a_stranded_centre_moves_onto_an_image_of_the_batch() -> None:
    r = seeded(3, seed=2)
    state = r.export_state()
    state["centres"][2] = torch.tensor([1e6, 1e6], dtype=torch.float64)  # far from every image: takes none
    state["counts"][2] = 0.0
    r.load_state(state)
    batch = torch.tensor([[0.0, 0.1], [5.0, 5.1]])
    r.begin()
    r.record("a", batch)
    r.commit()
    assert any(torch.equal(r.centres[2], row) for row in batch.double())
    assert float(r.counts[2]) == float(r.counts[:2].min())


def test_descriptors_are_each_images_standardized_mean_and_log_std() -> None:
    x = torch.tensor([[[1.0, 3.0]], [[5.0, 5.0]]])  # two images of one channel, two positions each
    source = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])  # median 2, inter-quartile range 3 - 1 = 2
    d = image_descriptors(x, 2, None, source)
    assert torch.allclose(d[:, 0], torch.tensor([0.0, 1.5]))
    assert torch.allclose(d[:, 1], torch.log(torch.tensor([0.5, 0.0]) + 0.05))
    pre = (torch.tensor([2.0]), torch.tensor([-1.0]))  # read as 2 x - 1
    assert torch.allclose(image_descriptors(x, 2, pre, source), image_descriptors(2 * x - 1, 2, None, source))


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("batch", [1, 3, 16])
def test_blend_0_is_robust_aqr_value_for_value(name: str, batch: int) -> None:
    model, stats = calibrated(name)
    stream = aqr.AQR(model, stats, target="robust", compile=False)
    shared = aqr.AQR(model, stats, target="mixed", blend=0.0, compile=False)
    for seed in range(SEED_IMAGES // batch + 4):
        x = shifted(batch, seed)
        assert torch.equal(shared(x), stream(x))
    held = shifted(batch, 7)
    assert torch.equal(shared.forward_held(held), stream.forward_held(held))


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_clusters_take_their_images_on_a_stream_of_two_domains_and_the_state_continues_bit_for_bit(name: str) -> None:
    model, stats = calibrated(name)
    adapter = aqr.AQR(model, stats, target="mixed", components=3, compile=False)
    robust = aqr.AQR(model, stats, target="robust", compile=False)
    differ = False
    for seed in range(40):  # both domains in each batch
        x = torch.cat([images(4, seed=seed), shifted(4, 2 * seed + 1)])
        differ |= not torch.equal(adapter(x), robust(x))
    # a cluster maps its images with its state before the batch (the shared state, at batch 8, with the batch
    # merged in first), so even a cluster that takes every image changes the map, once the predicted classes
    # show they do not come in runs (RUN_WINDOW of them)
    assert adapter._batch.router.seeded and differ
    # the tiny ViT's token-normalized layers tell its two domains apart too little for two clusters: one takes
    # every image there
    apart = name != "ln"
    started = [sum(part.started for part in m.streams[torch.device("cpu")].parts) for m in adapter._maps.values()]
    assert max(started) >= (2 if apart else 1)
    state = adapter.state_dict()
    fresh = aqr.AQR(model, stats, target="mixed", components=3, compile=False)
    fresh.load_state_dict(state)
    for seed in range(20, 26):
        x = torch.cat([images(5, seed=seed), shifted(3, 2 * seed + 1)])
        assert torch.equal(fresh(x), adapter(x))
    held = shifted(4, 41)
    before = adapter.state_dict()
    assert torch.equal(fresh.forward_held(held), adapter.forward_held(held))
    assert same(adapter.state_dict(), before)  # a held batch leaves the state as it was
    other = aqr.AQR(model, stats, target="stream", compile=False)
    with pytest.raises(RuntimeError, match="target='mixed'"):
        other.load_state_dict(state)


def test_the_clusters_share_is_0_until_the_classes_show_no_runs_and_fades_as_they_come_in_runs() -> None:
    model, stats = calibrated("bn")
    adapter = aqr.AQR(model, stats, target="mixed", components=2, compile=False)
    robust = aqr.AQR(model, stats, target="robust", compile=False)
    for seed in range(RUN_WINDOW // 8):  # runs are 1 until RUN_WINDOW classes were seen: robust AQR's map
        x = torch.cat([images(4, seed=seed), shifted(4, 2 * seed + 1)])
        assert torch.equal(adapter(x), robust(x))
    assert adapter._batch.router.seeded
    runs = {}
    for seed in range(RUN_WINDOW // 8, RUN_WINDOW // 8 + 6):
        x = torch.cat([images(4, seed=seed), shifted(4, 2 * seed + 1)])
        runs[seed] = adapter._batch.kind.batch_shares(adapter._batch.recent, adapter.config)[1]  # this batch's
        same_map = torch.equal(adapter(x), robust(x))
        if runs[seed] == 1.0:
            assert same_map
    assert min(runs.values()) < 1.0  # i.i.d. classes: the clusters map
    for layer in adapter._maps.values():
        stream = layer.streams[torch.device("cpu")]
        assert stream._blend(1.0) == 0.0 and stream._blend(0.0) == stream.blend == 0.3
        assert stream._blend(0.5) == pytest.approx(0.15)


def test_reset_forgets_the_clusters() -> None:
    model, stats = calibrated("bn")
    adapter = aqr.AQR(model, stats, target="mixed", components=2, compile=False)
    batches = [torch.cat([images(8, seed=s), shifted(8, 2 * s + 1)]) for s in range(8)]
    first = [adapter(x) for x in batches]
    assert adapter._batch.router.seeded
    adapter.reset()
    assert not adapter._batch.router.seeded
    again = [adapter(x) for x in batches]
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_the_options_are_checked_and_refused_elsewhere() -> None:
    assert AQRConfig(target="mixed", components=4, blend=0.25).mixed.components == 4
    with pytest.raises(ValueError, match="components must be an integer"):
        AQRConfig(target="mixed", components=0)
    with pytest.raises(ValueError, match="blend must be"):
        AQRConfig(target="mixed", blend=float("nan"))
    with pytest.raises(ValueError, match="blend must be"):
        AQRConfig(target="mixed", blend=1.5)
    with pytest.raises(ValueError, match="components=4: an option of target='mixed' only"):
        AQRConfig(target="stream", components=4)
    assert AQRConfig(target="mixed", groups=4, own_batch=False).robust.groups == 4  # robust AQR's options are its own
    with pytest.raises(ValueError, match="balance=0.5 .* not supported with it"):
        AQRConfig(target="mixed", balance=0.5)
    assert plan("aqr", {"target": "mixed", "components": 4}).config.components == 4


def test_statistics_without_descriptors_are_refused_in_one_line() -> None:
    model = bn_cnn().eval()
    stats = aqr.calibrate(model, [images(32, seed=0)], num_quantiles=21, compile=False)
    with pytest.raises(ValueError, match="descriptors=True"):
        aqr.AQR(model, stats, target="mixed", compile=False)


def test_a_descriptor_layer_left_out_of_the_recalibrated_ones_is_refused_by_name() -> None:
    model, stats = calibrated("bn")
    first = stats.descriptors.layers[0]
    rest = [name for name in stats.layer_names if name != first]
    with pytest.raises(ValueError, match=f"does not recalibrate \\['{first}'\\]"):
        aqr.AQR(model, stats, target="mixed", layers=rest, compile=False)


def test_an_overflowing_descriptor_joins_no_cluster_and_moves_no_centre() -> None:
    r = seeded(2, seed=3)
    before = r.export_state()
    r.begin()
    r.record("a", torch.tensor([[0.0, 0.1], [float("inf"), 0.0]]))
    assert r.assignment()[1] == -1 and r.assignment()[0] >= 0
    r.commit()
    assert bool(torch.isfinite(r.centres).all()) and float(r.counts.sum()) == float(before["counts"].sum()) + 1
    huge = aqr.AQR(*calibrated("bn"), target="mixed", compile=False)
    for seed in range(6):  # finite values whose spread overflows: the stream goes on, its state stays loadable
        x = shifted(16, seed)
        x[0] = 1e20 * (-1) ** torch.arange(x[0].numel()).view(x[0].shape)
        huge(x)
    assert huge._batch.router.seeded and bool(torch.isfinite(huge._batch.router.centres).all())


def test_a_moved_centre_starts_its_states_again_from_the_shared_one() -> None:
    model, stats = calibrated("bn")
    adapter = aqr.AQR(model, stats, target="mixed", components=3, compile=False)
    for seed in range(10):
        adapter(torch.cat([images(8, seed=seed), shifted(8, 2 * seed + 1)]))
    router = adapter._batch.router
    layer = next(m.streams[torch.device("cpu")] for m in adapter._maps.values()
                 if m.streams[torch.device("cpu")].parts)
    k = next(k for k in range(3) if layer.parts[k].started)
    assert not layer._starts()[k]
    router.generation[k] += 1  # as a stranded centre's move does
    assert layer._starts()[k]
    adapter(torch.cat([images(8, seed=50), shifted(8, 101)]))
    assert int(layer.generations[k]) == int(router.generation[k]) or not layer.parts[k].started


def test_a_state_is_refused_by_an_aqr_of_other_descriptor_statistics() -> None:
    model, stats = calibrated("bn")
    adapter = aqr.AQR(model, stats, target="mixed", compile=False)
    adapter(shifted(16, 1))
    other = aqr.calibrate(model, [images(64, seed=s) for s in range(2)], num_quantiles=21, compile=False,
                          descriptors=True)
    other.descriptors = DescriptorStats(stats.descriptors.layers, stats.descriptors.mean + 1,
                                        stats.descriptors.whitening, stats.descriptors.images)
    with pytest.raises(RuntimeError, match="other source statistics"):
        aqr.AQR(model, other, target="mixed", compile=False).load_state_dict(adapter.state_dict())


def test_the_knot_average_estimator_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError, match="estimator='knot-ema' is not supported"):
        aqr.AQRConfig(target="mixed", estimator="knot-ema")


def test_a_starting_cluster_copies_the_shared_states_stream_parts_alone() -> None:
    """What a cluster loads when it starts: the shared robust state's parts a plain stream state has, the same
    values as in its whole export, without the class groups."""
    model, stats = calibrated("bn")
    adapter = aqr.AQR(model, stats, target="mixed", components=3, compile=False)
    for seed in range(6):
        adapter(torch.cat([images(8, seed=seed), shifted(8, 2 * seed + 1)]))
    layer = next(m.streams[torch.device("cpu")] for m in adapter._maps.values()
                 if m.streams[torch.device("cpu")].parts)
    part, whole = layer.shared.export_stream_state(), layer.shared.export_state()
    assert set(part) == set(layer.parts[0].export_state())
    assert not any(name.startswith("group_") for name in part) and "group_knots" in whole
    for name, value in part.items():
        assert torch.equal(value, whole[name]) if isinstance(value, torch.Tensor) else value == whole[name]
    layer.parts[0].load_state(part)  # a cluster's state takes it as it is
