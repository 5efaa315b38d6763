"""RBN (aqr.methods.rbn): RoTTA's robust BatchNorm fed by the class-balanced memory."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aqr.methods import NotApplicable, RBNConfig, create
from tests.models_tiny import bn_cnn, gn_cnn, images, tiny_vit

CLASSES = 5


def net() -> nn.Module:
    model = bn_cnn(CLASSES)
    with torch.no_grad():  # source statistics away from what shifted test images give
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.5, 2.0)
        model[-1].weight.mul_(4.0)
    return model.eval()


def shifted(n: int, seed: int) -> torch.Tensor:
    return images(n, seed=seed) * 2.0 + 0.5


def snapshot(model: nn.Module) -> tuple[dict, dict]:
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {name: m.training for name, m in model.named_modules()})


def test_published_defaults() -> None:
    config = RBNConfig()
    assert (config.momentum, config.capacity, config.update_interval, config.lambda_t, config.lambda_u) == \
        (0.05, 64, 64, 1.0, 1.0)
    for bad in ({"momentum": 0.0}, {"momentum": 1.5}, {"capacity": 0}, {"update_every": 0}, {"num_classes": 1},
                {"lambda_u": -1.0}, {"capacity": 2.5}):
        with pytest.raises(ValueError):
            RBNConfig(**bad)


def test_global_statistics_take_one_ema_step_on_the_memory() -> None:
    model = net()
    rbn = create("rbn", model, protocol="online", capacity=8)
    x = shifted(8, seed=1)
    # the first batch is scored with the source statistics
    assert torch.allclose(rbn(x), model(x), atol=1e-6)
    assert rbn.offered == 8 and rbn.updates == 1
    memory = rbn.memory.items()
    assert 1 <= len(memory) <= 8
    bn1, bn2 = model[1], model[4]
    layer1, layer2 = rbn.layers
    m = 0.05
    with torch.no_grad():
        h1 = model[0](memory)
        mean1, var1 = h1.mean((0, 2, 3)), h1.var((0, 2, 3), unbiased=False)
        g_mean1, g_var1 = (1 - m) * bn1.running_mean + m * mean1, (1 - m) * bn1.running_var + m * var1
        # the next layer sees the memory batch normalized with the already-updated statistics
        a1 = F.relu(F.batch_norm(h1, g_mean1, g_var1, bn1.weight, bn1.bias, False, 0.0, bn1.eps))
        h2 = model[3](a1)
        g_mean2 = (1 - m) * bn2.running_mean + m * h2.mean((0, 2, 3))
        g_var2 = (1 - m) * bn2.running_var + m * h2.var((0, 2, 3), unbiased=False)
    for got, want in ((layer1.mean, g_mean1), (layer1.var, g_var1), (layer2.mean, g_mean2),
                      (layer2.var, g_var2)):
        assert torch.allclose(got, want, atol=1e-6)
    assert not torch.allclose(layer1.mean, bn1.running_mean)
    # the next batch is scored with the global statistics, as an eval-mode BatchNorm holding them
    expected = copy.deepcopy(model)
    with torch.no_grad():
        for bn, layer in ((expected[1], layer1), (expected[4], layer2)):
            bn.running_mean.copy_(layer.mean)
            bn.running_var.copy_(layer.var)
    y = shifted(8, seed=2)
    assert torch.allclose(rbn(y), expected(y), atol=1e-5)


def test_statistics_move_each_time_update_every_images_were_offered() -> None:
    rbn = create("rbn", net(), protocol="online", capacity=8, update_every=8)
    layer = rbn.layers[0]
    history = []
    for k in range(5):
        rbn(shifted(5, seed=k))
        history.append((rbn.offered, rbn.updates, layer.mean.clone()))
    assert [(o, u) for o, u, _ in history] == [(5, 0), (10, 1), (15, 1), (20, 2), (25, 3)]
    assert torch.equal(history[0][2], layer.source_mean)
    assert not torch.equal(history[1][2], history[0][2])
    assert torch.equal(history[2][2], history[1][2])  # no update between 10 and 15 offered images


def test_user_model_is_unchanged_and_reset_restores_the_start() -> None:
    model = net()
    model.train()
    before = snapshot(model)
    rbn = create("rbn", model, protocol="online", capacity=16)
    batches = [shifted(12, seed=s) for s in range(6)]
    first = [rbn(x) for x in batches]
    after = snapshot(model)
    assert before[1] == after[1]
    assert all(torch.equal(before[0][k], v) for k, v in after[0].items())
    assert rbn.updates > 0 and not torch.equal(first[0], first[-1])
    rbn.reset()
    assert len(rbn.memory) == 0 and rbn.offered == 0 and rbn.updates == 0
    for layer in rbn.layers:
        assert torch.equal(layer.mean, layer.source_mean) and torch.equal(layer.var, layer.source_var)
    again = [rbn(x) for x in batches]
    assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_episodic_protocol_is_refused() -> None:
    with pytest.raises(ValueError, match="protocol='online'"):
        create("rbn", net(), protocol="episodic")  # a reset before every batch would leave the source model
    assert create("rbn", net()).protocol.protocol == "online"  # the default protocol


@pytest.mark.parametrize("make", [gn_cnn, tiny_vit, lambda: nn.Sequential(nn.Flatten(), nn.Linear(192, 5))])
def test_not_applicable_without_batchnorm(make) -> None:
    with pytest.raises(NotApplicable, match="BatchNorm"):
        create("rbn", make(), protocol="online")


def test_not_applicable_without_running_statistics() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, track_running_stats=False), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(4, 3))
    with pytest.raises(NotApplicable, match="running statistics"):
        create("rbn", model, protocol="online")


def test_non_finite_images_never_enter_the_statistics() -> None:
    rbn = create("rbn", net(), protocol="online", capacity=8)
    x = shifted(8, seed=3)
    x[2] = float("nan")
    x[5, 0, 0, 0] = float("inf")
    out = rbn(x)
    assert torch.isfinite(out[[0, 1, 3, 4, 6, 7]]).all()
    assert rbn.offered == 6 and torch.isfinite(rbn.memory.items()).all()
    rbn(shifted(8, seed=4))
    assert rbn.updates == 1
    assert all(torch.isfinite(layer.mean).all() and torch.isfinite(layer.var).all()
               for layer in rbn.layers)


def test_runs_on_the_cifar_resnet_and_batchnorm1d() -> None:
    from aqr import models

    rbn = create("rbn", models.create("resnet20").eval(), protocol="online", capacity=8)
    for seed in range(3):
        assert rbn(torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(seed))).shape == (4, 10)
    assert rbn.updates == 1 and len(rbn.layers) == 19
    mlp = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3)).eval()
    rbn = create("rbn", mlp, protocol="online", capacity=4)
    rbn(torch.randn(4, 6) * 3)
    assert rbn.updates == 1 and not torch.equal(rbn.layers[0].mean, rbn.layers[0].source_mean)


def test_threads_sharing_one_rbn_see_a_serial_order() -> None:
    model = net()
    rbn = create("rbn", model, protocol="online", capacity=8, update_every=8)
    batches = {k: shifted(6, seed=20 + k) for k in range(12)}
    order: list[int] = []
    outputs: dict[int, torch.Tensor] = {}
    observe = rbn._observe

    def recording(x: torch.Tensor, logits: torch.Tensor) -> None:  # runs under the method's lock
        order.append(next(k for k, b in batches.items() if torch.equal(b, x)))
        observe(x, logits)

    rbn._observe = recording
    start = threading.Barrier(4)

    def work(first: int) -> None:
        start.wait()
        for k in range(first, 12, 4):
            outputs[k] = rbn(batches[k])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(order) == list(range(12)) and rbn.offered == 72 and rbn.updates == 9
    serial = create("rbn", model, protocol="online", capacity=8, update_every=8)
    for k in order:  # replaying the order the lock let them through gives the same outputs and state
        assert torch.equal(serial(batches[k]), outputs[k])
    for a, b in zip(serial.layers, rbn.layers):
        assert torch.equal(a.mean, b.mean) and torch.equal(a.var, b.var)


def test_a_copy_gets_its_own_state_and_lock() -> None:
    rbn = create("rbn", net(), protocol="online", capacity=8)
    rbn(shifted(8, seed=1))
    twin = copy.deepcopy(rbn)
    assert twin._lock is not rbn._lock
    x = shifted(8, seed=2)
    assert torch.equal(twin(x), rbn(x))
    assert torch.equal(twin.layers[0].mean, rbn.layers[0].mean)
