"""Tests for ETA/EATA, ROID and DeYO (aqr.methods): each method's core step against a hand
computation of its paper's equations, and the protocol (reset, episodic/online, NaN input, seeds,
the user's model untouched) on tiny models."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aqr import methods
from aqr.methods import NotApplicable, create, softmax_entropy
from aqr.methods.augment import affine, adjust_hue, hsv_to_rgb, rgb_to_hsv, roid_augment
from aqr.methods.deyo import occlude, patch_shuffle, plpd
from aqr.methods.eata import eata_selection, fisher_information, fisher_penalty
from aqr.methods.roid import prior_correction, roid_weights, soft_likelihood_ratio, symmetric_cross_entropy
from tests.models_tiny import bn_cnn, gn_cnn, images, tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = ["eta", "eata", "roid", "deyo"]
SCALES = {"bn": 15.0, "gn": 40.0, "vit": 4.0}  # head scale: entropies spread around the filters' thresholds
BUILDERS = {"bn": bn_cnn, "gn": gn_cnn, "vit": tiny_vit}


def model(kind: str = "gn") -> nn.Module:
    """A tiny model whose predictions are confident enough for the entropy filters to keep some."""
    net = BUILDERS[kind]().eval()
    with torch.no_grad():
        [m for m in net.modules() if isinstance(m, nn.Linear)][-1].weight.mul_(SCALES[kind])
    return net


def batch(seed: int, n: int = 16) -> torch.Tensor:
    return images(n, seed=seed)


def options(name: str, **extra) -> dict:
    """Options that make every method adapt on the tiny models (filters wide open unless overridden)."""
    opts = {"protocol": "online"}
    if name in ("eta", "eata"):
        opts.update(e0=10.0, d_margin=2.0)
    if name == "eata":
        opts.update(source=images(64, seed=99), fisher_batch_size=32)
    if name == "deyo":
        opts.update(margin=10.0, plpd_threshold=-1.0)
    opts.update(extra)
    return opts


def state_of(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def sgd(lr: float = 0.5) -> dict:
    """Plain gradient descent, so that a step is ``-lr * gradient``."""
    return {"optimizer": "sgd", "lr": lr, "momentum": 0.0}


def manual_step(method: methods.TTAMethod, loss_of_logits, x: torch.Tensor, lr: float) -> list[torch.Tensor]:
    """The trained parameters after one gradient-descent step on ``loss_of_logits(logits)``."""
    logits = method.model(x)
    grads = torch.autograd.grad(loss_of_logits(logits), method.trained, allow_unused=True)
    return [p.detach() - lr * (g if g is not None else 0) for p, g in zip(method.trained, grads)]


# ---------------------------------------------------------------------------- registry and presets
def test_registered_with_declarations() -> None:
    for name in NAMES:
        assert name in methods.available()
        needs = methods.declaration(name).needs
        assert (needs.stats, needs.batch_size, needs.source) == (None, False, name == "eata")
    assert not methods.declaration("tent").needs.source


def test_presets_follow_the_reference_configs() -> None:
    net = model()
    for name in NAMES:
        extra = {"source": images(8)} if name == "eata" else {}
        cifar = create(name, net, **extra)
        assert isinstance(cifar.optimizer, torch.optim.Adam)
        assert cifar.optimizer.param_groups[0]["lr"] == 1e-3 and cifar.optimizer.param_groups[0]["betas"] == (0.9, 0.999)
        imagenet = create(name, net, defaults="imagenet", **extra)
        group = imagenet.optimizer.param_groups[0]
        assert isinstance(imagenet.optimizer, torch.optim.SGD)
        assert (group["lr"], group["momentum"], group["nesterov"], group["dampening"]) == (2.5e-4, 0.9, True, 0.0)
        assert create(name, net, defaults="imagenet", lr=0.01, **extra).optimizer.param_groups[0]["lr"] == 0.01
        with pytest.raises(ValueError, match="defaults must be one of"):
            create(name, net, defaults="mnist", **extra)
        with pytest.raises(TypeError):
            create(name, net, learning_rate=1.0, **extra)
    assert create("eta", net).config.d_margin == 0.4 and create("eta", net, defaults="imagenet").config.d_margin == 0.05
    eata = create("eata", net, defaults="imagenet", source=images(8))
    assert (eata.config.fisher_alpha, eata.config.fisher_batch_size) == (2000.0, 64)
    assert create("eata", net, source=images(8)).config.fisher_alpha == 1.0
    assert create("eta", net).config.threshold(10) == pytest.approx(0.4 * math.log(10))
    with pytest.raises(ValueError, match="optimizer"):
        create("roid", net, optimizer="rmsprop")


def test_eata_needs_source_images() -> None:
    with pytest.raises(TypeError, match="source="):
        create("eata", model())
    without = create("eata", model(), fisher_alpha=0.0, e0=10.0)  # no regularizer: ETA, no source needed
    assert without.fisher is None
    x = batch(2)
    assert torch.equal(without(x), create("eta", model(), e0=10.0)(x))
    with pytest.raises(TypeError, match="image tensors"):
        create("eata", model(), source=["not images"])
    bad = images(8)
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        create("eata", model(), source=bad)


@pytest.mark.parametrize("name", NAMES)
def test_not_applicable_without_norm_layers(name: str) -> None:
    net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 5))
    with pytest.raises(NotApplicable):
        create(name, net, **({"source": images(8)} if name == "eata" else {}))


# ---------------------------------------------------------------------------- ETA / EATA
def test_eata_selection_by_hand() -> None:
    e0, margin = 0.4 * math.log(10), 0.4
    probs = torch.tensor([[0.90, 0.10, 0.0], [0.10, 0.85, 0.05], [0.05, 0.05, 0.90], [0.4, 0.3, 0.3]])
    entropy = torch.tensor([0.2, 0.5, 0.3, 2.0])  # the last one is unreliable (> 0.921)

    keep, weights, moving = eata_selection(probs, entropy, e0, margin, None)
    assert keep.tolist() == [True, True, True, False]  # no average yet: every reliable sample
    assert torch.allclose(weights, torch.exp(e0 - entropy[:3]))
    assert torch.allclose(moving, probs[:3].mean(0))

    old = torch.tensor([1.0, 0.0, 0.0])
    keep, weights, moving = eata_selection(probs, entropy, e0, margin, old)
    # |cos| with (1, 0, 0): 0.994, 0.117, 0.055 (and the unreliable last one)
    assert keep.tolist() == [False, True, True, False]
    assert torch.allclose(weights, torch.exp(e0 - torch.tensor([0.5, 0.3])))
    assert torch.allclose(moving, 0.9 * old + 0.1 * probs[1:3].mean(0))

    keep, weights, moving = eata_selection(probs, entropy + 5.0, e0, margin, old)
    assert not keep.any() and weights.numel() == 0 and torch.equal(moving, old)  # unchanged when none selected
    assert eata_selection(probs, entropy + 5.0, e0, margin, None)[2] is None


def test_eta_step_is_weighted_entropy_descent_with_the_diversity_filter() -> None:
    net, lr, e0 = model("gn"), 0.5, 0.4 * math.log(5)
    x1, x2 = batch(2), batch(3)
    # a redundancy margin that splits the second batch: the median |cosine| it meets
    probe = create("eta", net, **options("eta", e0=e0), **sgd(lr))
    probe(x1)
    with torch.no_grad():
        cosine = F.cosine_similarity(probe.model(x2).softmax(1), probe.moving_probs.unsqueeze(0), dim=1).abs()
    margin = float(cosine.median())
    m = create("eta", net, **options("eta", e0=e0, d_margin=margin), **sgd(lr))
    moving = None

    def loss_given(moving_before):
        def loss(logits):
            entropy = softmax_entropy(logits)
            probs = logits.detach().softmax(1)
            keep = entropy.detach() < e0  # Eq. 3
            if moving_before is not None:  # Eq. 5
                keep &= F.cosine_similarity(probs, moving_before.unsqueeze(0), dim=1).abs() < margin
            assert 0 < keep.sum() < len(keep)
            weight = 1 / torch.exp(entropy.detach()[keep] - e0)  # Eq. 6
            return (entropy[keep] * weight).mean(), probs[keep].mean(0)
        return loss

    for x in (x1, x2):
        expected = manual_step(m, lambda logits: loss_given(moving)(logits)[0], x, lr)
        with torch.no_grad():
            chosen_mean = loss_given(moving)(m.model(x))[1]
        m(x)
        assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(m.trained, expected))
        moving = chosen_mean if moving is None else 0.9 * moving + 0.1 * chosen_mean
        assert torch.allclose(m.moving_probs, moving, atol=1e-6)


def test_eta_skips_the_update_when_nothing_is_selected() -> None:
    m = create("eta", model("gn"), protocol="online", e0=0.0)
    start = state_of(m.model)
    m(batch(2))
    assert same_state(start, state_of(m.model)) and m.moving_probs is None and m.skipped_steps == 1


def test_fisher_information_is_the_mean_squared_pseudo_label_gradient() -> None:
    net, source = model("bn"), images(80, seed=7)
    m = create("eata", net, source=source, fisher_batch_size=32, source_images=70, e0=10.0)
    reference = copy.deepcopy(m.model)  # configured like the method's copy, weights unchanged
    params = [p for n, p in reference.named_parameters() if n in m.param_names]
    squares = []
    for chunk in (source[:32], source[32:64], source[64:70]):  # 70 images in batches of 32
        logits = reference(chunk)
        grads = torch.autograd.grad(F.cross_entropy(logits, logits.argmax(1)), params)
        squares.append([g ** 2 for g in grads])
    for i, name in enumerate(m.param_names):
        want = sum(s[i] for s in squares) / 3
        assert torch.allclose(m.fisher[name], want, rtol=1e-5, atol=1e-10)
    assert any(bool((f > 0).any()) for f in m.fisher.values())
    # an iterable of (images, labels) batches gives the same as the tensor
    loader = [(source[i:i + 32], torch.zeros(32)) for i in range(0, 80, 32)]
    again = create("eata", net, source=loader, source_images=70, e0=10.0)
    assert all(torch.allclose(again.fisher[n], m.fisher[n], rtol=1e-5, atol=1e-10) for n in m.param_names)
    with pytest.raises(ValueError, match="no images"):
        fisher_information(reference, dict(zip(m.param_names, params)), [])


def test_fisher_penalty_for_a_known_parameter_change() -> None:
    anchor = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.5])}
    fisher = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}
    moved = {"a": torch.tensor([1.5, 9.0]), "b": torch.tensor([0.0])}
    # 2 * (3 * 0.5^2 + 0 * 7^2 + 4 * 0.5^2) = 3.5
    assert fisher_penalty(moved, fisher, anchor, 2.0).item() == pytest.approx(3.5)
    assert fisher_penalty(anchor, fisher, anchor, 2.0).item() == 0.0

    m = create("eata", model("gn"), source=images(32, seed=8), fisher_alpha=5.0, **sgd())
    assert m.regularizer().item() == 0.0  # at the source weights
    delta = 0.1
    with torch.no_grad():
        for p in m.trained:
            p.add_(delta)
    want = 5.0 * sum(float(f.sum()) for f in m.fisher.values()) * delta ** 2
    assert m.regularizer().item() == pytest.approx(want, rel=1e-4)


def test_eata_step_adds_the_fisher_gradient() -> None:
    """Second online step: the regularizer's gradient 2 alpha F (theta - theta0) joins ETA's."""
    net, lr, alpha = model("gn"), 0.5, 50.0
    opts = options("eata", fisher_alpha=alpha, d_margin=2.0) | sgd(lr)
    with_fisher, without = create("eata", net, **opts), create("eata", net, **(opts | {"fisher_alpha": 0.0}))
    with_fisher(batch(2))
    without(batch(2))
    # after one step both moved the same way (the penalty's gradient is zero at theta0)
    assert all(torch.allclose(p, q) for p, q in zip(with_fisher.trained, without.trained))
    theta = [p.detach().clone() for p in with_fisher.trained]
    with_fisher(batch(3))
    without(batch(3))
    for name, t, p, q in zip(with_fisher.param_names, theta, with_fisher.trained, without.trained):
        pull = 2 * alpha * with_fisher.fisher[name] * (t - with_fisher.anchor[name])
        assert torch.allclose(p, q - lr * pull, atol=1e-6)
    assert any(bool((with_fisher.fisher[n] * (t - with_fisher.anchor[n])).abs().max() > 0)
               for n, t in zip(with_fisher.param_names, theta))


# ---------------------------------------------------------------------------- ROID
def test_roid_weights_by_hand() -> None:
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 0.5], [1.0, 1.0, 1.0]])
    moving = torch.tensor([0.6, 0.2, 0.2])
    weights, dropped = roid_weights(logits, moving, temperature=1 / 3)

    def softmax(row):
        e = [math.exp(v) for v in row]
        return [v / sum(e) for v in e]

    probs = [softmax(row) for row in logits.tolist()]
    cos = [sum(a * b for a, b in zip(p, moving.tolist())) / math.sqrt(sum(a * a for a in p))
           / math.sqrt(sum(b * b for b in moving.tolist())) for p in probs]
    div = [1 - c for c in cos]
    div = [(d - min(div)) / (max(div) - min(div)) for d in div]
    ent = [-sum(q * math.log(q) for q in p) for p in probs]
    cert = [-e for e in ent]
    cert = [(c - min(cert)) / (max(cert) - min(cert)) for c in cert]
    mean_div = sum(div) / 4
    want = [0.0 if d < mean_div else math.exp(3 * d * c) for d, c in zip(div, cert)]
    assert dropped.tolist() == [d < mean_div for d in div]
    assert 0 < sum(dropped.tolist()) < 4
    assert weights.tolist() == pytest.approx(want, rel=1e-5)
    # all samples alike: nothing dropped, weight 1 (no 0/0)
    same, none = roid_weights(torch.zeros(3, 3), moving, 1 / 3)
    assert not none.any() and torch.equal(same, torch.ones(3))


def test_roid_losses_and_prior_correction_by_hand() -> None:
    logits = torch.tensor([[math.log(3.0), 0.0], [0.0, 0.0], [10.0, 0.0]])
    # p = (0.75, 0.25): -(0.75 log(3 + 1e-5) + 0.25 log(1/3 + 1e-5)); the third is clipped at 0.99
    want0 = -(0.75 * math.log(3 + 1e-5) + 0.25 * math.log(1 / 3 + 1e-5))
    p2 = 1 / (1 + math.exp(-10.0))
    q2 = 1 - p2
    want2 = -(0.99 * math.log(0.99 / 0.01 + 1e-5) + q2 * math.log(q2 / (1 - q2) + 1e-5))
    assert soft_likelihood_ratio(logits).tolist() == pytest.approx([want0, -math.log(1 + 1e-5), want2], rel=1e-5, abs=1e-7)

    a, b = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 2.0]])
    p, q = a.softmax(1)[0].tolist(), b.softmax(1)[0].tolist()
    sce = -0.5 * sum(qi * math.log(pi) for pi, qi in zip(p, q)) - 0.5 * sum(pi * math.log(qi) for pi, qi in zip(p, q))
    assert symmetric_cross_entropy(a, b).item() == pytest.approx(sce, rel=1e-6)

    logits = torch.tensor([[2.0, 0.0, -1.0], [1.0, 1.0, 0.0]])
    probs = logits.softmax(1)
    prior = probs.mean(0).tolist()
    smooth = max(1 / 2, 1 / 3) / max(prior)
    corrected = [(pk + smooth) / (1 + 3 * smooth) for pk in prior]
    want = [[v * c for v, c in zip(row, corrected)] for row in logits.tolist()]
    assert prior_correction(logits).tolist() == [pytest.approx(r, rel=1e-6) for r in want]


def test_roid_scores_prior_corrected_logits_and_ensembles_towards_the_source() -> None:
    net, x = model("gn"), batch(2)
    m = create("roid", net, protocol="online", lr=0.0)  # no gradient change: only the ensembling moves weights
    plain = create("source", net)(x)
    assert torch.allclose(m(x), prior_correction(plain), atol=1e-6)
    assert all(torch.equal(p, s) for p, s in zip(m.trained, m.source_weights))
    delta = 0.2
    with torch.no_grad():
        for p in m.trained:
            p.add_(delta)
    m(batch(3))
    assert all(torch.allclose(p, s + 0.99 * delta, atol=1e-6) for p, s in zip(m.trained, m.source_weights))
    off = create("roid", net, protocol="online", lr=0.0, use_prior_correction=False)
    assert torch.allclose(off(x), plain, atol=1e-6)


def test_roid_moving_probabilities_and_step() -> None:
    net, lr = model("gn"), 0.5
    m = create("roid", net, protocol="online", use_consistency=False, momentum_src=1.0, **sgd(lr))
    x = batch(2)

    def loss(logits):
        weights, dropped = roid_weights(logits.detach(), torch.full((5,), 0.2), 1 / 3)
        return (soft_likelihood_ratio(logits) * weights)[~dropped].sum() / len(x)

    expected = manual_step(m, loss, x, lr)
    with torch.no_grad():
        batch_mean = m.model(x).softmax(1).mean(0)
    m(x)
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(m.trained, expected))
    assert torch.allclose(m.moving_probs, 0.9 * torch.full((5,), 0.2) + 0.1 * batch_mean, atol=1e-6)


def test_roid_augmentation() -> None:
    x = images(4, size=16, seed=3)
    hsv = rgb_to_hsv(x)
    assert torch.allclose(hsv_to_rgb(hsv), x, atol=1e-5)
    assert torch.allclose(adjust_hue(x, 0.0), x, atol=1e-5)
    red = torch.tensor([1.0, 0.0, 0.0]).view(1, 3, 1, 1)
    assert torch.allclose(adjust_hue(red, 1 / 3), torch.tensor([0.0, 1.0, 0.0]).view(1, 3, 1, 1), atol=1e-5)
    assert torch.allclose(affine(x, 0.0, (0.0, 0.0), 1.0), x, atol=1e-5)
    shifted = affine(x, 0.0, (2.0, 1.0), 1.0)  # content moves right by 2, down by 1
    assert torch.allclose(shifted[..., 1:, 2:], x[..., :-1, :-2], atol=1e-5)
    assert torch.equal(shifted[..., :1, :], torch.zeros_like(shifted[..., :1, :]))
    torch.manual_seed(0)
    a = roid_augment(x)
    torch.manual_seed(0)
    b = roid_augment(x)
    assert torch.equal(a, b) and a.shape == x.shape and a.min() >= 0 and a.max() <= 1
    assert not torch.allclose(a, x, atol=1e-3)
    with pytest.raises(ValueError, match="RGB"):
        roid_augment(torch.rand(2, 1, 8, 8))


# ---------------------------------------------------------------------------- DeYO
def test_patch_shuffle_moves_whole_patches() -> None:
    x = torch.arange(16.0).view(1, 1, 4, 4)
    order = torch.tensor([[3, 2, 1, 0]])  # 2x2 grid of 2x2 patches, reversed
    want = torch.tensor([[10.0, 11.0, 8.0, 9.0], [14.0, 15.0, 12.0, 13.0],
                         [2.0, 3.0, 0.0, 1.0], [6.0, 7.0, 4.0, 5.0]])
    assert torch.equal(patch_shuffle(x, 2, order)[0, 0], want)
    assert torch.equal(patch_shuffle(x, 2, torch.tensor([[0, 1, 2, 3]])), x)
    y = images(3, size=8, seed=4)
    shuffled = patch_shuffle(y, 4)
    assert torch.equal(shuffled.sum(dim=(2, 3)), y.sum(dim=(2, 3))) or torch.allclose(
        shuffled.sum(dim=(2, 3)), y.sum(dim=(2, 3)))
    assert patch_shuffle(images(2, size=10), 4).shape == (2, 3, 10, 10)  # resized to 8x8 and back
    occluded = occlude(y, 4, 2, 2)
    assert torch.allclose(occluded[:, :, 2:6, 2:6], y.mean(dim=(2, 3), keepdim=True).expand(3, 3, 4, 4))
    assert torch.equal(occluded[:, :, :2], y[:, :, :2])


def test_plpd_by_hand() -> None:
    p = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]])
    q = torch.tensor([[0.3, 0.5, 0.2], [0.2, 0.2, 0.6]])
    assert plpd(p, q).tolist() == pytest.approx([0.4, 0.0])


class PositionBlind(nn.Module):
    """1x1 convolutions, GroupNorm and global pooling: its output ignores where pixels are."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 1)
        self.norm = nn.GroupNorm(2, 8)
        self.head = nn.Linear(8, 5)
        with torch.no_grad():
            self.head.weight.mul_(40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.norm(self.conv(x))).mean(dim=(2, 3)))


