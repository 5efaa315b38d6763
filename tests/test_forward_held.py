"""TTAMethod.forward_held: a batch the method has no time to adapt on is predicted with the state it holds
and leaves no trace (the realtime protocol), for every registered method."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from contextlib import nullcontext

import pytest
import torch
from torch import nn

import aqr
from aqr.core.layers import NonFiniteActivationError
from aqr.methods import METHODS, create, declaration
from aqr.methods.roid import prior_correction

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_CLASSES = 5


def bn_net(seed: int = 0) -> nn.Module:
    """A conv net with BatchNorm whose running statistics are off-centre (the user's model differs from TTN)."""
    torch.manual_seed(seed)
    net = nn.Sequential(OrderedDict(
        conv1=nn.Conv2d(3, 8, 3, padding=1), norm1=nn.BatchNorm2d(8), relu1=nn.ReLU(),
        conv2=nn.Conv2d(8, 8, 3, stride=2, padding=1), norm2=nn.BatchNorm2d(8), relu2=nn.ReLU(),
        pool=nn.AdaptiveAvgPool2d(1), flat=nn.Flatten(), fc=nn.Linear(8, NUM_CLASSES)))
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.5, 2.0)
        net.fc.weight.mul_(4.0)
    return net.eval()


def images(n: int = 16, seed: int = 1, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g) * 1.5 + shift


NET = bn_net()
STATS = aqr.calibrate(NET, [images(64, seed=s) for s in range(2)], num_quantiles=21, compile=False)
# the compositions with a gradient method map the normalized values before the affine step
PRE_AFFINE_STATS = aqr.calibrate(NET, [images(64, seed=s) for s in range(2)], num_quantiles=21, compile=False,
                                 point="pre-affine")


def options(name: str, protocol: str, target: str | None = None) -> dict:
    """Options under which method ``name`` adapts on the tiny net (filters open, stochastic parts exercised)."""
    needs = declaration(name).needs
    opts: dict = {"protocol": protocol}
    if needs.stats is not None:
        opts["stats"] = PRE_AFFINE_STATS if needs.stats == "pre-affine" else STATS
    if needs.source:
        opts["source"] = images(32, seed=11)
    opts |= {
        "tent": {"lr": 0.05},
        "sar": {"lr": 0.05, "e0": 10.0, "recovery_threshold": 0.0},
        "eta": {"e0": 10.0, "d_margin": 2.0},
        "eata": {"e0": 10.0, "d_margin": 2.0},
        "rdumb": {"e0": 10.0, "d_margin": 2.0, "reset_every": 2},
        "deyo": {"margin": 10.0, "plpd_threshold": -1.0},
        "cotta": {"augmentations": 2, "anchor_threshold": 1.0},  # always averages augmentations (draws)
        "rotta": {"capacity": 8, "update_every": 8},
        "rbn": {"capacity": 8, "update_every": 8},
    }.get(name.removeprefix("aqr+"), {})  # a composition takes its partner's options
    if target is not None:
        opts.update(target=target, horizon=16)
    return opts


def cases() -> list[tuple[str, str, str | None]]:
    """(method, protocol, AQR target) for every registered method, both protocols where it takes them."""
    found = []
    for name in METHODS:
        for protocol in ("online",) if name == "rbn" else ("episodic", "online"):
            found.append((name, protocol, None))
    for target in ("stream", "robust"):
        found += [("aqr", "online", target), ("aqr", "episodic", target)]
        found += [(name, "online", target) for name in METHODS if name.startswith("aqr+")]
    return found


CASES = cases()
IDS = [f"{n}-{p}" + (f"-{t}" if t else "") for n, p, t in CASES]


def build(name: str, protocol: str, target: str | None = None):
    with pytest.warns(UserWarning, match="episodic") if protocol == "episodic" and target else nullcontext():
        return create(name, NET, **options(name, protocol, target))


# ------------------------------------------------------------------ a fingerprint of everything a method holds
SKIPPED = {"_modules", "_parameters", "_buffers", "_non_persistent_buffers_set", "_source_views", "_lock",
           "_state_lock", "config", "protocol", "optimizer"}  # the optimizer: by its state_dict


