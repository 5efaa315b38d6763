"""Hardening, round 4 (continued): every method's state_dict continues bit for bit, threads sharing one
method get the outputs of a sequential order, threads leave the caller's random state alone, and the
kernel cache refuses files another user could have planted.

Each test reproduces an attack that used to lose state, raise in a thread, change the caller's RNG or
load a planted library."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from aqr.backends import build as kernel_build
from aqr.harness import ray_executor
from aqr.methods import create
from aqr.util.ownership import untrusted_reason
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


# ---- 2. a kernel cache or node cache another user could have written --------------------------------------

QUICK = ["-O0"]  # the same library logic, a quicker build
needs_compiler = pytest.mark.skipif(kernel_build.compile_command() is None, reason="no C compiler")
LOAD_KERNELS = textwrap.dedent(f"""
    import json, warnings
    from aqr.backends import build
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lib = build.warned(*build.try_load(lambda _: build.load(build.compile_command({QUICK!r}))))
    print(json.dumps({{"loaded": lib is not None, "warnings": [str(w.message) for w in caught]}}))
""")


def load_kernels_in_subprocess(cache: Path) -> dict:
    """Load the quick build of the per-batch kernels in a fresh process on the kernel cache ``cache``."""
    env = {**os.environ, "AQR_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", LOAD_KERNELS], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def plant_library(cache: Path, marker: Path) -> Path:
    """A library under the quick build's cached name, beside a stamp of its own size and SHA-256, whose
    constructor writes ``marker`` when it is loaded (as another user's planted library would run its code)."""
    source = cache.parent / "planted.c"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) '
                      f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    library = cache / kernel_build.library_path(kernel_build.compile_command(QUICK)).name
    subprocess.run([*kernel_build.compiler(), "-shared", "-fPIC", "-o", str(library), str(source)], check=True,
                   timeout=120)
    kernel_build.stamp_path(library).write_text(json.dumps(kernel_build.file_stamp(library)))
    return library


@needs_compiler
@pytest.mark.parametrize("attack", ["folder writable by others", "library writable by others",
                                    "library of another user"])
def test_a_planted_library_is_never_loaded(tmp_path, attack):
    if attack == "library of another user" and os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    cache, marker = tmp_path / "cache", tmp_path / "constructor-ran"
    cache.mkdir(mode=0o700)
    library = plant_library(cache, marker)
    if attack == "folder writable by others":
        cache.chmod(0o777)  # the planted library's folder: anyone could have put it there
    elif attack == "library writable by others":
        library.chmod(0o666)
    else:
        os.chown(library, 12345, 12345)
        os.chown(kernel_build.stamp_path(library), 12345, 12345)
    result = load_kernels_in_subprocess(cache)
    assert not marker.exists(), attack  # the planted constructor used to run before any check
    assert result["loaded"], result  # rebuilt (in a private folder where the cache's is not private)
    (warning,) = result["warnings"]
    assert ("is not used" if attack.startswith("folder") else "another user could have written") in warning, warning
    if not attack.startswith("folder"):  # rebuilt in place, this user's alone
        assert untrusted_reason(library) is None and kernel_build.verified(library)


@needs_compiler
def test_a_new_kernel_cache_is_private(tmp_path):
    cache = tmp_path / "new" / "kernels"
    assert load_kernels_in_subprocess(cache) == {"loaded": True, "warnings": []}
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700  # was 0755
    for path in cache.iterdir():
        assert not path.stat().st_mode & 0o022, path


def test_the_ray_node_cache_is_per_user_and_checks_each_files_hash(tmp_path, monkeypatch):
    monkeypatch.setattr(ray_executor.tempfile, "tempdir", str(tmp_path))
    cache = ray_executor.node_cache()
    assert cache == tmp_path / f"aqr-ray-{os.geteuid()}" and stat.S_IMODE(cache.stat().st_mode) == 0o700  # was /tmp/aqr-ray
    data = b"the driver's statistics"
    name = f"{hashlib.sha256(data).hexdigest()[:24]}.aqr.safetensors"
    sent: list[bytes] = []

    def fetch() -> bytes:
        sent.append(data)
        return data

    planted = cache / "stats" / name
    planted.parent.mkdir(mode=0o700)
    planted.write_bytes(b"someone else's statistics")  # under the right name: used to be read as it was
    path = ray_executor.node_stats_file(cache, name, fetch)
    assert path.read_bytes() == data and len(sent) == 1
    assert ray_executor.node_stats_file(cache, name, fetch).read_bytes() == data and len(sent) == 1  # kept
    path.chmod(0o666)
    assert ray_executor.node_stats_file(cache, name, fetch).read_bytes() == data and len(sent) == 2
    with pytest.raises(ValueError, match="SHA-256"):
        ray_executor.node_stats_file(cache, f"{'0' * 24}.aqr.safetensors", fetch)
    with pytest.raises(ValueError, match="not a node statistics file name"):
        ray_executor.node_stats_file(cache, "../../etc/passwd", fetch)
    (tmp_path / f"aqr-ray-{os.geteuid()}").chmod(0o777)  # another user could write there now: not used
    assert ray_executor.node_cache() != cache


# ---- the user's model left alone by the wrapper's state and gradient flags ----------------------------------

def test_loading_a_state_never_writes_into_the_users_model() -> None:
    import aqr

    model = copy.deepcopy(NET)
    adapted = aqr.AQR(model, STATS, target="stream", horizon=16)
    adapted(images(seed=2))
    state = adapted.state_dict()
    versions = {k: p._version for k, p in model.state_dict().items()}
    fresh = aqr.AQR(model, STATS, target="stream", horizon=16)
    fresh.load_state_dict(state)  # the model's entries equal the model: compared, not copied in
    assert {k: p._version for k, p in model.state_dict().items()} == versions
    assert torch.equal(fresh(images(seed=3)), adapted(images(seed=3)))
    other = dict(state)
    other["model.conv1.weight"] = state["model.conv1.weight"] + 1.0  # another model's weights
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"other values of the user's model \(model.conv1.weight\)"):
        aqr.AQR(model, STATS, target="stream", horizon=16).load_state_dict(other)  # used to copy them into it
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with pytest.raises(RuntimeError, match="Missing key"):
        aqr.AQR(model, STATS, target="stream", horizon=16).load_state_dict(
            {k: v for k, v in state.items() if k != "model.conv1.weight"})


def test_the_wrappers_requires_grad_leaves_the_users_flags_alone() -> None:
    import aqr

    model = copy.deepcopy(NET).requires_grad_(True)
    adapted = aqr.AQR(model, STATS)
    assert adapted.requires_grad_(True) is adapted  # changes nothing: passes
    with pytest.raises(ValueError, match="never changes the user's model"):
        adapted.requires_grad_(False)  # used to turn every parameter of the user's model off
    assert all(p.requires_grad for p in model.parameters())
