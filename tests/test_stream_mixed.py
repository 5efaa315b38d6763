"""target="mixed": the components' assignment and update on hand-checkable descriptors, its equality with
target="stream" where one component takes every image, its state continuing bit for bit, and its options."""

from __future__ import annotations

import pytest
import torch

import aqr
from aqr.adapt.config import AQRConfig
from aqr.adapt.stream.mixed import MIN_SEEN, ComponentAssigner, image_descriptors
from aqr.adapt.stream.running import batch_weight
from aqr.methods import plan
from tests.models_tiny import bn_cnn, gn_cnn, images, tiny_vit

BUILDERS = {"bn": bn_cnn, "gn": gn_cnn, "ln": tiny_vit}


def calibrated(name: str) -> tuple[torch.nn.Module, aqr.SourceStats]:
    model = BUILDERS[name]().eval()
    return model, aqr.calibrate(model, [images(64, seed=s) for s in range(2)], num_quantiles=21, compile=False)


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


def test_the_first_batch_starts_one_component_at_its_mean() -> None:
    assigner = ComponentAssigner(components=2, spawn=4.0, horizon=8.0)
    desc = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0], [2.0, 2.0]])
    a = assigner.assign(desc)
    assert a.of.tolist() == [0, 0, 0, 0] and a.spawned == 0 and a.parent is None
    assigner.commit(a)
    assert assigner.active.tolist() == [True, False] and assigner.seen.tolist() == [4, 0]
    assert torch.equal(assigner.centres[0], torch.tensor([1.0, 1.0], dtype=torch.float64))
    # each image differs from (1, 1) by 1 in both values: squared differences 1 and 1, median 1
    assert float(assigner.spreads[0]) == pytest.approx(1.0)


