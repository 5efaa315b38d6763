"""aqr.AQR(target="stream") on whole models: the running estimate, its state, and the batch mode unchanged."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import aqr
from aqr.core.layers import NonFiniteActivationError
from aqr.methods import create
from tests import batch_reference
from tests.models_tiny import images

BUILDERS = batch_reference.BUILDERS


pytestmark = pytest.mark.usefixtures("one_thread")


def calibrated(name: str) -> tuple[nn.Module, aqr.SourceStats]:
    model = BUILDERS[name]().eval()
    return model, aqr.calibrate(model, [images(64, seed=s) for s in range(2)], num_quantiles=21, compile=False)


def shifted(n: int, seed: int) -> torch.Tensor:
    return images(n, seed=seed) * 1.5 + 0.2


def state(adapter: aqr.AQR) -> list[dict]:
    return [s.snapshot() for m in adapter._maps.values() for s in m.streams.values()]


def same(a: list[dict], b: list[dict]) -> bool:
    from tests.test_stream import _same

    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("name", ["bn", "gn", "vit"])
def test_the_batch_mode_gives_the_outputs_it_gave_before_streaming(name: str) -> None:
    """Outputs stored by the implementation before target='stream' existed (tests/batch_reference.py:
    the same models, statistics and inputs), for the fast (C and torch), exact and Gaussian-tail maps."""
    stored = load_file(batch_reference.DATA / "batch_reference.safetensors")
    model = batch_reference.BUILDERS[name]().eval()
    model.load_state_dict({k.split("/", 2)[2]: v for k, v in stored.items() if k.startswith(f"{name}/weights/")})
    stats = aqr.SourceStats.load(batch_reference.DATA / f"batch_reference_{name}.stats.safetensors")
    x = stored[f"{name}/input"]
    for key, options in batch_reference.CONFIGS.items():
        for target in ({}, {"target": "batch"}):
            out = aqr.AQR(model, stats, **options, **target)(x)
            torch.testing.assert_close(out, stored[f"{name}/{key}"], rtol=1e-6, atol=1e-6, msg=f"{name} {key}")


def per_image_offsets(n: int, g: torch.Generator) -> torch.Tensor:
    """Images whose values are N(mu_i, 1), mu_i ~ N(0, 1) per image: the pooled distribution (what the
    source knots describe) is wider than any one image's."""
    return torch.randn(n, 1, 1, 1, generator=g) + torch.randn(n, 3, 8, 8, generator=g)


@pytest.fixture(scope="module")
def probe() -> tuple[nn.Module, aqr.SourceStats, torch.Tensor, torch.Tensor]:
    """A bare BatchNorm (the identity in eval mode), its statistics, and a shifted stream ``exp(clean / 2)``
    that AQR should map back to ``clean`` (a monotone shift of every value)."""
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(3, affine=False)).eval()
    stats = aqr.calibrate(model, [per_image_offsets(256, g) for _ in range(4)], tail_unit="images", compile=False)
    clean = per_image_offsets(512, g)
    return model, stats, clean, torch.exp(clean / 2)


def error(adapter: nn.Module, x: torch.Tensor, clean: torch.Tensor, batch: int) -> float:
    out = torch.cat([adapter(x[i : i + batch]) for i in range(0, len(x), batch)])
    return float(((out - clean)[256:] ** 2).mean())  # after the warm-up


@pytest.mark.parametrize("batch", [1, 4])
def test_small_batches_of_a_stream_are_mapped_back_where_per_batch_aqr_fails(probe, batch: int) -> None:
    model, stats, clean, x = probe
    large = float(((aqr.AQR(model, stats)(x) - clean)[256:] ** 2).mean())
    stream = error(aqr.AQR(model, stats, target="stream", horizon=64), x, clean, batch)
    per_batch = error(aqr.AQR(model, stats), x, clean, batch)
    assert large < 0.01 and stream < 0.05, (large, stream)
    assert per_batch > 5 * stream  # one image's quantiles are not the pooled distribution's
    # the torch kernels run the same estimator
    assert error(aqr.AQR(model, stats, target="stream", horizon=64, native=False, compile=False), x, clean,
                 batch) == pytest.approx(stream, rel=0.05)


def test_knot_ema_is_biased_at_batch_1_where_cdf_ema_is_not(probe) -> None:
    """Averaging each image's quantile function gives one image's width, not the pooled distribution's."""
    model, stats, clean, x = probe
    cdf = error(aqr.AQR(model, stats, target="stream", horizon=64), x, clean, 1)
    knots = error(aqr.AQR(model, stats, target="stream", horizon=64, estimator="knot-ema"), x, clean, 1)
    assert knots > 5 * cdf


