"""UnMix-TNS (aqr.methods.unmixtns) and RDumb (aqr.methods.rdumb): their core steps against hand computations,
both protocols, reset, non-finite input and the presets."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from aqr.methods import NotApplicable, create, plan
from aqr.methods.unmixtns import (UnMixTNSBatchNorm, UnMixTNSConfig, component_step, initial_components,
                                  mixed_statistics)

from .test_methods import TinyViT, conv_net, images, state_of, same_state

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------- UnMix-TNS: the core step by hand
def test_assignment_mixing_and_update_on_a_two_component_toy() -> None:
    """Two channels, two components, two images: every number written out from the paper's equations."""
    means = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # component 1 points along channel 0, component 2 along 1
    variances = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    inst_mean = torch.tensor([[2.0, 0.0], [1.0, 1.0]])  # image 1 like component 1; image 2 halfway
    inst_var = torch.tensor([[0.5, 0.5], [1.0, 1.0]])
    tau = 0.5
    probs, mean, var = mixed_statistics(inst_mean, inst_var, means, variances, tau)

    # assignment: softmax over cosine similarities / tau
    c = 1 / math.sqrt(2)
    p1 = torch.softmax(torch.tensor([1.0, 0.0]) / tau, 0)
    p2 = torch.softmax(torch.tensor([c, c]) / tau, 0)
    assert torch.allclose(probs, torch.stack([p1, p2]))
    assert torch.allclose(p2, torch.tensor([0.5, 0.5]))

    # mixing: image i's moments from the K mixed components
    for i, p in enumerate((p1, p2)):
        mixed_means = [(1 - p[k]) * means[k] + p[k] * inst_mean[i] for k in range(2)]
        mixed_vars = [(1 - p[k]) * variances[k] + p[k] * inst_var[i] for k in range(2)]
        m = (mixed_means[0] + mixed_means[1]) / 2
        v = (mixed_vars[0] + mixed_vars[1]) / 2 + (mixed_means[0] ** 2 + mixed_means[1] ** 2) / 2 - m ** 2
        assert torch.allclose(mean[i], m) and torch.allclose(var[i], v)

    # update: x_k + a * mean_i p_ik (y_i - x_k)
    a = 0.1
    new_means, new_vars = component_step(inst_mean, inst_var, probs, means, variances, a)
    for k in range(2):
        step_m = (p1[k] * (inst_mean[0] - means[k]) + p2[k] * (inst_mean[1] - means[k])) / 2
        step_v = (p1[k] * (inst_var[0] - variances[k]) + p2[k] * (inst_var[1] - variances[k])) / 2
        assert torch.allclose(new_means[k], means[k] + a * step_m)
        assert torch.allclose(new_vars[k], variances[k] + a * step_v)