def fingerprint(obj: object, depth: int = 0) -> object:
    """A comparable copy of ``obj``: tensors cloned, generators' states, containers and plain objects recursed."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.detach().clone())
    if isinstance(obj, torch.Generator):
        return ("generator", obj.get_state())
    if isinstance(obj, (int, float, str, bool, type(None))):
        return obj
    if isinstance(obj, dict):
        return {k: fingerprint(v, depth) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [fingerprint(v, depth) for v in obj]
    if isinstance(obj, nn.Module) or depth > 4 or callable(obj):
        return type(obj).__name__  # modules: their state_dict is compared
    if dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
        return {k: fingerprint(v, depth + 1) for k, v in vars(obj).items() if "hook" not in k}
    return type(obj).__name__


def method_state(method) -> dict:
    """Every tensor of the state_dict (with streaming AQR's running state), the optimizer's state and the
    method's own attributes (memories, moving averages, counters, generators)."""
    own = {k: v for k, v in vars(method).items() if k not in SKIPPED and "hook" not in k}
    optimizer = method.optimizer.state_dict() if method.optimizer is not None else None
    return {"state_dict": fingerprint(method.state_dict()), "optimizer": fingerprint(optimizer),
            "own": fingerprint(own)}


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# ------------------------------------------------------------------ every method
@pytest.mark.parametrize(("name", "protocol", "target"), CASES, ids=IDS)
def test_forward_held_leaves_no_trace(name: str, protocol: str, target: str | None) -> None:
    m = build(name, protocol, target)
    for seed in (2, 3):
        m(images(seed=seed, shift=0.5))
    before, rng = method_state(m), torch.get_rng_state()
    held = m.forward_held(images(seed=4, shift=-0.5))
    assert held.shape == (16, NUM_CLASSES) and not held.requires_grad
    assert same(before, method_state(m))
    assert torch.equal(rng, torch.get_rng_state())


@pytest.mark.parametrize(("name", "protocol", "target"), CASES, ids=IDS)
def test_a_held_batch_does_not_change_later_forwards(name: str, protocol: str, target: str | None) -> None:
    a, b, c = images(seed=2, shift=0.5), images(seed=3, shift=-0.7), images(seed=4, shift=0.5)
    skipped, plain = build(name, protocol, target), build(name, protocol, target)
    skipped(a)
    skipped.forward_held(b)
    plain(a)
    assert torch.equal(skipped(c), plain(c))
    assert same(method_state(skipped), method_state(plain))


@pytest.mark.parametrize(("name", "protocol", "target"), CASES, ids=IDS)
def test_without_a_held_state_it_is_the_users_model(name: str, protocol: str, target: str | None) -> None:
    m = build(name, protocol, target)
    if m.holds_state:
        pytest.skip("holds a state across batches")
    for seed in (2, 3):
        m(images(seed=seed, shift=0.5))
    x = images(seed=5, shift=0.5)
    with torch.no_grad():
        assert torch.equal(m.forward_held(x), NET(x))


@pytest.mark.parametrize(("name", "protocol", "target"), CASES, ids=IDS)
def test_a_held_state_is_the_adapted_one(name: str, protocol: str, target: str | None) -> None:
    m = build(name, protocol, target)
    if not m.holds_state:
        pytest.skip("holds no state across batches")
    x = images(seed=5, shift=0.5)
    fresh = m.forward_held(x)
    for seed in (2, 3, 6):
        m(images(seed=seed, shift=1.0))
    adapted = m.forward_held(x)
    with torch.no_grad():
        source = NET(x)
    assert not torch.equal(adapted, fresh)  # the state moved, and the held prediction with it
    assert not torch.allclose(adapted, source, atol=1e-4)


def test_which_methods_hold_a_state() -> None:
    holding = {(n, p, t) for n, p, t in CASES if build(n, p, t).holds_state}
    weights = {"tent", "sar", "eta", "eata", "roid", "deyo", "cotta", "rotta", "bn-ema", "rbn", "unmixtns", "rdumb"}
    expected = {(n, "online", None) for n in weights} | {("aqr", "online", "stream"), ("aqr", "online", "robust")}
    # the compositions: the gradient ones hold their weights (and a streaming map's state), aqr+lame only AQR's stream
    composed = {"aqr+tent", "aqr+eta", "aqr+roid"} & set(METHODS)
    expected |= {(n, "online", t) for n in composed for t in (None, "stream", "robust")}
    expected |= {("aqr+lame", "online", t) for t in ("stream", "robust") if "aqr+lame" in METHODS}
    assert holding == expected


# ------------------------------------------------------------------ what each state predicts
@pytest.mark.parametrize("name", ["tent", "sar", "eta", "eata", "deyo", "roid", "rotta", "rbn", "unmixtns", "rdumb"])
def test_held_is_what_the_online_method_would_score_before_adapting(name: str) -> None:
    """Online, these methods score a batch with the state before its update: forward_held gives the same
    logits (ROID: without its prior correction, a per-batch output step that carries nothing over)."""
    held, scored = build(name, "online"), build(name, "online")
    for m in (held, scored):
        m(images(seed=2, shift=0.5))
        m(images(seed=3, shift=0.5))
    x = images(seed=7, shift=0.8)
    out = held.forward_held(x)
    expected = scored(x)
    if name == "roid":
        out = prior_correction(out)
    assert torch.allclose(out, expected, atol=1e-6)


def test_cotta_held_is_the_teachers_plain_forward() -> None:
    opts = options("cotta", "online") | {"anchor_threshold": 0.0}  # forward then predicts without augmentations
    held, scored = create("cotta", NET, **opts), create("cotta", NET, **opts)
    for m in (held, scored):
        m(images(seed=2, shift=0.5))
    x = images(seed=7, shift=0.8)
    assert torch.equal(held.forward_held(x), scored(x))
    # with augmentation averaging configured, the held prediction is still the teacher's plain one
    averaging = create("cotta", NET, **options("cotta", "online"))
    averaging(images(seed=2, shift=0.5))
    with torch.no_grad():
        assert torch.equal(averaging.forward_held(x), averaging.teacher(x))
    assert averaging.augmented_batches == 1


def test_bn_ema_held_normalizes_with_the_current_statistics() -> None:
    m = build("bn-ema", "online")
    m(images(seed=2, shift=0.5))
    frozen = bn_net()
    with torch.no_grad():
        for bn, layer in zip((frozen.norm1, frozen.norm2), m.layers):
            bn.running_mean.copy_(layer.mean)
            bn.running_var.copy_(layer.var)
        x = images(seed=7, shift=0.8)
        assert torch.allclose(m.forward_held(x), frozen(x), atol=1e-6)


@pytest.mark.parametrize("target", ["stream", "robust"])
def test_streaming_aqr_held_maps_with_the_committed_state(target: str) -> None:
    """A batch of fewer than rebuild_every images is mapped with the committed state by forward too: the held
    map is the same. Streaming AQR's forward merges a large batch into its state before mapping it, held maps
    it with the committed state alone (as robust AQR's forward does until it has seen enough classes)."""
    held, small_scored, large_scored = (build("aqr", "online", target) for _ in range(3))
    for m in (held, small_scored, large_scored):
        m(images(seed=2, shift=0.5))
    small = images(n=4, seed=7, shift=0.8)
    assert torch.equal(held.forward_held(small), small_scored(small))
    large = images(n=16, seed=8, shift=2.0)
    if target == "stream":
        assert not torch.allclose(held.forward_held(large), large_scored(large), atol=1e-4)
    else:
        assert torch.equal(held.forward_held(large), large_scored(large))


def test_streaming_aqr_held_before_any_batch_is_the_model_in_eval_mode() -> None:
    adapter = aqr.AQR(NET, STATS, target="stream", horizon=16)
    x = images(seed=5)
    with torch.no_grad():
        assert torch.equal(adapter.forward_held(x), NET(x))
        assert torch.equal(aqr.AQR(NET, STATS).forward_held(x), NET(x))  # per-batch AQR keeps no state
    assert adapter.memory_bytes() == 0  # no state was made for the device


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_streaming_aqr_held_with_nan_leaves_the_state(policy: str) -> None:
    adapter = aqr.AQR(NET, STATS, target="stream", horizon=16, on_nonfinite=policy)
    adapter(images(seed=2))
    before = fingerprint(adapter.state_dict())
    x = images(seed=3)
    x[0, 0, 0, 0] = float("nan")
    if policy == "raise":
        with pytest.raises(NonFiniteActivationError):
            adapter.forward_held(x)
    else:
        adapter.forward_held(x)
    assert same(before, fingerprint(adapter.state_dict()))
    assert torch.equal(adapter.forward_held(images(seed=4)), adapter.forward_held(images(seed=4)))


def test_episodic_weight_updating_held_uses_the_initial_weights_not_the_last_batchs() -> None:
    m = build("tent", "episodic")
    m(images(seed=2, shift=1.0))
    x = images(seed=5)
    assert any(not torch.equal(p, q) for p, q in zip(m.model.parameters(), bn_net().parameters()))  # adapted
    with torch.no_grad():
        assert torch.equal(m.forward_held(x), NET(x))
