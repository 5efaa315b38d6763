"""AQR composed with the field's methods (aqr+tent, aqr+eta, aqr+roid, aqr+lame): where the map sits, what
the affine update does on top of it, gradients through the maps, statistics at the pre-affine point,
protocols, resets, targets, non-finite input, option routing and cell keys. Tiny models, one thread."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import aqr
from aqr.core.points import affine, normalized
from aqr.core.qmap import channel_quantiles, map_rows_with_lines, tail_lines, to_channel_rows
from aqr.core.qmap_grad import from_channel_rows, with_segment_slopes
from aqr.core.stats import SourceStats, StatsError
from aqr.harness.specs import MethodSpec, check_method
from aqr.methods import create, softmax_entropy
from tests.models_tiny import bn_cnn, gn_cnn

COMPOSED = ("aqr+tent", "aqr+eta", "aqr+roid")
TARGETS = ("batch", "stream", "robust")
QUICK = {"num_quantiles": 11, "tail_batch": 10, "tail_repeats": 20, "compile": False}


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every test here runs on one torch thread."""


def images(n: int = 16, seed: int = 0, shift: float = 0.0, size: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 3, size, size, generator=g) * (1 + shift) + shift).clamp(0, 2)


def one_bn_model(seed: int = 0) -> nn.Module:
    """One BatchNorm layer (random affine of both signs, non-trivial running statistics) and a linear head."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(3 * 4 * 4, 4))
    bn = model[0]
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([1.5, -0.7, 0.4]))
        bn.bias.copy_(torch.tensor([0.2, -0.1, 0.3]))
        bn.running_mean.copy_(torch.tensor([0.4, 0.6, 0.5]))
        bn.running_var.copy_(torch.tensor([0.1, 0.05, 0.2]))
    return model.eval()


def stats_of(model: nn.Module, point: str = "output", n: int = 64, size: int = 8) -> SourceStats:
    return aqr.calibrate(model, [images(n, seed=100, size=size)], point=point, **QUICK)


def quiet_create(name: str, model: nn.Module, **options: object) -> nn.Module:
    """``create`` without the episodic-stream warning (asserted on its own below)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return create(name, model, **options)


def partner_options(name: str) -> dict[str, object]:
    """Options that make each gradient partner update on tiny random models (its filters pass every image)."""
    if name == "aqr+tent":
        return {"lr": 1e-2}
    if name == "aqr+eta":
        return {"e0": 10.0, "d_margin": 2.0}
    return {}


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------- the known results
def test_the_map_alone_restores_the_source_distribution_of_the_normalized_values() -> None:
    model = one_bn_model()
    stats = aqr.calibrate(model, [images(64, seed=100, size=4)], point="pre-affine", **QUICK)
    method = create("aqr+tent", model, stats=stats, mode="exact", lr=0.0)
    bn = method.model[0]
    seen: list[torch.Tensor] = []
    bn.register_forward_hook(lambda _m, _i, out: seen.append(out.detach()))
    x = 0.8 + 1.8 * torch.rand(32, 3, 4, 4, generator=torch.Generator().manual_seed(1))  # shifted, no ties
    method(x)
    z = (seen[-1] - bn.bias.view(1, -1, 1, 1)) / bn.weight.view(1, -1, 1, 1)  # the values before the affine step
    # exactly AQR's map of the batch's normalized values onto the source knots of the pre-affine point
    x_hat = F.batch_norm(x, None, None, None, None, True, 0.0, bn.eps)
    expected = aqr.quantile_map(x_hat, stats.source_quantiles("0"), tail=stats.tail, dim=1)
    assert torch.allclose(z, expected, atol=1e-5)
    # which restores the source distribution: the batch's quantiles are the source knots (up to interpolation)
    source = stats.source_quantiles("0")
    spread = (source[:, -2] - source[:, 1]).unsqueeze(1)
    assert ((channel_quantiles(z, 11, dim=1) - source)[:, 1:-1].abs() <= 0.1 * spread).all()
    shifted = (channel_quantiles(x_hat, 11, dim=1) - source)[:, 1:-1].abs()
    assert (shifted > 0.1 * spread).any()  # the shift was there before the map


