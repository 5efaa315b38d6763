"""ROID's parts switched off one at a time, in ``roid`` and in ``aqr+roid``: batch statistics, weighting,
the consistency loss, the prior correction and the weight ensembling. Each switch is shown to change
what it names on a tiny model, and nothing else. Tiny models, one thread."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import aqr
from aqr import methods
from aqr.methods import create
from aqr.methods.roid import ROIDConfig, prior_correction
from tests.models_tiny import bn_cnn, images

pytestmark = pytest.mark.usefixtures("one_thread")

NAMES = ("roid", "aqr+roid")
QUICK = {"num_quantiles": 11, "tail_batch": 10, "tail_repeats": 20}


def bn_model() -> nn.Module:
    """A tiny BN model with non-trivial running statistics and a confident head."""
    net = bn_cnn().eval()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.5, 2.0)
        [m for m in net.modules() if isinstance(m, nn.Linear)][-1].weight.mul_(15.0)
    return net


def build(name: str, net: nn.Module, **options: object) -> nn.Module:
    """``roid`` or ``aqr+roid`` (a streaming target, statistics before the affine step) on ``net``, online."""
    if name == "aqr+roid":
        stats = aqr.calibrate(net, [images(64, seed=100)], point="pre-affine", **QUICK)
        options = {"stats": stats, "target": "stream", "compile": False, **options}
    return create(name, net, protocol="online", **options)


def shifted(seed: int, shift: float) -> torch.Tensor:
    return (images(16, seed=seed) * (1 + shift) + shift).clamp(0, 2)


def test_defaults_keep_every_part_on_but_the_composition_keeps_the_source_statistics() -> None:
    config = ROIDConfig()
    assert (config.use_batch_statistics, config.use_weighting, config.use_consistency,
            config.use_prior_correction) == (True, True, True, True)
    assert config.momentum_src < 1.0
    composed = methods.plan("aqr+roid", {}).config
    assert not composed.use_batch_statistics
    assert (composed.use_weighting, composed.use_consistency, composed.use_prior_correction) == (True, True, True)
    assert methods.plan("aqr+roid", {"use_batch_statistics": True}).config.use_batch_statistics
    with pytest.raises(ValueError, match="use_batch_statistics must be True or False, got 'no'"):
        ROIDConfig(use_batch_statistics="no")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", NAMES)
def test_without_batch_statistics_batchnorm_keeps_the_source_statistics(name: str) -> None:
    net = bn_model()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    first, second = shifted(1, 0.0), shifted(2, 0.6)
    fixed = {"lr": 0.0, "use_prior_correction": False, "use_consistency": False}
    on, off = build(name, net, use_batch_statistics=True, **fixed), build(name, net, use_batch_statistics=False, **fixed)
    for layer in (m for m in off.model.modules() if isinstance(m, nn.BatchNorm2d)):
        assert layer.running_mean is not None and not layer.training
    assert all(m.running_mean is None for m in on.model.modules() if isinstance(m, nn.BatchNorm2d))
    on(first), off(first)
    out_on, out_off = on(second), off(second)
    assert not torch.allclose(out_on, out_off, atol=1e-4)  # the second batch is normalized differently
    if name == "roid":  # nothing trains at lr 0: the source model in eval mode
        with torch.no_grad():
            assert torch.allclose(out_off, net(second), atol=1e-5)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())  # the user's model untouched
    trained = build(name, net, use_batch_statistics=False, use_consistency=False, optimizer="sgd", lr=0.5,
                    momentum=0.0)
    start = [p.detach().clone() for p in trained.trained]
    trained(first)
    assert any(not torch.equal(p, s) for p, s in zip(trained.trained, start))  # the affine parameters still train
    layers = [m for m in trained.model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert all(torch.equal(m.running_mean, before[f"{n}.running_mean"])
               for n, m in trained.model.named_modules() if m in layers)


@pytest.mark.parametrize("name", NAMES)
def test_without_weighting_the_moving_average_stays_uniform_and_the_step_differs(name: str) -> None:
    net, x = bn_model(), shifted(3, 0.3)
    runs = {}
    for weighting in (True, False):
        method = build(name, net, use_weighting=weighting, use_consistency=False, momentum_src=1.0,
                       optimizer="sgd", lr=0.5, momentum=0.0)
        method(x)
        runs[weighting] = method
    uniform = torch.full((5,), 0.2)
    assert torch.equal(runs[False].moving_probs, uniform) and not torch.allclose(runs[True].moving_probs, uniform)
    assert any(not torch.allclose(p, q) for p, q in zip(runs[True].trained, runs[False].trained))


@pytest.mark.parametrize("name", NAMES)
def test_without_consistency_no_augmented_forward(name: str) -> None:
    net, x = bn_model(), shifted(4, 0.2)
    calls = {}
    for consistency in (True, False):
        method = build(name, net, use_consistency=consistency)
        count = [0]
        method.model.register_forward_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        method(x)
        calls[consistency] = count[0]
    assert calls == {True: 2, False: 1}


@pytest.mark.parametrize("name", NAMES)
def test_without_prior_correction_the_model_logits_are_scored(name: str) -> None:
    net, x = bn_model(), shifted(5, 0.1)
    on, off = (build(name, net, lr=0.0, use_consistency=False, use_prior_correction=p) for p in (True, False))
    raw = off(x)
    assert torch.allclose(on(x), prior_correction(raw), atol=1e-6)
    assert not torch.allclose(prior_correction(raw), raw, atol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_without_weight_ensembling_the_weights_stay_where_the_step_left_them(name: str) -> None:
    net, x = bn_model(), shifted(6, 0.2)
    moved = {}
    for momentum_src in (0.99, 1.0):
        method = build(name, net, lr=0.0, use_consistency=False, momentum_src=momentum_src)
        with torch.no_grad():
            for p in method.trained:
                p.add_(0.2)
        method(x)
        moved[momentum_src] = [(p - s).detach() for p, s in zip(method.trained, method.source_weights)]
    assert all(torch.allclose(d, torch.full_like(d, 0.2)) for d in moved[1.0])
    assert all(torch.allclose(d, torch.full_like(d, 0.2 * 0.99), atol=1e-6) for d in moved[0.99])
