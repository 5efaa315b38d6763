"""CoTTA and RoTTA (teacher-student methods) and their plain-torch test-time augmentation, on tiny models."""

from __future__ import annotations

import colorsys
import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aqr.methods.rotta_memory import ClassBalancedMemory
from aqr.methods import NotApplicable, create, plan
from aqr.methods.augment import (STRONG, AugmentParams, Generators, adjust_hue, affine, gaussian_blur, hsv_to_rgb,
                                 rgb_to_hsv, tta_augment)
from aqr.methods.cotta import soft_cross_entropy, weight_and_bias
from aqr.methods.rbn import RobustBatchNorm
from aqr.methods.rotta import prediction_entropy, timeliness_weights
from tests.models_tiny import bn_cnn, gn_cnn, images, tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def confident_bn(seed: int = 0, num_classes: int = 5) -> nn.Module:
    """bn_cnn with off-centre running statistics and a sharper head."""
    net = bn_cnn(num_classes, seed=seed)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.3, 0.3)
                m.running_var.uniform_(0.5, 2.0)
        net[-1].weight.mul_(4.0)
    return net.eval()


# ---------------------------------------------------------------------------- augmentation
def test_affine_identity_rotation_and_shift() -> None:
    x = images(2, size=6, seed=3)
    assert torch.allclose(affine(x, 0.0, (0.0, 0.0), 1.0), x, atol=1e-6)
    assert torch.allclose(affine(x, 90.0, (0.0, 0.0), 1.0), torch.rot90(x, -1, (-2, -1)), atol=1e-6)  # clockwise
    shifted = affine(x, 0.0, (2.0, 1.0), 1.0)
    assert torch.allclose(shifted[..., 1:, 2:], x[..., :-1, :-2], atol=1e-6)
    assert shifted[..., :1, :].abs().max() < 1e-6  # zeros enter at the edge
    # scaling by 2 about the centre: the centre 2x2 block of a 4x4 image spreads over the whole image
    y = images(1, size=4, seed=4)
    assert torch.allclose(affine(y, 0.0, (0.0, 0.0), 2.0)[..., 1:3, 1:3].mean(), y[..., 1:3, 1:3].mean(), atol=1e-6)


def test_hsv_round_trip_matches_colorsys_and_hue_shift() -> None:
    x = images(3, size=5, seed=5)
    hsv = rgb_to_hsv(x)
    for n, i, j in [(0, 0, 0), (1, 2, 3), (2, 4, 1)]:
        want = colorsys.rgb_to_hsv(*x[n, :, i, j].tolist())
        assert hsv[n, :, i, j].tolist() == pytest.approx(list(want), abs=1e-5)
        shifted = colorsys.hsv_to_rgb((want[0] + 0.05) % 1.0, want[1], want[2])
        assert adjust_hue(x, 0.05)[n, :, i, j].tolist() == pytest.approx(list(shifted), abs=1e-5)
    assert torch.allclose(hsv_to_rgb(hsv), x, atol=1e-6)


def test_gaussian_blur_keeps_constants_and_mass() -> None:
    flat = torch.full((1, 3, 8, 8), 0.3)
    assert torch.allclose(gaussian_blur(flat, 5, 0.5), flat, atol=1e-6)
    x = images(1, size=8, seed=6)
    assert torch.allclose(gaussian_blur(x, 5, 1e-3), x, atol=1e-6)  # a tiny sigma is the identity
    blurred = gaussian_blur(x, 5, 0.5)
    assert blurred.std() < x.std()


def test_tta_augment_shares_its_draws_over_the_batch_and_follows_its_generator() -> None:
    x = images(4, size=8, seed=7)
    twin = torch.cat([x[:1], x[:1]])
    quiet = AugmentParams(noise_std=0.0)
    out = tta_augment(twin, Generators(3), quiet)
    assert torch.equal(out[0], out[1])  # one set of parameters for the whole batch
    a, b = tta_augment(x, Generators(3)), tta_augment(x, Generators(3))
    assert torch.equal(a, b) and a.shape == x.shape and a.min() >= 0 and a.max() <= 1
    gens = Generators(3)
    first, second = tta_augment(x, gens), tta_augment(x, gens)
    assert not torch.allclose(first, second)
    assert not torch.allclose(first, x, atol=0.05)
    with pytest.raises(ValueError, match="RGB images"):
        tta_augment(torch.rand(2, 4, 6), Generators(0))
    state = torch.get_rng_state()
    tta_augment(x, Generators(1), STRONG)
    assert torch.equal(state, torch.get_rng_state())  # the global RNG is never drawn