def test_deyo_plpd_filter_on_a_model_blind_to_positions() -> None:
    """Shuffling patches cannot change a position-blind model's output: PLPD is 0, nothing passes 0.2."""
    net, x = PositionBlind(), batch(2)
    strict = create("deyo", net, protocol="online", margin=10.0)
    start = state_of(strict.model)
    strict(x)
    assert strict.selected_entropy == len(x) and strict.selected == 0 and same_state(start, state_of(strict.model))
    loose = create("deyo", net, protocol="online", margin=10.0, plpd_threshold=-1e-4)
    loose(x)
    assert loose.selected == len(x) and not same_state(start, state_of(loose.model))


def test_deyo_step_by_hand() -> None:
    """With the deterministic occlusion: entropy filter, PLPD filter, weights exp(E0 - H) + exp(PLPD)."""
    net, lr = model("gn"), 0.5
    with torch.no_grad():
        entropy = softmax_entropy(net(batch(2)))
    margin = float(entropy.median()) / math.log(5)
    m = create("deyo", net, protocol="online", aug="occ", occlusion_size=4, row_start=0, column_start=0,
               margin=margin, plpd_threshold=-0.01, **sgd(lr))
    x = batch(2)

    def loss(logits):
        ent = softmax_entropy(logits)
        keep = ent.detach() < margin * math.log(5)
        with torch.no_grad():
            destroyed = m.model(occlude(x[keep], 4, 0, 0)).softmax(1)
        probs = logits.detach()[keep].softmax(1)
        label = probs.argmax(1)
        diff = probs[torch.arange(len(label)), label] - destroyed[torch.arange(len(label)), label]
        chosen = diff > -0.01
        assert 0 < keep.sum() < len(x) and 0 < chosen.sum()
        e = ent[keep][chosen]
        weight = torch.exp(0.4 * math.log(5) - e.detach()) + torch.exp(diff[chosen])
        return (e * weight).mean()

    expected = manual_step(m, loss, x, lr)
    m(x)
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(m.trained, expected))