def check_reset_round_trip(model: nn.Module, stats: aqr.SourceStats, batch: int, **options: object) -> aqr.AQR:
    """A stream of 40 images, reset, the same stream again: the reset state is a fresh adapter's bit for bit,
    the outputs repeat, the memory stays, the model is untouched. Returns the adapter (after the rerun)."""
    before = copy.deepcopy(model.state_dict())
    adapter, fresh = aqr.AQR(model, stats, **options), aqr.AQR(model, stats, **options)
    x = shifted(40, seed=4)
    fresh(x[:1])
    fresh.reset()
    initial = state(fresh)
    first = torch.cat([adapter(x[i : i + batch]) for i in range(0, 40, batch)])
    assert not same(state(adapter), initial)
    size = adapter.memory_bytes()
    adapter.reset()
    assert same(state(adapter), initial)
    again = torch.cat([adapter(x[i : i + batch]) for i in range(0, 40, batch)])
    assert torch.equal(first, again)
    assert adapter.memory_bytes() == size > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return adapter


def test_reset_restores_the_initial_state_bit_for_bit_and_the_model_is_untouched() -> None:
    check_reset_round_trip(*calibrated("bn"), batch=2, target="stream", horizon=16)


@pytest.mark.parametrize("policy", ["raise", "skip"])
@pytest.mark.parametrize("where", ["input", "head"])
def test_a_batch_with_nan_leaves_the_state_unchanged(policy: str, where: str) -> None:
    model, stats = calibrated("bn")
    adapter = aqr.AQR(model, stats, target="stream", on_nonfinite=policy, horizon=16)
    for i in range(6):
        adapter(shifted(2, seed=10 + i))
    saved = state(adapter)
    bad = shifted(2, seed=20)
    if where == "input":
        bad[1, 0, 3, 3] = float("nan")
        context = pytest.raises(NonFiniteActivationError, match="layer")
    else:  # every layer finite, the logits not: a head with an infinite bias
        model = copy.deepcopy(model)
        adapter = aqr.AQR(model, stats, target="stream", on_nonfinite=policy, horizon=16)
        for i in range(6):
            adapter(shifted(2, seed=10 + i))
        saved = state(adapter)
        with torch.no_grad():
            model[-1].bias.fill_(float("inf"))
        context = pytest.raises(NonFiniteActivationError, match="logits")
    if policy == "raise":
        with context:
            adapter(bad)
    else:
        out = adapter(bad)
        assert not torch.isfinite(out).all()
    assert same(state(adapter), saved)


def test_threads_sharing_one_stream_are_serialized() -> None:
    model, stats = calibrated("gn")
    shared = aqr.AQR(model, stats, target="stream", horizon=16)
    batches = [shifted(2, seed=30 + i) for i in range(8)]
    inside, most = [0], [0]

    def slow(_m: nn.Module, _i: object) -> None:
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        threading.Event().wait(0.005)
        inside[0] -= 1

    handle = model[1].register_forward_pre_hook(slow)
    try:
        threads = [threading.Thread(target=shared, args=(b,)) for b in batches]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        handle.remove()
    assert most[0] == 1
    assert sum(s.seen + s.group.images for m in shared._maps.values() for s in m.streams.values()) == 16 * len(shared._maps)


def test_a_call_from_inside_its_own_forward_is_refused() -> None:
    model, stats = calibrated("bn")
    adapter = aqr.AQR(model, stats, target="stream")
    errors = []

    def reenter(_m: nn.Module, inputs: tuple) -> None:
        try:
            adapter(torch.zeros(1, 3, 8, 8))
        except RuntimeError as err:
            errors.append(str(err))

    handle = model[-1].register_forward_pre_hook(reenter)
    try:
        adapter(shifted(2, seed=1))
    finally:
        handle.remove()
    assert errors and "inside its own forward" in errors[0]


def test_options_are_checked() -> None:
    model, stats = calibrated("bn")
    for bad in ({"target": "window"}, {"target": "stream", "mode": "exact"}, {"estimator": "median"},
                {"horizon": 0}, {"rebuild_every": 0}, {"stream_grid": 0}):
        with pytest.raises(ValueError):
            aqr.AQR(model, stats, **bad)
    with pytest.raises(ValueError, match="tail"):
        aqr.AQR(model, stats, target="stream", tail="gaussian")
    with pytest.raises(ValueError, match="aqr.AQR"):
        with aqr.recalibrating(model, stats, target="stream"):
            pass
    assert aqr.AQR(model, stats).memory_bytes() == 0