def torchvision_tensor_ops():
    """torchvision's tensor image operations (``transforms/_functional_tensor.py``, which needs only torch),
    loaded from its file so that torchvision's compiled ops need not load; skip without torchvision."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("torchvision")
    path = Path(spec.origin).parent / "transforms" / "_functional_tensor.py" if spec and spec.origin else None
    if path is None or not path.is_file():
        pytest.skip("torchvision's tensor transforms are not installed")
    module_spec = importlib.util.spec_from_file_location("tv_functional_tensor", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_colour_and_blur_steps_equal_torchvisions() -> None:
    tv = torchvision_tensor_ops()
    from aqr.methods.augment import _blend, _gray

    x = images(3, size=12, seed=8)
    assert torch.allclose(tv.adjust_brightness(x, 1.3), _blend(x, torch.zeros_like(x), 1.3), atol=1e-6)
    assert torch.allclose(tv.adjust_contrast(x, 0.75), _blend(x, _gray(x).mean((1, 2, 3), keepdim=True), 0.75),
                          atol=1e-6)
    assert torch.allclose(tv.adjust_saturation(x, 1.4), _blend(x, _gray(x), 1.4), atol=1e-6)
    for shift in (0.05, -0.06):
        assert torch.allclose(tv.adjust_hue(x, shift), adjust_hue(x, shift), atol=1e-5)
    assert torch.allclose(tv.adjust_gamma(x.clamp(1e-8, 1), 0.8), x.clamp(1e-8, 1).pow(0.8), atol=1e-6)
    assert torch.allclose(tv.gaussian_blur(x, [5, 5], [0.4, 0.4]), gaussian_blur(x, 5, 0.4), atol=1e-6)
    assert torch.equal(tv.pad(x, [6, 6, 6, 6], padding_mode="edge"), F.pad(x, (6, 6, 6, 6), mode="replicate"))


# ---------------------------------------------------------------------------- CoTTA
def test_cotta_trains_every_weight_and_bias_with_the_reference_optimizers() -> None:
    m = create("cotta", bn_cnn(), protocol="online")
    assert {n for n, p in m.model.named_parameters() if p.requires_grad} == {n for n, _ in weight_and_bias(m.model)}
    assert set(m.param_names) == {n for n, _ in m.model.named_parameters()}
    assert isinstance(m.optimizer, torch.optim.Adam) and m.optimizer.param_groups[0]["lr"] == 1e-3
    assert m.optimizer.param_groups[0]["betas"] == (0.9, 0.999)
    assert not any(p.requires_grad for p in m.teacher.parameters())
    assert not any(p.requires_grad for p in m.anchor.parameters())
    cfg = m.config
    assert (cfg.ema, cfg.restore_prob, cfg.anchor_threshold, cfg.augmentations) == (0.999, 0.01, 0.92, 32)
    imagenet = create("cotta", bn_cnn(), defaults="imagenet")
    group = imagenet.optimizer.param_groups[0]
    assert isinstance(imagenet.optimizer, torch.optim.SGD) and group["lr"] == 0.01 and group["nesterov"]
    assert group["momentum"] == 0.9
    cfg = imagenet.config
    assert (cfg.restore_prob, cfg.anchor_threshold, cfg.loss) == (0.001, 0.1, "symmetric")
    assert create("cotta", bn_cnn(), defaults="imagenet", lr=0.5).config.lr == 0.5
    with pytest.raises(ValueError, match="defaults"):
        create("cotta", bn_cnn(), defaults="cifar100")
    for bad in ({"ema": 1.5}, {"restore_prob": -0.1}, {"augmentations": 0}, {"loss": "kl"}, {"optimizer": "rmsprop"}):
        with pytest.raises(ValueError):
            create("cotta", bn_cnn(), **bad)


def test_cotta_losses_are_the_soft_cross_entropies() -> None:
    s, t = torch.randn(6, 5), torch.randn(6, 5)
    ce = -(F.softmax(t, 1) * F.log_softmax(s, 1)).sum(1)
    assert torch.allclose(soft_cross_entropy(s, t), ce)
    m = create("cotta", bn_cnn())
    assert torch.allclose(m.loss(s, t), ce.mean())
    sym = create("cotta", bn_cnn(), loss="symmetric")
    assert torch.allclose(sym.loss(s, t), 0.5 * ce.mean() + 0.5 * soft_cross_entropy(t, s).mean())


def test_cotta_teacher_is_the_ema_of_the_student() -> None:
    net = confident_bn()
    m = create("cotta", net, protocol="online", restore_prob=0.0, anchor_threshold=0.0, lr=0.01)
    start = state_of(m.model)
    m(images(16, seed=2))
    student, teacher = state_of(m.model), state_of(m.teacher)
    changed = [k for k in start if not torch.equal(start[k], student[k])]
    assert len(changed) == len(start)  # every weight and bias moved
    for k in start:
        assert torch.allclose(teacher[k], 0.999 * start[k] + 0.001 * student[k], atol=1e-7)
    m(images(16, seed=3))
    student2, teacher2 = state_of(m.model), state_of(m.teacher)
    for k in start:
        assert torch.allclose(teacher2[k], 0.999 * teacher[k] + 0.001 * student2[k], atol=1e-7)


def test_cotta_stochastic_restore_resets_about_a_fraction_p_of_the_weights() -> None:
    net = confident_bn()
    p = 0.3
    m = create("cotta", net, protocol="online", restore_prob=p, anchor_threshold=0.0, lr=0.01)
    start = state_of(m.model)
    m(images(16, seed=2))
    after = state_of(m.model)
    restored = sum(int((after[k] == start[k]).sum()) for k in start)
    total = sum(v.numel() for v in start.values())
    sd = math.sqrt(p * (1 - p) / total)
    assert abs(restored / total - p) < 5 * sd, (restored, total)
    # the teacher averaged the student *before* the restore: it differs from the source wherever a weight moved
    unrestored = create("cotta", net, protocol="online", restore_prob=0.0, anchor_threshold=0.0, lr=0.01)
    unrestored(images(16, seed=2))
    assert same_state(state_of(m.teacher), state_of(unrestored.teacher))
    full = create("cotta", net, protocol="online", restore_prob=1.0, anchor_threshold=0.0, lr=0.01)
    full(images(16, seed=2))
    assert same_state(state_of(full.model), start)


def test_cotta_averages_augmentations_exactly_when_the_anchor_is_unsure() -> None:
    net = confident_bn()
    x = images(16, seed=4)
    ttn = create("ttn", net)
    with torch.no_grad():
        confidence = ttn(x).softmax(1).amax(1).mean().item()
    sure = create("cotta", net, protocol="online", anchor_threshold=confidence - 1e-4, augmentations=3)
    assert torch.equal(sure(x), ttn(x)) and sure.augmented_batches == 0  # the teacher's own prediction
    unsure = create("cotta", net, protocol="online", anchor_threshold=confidence + 1e-4, augmentations=3)
    out = unsure(x)
    assert unsure.augmented_batches == 1
    gens, teacher = Generators(0), ttn.model  # the same draws as the method's first batch (seed 0)
    with torch.no_grad():
        want = sum(teacher(tta_augment(x, gens)) for _ in range(3)) / 3
    assert torch.allclose(out, want, atol=1e-5)
    assert not torch.allclose(out, ttn(x), atol=1e-3)


def test_cotta_reset_restores_student_teacher_optimizer_and_draws() -> None:
    net = confident_bn()
    opts = {"protocol": "online", "anchor_threshold": 1.0, "augmentations": 2, "restore_prob": 0.1}
    m, fresh = create("cotta", net, **opts), create("cotta", net, **opts)
    start, teacher0 = state_of(m.model), state_of(m.teacher)
    outs = [m(images(8, seed=s)) for s in (2, 3)]
    assert not same_state(start, state_of(m.model)) and not same_state(teacher0, state_of(m.teacher))
    m.reset()
    assert same_state(start, state_of(m.model)) and same_state(teacher0, state_of(m.teacher))
    assert len(m.optimizer.state_dict()["state"]) == 0
    again = [m(images(8, seed=s)) for s in (2, 3)]
    assert all(torch.equal(a, b) for a, b in zip(outs, again))
    assert torch.equal(fresh(images(8, seed=2)), outs[0])


def test_cotta_is_deterministic_by_seed_and_leaves_the_global_rng_alone() -> None:
    net = confident_bn()
    runs = []
    for seed in (5, 5, 6):
        m = create("cotta", net, protocol="online", seed=seed, anchor_threshold=1.0, augmentations=2)
        torch.manual_seed(123)
        expected_next = torch.Generator().manual_seed(123)
        runs.append([m(images(8, seed=s)) for s in (2, 3)])
        assert torch.equal(torch.randn(3), torch.randn(3, generator=expected_next))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    assert not torch.equal(runs[0][0], runs[2][0])


def test_cotta_episodic_scores_the_adapted_teacher_and_forgets_between_batches() -> None:
    net = confident_bn()
    opts = {"anchor_threshold": 1.0, "augmentations": 2, "protocol": "episodic"}
    fresh, used = create("cotta", net, **opts), create("cotta", net, **opts)
    for s in (2, 3):
        used(images(8, seed=s) * 0.5)
    target = images(8, seed=9)
    assert torch.equal(fresh(target), used(target))


def test_cotta_a_batch_with_nan_changes_nothing() -> None:
    m = create("cotta", confident_bn(), protocol="online", anchor_threshold=1.0, augmentations=2)
    m(images(8, seed=2))
    student, teacher = state_of(m.model), state_of(m.teacher)
    bad = images(8, seed=3)
    bad[2, 0, 1, 1] = float("nan")
    out = m(bad)
    assert out.shape == (8, 5)
    assert same_state(student, state_of(m.model)) and same_state(teacher, state_of(m.teacher))
    assert torch.isfinite(m(images(8, seed=4))).all()


# ---------------------------------------------------------------------------- RoTTA
def test_rotta_timeliness_weights_and_uncertainty_are_the_papers() -> None:
    w = timeliness_weights(np.array([0, 64, 128]), 64)
    assert w.tolist() == pytest.approx([0.5, math.exp(-1) / (1 + math.exp(-1)), math.exp(-2) / (1 + math.exp(-2))])
    logits = torch.randn(4, 5)
    p = logits.softmax(1)
    assert torch.allclose(prediction_entropy(logits), -(p * torch.log(p + 1e-6)).sum(1))


def test_rotta_not_applicable_without_batchnorm() -> None:
    for net in (gn_cnn(), tiny_vit()):
        with pytest.raises(NotApplicable, match="BatchNorm"):
            create("rotta", net, protocol="online")


def test_rotta_model_parts_and_first_output() -> None:
    net = confident_bn()
    m = create("rotta", net, protocol="online")
    assert len(m.layers) == 2 and all(isinstance(layer, RobustBatchNorm) for layer in m.layers)
    assert {n for n, p in m.model.named_parameters() if p.requires_grad} == {"1.weight", "1.bias", "4.weight", "4.bias"}
    assert not any(p.requires_grad for p in m.teacher.parameters())
    assert isinstance(m.optimizer, torch.optim.Adam) and m.optimizer.param_groups[0]["lr"] == 1e-3
    assert (m.config.bn_momentum, m.config.nu, m.config.capacity, m.config.update_interval) == (0.05, 0.001, 64, 64)
    x = images(8, seed=2)
    assert torch.allclose(m(x), create("source", net)(x), atol=1e-6)  # the teacher before any update: the source


def test_rotta_memory_is_class_balanced_and_fed_the_teachers_predictions() -> None:
    net, x = confident_bn(num_classes=2), images(24, seed=3)
    with torch.no_grad():  # the head's bias splits the images between the two classes
        z = net(x)
        net[-1].bias[1] -= (z[:, 1] - z[:, 0]).median()
    m = create("rotta", net, protocol="online", capacity=8, update_every=1000)
    logits = m(x)
    mem = m.memory
    predicted = np.bincount(logits.argmax(1).numpy(), minlength=2)
    assert predicted.min() >= 4  # both classes fill their share
    assert len(mem) == 8 and mem.class_counts().tolist() == [4, 4]
    held = mem.items()
    rows = [int(torch.nonzero((x == item).flatten(1).all(1))[0]) for item in held]
    assert mem.classes().tolist() == logits[rows].argmax(1).tolist()
    assert mem.uncertainties() == pytest.approx(prediction_entropy(logits[rows]).double().numpy(), abs=1e-6)
    assert (mem.uncertainties() > 0).all()
    # the memory saw the images in stream order with the teacher's classes and uncertainties
    reference = ClassBalancedMemory(8, 2)
    reference.add(x, logits.argmax(1), prediction_entropy(logits))
    assert torch.equal(reference.items(), held) and np.array_equal(reference.ages(), mem.ages())
    assert m.offered == 24 and m.updates == 0


def test_rotta_loss_is_the_timeliness_weighted_consistency_on_the_memory() -> None:
    net = confident_bn()
    m = create("rotta", net, protocol="online", capacity=8, update_every=1000)
    m(images(12, seed=3))
    student, teacher = copy.deepcopy(m.model), copy.deepcopy(m.teacher)
    items, ages = m.memory.items(), m.memory.ages()
    loss = m.memory_loss()
    # by hand: both models' RBN layers move once with the batch, the student sees the strong augmentation
    strong = tta_augment(items, Generators(0))
    for model in (student, teacher):
        for layer in model.modules():
            if isinstance(layer, RobustBatchNorm):
                layer.updating = True
    with torch.no_grad():
        target = teacher(items).softmax(1)
        pred = student(strong).log_softmax(1)
    weights = torch.sigmoid(-torch.as_tensor(ages, dtype=torch.float32) / 8)
    want = (-(target * pred).sum(1) * weights).mean()
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    assert len(set(ages.tolist())) > 1  # the weights really differ
    moved = [layer.mean for layer in m.teacher_layers]
    assert not torch.equal(moved[0], m.teacher_layers[0].source_mean)


def test_rotta_trains_every_update_every_images_and_teacher_follows_by_nu() -> None:
    net = confident_bn()
    m = create("rotta", net, protocol="online", capacity=8, update_every=4, nu=0.1, lr=0.01)
    start = state_of(m.model)
    teacher_start = {k: v for k, v in state_of(m.teacher).items()}
    m(images(6, seed=2))
    assert m.offered == 6 and m.updates == 1
    student, teacher = state_of(m.model), state_of(m.teacher)
    for name in ("1.weight", "4.bias"):
        assert not torch.equal(student[name], start[name])
        assert torch.allclose(teacher[name], 0.9 * teacher_start[name] + 0.1 * student[name], atol=1e-7)
    m(images(10, seed=3))
    assert m.offered == 16 and m.updates == 4


def test_rotta_reset_restores_everything() -> None:
    net = confident_bn()
    opts = {"protocol": "online", "capacity": 8, "update_every": 4}
    m, fresh = create("rotta", net, **opts), create("rotta", net, **opts)
    start, teacher0 = state_of(m.model), state_of(m.teacher)
    outs = [m(images(8, seed=s)) for s in (2, 3, 4)]
    assert not same_state(teacher0, state_of(m.teacher)) and len(m.memory) > 0
    m.reset()
    assert same_state(start, state_of(m.model)) and same_state(teacher0, state_of(m.teacher))
    assert len(m.memory) == 0 and m.offered == 0 and m.updates == 0
    assert len(m.optimizer.state_dict()["state"]) == 0
    assert all(torch.equal(a, b) for a, b in zip(outs, [m(images(8, seed=s)) for s in (2, 3, 4)]))
    assert all(torch.equal(a, fresh(images(8, seed=s))) for a, s in zip(outs, (2, 3, 4)))
    assert not torch.equal(outs[2], create("source", net)(images(8, seed=4)))


def test_rotta_episodic_adapts_on_the_batch_then_forgets() -> None:
    net = confident_bn()
    small = create("rotta", net, capacity=8, update_every=16, protocol="episodic")
    x = images(8, seed=5)
    assert torch.allclose(small(x), create("source", net)(x), atol=1e-6)  # no update within 8 images
    opts = {"capacity": 8, "update_every": 4, "protocol": "episodic"}
    fresh, used = create("rotta", net, **opts), create("rotta", net, **opts)
    for s in (2, 3):
        used(images(8, seed=s) * 0.5)
    out = fresh(x)
    assert torch.equal(used(x), out) and fresh.updates == 2
    assert not torch.allclose(out, create("source", net)(x), atol=1e-4)


def test_rotta_non_finite_images_never_enter_the_memory() -> None:
    m = create("rotta", confident_bn(), protocol="online", capacity=8, update_every=4)
    x = images(8, seed=6)
    x[3] = float("nan")
    out = m(x)
    assert torch.isfinite(out[[0, 1, 2, 4, 5, 6, 7]]).all() and not torch.isfinite(out[3]).any()
    assert m.offered == 7 and torch.isfinite(m.memory.items()).all()
    assert all(torch.isfinite(p).all() for p in m.teacher.state_dict().values())
    assert torch.isfinite(m(images(8, seed=7))).all()


def test_one_optimizer_config_and_preset_helper_for_the_field_methods() -> None:
    from aqr.methods.options import OptimizerConfig

    for name in ("eta", "roid", "deyo", "cotta", "rotta"):
        for defaults in ("cifar10", "imagenet"):
            config = plan(name, {"defaults": defaults}).config
            assert isinstance(config, OptimizerConfig) and config.defaults == defaults
        with pytest.raises(ValueError, match=f"{name}: defaults must be one of"):
            plan(name, {"defaults": "mnist"})
    # SGD without momentum is plain SGD, whatever nesterov says (torch refuses Nesterov without momentum)
    sgd = create("cotta", bn_cnn(), optimizer="sgd", momentum=0.0).optimizer
    assert isinstance(sgd, torch.optim.SGD) and not sgd.param_groups[0]["nesterov"]
