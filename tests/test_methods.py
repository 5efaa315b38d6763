"""Tests for aqr.methods: the protocol, and Source/TTN/TENT/SAR (+ AQR wrapper) on tiny models."""

from __future__ import annotations

import math
from pathlib import Path
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aqr import methods
from aqr.methods import NotApplicable, create, softmax_entropy

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_CLASSES = 5


# ---------------------------------------------------------------------------- tiny models
def conv_net(norm: str = "bn", seed: int = 0) -> nn.Module:
    """Conv net with BatchNorm ("bn") or GroupNorm ("gn"); running stats deliberately off-centre."""
    torch.manual_seed(seed)

    def norm_layer(c: int) -> nn.Module:
        return nn.BatchNorm2d(c) if norm == "bn" else nn.GroupNorm(2, c)

    net = nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(3, 8, 3, padding=1),
            norm1=norm_layer(8),
            relu1=nn.ReLU(),
            conv2=nn.Conv2d(8, 8, 3, stride=2, padding=1),
            norm2=norm_layer(8),
            relu2=nn.ReLU(),
            pool=nn.AdaptiveAvgPool2d(1),
            flat=nn.Flatten(),
            fc=nn.Linear(8, NUM_CLASSES),
        )
    )
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.5, 2.0)
        net.fc.weight.mul_(4.0)  # confident enough that entropies spread out
    return net.eval()


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """Token input (N, T, 6) -> 2 pre-norm transformer blocks -> final norm -> head."""

    def __init__(self, d: int = 8, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(6, d)
        self.blocks = nn.Sequential(Block(d), Block(d))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.embed(x))).mean(1))


def images(n: int = 16, seed: int = 1, shift: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g) * 1.5 + shift


def tokens(n: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, 6, generator=g)


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def mean_entropy(logits: torch.Tensor) -> float:
    return softmax_entropy(logits).mean().item()


MODELS = {"bn": (lambda: conv_net("bn"), images), "gn": (lambda: conv_net("gn"), images), "ln": (TinyViT, tokens)}
FIELD = ["eta", "eata", "roid", "deyo"]  # the reference-code methods, tested in depth in test_field_methods.py


def field_options(name: str, data=images) -> dict:
    """Options under which a reference-code method adapts on these tiny models (filters open)."""
    if name in ("eta", "eata"):
        return {"e0": 10.0, "d_margin": 2.0} | ({"source": data(n=32, seed=11)} if name == "eata" else {})
    if name == "roid":
        return {} if data is images else {"use_consistency": False}  # its augmentation needs RGB images
    if name == "deyo":
        if data is not images:
            pytest.skip("deyo destroys the object in images; these inputs are tokens")
        return {"margin": 10.0, "plpd_threshold": -1.0}
    return {}


# ---------------------------------------------------------------------------- registry
def test_available_and_create() -> None:
    assert methods.available() == ["source", "ttn", "tent", "sar", "aqr", "moments", "rbn", "bn-ema", *FIELD,
                                   "cotta", "rotta", "lame", "unmixtns", "rdumb", "aqr+tent", "aqr+eta", "aqr+roid",
                                   "aqr+lame"]
    net = conv_net()
    for name in ["source", "ttn", "tent", "sar", "rbn"]:
        m = create(name, net, protocol="online" if name == "rbn" else "episodic")
        assert isinstance(m, nn.Module) and isinstance(m, methods.TTAMethod)
        assert m(images()).shape == (16, NUM_CLASSES)
        m.reset()
    with pytest.raises(KeyError, match="unknown method"):
        create("bogus", net)
    with pytest.raises(TypeError):
        create("tent", net, learning_rate=1.0)
    with pytest.raises(ValueError):
        create("tent", net, protocol="sometimes")


@pytest.mark.parametrize("kind", ["gn", "ln"])
def test_ttn_not_applicable_without_batchnorm(kind: str) -> None:
    build, _ = MODELS[kind]
    with pytest.raises(NotApplicable):
        create("ttn", build())


def test_entropy_methods_not_applicable_without_norm_layers() -> None:
    net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, NUM_CLASSES))
    for name in ["tent", "sar", *FIELD]:
        with pytest.raises(NotApplicable):
            create(name, net, **field_options(name))