def test_the_layer_normalizes_each_image_with_its_own_mixed_statistics() -> None:
    bn = nn.BatchNorm2d(3)
    with torch.no_grad():
        bn.running_mean.copy_(torch.tensor([0.5, -0.5, 1.0]))
        bn.running_var.copy_(torch.tensor([1.0, 2.0, 0.5]))
        bn.weight.copy_(torch.tensor([1.5, 0.5, 1.0]))
        bn.bias.copy_(torch.tensor([0.1, -0.1, 0.0]))
    layer = UnMixTNSBatchNorm(bn, UnMixTNSConfig(num_components=4), torch.Generator().manual_seed(0))
    x = torch.randn(5, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    means, variances = layer.means.clone(), layer.vars.clone()
    out = layer(x)
    var_i, mean_i = torch.var_mean(x, dim=[2, 3], correction=0)
    probs, mean, var = mixed_statistics(mean_i, var_i, means, variances, 0.07)
    expected = (x - mean[..., None, None]) / torch.sqrt(var[..., None, None] + bn.eps)
    expected = expected * bn.weight.view(1, -1, 1, 1) + bn.bias.view(1, -1, 1, 1)
    assert torch.allclose(out, expected, atol=1e-6)
    # the batch of 5 moved the components by the batch momentum 1 - 0.9^(5/64), after normalizing
    a = 1 - 0.9 ** (5 / 64)
    new_means, new_vars = component_step(mean_i, var_i, probs, means, variances, a)
    assert torch.allclose(layer.means, new_means) and torch.allclose(layer.vars, new_vars)
    assert not torch.allclose(layer.means, means)


def test_components_start_around_the_source_statistics() -> None:
    mean, var = torch.tensor([1.0, -2.0]), torch.tensor([4.0, 0.25])
    g = torch.Generator().manual_seed(3)
    means, variances = initial_components(mean, var, 4, 0.5, g)
    z = torch.randn(4, 2, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(means, mean + math.sqrt(0.5 * 4 / 3) * var.sqrt() * z)
    assert torch.allclose(variances, 0.5 * var.expand(4, 2))
    # the equal-weight mixture of many components has the source's moments in expectation
    means, variances = initial_components(mean, var, 20000, 0.5, torch.Generator().manual_seed(0))
    mixture_var = variances.mean(0) + means.var(0, correction=0)
    assert torch.allclose(means.mean(0), mean, atol=0.05) and torch.allclose(mixture_var, var, rtol=0.05)
    # one component: the source statistics, no random numbers drawn
    one, one_var = initial_components(mean, var, 1, 0.5, torch.Generator().manual_seed(0))
    assert torch.equal(one[0], mean) and torch.equal(one_var[0], var)


def test_components_are_drawn_from_the_protocol_seed() -> None:
    net = conv_net("bn")
    a = create("unmixtns", net, protocol="online", seed=5)
    b = create("unmixtns", net, protocol="online", seed=5)
    c = create("unmixtns", net, protocol="online", seed=6)
    assert torch.equal(a.layers[0].means, b.layers[0].means)
    assert not torch.equal(a.layers[0].means, c.layers[0].means)
    # as the reference draws them: torch's generator seeded once, one (K, C) draw per layer in module order
    g = torch.Generator().manual_seed(5)
    for layer, bn in zip(a.layers, [net.norm1, net.norm2]):
        expected, _ = initial_components(bn.running_mean, bn.running_var, 16, 0.5, g)
        assert torch.equal(layer.means, expected)


# ---------------------------------------------------------------------------- UnMix-TNS: the method
def test_online_components_move_and_reset_restores_them() -> None:
    net = conv_net("bn")
    before = state_of(net)
    m = create("unmixtns", net, protocol="online")
    x = images(n=8)
    first = m(x)
    second = m(x)
    assert not torch.equal(first, second)  # the components moved
    m.reset()
    assert torch.equal(m(x), first)
    assert same_state(before, state_of(net))  # the user's model is untouched


def test_episodic_protocol_starts_every_batch_from_the_initial_components() -> None:
    m = create("unmixtns", conv_net("bn"), protocol="episodic")
    x = images(n=8)
    assert torch.equal(m(x), m(x))


def test_forward_held_moves_nothing() -> None:
    m = create("unmixtns", conv_net("bn"), protocol="online")
    x, y = images(n=8), images(n=8, seed=4)
    m(x)
    snapshot = [layer.means.clone() for layer in m.layers]
    held = m.forward_held(y)
    assert all(torch.equal(layer.means, s) for layer, s in zip(m.layers, snapshot))
    assert torch.allclose(held, m(y))  # held predicts as the next forward would, before its update


def test_non_finite_images_never_move_the_components() -> None:
    m = create("unmixtns", conv_net("bn"), protocol="online")
    clean = create("unmixtns", conv_net("bn"), protocol="online")
    x = images(n=8)
    bad = x.clone()
    bad[3, 0, 2, 2] = float("nan")
    bad[5, 1, 0, 0] = float("inf")
    out = m(bad)
    good = torch.ones(8, dtype=torch.bool)
    good[[3, 5]] = False
    assert torch.isfinite(out[good]).all()
    # the components moved by the finite images only (weighted by the whole batch's size, as every image counts)
    for layer in m.layers:
        assert torch.isfinite(layer.means).all() and torch.isfinite(layer.vars).all()
    # a batch of finite images afterwards still gives finite outputs
    assert torch.isfinite(m(x)).all()
    clean(x)
    assert not torch.equal(m.layers[0].means, clean.layers[0].means)


def test_not_applicable_without_batchnorm() -> None:
    for model in (conv_net("gn"), TinyViT()):
        with pytest.raises(NotApplicable, match="BatchNorm"):
            create("unmixtns", model)


def test_presets_and_options() -> None:
    assert plan("unmixtns").config == UnMixTNSConfig(num_components=16, batch_size_max=64)
    assert plan("unmixtns", {"defaults": "imagenet"}).config.batch_size_max == 16
    assert plan("unmixtns", {"num_components": 128}).config.num_components == 128
    for bad in ({"num_components": 0}, {"temperature": 0.0}, {"init_spread": 1.5}, {"momentum": 0.0},
                {"batch_size_max": 2.5}):
        with pytest.raises(ValueError):
            plan("unmixtns", bad)
    m = create("unmixtns", conv_net("bn"), num_components=2, momentum=0.5)
    assert m.layers[0].means.shape == (2, 8) and m.layers[0].layer_momentum == 0.5


# ---------------------------------------------------------------------------- RDumb
ETA_OPEN = {"e0": 10.0, "d_margin": 2.0}  # filters open on the tiny model, so every step updates


def test_rdumb_equals_eta_before_its_first_reset_and_resets_on_schedule() -> None:
    net = conv_net("bn")
    rdumb = create("rdumb", net, protocol="online", reset_every=3, **ETA_OPEN)
    eta = create("eta", net, protocol="online", **ETA_OPEN)
    batches = [images(n=8, seed=s) for s in range(7)]
    ours = [rdumb(x) for x in batches]
    theirs = [eta(x) for x in batches[:3]]
    assert all(torch.equal(a, b) for a, b in zip(ours[:3], theirs))  # steps 1-3: ETA's
    assert rdumb.scheduled_resets == 2  # after steps 3 and 6
    fresh = create("eta", net, protocol="online", **ETA_OPEN)
    restarted = [fresh(x) for x in batches[3:6]]
    assert all(torch.equal(a, b) for a, b in zip(ours[3:6], restarted))  # steps 4-6 start from the source again
    assert not torch.equal(ours[3], eta(batches[3]))  # ETA kept adapting; RDumb had forgotten


def test_rdumb_counts_steps_that_update_nothing() -> None:
    rdumb = create("rdumb", conv_net("bn"), protocol="online", reset_every=2, e0=1e-9)  # nothing passes the filter
    for s in range(4):
        rdumb(images(n=8, seed=s))
    assert rdumb.scheduled_resets == 2 and rdumb.skipped_steps == 4


def test_rdumb_reset_and_presets() -> None:
    net = conv_net("bn")
    rdumb = create("rdumb", net, protocol="online", reset_every=5, **ETA_OPEN)
    for s in range(3):
        rdumb(images(n=8, seed=s))
    rdumb.reset()  # a reset asked for restarts the count
    assert rdumb.steps_since_reset == 0
    for s in range(4):
        rdumb(images(n=8, seed=s))
    assert rdumb.scheduled_resets == 0
    assert plan("rdumb").config.reset_every == 1000 and plan("rdumb").config.optimizer == "adam"
    assert plan("rdumb", {"defaults": "imagenet"}).config.optimizer == "sgd"
    assert plan("rdumb", {"defaults": "imagenet"}).config.d_margin == 0.05
    with pytest.raises(ValueError, match="reset_every"):
        plan("rdumb", {"reset_every": 0})
    # episodic: every batch starts from the source, so the schedule never fires
    episodic = create("rdumb", net, protocol="episodic", reset_every=1, **ETA_OPEN)
    assert torch.equal(episodic(images(n=8)), episodic(images(n=8)))
