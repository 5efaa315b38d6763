"""Copies and saved states of an adapted model: ``copy.deepcopy``, ``pickle`` and ``torch.save`` of an
``aqr.AQR`` (any target, before or after forward passes, also while another thread is inside one) give a
wrapper that continues like the original, and a streaming AQR's ``state_dict()`` holds its running
state, which a fresh AQR loads (``weights_only=True``) to continue the stream bit for bit."""

from __future__ import annotations

import copy
import io
import pickle
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

import aqr
from aqr.adapt.stream.native_kernels import NativeStreamKernels, load_stream_kernels
from aqr.backends.build import load_kernels
from aqr.backends.native import NativeBackend
from tests.models_tiny import images
from tests.test_robust_groups import _labelled
from tests.test_threads import assert_unchanged, snapshot

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCKED = "aqr-blocked-forward"  # the name of the thread a Gate holds inside the forward pass


class Gate(nn.Module):
    """The identity; in the thread named :data:`BLOCKED` it signals ``inside`` and waits for ``release``.
    A copy gets events of its own (events cannot be copied)."""

    def __init__(self) -> None:
        super().__init__()
        self.__setstate__({})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if threading.current_thread().name == BLOCKED:
            self.inside.set()
            assert self.release.wait(60), "the test never released the blocked forward pass"
        return x

    def __getstate__(self) -> dict[str, object]:
        state = super().__getstate__()
        del state["inside"], state["release"]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        super().__setstate__(state)
        self.inside, self.release = threading.Event(), threading.Event()


def gated_model() -> nn.Module:
    """A Gate, then a BatchNorm CNN whose head reads every position (the pooled heads of tests/models_tiny.py
    predict one class for every input: "robust" would fill one group)."""
    torch.manual_seed(0)
    return nn.Sequential(Gate(), nn.Conv2d(3, 8, 3, padding=1, stride=2), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
                         nn.Linear(8 * 4 * 4, 5)).eval()


CONFIGS: dict[str, dict[str, object]] = {
    "batch": {},
    "stream": {"target": "stream", "horizon": 16, "rebuild_every": 4},
    "stream-knot-ema": {"target": "stream", "estimator": "knot-ema", "horizon": 16, "rebuild_every": 4},
    "robust": {"target": "robust", "groups": 4, "class_horizon": 8, "rebuild_every": 4},
    "robust-balanced": {"target": "robust", "groups": 4, "balance": 0.5, "passes": 2, "rebuild_every": 4},
}
STREAMING = [name for name in CONFIGS if name != "batch"]


def native_ids(native: bool) -> str:
    return "C" if native else "torch"


@pytest.fixture(params=[True, False], ids=native_ids)
def native(request: pytest.FixtureRequest) -> bool:
    """Both fast paths: aqr's C kernels (skipped without a compiler) and torch."""
    if request.param and (load_kernels()[0] is None or load_stream_kernels()[0] is None):
        pytest.skip(f"aqr's C kernels are unavailable: {load_kernels()[1] or load_stream_kernels()[1]}")
    return request.param


@pytest.fixture(scope="module")
def calibrated() -> tuple[nn.Module, aqr.SourceStats]:
    """The gated model and statistics with 4 class groups (what ``balance < 1`` needs; the rest ignore them)."""
    model = gated_model()
    labelled = _labelled(128, 5, seed=0)
    return model, aqr.calibrate(model, labelled, num_quantiles=21, compile=False, groups=4)


def adapter(setup: tuple[nn.Module, aqr.SourceStats], config: str, native: bool) -> aqr.AQR:
    model, stats = setup
    return aqr.AQR(model, stats, compile=False, native=native, **CONFIGS[config])


def batch(i: int) -> torch.Tensor:
    """The ``i``-th batch of a shifted stream: 1 to 8 images (small batches and ones that rebuild first), each
    image's colours offset on their own (so the tiny model predicts several classes: "robust" fills groups)."""
    n = (3, 8, 1, 8, 2, 5)[i % 6]
    offsets = torch.randn(n, 3, 1, 1, generator=torch.Generator().manual_seed(100 + i))
    return images(n, seed=100 + i) * 1.5 + 0.2 + offsets