# ---------------------------------------------------------------------------- source / TTN
def test_source_is_eval_model_whatever_mode_it_was_given() -> None:
    net, x = conv_net(), images()
    expected = net(x)
    net.train()
    out = create("source", net)(x)
    assert torch.equal(out, expected.detach())
    assert net.training  # the user's flag is left alone


def test_ttn_equals_manual_batch_norm() -> None:
    net, x = conv_net(), images(shift=0.5)
    ttn = create("ttn", net)

    def bn(h: torch.Tensor, layer: nn.BatchNorm2d) -> torch.Tensor:
        mean = h.mean(dim=(0, 2, 3), keepdim=True)
        var = h.var(dim=(0, 2, 3), unbiased=False, keepdim=True)
        w, b = layer.weight.view(1, -1, 1, 1), layer.bias.view(1, -1, 1, 1)
        return (h - mean) / torch.sqrt(var + layer.eps) * w + b

    with torch.no_grad():
        h = F.relu(bn(net.conv1(x), net.norm1))
        h = F.relu(bn(net.conv2(h), net.norm2))
        manual = net.fc(h.mean(dim=(2, 3)))
    running_before = net.norm1.running_mean.clone()
    assert torch.allclose(ttn(x), manual, atol=1e-5)
    assert not torch.allclose(create("source", net)(x), manual, atol=1e-3)  # it is a real change
    assert torch.equal(net.norm1.running_mean, running_before)


# ---------------------------------------------------------------------------- protocol
@pytest.mark.parametrize("kind", ["bn", "gn", "ln"])
@pytest.mark.parametrize("name", ["tent", "sar", *FIELD])
def test_episodic_logits_do_not_depend_on_earlier_batches(name: str, kind: str) -> None:
    build, data = MODELS[kind]
    net = build()
    opts = {"lr": 0.05, "e0": 10.0, "recovery_threshold": 0.0} if name == "sar" else {"lr": 0.05}
    opts |= field_options(name, data) | {"protocol": "episodic"}
    fresh, used = create(name, net, **opts), create(name, net, **opts)
    target = data(seed=7)
    for seed in (2, 3, 4):
        used(data(seed=seed) * 2.0)
    out = fresh(target)
    assert torch.equal(used(target), out)
    # and adaptation really did something within the batch
    assert not torch.allclose(out, create("source", net)(target) if kind != "bn" else create("ttn", net)(target))


@pytest.mark.parametrize("name", ["tent", "sar", *FIELD, "cotta"])
def test_online_changes_weights_and_reset_restores_them(name: str) -> None:
    net = conv_net("gn")
    opts = {"lr": 0.05, "protocol": "online"} | field_options(name)
    if name == "sar":
        opts.update(e0=10.0, recovery_threshold=0.0)
    m = create(name, net, **opts)
    start = state_of(m.model)
    m(images(seed=2))
    after1 = state_of(m.model)
    m(images(seed=3))
    after2 = state_of(m.model)
    assert not same_state(start, after1) and not same_state(after1, after2)
    m.reset()
    assert same_state(start, state_of(m.model))
    assert len(m.optimizer.state_dict()["state"]) == 0  # momentum buffers gone too


def test_online_scores_the_forward_that_computed_the_loss() -> None:
    net, x = conv_net("bn"), images()
    for name in ["tent", "sar"]:
        first = create(name, net, protocol="online", lr=0.05)(x)
        assert torch.equal(first, create("ttn", net)(x))  # computed before the update


@pytest.mark.parametrize("kind", ["bn", "gn", "ln"])
@pytest.mark.parametrize("name", ["source", "ttn", "tent", "sar", "tent-online", "sar-online", *FIELD,
                                  *(f"{n}-online" for n in FIELD), "cotta", "cotta-online", "rotta", "rotta-online",
                                  "lame"])