def test_a_far_image_starts_a_component_from_its_nearest_and_the_centres_move_by_the_running_weight() -> None:
    assigner = ComponentAssigner(components=2, spawn=4.0, horizon=8.0)
    first = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0], [2.0, 2.0]]).repeat(MIN_SEEN // 4, 1)
    assigner.commit(assigner.assign(first))
    near, far = [1.0, 1.5], [9.0, 9.0]  # median squared differences from (1, 1) (the lower of two): 0 and 64
    a = assigner.assign(torch.tensor([near, far]))
    assert a.of.tolist() == [0, 1] and (a.spawned, a.parent) == (1, 0)
    before = assigner.export_state()
    assert all(torch.equal(before[k], assigner.export_state()[k]) for k in ("centres", "seen"))  # assign changes nothing
    assigner.commit(a)
    w0 = batch_weight(1, MIN_SEEN, 8.0)  # a running mean of the component's images until it saw its horizon
    assert torch.allclose(assigner.centres[0], torch.tensor([1.0, 1.0 + 0.5 * w0], dtype=torch.float64))
    assert torch.equal(assigner.centres[1], torch.tensor(far, dtype=torch.float64))  # its own image, weight 1
    assert assigner.seen.tolist() == [MIN_SEEN + 1, 1] and assigner.last.tolist() == [MIN_SEEN + 2] * 2
    # no free component left: an image far from both goes to the nearer one
    b = assigner.assign(torch.tensor([[-20.0, -20.0]]))
    assert b.of.tolist() == [0] and b.spawned is None


def test_a_component_idle_for_its_horizons_is_taken_over() -> None:
    assigner = ComponentAssigner(components=2, spawn=4.0, horizon=2.0)
    base = torch.zeros(MIN_SEEN, 2)
    base[::2, 0] = 1.0
    assigner.commit(assigner.assign(base))
    assigner.commit(assigner.assign(torch.tensor([[50.0, 50.0]])))  # component 1
    for _ in range(8):  # component 1 takes nothing for 8 images = 4 horizons
        assigner.commit(assigner.assign(base[:1]))
    a = assigner.assign(torch.tensor([[-50.0, -50.0]]))
    assert (a.spawned, a.parent) == (1, 0)


def test_held_batches_assign_without_starting_components() -> None:
    assigner = ComponentAssigner(components=3, spawn=1.0, horizon=8.0)
    assigner.commit(assigner.assign(torch.randn(MIN_SEEN, 4, generator=torch.Generator().manual_seed(0))))
    a = assigner.assign(torch.full((2, 4), 100.0), held=True)
    assert a.spawned is None and a.update is None and a.of.tolist() == [0, 0]


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
def test_one_component_is_streaming_aqr_value_for_value(name: str, batch: int) -> None:
    model, stats = calibrated(name)
    stream = aqr.AQR(model, stats, target="stream", compile=False)
    single = aqr.AQR(model, stats, target="mixed", components=1, compile=False)
    one_domain = aqr.AQR(model, stats, target="mixed", spawn=1e30, compile=False)  # nothing is ever far enough
    for seed in range(6):
        x = shifted(batch, seed)
        expected = stream(x)
        assert torch.equal(single(x), expected) and torch.equal(one_domain(x), expected)
    held = shifted(batch, 7)
    assert torch.equal(single.forward_held(held), stream.forward_held(held))


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_components_start_on_a_stream_of_two_domains_and_the_state_continues_bit_for_bit(name: str) -> None:
    model, stats = calibrated(name)
    spawn = 1.5 if name == "ln" else 3.0  # the tiny ViT's tokens, normalized each, tell the domains apart less
    adapter = aqr.AQR(model, stats, target="mixed", components=3, spawn=spawn, compile=False)
    for seed in range(4):  # one domain first, then both in each batch
        adapter(images(8, seed=seed))
    for seed in range(12):
        adapter(torch.cat([images(4, seed=seed), shifted(4, 2 * seed + 1)]))
    active = [int(m.streams[torch.device("cpu")].assigner.active.sum()) for m in adapter._maps.values()]
    assert max(active) >= 2  # the domains took components of their own
    state = adapter.state_dict()
    fresh = aqr.AQR(model, stats, target="mixed", components=3, spawn=spawn, compile=False)
    fresh.load_state_dict(state)
    for seed in range(20, 26):
        x = torch.cat([images(5, seed=seed), shifted(3, 2 * seed + 1)])
        assert torch.equal(fresh(x), adapter(x))
    held = shifted(4, 41)
    before = adapter.state_dict()
    assert torch.equal(fresh.forward_held(held), adapter.forward_held(held))
    after = adapter.state_dict()
    assert same(after, before)  # a held batch leaves the state as it was
    other = aqr.AQR(model, stats, target="stream", compile=False)
    with pytest.raises(RuntimeError, match="target='mixed'"):
        other.load_state_dict(state)


def test_reset_forgets_the_components() -> None:
    model, stats = calibrated("bn")
    adapter = aqr.AQR(model, stats, target="mixed", components=2, spawn=3.0, compile=False)
    batches = [images(8, seed=s) for s in range(3)] + [torch.cat([images(4, seed=s), shifted(4, 2 * s + 1)])
                                                       for s in range(6)]
    first = [adapter(x) for x in batches]
    assert int(next(iter(adapter._maps.values())).streams[torch.device("cpu")].assigner.active.sum()) == 2
    adapter.reset()
    again = [adapter(x) for x in batches]
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_the_options_are_checked_and_refused_elsewhere() -> None:
    assert AQRConfig(target="mixed", components=4, spawn=2.0).mixed.components == 4
    with pytest.raises(ValueError, match="components must be an integer"):
        AQRConfig(target="mixed", components=0)
    with pytest.raises(ValueError, match="spawn must be"):
        AQRConfig(target="mixed", spawn=float("nan"))
    with pytest.raises(ValueError, match="components=4: an option of target='mixed' only"):
        AQRConfig(target="stream", components=4)
    with pytest.raises(ValueError, match="groups=4: an option of target='robust' only"):
        AQRConfig(target="mixed", groups=4)
    assert plan("aqr", {"target": "mixed", "components": 4}).config.components == 4


def test_off_the_cpu_it_says_it_runs_on_the_cpu_only() -> None:
    model, stats = calibrated("bn")
    adapter = aqr.AQR(model, stats, target="mixed", compile=False, native=False)
    layer = next(iter(adapter._maps.values()))
    stream = layer.stream(torch.device("meta"))
    with pytest.raises(ValueError, match="CPU only"):
        stream.assign(torch.zeros(4, 3, 2, device="meta"), 4, None)


def test_the_distance_is_the_median_squared_difference() -> None:
    from aqr.adapt.stream.mixed import descriptor_distance

    centre = torch.zeros(5)
    content = torch.tensor([10.0, 0.0, 0.0, 0.0, 0.1])  # one channel far: content
    shift = torch.tensor([1.0, 1.0, 1.0, -1.0, 1.0])  # every channel moved: a domain
    assert float(descriptor_distance(content, centre)) == 0.0 and float(descriptor_distance(shift, centre)) == 1.0