def run(a: nn.Module, start: int, stop: int) -> list[torch.Tensor]:
    return [a(batch(i)) for i in range(start, stop)]


# Enough images before the copy that "robust" has the 256 recent classes its own-batch share reads.
HISTORY = 60


HOW = ("deepcopy", "pickle", "torch.save")


def round_trip(how: str) -> Callable[[nn.Module], nn.Module]:
    def through_torch_save(a: nn.Module) -> nn.Module:
        buffer = io.BytesIO()
        torch.save(a, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)  # the whole module: our own object, in memory

    return {"deepcopy": copy.deepcopy, "pickle": lambda a: pickle.loads(pickle.dumps(a)),
            "torch.save": through_torch_save}[how]


def assert_same_outputs(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"batch {i}: largest difference {float((g - w).abs().max())}"


def uses_native(a: aqr.AQR) -> bool:
    """Whether every layer of ``a`` ran aqr's C kernels (the copy loaded them again)."""
    cpu = torch.device("cpu")
    for layer_map in a._maps.values():
        streams = getattr(layer_map, "streams", None)
        if streams is not None:
            if not isinstance(streams[cpu].kernels, NativeStreamKernels) or streams[cpu].kernels._lib is None:
                return False
        elif not isinstance(layer_map._backends.get(cpu), NativeBackend):
            return False
    return True


@pytest.mark.parametrize("history", [0, HISTORY], ids=["fresh", "after-forwards"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_copy_continues_like_the_original(calibrated, config: str, native: bool, history: int) -> None:
    """Fed the same next batches, each copy (deepcopy, pickle, torch.save) gives the original's outputs bit for
    bit; a stream's state was copied (a fresh AQR's outputs differ); the user's model is never changed, and
    each copy has its own."""
    model, _ = calibrated
    before = snapshot(model)
    a = adapter(calibrated, config, native)
    run(a, 0, history)
    copies = {how: round_trip(how)(a) for how in HOW}
    want = run(a, history, history + 8)
    for how, b in copies.items():
        assert b.model is not model, how
        assert_same_outputs(run(b, history, history + 8), want)
        if native:
            assert uses_native(b), how
    if history and config in STREAMING:
        fresh = adapter(calibrated, config, native)
        assert not torch.equal(fresh(batch(history + 8)), copies["pickle"](batch(history + 8)))
    assert_unchanged(model, before)


def saved_and_loaded(state: dict[str, object]) -> dict[str, object]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("history", [0, 1, HISTORY], ids=["fresh", "one-batch", "after-forwards"])
@pytest.mark.parametrize("config", STREAMING)
def test_a_saved_state_continues_the_stream_bit_for_bit(calibrated, config: str, native: bool, history: int) -> None:
    """``torch.save(a.state_dict())``, then ``load_state_dict(torch.load(..., weights_only=True))`` into a fresh
    AQR (one that already ran other batches, too): its next outputs are the uninterrupted stream's."""
    model, _ = calibrated
    before = snapshot(model)
    a = adapter(calibrated, config, native)
    run(a, 0, history)
    state = saved_and_loaded(a.state_dict())
    assert set(state) == {f"model.{k}" for k in model.state_dict()} | {"_extra_state"}
    fresh, used = adapter(calibrated, config, native), adapter(calibrated, config, native)
    run(used, 200, 210)  # another stream: its state is replaced, not merged
    for b in (fresh, used):
        b.load_state_dict(state)
    want = run(a, history, history + 12)
    assert_same_outputs(run(fresh, history, history + 12), want)
    assert_same_outputs(run(used, history, history + 12), want)
    assert fresh.memory_bytes() == a.memory_bytes()
    assert_unchanged(model, before)


def test_the_batch_targets_state_dict_is_the_models(calibrated) -> None:
    model, _ = calibrated
    assert list(adapter(calibrated, "batch", False).state_dict()) == [f"model.{k}" for k in model.state_dict()]


def test_a_state_saved_on_the_C_kernels_continues_on_the_torch_kernels(calibrated) -> None:
    """The state does not depend on the kernels that ran it: the C path's state continues on torch's
    (whose arithmetic may differ in the last bits)."""
    if load_stream_kernels()[0] is None:
        pytest.skip(f"aqr's stream C kernels are unavailable: {load_stream_kernels()[1]}")
    a = adapter(calibrated, "stream", True)
    run(a, 0, HISTORY)
    b = adapter(calibrated, "stream", False)
    b.load_state_dict(saved_and_loaded(a.state_dict()))
    fresh = adapter(calibrated, "stream", False)
    x = batch(HISTORY)
    want, got = a(x), b(x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (fresh(x) - want).abs().max() > 100 * (got - want).abs().max()


@pytest.mark.parametrize("config", ["batch", "stream", "robust"])
def test_a_copy_taken_while_another_thread_is_inside_forward(calibrated, config: str, native: bool) -> None:
    """While a thread is held inside ``a(x)``, the main thread copies ``a`` (deepcopy, pickle, torch.save, and
    a fresh AQR loading its state_dict): each copy holds the state before ``x``, has locks of its own and no
    thread id, so the main thread and, once released, the held thread itself can call it; ``a`` then
    continues as if nothing had been copied."""
    model, _ = calibrated
    before = snapshot(model)
    gate = model[0]
    a, reference = adapter(calibrated, config, native), adapter(calibrated, config, native)
    run(a, 0, 30)
    run(reference, 0, 30)
    held = images(4, seed=999)
    results: dict[str, object] = {}
    copies: dict[str, nn.Module] = {}

    def held_thread() -> None:
        try:
            results["a"] = a(held)
            threading.current_thread().name = "released"  # the copies' gates let it through
            results.update({how: b(batch(31)) for how, b in copies.items()})  # the thread the original held
        except BaseException as err:  # noqa: BLE001 - re-raised in the main thread
            results["error"] = err

    worker = threading.Thread(target=held_thread, name=BLOCKED)
    worker.start()
    try:
        assert gate.inside.wait(60), "the held thread never entered the forward pass"
        copies.update({how: round_trip(how)(a) for how in HOW})
        copies["state_dict"] = adapter(calibrated, config, native)
        copies["state_dict"].load_state_dict(saved_and_loaded(a.state_dict()))
        want = reference(batch(30))
        for how, b in copies.items():  # the main thread calls the copies
            assert_same_outputs([b(batch(30))], [want])
    finally:
        gate.release.set()
        worker.join(60)
        gate.inside.clear()
        gate.release.clear()
    assert not worker.is_alive() and "error" not in results, results.get("error")
    want = reference(batch(31))
    for how in copies:
        assert_same_outputs([results[how]], [want])
    # the original took the held batch; it continues like a wrapper that ran the same batches in one thread
    follow = adapter(calibrated, config, native)
    run(follow, 0, 30)
    assert_same_outputs([results["a"]], [follow(held)])
    assert_same_outputs(run(a, 32, 36), run(follow, 32, 36))
    assert_unchanged(model, before)


def refused(b: aqr.AQR, state: dict[str, object], match: str, strict: bool = True) -> None:
    """Loading ``state`` into ``b`` raises naming ``match`` and leaves ``b``'s stream as it was."""
    probe = copy.deepcopy(b)
    with pytest.raises(RuntimeError, match=match):
        b.load_state_dict(state, strict=strict)
    assert_same_outputs(run(b, 80, 84), run(probe, 80, 84))


def test_a_state_of_another_target_options_or_statistics_is_refused(calibrated) -> None:
    model, stats = calibrated
    a = adapter(calibrated, "stream", False)
    run(a, 0, 20)
    state = saved_and_loaded(a.state_dict())
    for other, match in ((adapter(calibrated, "robust", False), "target='stream'"),
                         (aqr.AQR(model, stats, native=False, compile=False, target="stream", horizon=32,
                                  rebuild_every=4), "other options: horizon=16"),
                         (aqr.AQR(model, stats, native=False, compile=False, target="stream", horizon=16,
                                  rebuild_every=4, layers=["2"]), "layers"),
                         (aqr.AQR(model, aqr.calibrate(model, [images(64, seed=7) * 2], num_quantiles=21,
                                                       compile=False), native=False, compile=False,
                                  **CONFIGS["stream"]), "other source statistics")):
        run(other, 0, 5)
        refused(other, state, match)
    # a batch AQR keeps no running state: strict loading refuses one, strict=False loads the model's weights
    with pytest.raises(RuntimeError, match="holds a running state, of target='stream'; this aqr.AQR has target='batch'"):
        adapter(calibrated, "batch", False).load_state_dict(state)
    adapter(calibrated, "batch", False).load_state_dict(state, strict=False)
    # a streaming AQR needs one: a batch AQR's state dict lacks it
    b = adapter(calibrated, "stream", False)
    run(b, 0, 5)
    refused(b, adapter(calibrated, "batch", False).state_dict(), "no running state \\('_extra_state'\\), of target='batch'")


@pytest.mark.parametrize("config", ["stream", "robust"])
def test_a_damaged_state_is_refused_before_any_part_is_taken(calibrated, config: str) -> None:
    """Counters out of bounds (which the C kernels would index with), NaN, wrong shapes, missing parts and
    an unknown format are refused; the stream keeps its state."""
    a = adapter(calibrated, config, False)
    run(a, 0, 20)
    good = saved_and_loaded(a.state_dict())
    layers = list(good["_extra_state"]["layers"])

    def damaged(change: Callable[[dict], None]) -> dict[str, object]:
        state = copy.deepcopy(good)
        change(state["_extra_state"])
        return state

    def last_layer(record: dict) -> dict:
        return record["layers"][layers[-1]][0]

    b = adapter(calibrated, config, False)
    run(b, 0, 7)
    cases = [
        (lambda r: last_layer(r).update({"window.filled": 10**6}), "tail window"),
        (lambda r: last_layer(r).update({"window.head": -1}), "window.head"),
        (lambda r: last_layer(r)["knots"].__setitem__((0, 3), float("nan")), "NaN"),
        (lambda r: last_layer(r).update({"knots": last_layer(r)["knots"][:, :-1]}), "knots"),
        (lambda r: last_layer(r).update({"seen": 2.5}), "seen"),
        (lambda r: last_layer(r).pop("group.counts"), "lacks"),
        (lambda r: r["layers"][layers[0]].append(r["layers"][layers[0]][0]), "two entries"),
        (lambda r: r.update({"recent": torch.tensor([-1])}), "recent"),
        (lambda r: r.update({"version": 99}), "version 99"),
        (lambda r: r.update({"format": "something else"}), "not a running state"),
    ]
    if config == "robust":
        cases += [(lambda r: last_layer(r).update({"group_seen": [1, 2]}), "group_seen"),
                  (lambda r: last_layer(r).update({"runs": 3.0}), "runs")]
    for change, match in cases:
        refused(b, damaged(change), match)
    b.load_state_dict(good)  # and the undamaged state is taken
    assert_same_outputs(run(b, 20, 26), run(a, 20, 26))


def test_a_stream_state_cannot_be_loaded_from_inside_its_own_forward(calibrated) -> None:
    """A hook that loads the wrapper's own state mid-batch would deadlock on the stream's lock: it is refused."""
    model, stats = calibrated
    a = adapter(calibrated, "stream", False)
    run(a, 0, 5)
    state = a.state_dict()
    errors: list[BaseException] = []

    def hook(module: nn.Module, inputs: object, output: object) -> None:
        try:
            a.load_state_dict(state)
        except RuntimeError as err:
            errors.append(err)

    handle = model[1].register_forward_hook(hook)
    try:
        a(batch(5))
    finally:
        handle.remove()
    assert len(errors) == 1 and "inside its own forward pass" in str(errors[0])