def test_user_model_is_never_modified(name: str, kind: str) -> None:
    build, data = MODELS[kind]
    net = build()
    net.train()
    before = state_of(net)
    grads = {k: p.requires_grad for k, p in net.named_parameters()}
    base, _, protocol = name.partition("-")
    try:
        opts = {"protocol": protocol or "episodic", "lr": 0.05} if base in ("tent", "sar", *FIELD) else {}
        opts |= field_options(base, data)
        if base == "cotta":  # augmentation averaging on images; the token model cannot be augmented
            opts.update(protocol=protocol or "episodic", augmentations=2, anchor_threshold=0.0 if kind == "ln" else 1.0)
        if base == "rotta":
            opts.update(protocol=protocol or "episodic", capacity=8, update_every=8)
        m = create(base, net, **opts)
    except NotApplicable:
        return
    for seed in (2, 3):
        m(data(seed=seed))
    m.reset()
    assert same_state(before, state_of(net))
    assert grads == {k: p.requires_grad for k, p in net.named_parameters()}
    assert net.training and all(mod.training for mod in net.modules())
    assert all(p.grad is None for p in net.parameters())


def test_wrapper_train_eval_does_not_change_the_wrapped_model() -> None:
    net, x = conv_net("bn"), images()
    m = create("source", net)
    expected = m(x)
    m.train()
    assert torch.equal(m(x), expected)
    assert not m.model.training


# ---------------------------------------------------------------------------- TENT
@pytest.mark.parametrize("kind", ["bn", "gn", "ln"])
def test_tent_trains_only_norm_affine_parameters(kind: str) -> None:
    build, data = MODELS[kind]
    m = create("tent", build(), protocol="online", lr=0.05)
    norm_types = (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm)
    affine = {
        f"{mn}.{pn}" for mn, mod in m.model.named_modules() if isinstance(mod, norm_types) for pn, _ in mod.named_parameters()
    }
    assert {n for n, p in m.model.named_parameters() if p.requires_grad} == affine
    assert set(m.param_names) == affine
    before = state_of(m.model)
    m(data(seed=2))
    after = state_of(m.model)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and changed <= affine


@pytest.mark.parametrize("kind", ["bn", "gn"])
def test_tent_reduces_entropy_on_the_adapted_forward(kind: str) -> None:
    net, x = conv_net(kind), images(shift=0.5)
    unadapted = create("ttn" if kind == "bn" else "source", net)(x)
    adapted = create("tent", net, lr=0.01, protocol="episodic")(x)
    assert mean_entropy(adapted) < mean_entropy(unadapted) - 1e-4


def test_tent_batchnorm_uses_batch_statistics() -> None:
    net, x = conv_net("bn"), images(shift=0.5)
    assert torch.allclose(create("tent", net, lr=0.0)(x), create("ttn", net)(x), atol=1e-6)


def test_default_learning_rates() -> None:
    assert methods.default_lr("cnn") == 2.5e-4
    assert methods.default_lr("vit", 128) == pytest.approx(1e-3 / 64 * 128)
    assert methods.infer_arch(conv_net()) == "cnn" and methods.infer_arch(TinyViT()) == "vit"
    assert create("tent", conv_net()).optimizer.param_groups[0]["lr"] == 2.5e-4
    assert create("tent", conv_net()).optimizer.param_groups[0]["momentum"] == 0.9
    with pytest.raises(ValueError, match="batch_size"):
        create("tent", TinyViT())
    vit = create("sar", TinyViT(), batch_size=32)
    assert vit.optimizer.base.param_groups[0]["lr"] == pytest.approx(5e-4)


# ---------------------------------------------------------------------------- SAR
def test_sar_threshold_defaults_to_04_ln_c() -> None:
    m = create("sar", conv_net("gn"))
    assert m.config.threshold(NUM_CLASSES) == pytest.approx(0.4 * math.log(NUM_CLASSES))
    assert m.config.threshold(1000) == pytest.approx(0.4 * math.log(1000))
    ent = torch.tensor([0.1, 0.6, 0.7, 2.0])
    assert m.reliable(ent, NUM_CLASSES).tolist() == [True, True, False, False]  # 0.4 ln 5 = 0.64


def test_sar_filter_ignores_high_entropy_samples() -> None:
    # GroupNorm: samples do not interact, so a step on the full batch must equal a step on its
    # reliable part alone when the filter works.
    net, x = conv_net("gn"), images(n=32, seed=5)
    with torch.no_grad():
        ent = softmax_entropy(net(x))
    e0 = ent.median().item()
    reliable = ent < e0
    assert 0 < reliable.sum() < len(x)
    opts = {"protocol": "online", "lr": 0.05, "e0": e0, "recovery_threshold": 0.0}
    full, part = create("sar", net, **opts), create("sar", net, **opts)
    full(x)
    part(x[reliable])
    a, b = state_of(full.model), state_of(part.model)
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert not same_state(a, state_of(create("sar", net).model))  # the step did change weights
    assert full.ema == pytest.approx(part.ema, abs=1e-6)

    nothing = create("sar", net, protocol="online", lr=0.05, e0=0.0)
    nothing(x)
    assert same_state(state_of(nothing.model), state_of(create("sar", net).model)) and nothing.ema is None