def test_the_method_keeps_its_stream_online_and_restarts_it_episodically() -> None:
    model, stats = calibrated("bn")
    x = shifted(8, seed=6)
    online = create("aqr", model, stats=stats, target="stream", protocol="online")
    episodic = create("aqr", model, stats=stats, target="stream", protocol="episodic")
    first = episodic(x[:4])
    assert torch.equal(online(x[:4]), first)
    second = episodic(x[4:])  # reset before each batch: the batch is mapped with its own knots
    assert torch.equal(second, aqr.AQR(model, stats, target="stream")(x[4:]))
    assert not torch.equal(online(x[4:]), second)  # the online stream maps it with the first batch's
    online.reset()
    assert torch.equal(online(x[:4]), first)


def test_the_direct_small_batch_path_gives_the_general_paths_outputs_and_state(monkeypatch) -> None:
    """A small batch of a folded BatchNorm on the C kernels goes straight to one bound scan (and its commit
    to one bound push); the general chain of checks, step and scan gives the same bits, also across held
    batches, large batches, a NaN batch and the user's parameters changed between batches."""
    from aqr.adapt.stream.stream_maps import StreamLayerMap

    model, stats = calibrated("bn")

    def run(direct: bool) -> tuple[list[torch.Tensor], list[dict]]:
        twin_model = copy.deepcopy(model)
        adapter = aqr.AQR(twin_model, stats, target="stream", horizon=16, rebuild_every=4, on_nonfinite="skip")
        taken, outs = [], []
        for i, b in enumerate([1, 1, 2, 3, 1, 5, 1, 2, 1, 1, 8, 1, 3, 1, 2, 1]):
            x = shifted(b, seed=100 + i)
            if i == 6:
                x[0, 0, 2, 2] = float("nan")
            if i == 9:
                with torch.no_grad():
                    twin_model[1].weight.mul_(1.1)  # in place: its version moves
            if i == 12:
                twin_model[1].bias.data = twin_model[1].bias.data + 0.3  # new memory, same version
            outs.append(adapter(x))
            if i % 4 == 2:
                outs.append(adapter.forward_held(shifted(2, seed=200 + i)))
            taken.append(any(m._small is not None for m in adapter._maps.values()))
        assert any(taken) == direct
        return outs, state(adapter)

    direct = run(True)
    monkeypatch.setattr(StreamLayerMap, "_note_small", lambda *args: None)  # every batch by the general path
    general = run(False)
    assert len(direct[0]) == len(general[0])
    for a, b in zip(direct[0], general[0]):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert same(direct[1], general[1])


class SharedNorm(nn.Module):
    """Two convolutions normalized by one BatchNorm: its layer runs twice in every forward pass."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.bn, self.head = nn.BatchNorm2d(8), nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv1(x)))
        return self.head(torch.relu(self.bn(self.conv2(x))).mean((2, 3)))


def test_a_layer_run_twice_per_forward_commits_its_batches_in_order(monkeypatch) -> None:
    """A BatchNorm applied twice per forward pass stages two batches of one stream; the direct path commits them
    one after the other, as the general path does: the same outputs and state, bit for bit."""
    from aqr.adapt.stream.stream_maps import StreamLayerMap

    torch.manual_seed(0)
    model = SharedNorm()
    with torch.no_grad():
        for s in range(4):  # running statistics of its own
            model(images(32, seed=s))
    model.eval()
    stats = aqr.calibrate(model, [images(64, seed=s) for s in range(2)], num_quantiles=21, compile=False)

    def run(direct: bool) -> tuple[list[torch.Tensor], list[dict]]:
        adapter = aqr.AQR(copy.deepcopy(model), stats, target="stream", horizon=8, rebuild_every=4)
        outs = [adapter(shifted(b, seed=300 + i)) for i, b in enumerate([1, 2, 1, 1, 3, 1, 1, 1, 2])]
        assert any(m._small is not None for m in adapter._maps.values()) == direct
        return outs, state(adapter)

    direct = run(True)
    monkeypatch.setattr(StreamLayerMap, "_note_small", lambda *args: None)
    general = run(False)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(direct[0], general[0]))
    assert same(direct[1], general[1])


def test_a_batch_norm_changed_through_data_is_folded_anew() -> None:
    """``bn.bias.data = ...`` keeps the tensor and its version: the folded affine sees the new memory."""
    model, stats = calibrated("bn")
    x = shifted(2, seed=7)
    adapter = aqr.AQR(model, stats)
    adapter(x)
    model[1].bias.data = model[1].bias.data + 0.5
    fresh = aqr.AQR(model, stats)
    assert torch.equal(adapter(x), fresh(x))
