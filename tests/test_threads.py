"""Several threads using aqr on one model: the sequential results, and the user's model left exactly
as it was."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

import aqr
from tests.models_tiny import bn_cnn, images, tiny_vit

THREADS = 8


def snapshot(model: nn.Module) -> dict:
    """Everything of a model that aqr could leave changed: modes, instance attributes, hooks, weights."""
    return {
        "training": {name: m.training for name, m in model.named_modules()},
        "attributes": {name: sorted(m.__dict__) for name, m in model.named_modules()},
        "forward": {name: m.__dict__.get("forward") for name, m in model.named_modules()},
        "hooks": {name: (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for name, m in model.named_modules()},
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    for key in ("training", "attributes", "forward", "hooks"):
        assert after[key] == before[key], key
    assert after["state"].keys() == before["state"].keys()
    for k, v in before["state"].items():
        assert torch.equal(after["state"][k], v), k


def run_threads(work: Callable[[int], None], n: int = THREADS) -> None:
    """Run ``work(i)`` in ``n`` threads started together; re-raise the first failure."""
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def run(i: int) -> None:
        try:
            start.wait()
            work(i)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def calibrated(make: Callable[[], nn.Module], shift: float = 1.0) -> tuple[nn.Module, aqr.SourceStats]:
    model = make()
    return model, aqr.calibrate(model, [images(256, seed=3) * shift])


@pytest.mark.parametrize("make", [bn_cnn, tiny_vit])
@pytest.mark.parametrize("native", [True, False])
def test_threads_sharing_one_aqr_get_the_sequential_outputs(make, native):
    model, stats = calibrated(make)
    model.train()  # a user's model in training mode: it must come back so
    norm = next(m for m in model.modules() if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)))
    norm.register_forward_hook(lambda m, i, o: None)  # a user's own hook stays, and only it
    adapted = aqr.AQR(model, stats, native=native, compile=False)
    batches = [images(16, seed=10 + i) * (0.5 + 0.1 * i) for i in range(THREADS)]
    before = snapshot(model)
    expected = [adapted(x) for x in batches]
    outputs: dict[tuple[int, int], torch.Tensor] = {}

    def work(i: int) -> None:
        for r in range(6):
            j = (i + r) % THREADS  # each thread runs different batches, all batches run at once
            outputs[i, r] = adapted(batches[j])

    run_threads(work)
    for (i, r), out in outputs.items():
        torch.testing.assert_close(out, expected[(i + r) % THREADS], rtol=1e-6, atol=1e-6)
    assert_unchanged(model, before)
    with torch.no_grad():
        plain = model.eval()(batches[0])
    assert not torch.allclose(plain, expected[0])


def test_recalibrating_blocks_exited_out_of_order_leave_the_model_as_before():
    """The issue's reproduction: the second block's exit used to leave its swapped forward behind."""
    model, stats = calibrated(bn_cnn)
    model.train()
    before = snapshot(model)
    x = images(16, seed=7)
    with torch.no_grad():
        plain = model.eval()(x)
        model.train()
        inside = aqr.AQR(model, stats)(x)
        a, b = aqr.recalibrating(model, stats), aqr.recalibrating(model, stats)
        a.__enter__()
        b.__enter__()  # nested blocks compose: b maps what a produced
        a.__exit__(None, None, None)
        torch.testing.assert_close(model(x), inside, rtol=1e-5, atol=1e-5)  # b is still active
        assert not model.training
        b.__exit__(None, None, None)
    assert "forward" not in model[1].__dict__
    assert_unchanged(model, before)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), plain)


def test_threads_in_recalibrating_blocks_and_a_plain_caller_each_see_their_own_model():
    """Two threads recalibrate with two sets of statistics while a third calls the model plainly.

    Caveat (documented): while any thread is inside a block the model is in eval mode, so the plain
    caller here uses a model already in eval mode.
    """
    model, stats = calibrated(bn_cnn)
    dark = aqr.calibrate(model, [images(256, seed=3) * 0.3])
    model.eval()
    before = snapshot(model)
    x = images(16, seed=8)
    with torch.no_grad():
        plain = model(x)
        with aqr.recalibrating(model, stats):
            want = {"stats": model(x)}
        with aqr.recalibrating(model, dark):
            want["dark"] = model(x)
    assert not torch.allclose(want["stats"], want["dark"])
    which = {0: "stats", 1: "dark", 2: None}
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in which}

    def work(i: int) -> None:
        for _ in range(20):
            with torch.no_grad():
                if which[i] is None:
                    seen[i].append(model(x))
                else:
                    with aqr.recalibrating(model, stats if which[i] == "stats" else dark):
                        seen[i].append(model(x))

    run_threads(work, n=3)
    for i, outs in seen.items():
        for out in outs:
            torch.testing.assert_close(out, plain if which[i] is None else want[which[i]], rtol=1e-5, atol=1e-5)
    assert_unchanged(model, before)


def test_threads_calibrating_one_model_get_the_sequential_statistics():
    model = bn_cnn().train()
    data = [images(64, seed=s) for s in range(4)]
    want = aqr.calibrate(model, data)
    before = snapshot(model)
    got: dict[int, aqr.SourceStats] = {}
    run_threads(lambda i: got.__setitem__(i, aqr.calibrate(model, data)), n=4)
    for stats in got.values():
        for name, layer in want.layers.items():
            assert torch.equal(stats.layers[name].quantiles, layer.quantiles), name
    assert_unchanged(model, before)


def test_the_wrapper_never_touches_the_model_and_follows_its_changes():
    """AQR runs a private twin of the module tree: the model's hooks still see recalibrated outputs,
    and later weight changes (load_state_dict) are seen, while the model itself is never modified."""
    model, stats = calibrated(bn_cnn)
    seen = []
    model[1].register_forward_hook(lambda m, i, out: seen.append((type(m).__name__, out.clone())))
    adapted = aqr.AQR(model, stats)
    before = snapshot(model)
    x = images(16, seed=9)
    out = adapted(x)
    assert_unchanged(model, before)  # the user's hook ran, nothing of the model changed
    kind, first = seen[-1]
    assert kind == "BatchNorm2d"  # the hook is handed a BatchNorm, as before
    with torch.no_grad():
        model.eval()
        plain = model[1](model[0](x))
        model.train()
    assert not torch.allclose(first, plain)  # the hook saw the recalibrated output
    late = []
    model[4].register_forward_hook(lambda m, i, o: late.append(1))  # registered after AQR was built
    adapted(x)
    assert late == [1]
    other = bn_cnn(seed=5)
    model.load_state_dict(other.state_dict())
    with pytest.warns(UserWarning, match="weights differ"):
        fresh = aqr.AQR(model, stats)
    torch.testing.assert_close(adapted(x), fresh(x))
    assert not torch.allclose(adapted(x), out)
    assert [k for k in adapted.state_dict()] == [f"model.{k}" for k in model.state_dict()]


class Hidden(nn.Module):
    """Reaches its norm layer outside the module tree (a plain list, or a closure): AQR's twin cannot."""

    def __init__(self, closure: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.norm = nn.BatchNorm2d(4)
        norm = self.norm
        if closure:
            self.fetch = lambda: norm
        else:
            self.hidden = [self.norm]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.fetch() if hasattr(self, "fetch") else self.hidden[0]
        return norm(self.conv(x)).mean((2, 3))


def test_a_layer_outside_the_module_tree_is_named_not_silently_skipped():
    for closure in (False, True):
        model = Hidden(closure).eval()
        stats = aqr.calibrate(model, [images(32)])
        if closure:
            adapted = aqr.AQR(model, stats)
        else:
            with pytest.warns(UserWarning, match="'norm' is also held outside.*'hidden'"):
                adapted = aqr.AQR(model, stats)  # a hint before any call
        with pytest.raises(aqr.LayerError, match="'norm' was not called"):
            adapted(images(8))  # found by the first call


def test_a_spare_reference_to_a_layer_is_only_a_hint():
    """A model that keeps a list of its norms but calls them as submodules works (after a warning)."""
    model = bn_cnn()
    model.norms = [model[1], model[4]]  # a plain list, not registered
    stats = aqr.calibrate(model, [images(32)])
    with pytest.warns(UserWarning, match="also held outside"):
        adapted = aqr.AQR(model, stats)
    assert adapted(images(8)).shape == (8, 5)