def test_sar_recovery_resets_the_model() -> None:
    net, x = conv_net("gn"), images()
    start = state_of(create("sar", net).model)
    always = create("sar", net, protocol="online", lr=0.05, e0=10.0, recovery_threshold=1e9)
    always(x)
    assert always.recoveries == 1 and always.ema is None
    assert same_state(start, state_of(always.model))
    never = create("sar", net, protocol="online", lr=0.05, e0=10.0, recovery_threshold=0.0)
    never(x)
    never(images(seed=3))
    assert never.recoveries == 0 and not same_state(start, state_of(never.model))
    assert never.ema is not None and never.ema > 0


def test_sar_episodic_clears_the_ema_every_batch() -> None:
    net = conv_net("gn")
    m = create("sar", net, lr=0.05, e0=10.0, recovery_threshold=0.0, protocol="episodic")
    m(images(seed=2))
    ema2 = m.ema
    m(images(seed=3))
    single = create("sar", net, lr=0.05, e0=10.0, recovery_threshold=0.0, protocol="episodic")
    single(images(seed=3))
    assert ema2 is not None and m.ema == single.ema


def test_sar_freezing_rules() -> None:
    vit = TinyViT()
    m = create("sar", vit, lr=0.01, freeze=("blocks.1", "norm"))
    assert m.param_names and all(not n.startswith(("blocks.1.", "norm.")) for n in m.param_names)
    assert any(n.startswith("blocks.0.") for n in m.param_names)
    globbed = create("sar", vit, lr=0.01, freeze="blocks.*")
    assert all(not n.startswith("blocks.") for n in globbed.param_names)
    assert create("sar", vit, lr=0.01).frozen_rules == ()  # auto: no preset matches
    with pytest.raises(ValueError, match="matches no module"):
        create("sar", vit, lr=0.01, freeze=("blocks.7",))
    with pytest.raises(ValueError, match="matches no module"):
        create("sar", vit, lr=0.01, freeze="vit-base")
    with pytest.raises(ValueError, match="matches no module"):
        create("sar", conv_net(), freeze="layer4")

    resnet = nn.Sequential(OrderedDict(stem=conv_net("gn").conv1, layer3=nn.GroupNorm(2, 8), layer4=nn.GroupNorm(2, 8)))
    auto = create("sar", resnet)
    assert auto.frozen_rules == ("layer4",)
    assert auto.param_names == ["layer3.weight", "layer3.bias"]
    assert not auto.model.layer4.weight.requires_grad