def test_deyo_freezes_top_layers_like_sar() -> None:
    vit = tiny_vit()
    frozen = create("deyo", vit, freeze=("blocks.1", "norm"))
    assert frozen.param_names and all(not n.startswith(("blocks.1.", "norm.")) for n in frozen.param_names)
    assert create("deyo", vit).frozen_rules == ()
    with pytest.raises(ValueError, match="matches no module"):
        create("deyo", vit, freeze="layer4")


# ---------------------------------------------------------------------------- protocol
@pytest.mark.parametrize("kind", ["bn", "gn", "vit"])
@pytest.mark.parametrize("name", NAMES)
def test_online_adapts_and_reset_restores_everything(name: str, kind: str) -> None:
    m = create(name, model(kind), **options(name))
    fresh = create(name, model(kind), **options(name))
    start = state_of(m.model)
    outs = [m(batch(s)) for s in (2, 3)]
    assert not same_state(start, state_of(m.model))
    assert len(m.optimizer.state_dict()["state"]) > 0
    if name != "deyo":
        assert m.moving_probs is not None
    m.reset()
    assert same_state(start, state_of(m.model))
    assert len(m.optimizer.state_dict()["state"]) == 0
    if name != "deyo":
        assert m.moving_probs is None
    again = [m(batch(s)) for s in (2, 3)]
    assert all(torch.equal(a, b) for a, b in zip(outs, again))  # reset + same seed: the same run
    assert all(torch.equal(a, fresh(batch(s))) for a, s in zip(outs, (2, 3)))