def _entropy_step(weight: torch.Tensor, bias: torch.Tensor, values: torch.Tensor, head: nn.Linear,
                  lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight and bias after one SGD step (momentum's first step is plain SGD) on the mean entropy of
    ``head(weight * values + bias)``, the values fixed."""
    w, b = weight.detach().clone().requires_grad_(True), bias.detach().clone().requires_grad_(True)
    logits = head((values * w.view(1, -1, 1, 1) + b.view(1, -1, 1, 1)).flatten(1))
    gw, gb = torch.autograd.grad(softmax_entropy(logits).mean(), (w, b))
    return (w - lr * gw).detach(), (b - lr * gb).detach()


def test_the_affine_update_alone_and_composed_each_give_their_known_result() -> None:
    model = one_bn_model()
    stats = aqr.calibrate(model, [images(64, seed=100, size=4)], point="pre-affine", **QUICK)
    x, lr = images(32, seed=2, shift=0.8, size=4), 0.5
    bn, head = model[0], model[2]
    x_hat = F.batch_norm(x, None, None, None, None, True, 0.0, bn.eps)
    z = aqr.quantile_map(x_hat, stats.source_quantiles("0"), tail=stats.tail, dim=1)

    # TENT alone: one SGD step on the entropy of head(weight * x_hat + bias), scored after it (episodic)
    tent = create("tent", model, lr=lr, protocol="episodic")
    out = tent(x)
    w_t, b_t = _entropy_step(bn.weight, bn.bias, x_hat, head, lr)
    assert torch.allclose(tent.model[0].weight, w_t, atol=1e-5) and torch.allclose(tent.model[0].bias, b_t, atol=1e-5)
    assert torch.allclose(out, head((x_hat * w_t.view(1, -1, 1, 1) + b_t.view(1, -1, 1, 1)).flatten(1)), atol=1e-5)

    # composed: the same step on the mapped values, and output = weight' * map(x_hat) + bias' through the head
    composed = create("aqr+tent", model, stats=stats, mode="exact", lr=lr, protocol="episodic")
    out = composed(x)
    w_c, b_c = _entropy_step(bn.weight, bn.bias, z, head, lr)
    assert torch.allclose(composed.model[0].weight, w_c, atol=1e-5)
    assert torch.allclose(composed.model[0].bias, b_c, atol=1e-5)
    assert torch.allclose(out, head((z * w_c.view(1, -1, 1, 1) + b_c.view(1, -1, 1, 1)).flatten(1)), atol=1e-5)
    assert not torch.allclose(w_c, w_t, atol=1e-4) and not torch.allclose(w_c, bn.weight, atol=1e-4)


@pytest.mark.parametrize("make", [bn_cnn, gn_cnn])
@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_without_an_update_the_composition_is_aqr(make, mode: str) -> None:
    """The map before the affine step, with the initial weights, is AQR on the layer's output (the map of a
    channel ignores a scale and shift of its input, of either sign)."""
    model = make()
    pre, post = stats_of(model, "pre-affine"), stats_of(model)
    x = images(24, seed=3, shift=0.6)
    expected = create("aqr", model, stats=post, mode=mode, compile=False)(x)
    for name, zero in (("aqr+tent", {"lr": 0.0}), ("aqr+eta", {"lr": 0.0}), ("aqr+roid", {"lr": 0.0})):
        composed = create(name, model, stats=pre, mode=mode, compile=False, use_prior_correction=False, **zero) \
            if name == "aqr+roid" else create(name, model, stats=pre, mode=mode, compile=False, **zero)
        assert torch.allclose(composed(x), expected, atol=1e-5), name


def _eq1(rows: torch.Tensor, source_q: torch.Tensor, target_q: torch.Tensor) -> torch.Tensor:
    """Eq. 1 written out, differentiable in ``rows`` with the knots constant: a value in ``[p_j^T, p_{j+1}^T)``
    goes to ``p_j^S + (x - p_j^T) * slope_j`` (the edge segments extended beyond the end knots)."""
    k = target_q.shape[1]
    j = (torch.searchsorted(target_q, rows.detach(), right=True) - 1).clamp(0, k - 2)
    t0, t1 = target_q.gather(1, j), target_q.gather(1, j + 1)
    s0, s1 = source_q.gather(1, j), source_q.gather(1, j + 1)
    width = t1 - t0
    return s0 + (rows - t0) * torch.where(width > 0, (s1 - s0) / torch.where(width > 0, width, 1.0), 0.0)


def _reference_step(model: nn.Module, stats: SourceStats, x: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of TENT's loss with respect to the BatchNorms' weights and biases of ``bn_cnn``, written out:
    each BN normalizes with batch statistics, Eq. 1 with the batch's own knots held constant, then the
    layer's affine step."""
    params = [p.detach().clone().requires_grad_(True) for i in (1, 4) for p in (model[i].weight, model[i].bias)]

    def bn_block(h: torch.Tensor, name: str, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        x_hat = F.batch_norm(h, None, None, None, None, True, 0.0, 1e-5)
        rows = to_channel_rows(x_hat, 1)
        tq = channel_quantiles(rows.detach(), stats.num_quantiles)
        z = from_channel_rows(_eq1(rows, stats.source_quantiles(name).to(rows), tq), x_hat, 1)
        return z * w.view(1, -1, 1, 1) + b.view(1, -1, 1, 1)

    h = torch.relu(bn_block(model[0](x), "1", params[0], params[1]))
    h = torch.relu(bn_block(model[3](h), "4", params[2], params[3]))
    logits = model[8](model[7](model[6](h)))
    return list(torch.autograd.grad(softmax_entropy(logits).mean(), params))


def test_gradients_pass_through_later_maps_by_their_segment_slopes() -> None:
    model = bn_cnn()
    stats = stats_of(model, "pre-affine")
    x = images(16, seed=4, shift=0.5)
    expected = _reference_step(model, stats, x)
    method = create("aqr+tent", model, stats=stats, mode="exact", lr=1.0, momentum=0.0, compile=False)
    before = [p.detach().clone() for i in (1, 4) for p in (method.model[i].weight, method.model[i].bias)]
    method(x)
    after = [p.detach() for i in (1, 4) for p in (method.model[i].weight, method.model[i].bias)]
    got = [b - a for a, b in zip(after, before)]  # lr 1, no momentum: the gradient itself
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, atol=1e-5, rtol=1e-4)
    assert expected[0].abs().sum() > 0  # the first layer's update went through the second layer's map


@pytest.mark.parametrize("tail", ["standard", "none", "clip", "clip-source", "interval", "gaussian"])
def test_the_segment_slope_gradient_passes_gradcheck_on_the_reference_path(tail: str) -> None:
    g = torch.Generator().manual_seed(5)
    c, k = 3, 7
    source_q = torch.sort(torch.randn(c, k, generator=g, dtype=torch.float64), dim=1).values
    target_q = torch.sort(torch.randn(c, k, generator=g, dtype=torch.float64) * 2, dim=1).values
    target_q[1, 2] = target_q[1, 3]  # a tied pair of knots: a zero-width segment
    x0 = torch.randn(4, c, 5, generator=g, dtype=torch.float64) * 2.5  # values beyond both ends too
    rows0 = to_channel_rows(x0, 1)
    var, mean = torch.var_mean(rows0, dim=1, correction=0, keepdim=True)
    lines = None if tail == "standard" else tail_lines(source_q, target_q, tail, mean, var.sqrt(),
                                                       torch.zeros(c, dtype=torch.float64),
                                                       torch.ones(c, dtype=torch.float64))

    def mapped(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # the value from a path without gradient, the gradient from the slopes
            value = from_channel_rows(map_rows_with_lines(to_channel_rows(x, 1), source_q, target_q, lines), x, 1)
        return with_segment_slopes(x, value, source_q, target_q, lines, dim=1)

    assert torch.autograd.gradcheck(mapped, (x0.clone().requires_grad_(True),), eps=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- statistics at the pre-affine point
def test_pre_affine_statistics_are_a_separate_kind(tmp_path) -> None:
    model = bn_cnn()
    pre, post = stats_of(model, "pre-affine"), stats_of(model)
    assert pre.point == "pre-affine" and post.point == "output"
    assert pre.layers["1"].affine_weight is None and post.layers["1"].affine_weight is not None
    # the normalized values, as the eval-mode layer computes them before its affine step
    model.eval()
    x_hat = normalized(model[1], model[0](images(64, seed=100)), pre.layers["1"].info)
    assert torch.allclose(pre.layers["1"].mean, x_hat.mean(dim=(0, 2, 3)), atol=1e-4)
    assert torch.allclose(affine(model[1], x_hat, pre.layers["1"].info), model[1](model[0](images(64, seed=100))),
                          atol=1e-5)
    loaded = SourceStats.load(pre.save(tmp_path / "pre.aqr.safetensors"))
    assert loaded.point == "pre-affine" and torch.equal(loaded.layers["1"].quantiles, pre.layers["1"].quantiles)
    assert SourceStats.load(post.save(tmp_path / "post.aqr.safetensors")).point == "output"
    with pytest.raises(StatsError, match="point='output'"):
        create("aqr+tent", model, stats=post)
    with pytest.raises(StatsError, match="point='pre-affine'"):
        create("aqr", model, stats=pre)
    with pytest.raises(StatsError, match="point='pre-affine'"):
        create("aqr+lame", model, stats=pre)
    with pytest.raises(ValueError, match="point must be one of"):
        aqr.calibrate(model, [images()], point="input")


# ---------------------------------------------------------------------------- protocols, reset, targets
@pytest.mark.parametrize("name", COMPOSED)
def test_episodic_and_online_protocols(name: str) -> None:
    model = bn_cnn()
    stats = stats_of(model, "pre-affine")
    x, y = images(16, seed=6, shift=0.5), images(16, seed=7, shift=0.5)
    episodic = create(name, model, stats=stats, protocol="episodic", compile=False, **partner_options(name))
    first = episodic(x)
    episodic(y)
    assert torch.equal(episodic(x), first)  # every batch from the initial weights

    online = create(name, model, stats=stats, protocol="online", compile=False, **partner_options(name))
    start = state_of(online.model)
    a = online(x)
    assert not all(torch.equal(v, online.model.state_dict()[k]) for k, v in start.items())  # it adapted
    online(y)
    assert not torch.allclose(online(x), a)  # the updates carry over
    online.reset()
    assert all(torch.equal(v, online.model.state_dict()[k]) for k, v in start.items())
    assert torch.allclose(online(x), a, atol=1e-6)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", COMPOSED + ("aqr+lame",))
def test_every_target_runs_and_resets(name: str, target: str) -> None:
    model = bn_cnn()
    stats = stats_of(model, "output" if name == "aqr+lame" else "pre-affine")
    batches = [images(8, seed=s, shift=0.4) for s in range(3)]
    method = create(name, model, stats=stats, protocol="online", target=target, compile=False,
                    **({} if name == "aqr+lame" else partner_options(name)))
    outs = [method(x) for x in batches]
    assert all(o.shape == (8, 5) and bool(torch.isfinite(o).all()) for o in outs)
    method.reset()
    again = [method(x) for x in batches]
    for o, p in zip(outs, again):
        assert torch.allclose(o, p, atol=1e-6)
    if target != "batch":  # the running state changes the next batch's map
        fresh = create(name, model, stats=stats, protocol="online", target=target, compile=False,
                       **({} if name == "aqr+lame" else partner_options(name)))
        assert not torch.allclose(fresh(batches[2]), outs[2], atol=1e-6)


@pytest.mark.parametrize("name", ["aqr+tent", "aqr+lame"])
def test_a_copy_continues_the_stream(name: str) -> None:
    model = bn_cnn()
    stats = stats_of(model, "output" if name == "aqr+lame" else "pre-affine")
    method = create(name, model, stats=stats, protocol="online", target="stream", compile=False)
    method(images(8, seed=13, shift=0.4))
    twin = copy.deepcopy(method)
    x = images(8, seed=14, shift=0.4)
    assert torch.allclose(twin(x), method(x), atol=1e-6)


WINDOWS = [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [4, 1, 2, 3], [4, 5, 2, 3], [4, 5, 6, 3]]  # window=4, one image at a time


@pytest.mark.parametrize("name", COMPOSED)
def test_per_batch_map_runs_on_the_window_between_its_steps(name: str) -> None:
    """At batch 1 through the sliding window, an image between the window's steps is scored from the window's
    forward with the per-batch map of the window's quantiles, as at the step: before the first step exactly
    ``aqr`` on the window, after it the updated affine weights over the mapped window (not the bare model)."""
    model = bn_cnn()
    pre, post = stats_of(model, "pre-affine"), stats_of(model)
    x = images(len(WINDOWS), seed=21, shift=0.8)
    aqr_alone = create("aqr", model, stats=post, compile=False)
    method = quiet_create(name, model, stats=pre, protocol="online", window=4, compile=False, **partner_options(name))
    unmapped_differs = False
    for i, window in enumerate(WINDOWS):
        out = method(x[i:i + 1])[0]
        if i == 3:
            continue  # the window's step: the method's ordinary step on x[:4]
        with torch.no_grad():
            expected = method.model(x[window])[window.index(i)]  # the configured copy: maps each forward's batch
            unmapped = method.predict_held(x[window])[window.index(i)]  # what predict_held holds: no per-batch map
        assert torch.allclose(out, expected, atol=1e-5), (name, i)
        if i < 3:
            assert torch.allclose(out, aqr_alone(x[window])[window.index(i)], atol=1e-5), (name, i)
        unmapped_differs |= not torch.allclose(out, unmapped, atol=1e-3)
    assert unmapped_differs  # the images would have been scored otherwise without the map


def test_aqr_lame_maps_the_window_with_its_own_quantiles() -> None:
    model = bn_cnn()
    stats = stats_of(model)
    x = images(len(WINDOWS), seed=22, shift=0.8)
    method = create("aqr+lame", model, stats=stats, protocol="online", window=4, compile=False)
    batched = create("aqr+lame", model, stats=stats, protocol="online", compile=False)
    for i, window in enumerate(WINDOWS):
        assert torch.allclose(method(x[i:i + 1])[0], batched(x[window])[window.index(i)], atol=1e-5), i


def test_episodic_streaming_target_warns() -> None:
    model = bn_cnn()
    with pytest.warns(UserWarning, match="episodic protocol restarts it"):
        create("aqr+tent", model, stats=stats_of(model, "pre-affine"), target="stream", protocol="episodic")
    with pytest.warns(UserWarning, match="episodic protocol restarts it"):
        create("aqr+lame", model, stats=stats_of(model), target="stream", protocol="episodic")


def test_roid_augmented_images_do_not_enter_the_stream() -> None:
    model = bn_cnn()
    stats = stats_of(model, "pre-affine")
    x = images(16, seed=8, shift=0.5)
    seen = []
    for consistency in (True, False):
        method = create("aqr+roid", model, stats=stats, protocol="online", target="stream", compile=False,
                        use_consistency=consistency)
        method(x)
        method(x)
        stream = next(iter(method.aqr.maps.values())).stream(torch.device("cpu"))
        seen.append(stream.seen + stream.group.images)
    assert seen[0] == seen[1]


# ---------------------------------------------------------------------------- robustness
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", COMPOSED + ("aqr+lame",))
def test_non_finite_images_do_not_crash(name: str, target: str) -> None:
    model = bn_cnn()
    stats = stats_of(model, "output" if name == "aqr+lame" else "pre-affine")
    x = images(8, seed=9, shift=0.4)
    x[2, 0, 1, 1] = float("nan")
    method = quiet_create(name, model, stats=stats, protocol="online", target=target, compile=False,
                          **({"use_consistency": False} if name == "aqr+roid" else {}))
    out = method(x)
    assert out.shape == (8, 5)
    if name in ("aqr+eta", "aqr+roid"):  # these keep non-finite images apart: the others stay finite
        keep = torch.arange(8) != 2
        assert bool(torch.isfinite(out[keep]).all())
        assert all(bool(torch.isfinite(p).all()) for p in method.model.parameters())
    assert method(images(8, seed=10)).shape == (8, 5)


@pytest.mark.parametrize("name", COMPOSED + ("aqr+lame",))
def test_the_users_model_is_untouched(name: str) -> None:
    model = bn_cnn().train()
    before = state_of(model)
    stats = stats_of(model, "output" if name == "aqr+lame" else "pre-affine")
    model.train()
    method = create(name, model, stats=stats, protocol="online", compile=False,
                    **({} if name == "aqr+lame" else partner_options(name)))
    method(images(8, seed=11, shift=0.3))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(m.training for m in model.modules())
    assert all("forward" not in vars(m) for m in model.modules())
    assert model[1].running_mean is not None


def test_aqr_lame_corrects_the_logits_of_the_recalibrated_model() -> None:
    model = bn_cnn()
    stats = stats_of(model)
    x = images(16, seed=12, shift=0.5)
    adapted = create("aqr", model, stats=stats, compile=False)(x)
    # without the Laplacian term LAME's output is the log-probabilities of the logits it is given
    unary_only = create("aqr+lame", model, stats=stats, bound_lambda=0.0, compile=False)(x)
    assert torch.allclose(unary_only, torch.log(adapted.softmax(1) + 1e-10), atol=1e-5)
    # with it, the affinities of the recalibrated features
    from aqr.methods.lame import affinity_matrix, laplacian_optimization

    method = create("aqr+lame", model, stats=stats, compile=False)
    features, logits = method.features_and_logits(x)
    assert torch.allclose(logits, adapted, atol=1e-6)
    kernel = affinity_matrix(F.normalize(features, dim=-1))
    _, expected, _ = laplacian_optimization(-torch.log(logits.softmax(1) + 1e-10), kernel)
    assert torch.allclose(method(x), expected, atol=1e-5)
    assert not torch.allclose(features, create("lame", model).features_and_logits(x)[0], atol=1e-4)


# ---------------------------------------------------------------------------- options, specs, keys
def test_options_route_to_their_part() -> None:
    model = bn_cnn()
    stats = stats_of(model, "pre-affine")
    method = quiet_create("aqr+roid", model, stats=stats, target="stream", horizon=32.0, defaults="imagenet",
                          temperature=0.5, compile=False)
    assert method.config.aqr_config() == aqr.AQRConfig(target="stream", horizon=32.0, compile=False,
                                                        on_nonfinite="skip")
    assert (method.config.optimizer, method.config.lr, method.config.temperature) == ("sgd", 2.5e-4, 0.5)
    assert isinstance(method.optimizer, torch.optim.SGD)
    with pytest.raises(TypeError, match="takes no option"):
        create("aqr+tent", model, stats=stats, nope=1)
    with pytest.raises(TypeError, match="needs stats="):
        create("aqr+eta", model)
    with pytest.raises(ValueError, match="target must be one of"):
        create("aqr+tent", model, stats=stats, target="sideways")


@pytest.mark.parametrize("spec, error", [
    ("aqr+tent", None),
    ("aqr+tent:target=stream,lr=0.0001,tail=standard", None),
    ("aqr+eta:defaults=imagenet,d_margin=0.05,layers=top-half,K=11", None),
    ("aqr+roid:target=robust,use_consistency=false,tail_unit=values", None),
    ("aqr+lame:target=stream,knn=3,defaults=imagenet", None),
    ("aqr+lame:target=robust,passes=2", None),
    ("aqr+tent:bogus=1", "unknown options \\['bogus'\\]"),
    ("aqr+tent:match=moments", "maps quantiles before the affine step"),
    ("aqr+roid:target=robust,passes=2", "one pass"),
    ("aqr+eta:horizon=-1", "horizon"),
    ("aqr+eta:lr=-1", "lr must be"),
    ("aqr+tent:point=output", "unknown options \\['point'\\]"),
])
def test_check_method_takes_exactly_the_valid_options(spec: str, error: str | None) -> None:
    if error is None:
        check_method(MethodSpec.parse(spec), "online", 64)
    else:
        with pytest.raises(ValueError, match=error):
            check_method(MethodSpec.parse(spec), "online", 64)


def test_cells_of_compositions_carry_aqrs_versions_and_their_statistics_point() -> None:
    from aqr.harness.keys import AQR_FAST_PATH_VERSION, _aqr_parts, cell_key
    from aqr.harness.presets import preset
    from aqr.harness.source_stats import stats_options

    assert _aqr_parts("aqr") == (True, True) and _aqr_parts("moments") == (True, False)
    assert _aqr_parts("tent") == (False, False) and _aqr_parts("no-such-method") == (False, False)
    for name in COMPOSED + ("aqr+lame",):
        assert _aqr_parts(name) == (True, True)
    cell = next(iter(preset("smoke", data_dir="aqr-data").cells()))
    files = {"weights": "w", "source": "s", "eval": "e", "labels": "l"}
    composed = dataclasses.replace(cell, method="aqr+tent", options=())
    import aqr.harness.keys as keys

    key = cell_key(composed, files, "v")
    try:
        keys.AQR_FAST_PATH_VERSION = AQR_FAST_PATH_VERSION + 1  # a change of the map moves the key
        assert cell_key(composed, files, "v") != key
    finally:
        keys.AQR_FAST_PATH_VERSION = AQR_FAST_PATH_VERSION
    assert stats_options(composed)["point"] == "pre-affine"
    lame = dataclasses.replace(cell, method="aqr+lame", options=())
    plain = dataclasses.replace(cell, method="aqr", options=())
    assert stats_options(lame) == stats_options(plain) and "point" not in stats_options(plain)


def test_the_segment_search_agrees_with_searchsorted() -> None:
    from aqr.core.qmap_grad import knots_at_or_below

    g = torch.Generator().manual_seed(15)
    for trial in range(40):
        k = 3 + trial % 30
        knots = torch.sort(torch.randn(4, k, generator=g) * (0.01 + trial / 10), dim=1).values
        if trial % 3 == 0:
            knots[:, 1:4] = knots[:, 1:2]  # a run of tied knots
        if trial % 5 == 0:
            knots[2] = 0.5  # a constant channel (the search falls back to torch's)
        values = torch.randn(4, 300, generator=g) * 3
        values[:, :k] = knots  # values on the knots
        assert torch.equal(knots_at_or_below(values, knots), torch.searchsorted(knots, values, right=True))


def test_a_change_of_a_methods_defaults_moves_only_its_keys() -> None:
    import aqr.harness.keys as keys
    from aqr.harness.presets import preset

    cell = next(iter(preset("smoke", data_dir="aqr-data").cells()))
    files = {"weights": "w", "source": "s", "eval": "e", "labels": "l"}
    roid = dataclasses.replace(cell, method="aqr+roid", options=())
    tent = dataclasses.replace(cell, method="aqr+tent", options=())
    before = keys.cell_key(roid, files, "v"), keys.cell_key(tent, files, "v")
    saved = dict(keys.METHOD_DEFAULTS_VERSIONS)
    try:
        keys.METHOD_DEFAULTS_VERSIONS["aqr+roid"] += 1
        assert keys.cell_key(roid, files, "v") != before[0]
        assert keys.cell_key(tent, files, "v") == before[1]
    finally:
        keys.METHOD_DEFAULTS_VERSIONS.clear()
        keys.METHOD_DEFAULTS_VERSIONS.update(saved)