# ---------------------------------------------------------------------------- determinism
class Noisy(nn.Module):
    """Adds fresh Gaussian noise on every call, whatever the mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.randn_like(x)


@pytest.mark.parametrize("name", ["source", "tent", "sar", *FIELD, "cotta", "lame"])
def test_seed_makes_outputs_reproducible_and_leaves_global_rng_alone(name: str) -> None:
    net = nn.Sequential(Noisy(), conv_net("gn"))
    runs = []
    for seed in (3, 3, 4):
        m = (create(name, net, protocol="online", seed=seed, lr=0.05, **field_options(name))
             if name not in ("source", "lame") else create(name, net, seed=seed))
        torch.manual_seed(123)
        expected_next = torch.Generator().manual_seed(123)
        outs = [m(images(seed=s)) for s in (2, 3)]
        assert torch.equal(torch.randn(3), torch.randn(3, generator=expected_next))  # global RNG untouched
        runs.append(outs)
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not torch.equal(runs[0][0], runs[2][0])
    assert not torch.equal(runs[0][0], runs[0][1])  # batch k sees seed + k


# ---------------------------------------------------------------------------- AQR
def test_aqr_behind_the_same_interface() -> None:
    import aqr

    net = conv_net("bn")
    stats = aqr.calibrate(net, [images(n=64, seed=s) for s in range(4)])
    with pytest.raises(TypeError, match="stats"):
        create("aqr", net)
    before = state_of(net)
    m = create("aqr", net, stats=stats)
    x = images(seed=9, shift=0.5)
    out = m(x)
    assert torch.allclose(out, aqr.AQR(net, stats)(x))
    assert torch.equal(create("aqr", net, stats=stats, protocol="online")(x), out)
    m.reset()
    assert same_state(before, state_of(net))


def test_methods_declare_what_a_caller_must_supply() -> None:
    needs = {name: (d.needs.stats, d.needs.batch_size, d.needs.source)
             for name, d in ((n, methods.declaration(n)) for n in methods.available())}
    out, pre = "output", "pre-affine"
    assert needs == {"source": (None, False, False), "ttn": (None, False, False), "tent": (None, True, False),
                     "sar": (None, True, False), "aqr": (out, False, False), "moments": (out, False, False),
                     "rbn": (None, False, False), "bn-ema": (None, False, False), "eta": (None, False, False),
                     "eata": (None, False, True), "roid": (None, False, False), "deyo": (None, False, False),
                     "cotta": (None, False, False), "rotta": (None, False, False), "lame": (None, False, False),
                     "unmixtns": (None, False, False), "rdumb": (None, False, False),
                     "aqr+tent": (pre, True, False), "aqr+eta": (pre, False, False), "aqr+roid": (pre, False, False),
                     "aqr+lame": (out, False, False)}
    maps = {name for name in methods.available() if methods.declaration(name).maps_quantiles}
    assert maps == {"aqr", "aqr+tent", "aqr+eta", "aqr+roid", "aqr+lame"}
    for name in methods.available():  # the class carries the one declaration it was registered with
        d = methods.declaration(name)
        assert (d.cls.name, d.cls.Config, d.cls.declaration) == (name, d.config, d)
    with pytest.raises(KeyError, match="unknown method 'nope'"):
        methods.method_class("nope")
    with pytest.raises(KeyError, match="did you mean 'tent'"):
        methods.plan("tnet")


def test_aqr_options_are_a_typed_config() -> None:
    import aqr

    net = conv_net("bn")
    stats = aqr.calibrate(net, [images(n=32, seed=s) for s in range(2)])
    m = create("aqr", net, stats=stats, tail="clip", grid=64)
    assert isinstance(m.config, methods.AQRMethodConfig) and isinstance(m.config, aqr.AQRConfig)
    assert (m.config.tail, m.config.grid, m.config.mode) == ("clip", 64, "fast") and m.stats is stats
    assert m.aqr.config == aqr.AQRConfig(tail="clip", grid=64)
    assert "stats" not in repr(m.config)
    with pytest.raises(TypeError, match="turbo"):
        create("aqr", net, stats=stats, turbo=True)
    with pytest.raises(ValueError, match="mode"):
        create("aqr", net, stats=stats, mode="turbo")


# ---------------------------------------------------------------------------- moments (AQR's control)
def match_moments(out: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, dim: int) -> torch.Tensor:
    """The control's map written out: each channel's batch mean/std (population) onto ``mean``/``std``."""
    dims = [d for d in range(out.ndim) if d != dim % out.ndim]
    shape = [1] * out.ndim
    shape[dim] = -1
    m = out.double().mean(dims, keepdim=True)
    s = out.double().std(dims, keepdim=True, correction=0)
    return ((out.double() - m) / s * std.double().reshape(shape) + mean.double().reshape(shape)).float()


def direct_moments_forward(net: nn.Module, x: torch.Tensor, stats) -> torch.Tensor:
    """The moments control on ``conv_net`` or ``TinyViT`` computed layer by layer, without hooks."""
    def norm(name: str, module: nn.Module, h: torch.Tensor, dim: int) -> torch.Tensor:
        layer = stats.layers[name]
        return match_moments(module(h), layer.mean, layer.std, dim)

    if isinstance(net, TinyViT):
        h = net.embed(x)
        for i, block in enumerate(net.blocks):
            a = norm(f"blocks.{i}.norm1", block.norm1, h, -1)
            h = h + block.attn(a, a, a, need_weights=False)[0]
            h = h + block.mlp(norm(f"blocks.{i}.norm2", block.norm2, h, -1))
        return net.head(norm("norm", net.norm, h, -1).mean(1))
    h = x
    for name, module in net.named_children():
        h = norm(name, module, h, 1) if name.startswith("norm") else module(h)
    return h


@pytest.mark.parametrize("kind", ["bn", "gn", "ln"])
def test_moments_equals_the_direct_computation(kind: str) -> None:
    import aqr

    build, data = MODELS[kind]
    net = build().eval()
    stats = aqr.calibrate(net, [data(n=64, seed=s) for s in range(3)])
    before = state_of(net)
    method = create("moments", net, stats=stats)
    x = data(n=16, seed=7) * 1.7 + 0.4  # shifted and scaled: every layer's moments move
    with torch.no_grad():
        want = direct_moments_forward(net, x, stats)
        plain = net(x)
    got = method(x)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, plain, atol=1e-2)
    assert same_state(before, state_of(net))
    assert torch.equal(create("moments", net, stats=stats, protocol="online")(x), got)
    assert isinstance(method.config, methods.MomentsConfig) and method.aqr.config.match == "moments"


def test_moments_on_batchnorm_is_ttn_with_the_measured_source_moments() -> None:
    """On a BatchNorm layer the control equals TTN whose beta, |gamma| are the measured source mean, std."""
    import aqr

    net = conv_net("bn")
    stats = aqr.calibrate(net, [images(n=64, seed=s) for s in range(3)])
    twin = conv_net("bn")
    with torch.no_grad():
        for name in ("norm1", "norm2"):
            bn, layer = getattr(twin, name), stats.layers[name]
            bn.weight.copy_(layer.std * bn.weight.sign())
            bn.bias.copy_(layer.mean)
            bn.eps = 1e-12
    x = images(seed=5, shift=0.7)
    assert torch.allclose(create("moments", net, stats=stats)(x), create("ttn", twin)(x), atol=1e-4)


def test_moments_layers_and_nonfinite_policy() -> None:
    import aqr

    net = conv_net("gn")
    stats = aqr.calibrate(net, [images(n=32, seed=s) for s in range(2)])
    assert create("moments", net, stats=stats, layers=["norm2"]).aqr.layer_names == ["norm2"]
    with pytest.raises(TypeError, match="'moments' method needs stats"):
        create("moments", net)
    with pytest.raises(TypeError):
        create("moments", net, stats=stats, tail="clip")  # quantile options do not apply
    x = images()
    x[0, 0, 0, 0] = float("nan")
    with pytest.raises(aqr.NonFiniteActivationError, match="norm1"):
        create("moments", net, stats=stats)(x)
    out = create("moments", net, stats=stats, on_nonfinite="skip")(x)
    assert out.shape == (16, NUM_CLASSES)
    with pytest.raises(ValueError, match="no streaming form"):
        aqr.AQR(net, stats, match="moments", target="stream")


def test_sam_perturbs_by_rho_along_the_gradient_and_steps_from_the_original_point() -> None:
    from aqr.methods.sam import SAM

    a, b = nn.Parameter(torch.tensor([1.0, 2.0])), nn.Parameter(torch.tensor([3.0]))
    sam = SAM(torch.optim.SGD([a, b], lr=0.5), rho=0.05)
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])  # joint norm 5
    sam.perturb()
    assert torch.allclose(a, torch.tensor([1.03, 2.0])) and torch.allclose(b, torch.tensor([3.04]))
    assert a.grad is None
    a.grad, b.grad = torch.tensor([1.0, 1.0]), torch.tensor([2.0])  # gradient at the perturbed point
    sam.unperturb_and_step()
    assert torch.equal(a.detach(), torch.tensor([0.5, 1.5])) and torch.equal(b.detach(), torch.tensor([2.0]))


def test_tent_and_sar_survive_channels_last_input_on_groupnorm() -> None:
    """torch 2.13's CPU GroupNorm backward segfaults on a channels_last input that needs no grad
    while the affine parameters do; run in a subprocess so a crash fails this test, not the run."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from tests.models_tiny import gn_cnn\n"
        "from aqr.methods import create\n"
        "x = torch.rand(8, 16, 16, 3).permute(0, 3, 1, 2)\n"
        "for name in ('tent', 'sar'):\n"
        "    assert create(name, gn_cnn())(x).shape == (8, 5)\n"
        "print('ok')\n"
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-800:]