@pytest.mark.parametrize("kind", ["bn", "gn", "vit"])
@pytest.mark.parametrize("name", NAMES)
def test_episodic_logits_do_not_depend_on_earlier_batches(name: str, kind: str) -> None:
    opts = options(name, protocol="episodic", lr=0.05)
    fresh, used = create(name, model(kind), **opts), create(name, model(kind), **opts)
    for s in (4, 5):
        used(batch(s) * 0.5)
    target = batch(7)
    out = fresh(target)
    assert torch.equal(used(target), out)
    unadapted = create(name, model(kind), **(opts | {"lr": 0.0}))(target)
    assert not torch.allclose(out, unadapted)  # adaptation changed the scored pass


@pytest.mark.parametrize("name", NAMES)
def test_online_scores_the_forward_before_the_update(name: str) -> None:
    net, x = model("bn"), batch(2)
    first = create(name, net, **options(name))(x)
    unadapted = create("ttn", net)(x)
    assert torch.allclose(first, prior_correction(unadapted) if name == "roid" else unadapted, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_seed_reproduces_and_leaves_global_rng_alone(name: str) -> None:
    runs = []
    for seed in (3, 3, 4):
        m = create(name, model("bn"), seed=seed, **options(name))
        torch.manual_seed(123)
        outs = [m(batch(s)) for s in (2, 3, 4)]
        assert torch.equal(torch.randn(3), torch.randn(3, generator=torch.Generator().manual_seed(123)))
        runs.append(outs)
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    if name in ("roid", "deyo"):  # their augmentations draw random numbers
        assert not all(torch.equal(a, b) for a, b in zip(runs[0], runs[2]))


@pytest.mark.parametrize("kind", ["bn", "gn"])
@pytest.mark.parametrize("name", NAMES)
def test_non_finite_images_stay_out_of_adaptation(name: str, kind: str) -> None:
    m = create(name, model(kind), **options(name))
    twin = create(name, model(kind), **options(name))
    x = batch(2)
    bad = x.clone()
    bad[3] = float("nan")
    bad[5, 0, 1, 1] = float("inf")
    good = torch.ones(len(x), dtype=torch.bool)
    good[[3, 5]] = False
    out = m(bad)
    assert torch.isfinite(out[good]).all()
    twin_out = twin(x[good])  # the same step on the finite images alone
    assert torch.allclose(out[good], twin_out, atol=1e-5)
    assert all(torch.isfinite(p).all() for p in m.trained)
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(m.trained, twin.trained))
    assert torch.isfinite(m(batch(3))).all()
    every = bad.clone()
    every[:] = float("nan")
    start = state_of(m.model)
    m(every)  # nothing finite: no step
    assert same_state(start, state_of(m.model))


