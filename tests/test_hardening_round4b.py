"""Hardening, round 4 (continued): every method's state_dict continues bit for bit, threads sharing one
method get the outputs of a sequential order, threads leave the caller's random state alone, and the
kernel cache refuses files another user could have planted.

Each test reproduces an attack that used to lose state, raise in a thread, change the caller's RNG or
load a planted library."""

from __future__ import annotations

import copy
import io
import sys
import threading

import pytest
import torch

from aqr.methods import create
from tests.test_forward_held import CASES, IDS, NET, STATS, build, images, method_state, same

pytestmark = pytest.mark.usefixtures("one_thread")


def saved_and_loaded(state: dict) -> dict:
    """``state`` through ``torch.save`` and ``torch.load(weights_only=True)``: what a user gets back from a file."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def batches(n: int) -> list[torch.Tensor]:
    return [images(seed=20 + i, shift=0.4 * (-1) ** i) for i in range(n)]


# ---- 5. a saved state continues bit for bit -----------------------------------------------------------

@pytest.mark.parametrize(("name", "protocol", "target"), CASES, ids=IDS)
def test_a_loaded_state_continues_bit_for_bit(name: str, protocol: str, target: str | None) -> None:
    first, later = batches(3), batches(6)[3:]
    running = build(name, protocol, target)
    for x in first:
        running(x)
    state = saved_and_loaded(running.state_dict())
    resumed = build(name, protocol, target)
    resumed.load_state_dict(state)
    assert same(method_state(resumed), method_state(running)), name  # memories, moving averages, counters
    for x in later:  # tent/sar/eta drifted from the second batch (optimizer state), cotta on the first (generators)
        assert torch.equal(resumed(x), running(x)), name
        assert torch.equal(resumed.forward_held(x), running.forward_held(x)), name


def test_a_state_of_another_configuration_or_format_is_refused_in_one_line() -> None:
    opts = {"lr": 0.05, "protocol": "online"}
    tent = create("tent", NET, **opts)
    tent(images(seed=2))
    state = tent.state_dict()
    other = create("tent", NET, **(opts | {"lr": 0.1}))
    with pytest.raises(ValueError, match="another configuration") as err:
        other.load_state_dict(state)
    assert "\n" not in str(err.value) and "lr=0.05" in str(err.value)
    seeded = create("tent", NET, **opts, seed=5)
    with pytest.raises(ValueError, match="another configuration"):
        seeded.load_state_dict(state)
    future = dict(state)
    future["_extra_state"] = dict(state["_extra_state"], format=99)
    with pytest.raises(ValueError, match="format 99") as err:
        create("tent", NET, **opts).load_state_dict(future)
    assert "\n" not in str(err.value)
    fresh = create("tent", NET, **opts)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(ValueError):
        fresh.load_state_dict(future)
    assert all(torch.equal(v, fresh.model.state_dict()[k]) for k, v in before.items())  # refused: unchanged


@pytest.fixture()
def busy_switching():
    """Threads switched every microsecond (the interpreter's default is 5 ms), so short calls overlap too."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


# ---- 3. threads sharing one method ----------------------------------------------------------------------

THREADS = 4
CALLS = 2


def sequential_order_exists(method_factory, runs: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> bool:
    """Whether some interleaving of the threads' calls (each thread's in its own order), replayed on a fresh
    method, gives every output the threads saw (a depth-first search over the next thread to run)."""
    def search(method, positions: tuple[int, ...]) -> bool:
        if all(p == len(run) for p, run in zip(positions, runs)):
            return True
        for t, run in enumerate(runs):
            if positions[t] == len(run):
                continue
            x, seen = run[positions[t]]
            trial = copy.deepcopy(method)
            if torch.equal(trial(x), seen):
                if search(trial, positions[:t] + (positions[t] + 1,) + positions[t + 1:]):
                    return True
        return False

    return search(method_factory(), (0,) * len(runs))


@pytest.mark.parametrize(("name", "protocol", "target"), CASES, ids=IDS)
def test_threads_sharing_one_method_get_a_sequential_orders_outputs(name: str, protocol: str, target: str | None,
                                                                     busy_switching) -> None:
    shared = build(name, protocol, target)
    inputs = batches(THREADS)
    runs: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(THREADS)]
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS + 1)

    def work(i: int) -> None:
        try:
            start.wait()
            for _ in range(CALLS):
                runs[i].append((inputs[i], shared(inputs[i])))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    def other_calls() -> None:  # held batches, saved states: serialized with the forwards, never failing
        try:
            start.wait()
            for _ in range(CALLS):
                shared.forward_held(inputs[0])
                saved_and_loaded(shared.state_dict())
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    threads.append(threading.Thread(target=other_calls))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, f"{name}: {errors[0]!r}"  # tent & co raised "modified by an inplace operation", lame ValueError
    assert sequential_order_exists(lambda: build(name, protocol, target), runs), name


# ---- 4. the caller's random state ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["source", "ttn", "aqr", "tent", "roid"])
def test_threads_leave_the_callers_random_state_alone(name: str, busy_switching) -> None:
    opts = {"stats": STATS} if name == "aqr" else {"lr": 0.05} if name == "tent" else {}
    instances = [create(name, NET, **opts, protocol="online", seed=k) for k in range(THREADS)]
    x = images(seed=3)
    for trial in range(5):
        torch.manual_seed(1234 + trial)
        expected = torch.Generator().manual_seed(1234 + trial)
        start = threading.Barrier(THREADS)

        def work(i: int) -> None:
            start.wait()
            for _ in range(10):
                instances[i](x)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # each forward forked the global RNG and seeded it; two at once restored each other's seeded state
        assert torch.equal(torch.randn(4), torch.randn(4, generator=expected)), (name, trial)
