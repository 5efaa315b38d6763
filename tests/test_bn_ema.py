"""bn-ema (aqr.methods.bn_ema): test-time BatchNorm on EMA statistics of the stream."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aqr.methods import BNEmaConfig, NotApplicable, create
from tests.models_tiny import bn_cnn, gn_cnn, images


pytestmark = pytest.mark.usefixtures("one_thread")


def net() -> nn.Module:
    model = bn_cnn(5)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.5, 2.0)
    return model.eval()


def shifted(n: int, seed: int) -> torch.Tensor:
    return images(n, seed=seed) * 2.0 + 0.5


def test_config_checks() -> None:
    assert (BNEmaConfig().momentum, BNEmaConfig().pooled) == (1 / 64, True)
    for bad in ({"momentum": 0.0}, {"momentum": 1.5}, {"momentum": float("nan")}, {"pooled": "yes"}):
        with pytest.raises(ValueError):
            BNEmaConfig(**bad)


@pytest.mark.parametrize("pooled", [True, False])
def test_statistics_move_by_the_per_image_momentum_before_the_batch_is_normalized(pooled: bool) -> None:
    model = net()
    m = 0.1
    method = create("bn-ema", model, protocol="online", momentum=m, pooled=pooled)
    x = shifted(4, seed=1)
    out = method(x)
    a = 1 - (1 - m) ** 4  # per image: a batch of 4 moves the statistics by 1 - 0.9^4
    bn1, bn2 = model[1], model[4]
    with torch.no_grad():
        h1 = model[0](x)
        var_b, mean_b = torch.var_mean(h1, dim=(0, 2, 3), correction=0)
        mean1 = (1 - a) * bn1.running_mean + a * mean_b
        if pooled:
            var1 = (1 - a) * (bn1.running_var + bn1.running_mean**2) + a * (var_b + mean_b**2) - mean1**2
        else:
            var1 = (1 - a) * bn1.running_var + a * var_b
        layer1 = method.layers[0]
        assert torch.allclose(layer1.mean, mean1, atol=1e-6) and torch.allclose(layer1.var, var1, atol=1e-6)
        # the output is the model with every BN in eval mode holding the updated statistics
        expected = copy.deepcopy(model)
        for bn, layer in ((expected[1], method.layers[0]), (expected[4], method.layers[1])):
            bn.running_mean.copy_(layer.mean)
            bn.running_var.copy_(layer.var)
        assert torch.allclose(out, expected(x), atol=1e-5)
        h2 = model[3](F.relu(F.batch_norm(h1, mean1, var1, bn1.weight, bn1.bias, False, 0.0, bn1.eps)))
        assert torch.allclose(method.layers[1].mean, (1 - a) * bn2.running_mean + a * h2.mean((0, 2, 3)), atol=1e-5)


def test_one_image_at_a_time_follows_a_shift_and_reset_restores_the_source_bit_for_bit() -> None:
    model = net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    method = create("bn-ema", model, protocol="online")
    initial = [(layer.mean.clone(), layer.var.clone()) for layer in method.layers]
    x = shifted(64, seed=2)
    for i in range(64):
        method(x[i : i + 1])
    with torch.no_grad():
        target = model[0](x).mean((0, 2, 3))
    moved = method.layers[0].mean
    # 64 images at momentum 1/64 cover 1 - (63/64)^64 = 64 % of the way to the stream's statistics
    assert (moved - initial[0][0]).abs().sum() > 0.4 * (target - initial[0][0]).abs().sum()
    method.reset()
    for layer, (mean, var) in zip(method.layers, initial):
        assert torch.equal(layer.mean, mean) and torch.equal(layer.var, var)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the user's model untouched


def test_a_batch_with_nan_leaves_the_statistics_unchanged() -> None:
    method = create("bn-ema", net(), protocol="online")
    method(shifted(4, seed=3))
    saved = [(layer.mean.clone(), layer.var.clone()) for layer in method.layers]
    bad = shifted(4, seed=4)
    bad[1, 0, 2, 2] = float("nan")
    method(bad)
    for layer, (mean, var) in zip(method.layers, saved):
        assert torch.equal(layer.mean, mean) and torch.equal(layer.var, var)


def test_episodic_starts_every_batch_from_the_source_and_online_accumulates() -> None:
    model = net()
    episodic, online = create("bn-ema", model, protocol="episodic"), create("bn-ema", model)
    x, y = shifted(4, seed=5), shifted(4, seed=6)
    first = episodic(x)
    assert torch.equal(online(x), first)
    assert torch.equal(episodic(x), first)
    assert not torch.equal(online(x), first)
    assert not torch.equal(episodic(y), online(y))


def test_not_applicable_without_batchnorm() -> None:
    with pytest.raises(NotApplicable, match="BatchNorm"):
        create("bn-ema", gn_cnn(), protocol="online")


def test_calls_from_several_threads_are_serialized() -> None:
    import time

    shared = create("bn-ema", net(), protocol="online")
    inside, most = [0], [0]

    def slow_hook(_m: nn.Module, _i: object) -> None:
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.01)
        inside[0] -= 1

    shared.layers[0].register_forward_pre_hook(slow_hook)
    threads = [threading.Thread(target=shared, args=(shifted(2, seed=s),)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1
    assert all(torch.isfinite(layer.mean).all() for layer in shared.layers)