@pytest.mark.parametrize("protocol", ["episodic", "online"])
@pytest.mark.parametrize("kind", ["bn", "gn", "vit"])
@pytest.mark.parametrize("name", NAMES)
def test_user_model_is_never_modified(name: str, kind: str, protocol: str) -> None:
    net = model(kind)
    net.train()
    before = state_of(net)
    grads = {k: p.requires_grad for k, p in net.named_parameters()}
    m = create(name, net, **options(name, protocol=protocol, lr=0.05))
    for s in (2, 3):
        m(batch(s))
    m.reset()
    assert same_state(before, state_of(net))
    assert grads == {k: p.requires_grad for k, p in net.named_parameters()}
    assert all(mod.training for mod in net.modules())
    assert all(p.grad is None for p in net.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_trains_only_norm_affine_parameters_with_batch_statistics(name: str) -> None:
    m = create(name, model("bn"), **options(name))
    norm = (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm)
    affine = {f"{mn}.{pn}" for mn, mod in m.model.named_modules() if isinstance(mod, norm)
              for pn, _ in mod.named_parameters()}
    assert {n for n, p in m.model.named_parameters() if p.requires_grad} == affine == set(m.param_names)
    assert all(mod.running_mean is None for mod in m.model.modules() if isinstance(mod, nn.BatchNorm2d))
    assert not m.model.training
    before = state_of(m.model)
    m(batch(2))
    changed = {k for k, v in state_of(m.model).items() if not torch.equal(v, before[k])}
    assert changed and changed <= affine
