"""CoTTA: continual test-time domain adaptation (Wang et al., CVPR 2022).

Three copies of the model, all normalizing with batch statistics in their BatchNorm layers: the
*student* (trained), the *teacher* (an exponential moving average of the student) and the *anchor*
(the source weights, never trained). Per adaptation step, following the test-time-adaptation
benchmark repository (mariodoebler/test-time-adaptation, ``methods/cotta.py``):

1. the anchor's confidence on the batch, the mean over images of the largest softmax probability,
   decides the teacher's prediction: below ``anchor_threshold`` it is the mean of the teacher's logits
   over ``augmentations`` random augmentations of the batch (:func:`~aqr.methods.augment.tta_augment`),
   else the teacher's logits on the batch itself;
2. the student minimizes the cross-entropy of its softmax against the teacher's softmax
   (``loss="symmetric"``: the mean of both directions, the reference's ImageNet choice), one optimizer
   step (Adam, lr 1e-3, beta1 0.9 on CIFAR; SGD with Nesterov momentum 0.9, lr 0.01 on ImageNet);
3. teacher <- ``ema`` teacher + (1 - ``ema``) student, for every parameter;
4. stochastic restore: each element of every trained parameter goes back to its source value with
   probability ``restore_prob``, independently.

Trained parameters: every module's own ``weight`` and ``bias`` (all layers, not only norm layers),
as in the reference. The scored logits are the teacher's from step 1 (online: before the update;
episodic: after it, by a second teacher prediction). Options are :class:`CoTTAConfig`; the defaults
are the reference's CIFAR-10-C settings, ``defaults="imagenet"`` its ImageNet-C ones
(:data:`COTTA_DEFAULTS`).

Differences from the reference: the augmentations are plain-torch re-writes of its torchvision
transforms (:mod:`aqr.methods.augment`); augmentations and restore masks come from generators seeded by
the protocol's ``seed`` (re-seeded by ``reset()``) instead of the global RNG; the copies stay in eval
mode, as in the reference except its BatchNorm1d layers (which normalize with batch statistics here
too). A batch whose loss or gradients are not finite (e.g. NaN in the input) is scored but changes
nothing: no step, no teacher update, no restore.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .augment import SOFT, STRONG, Generators, tta_augment
from .base import NotApplicable, TTAMethod
from .declaration import method
from .norm_layers import use_batch_statistics
from .options import OptimizerConfig, check_positive, check_unit

LOSSES = ("ce", "symmetric")

#: The reference's settings per benchmark (``cfgs/cifar10_c/cotta.yaml``, ``cfgs/imagenet_c/cotta.yaml``).
COTTA_DEFAULTS: dict[str, dict[str, Any]] = {
    "cifar10": {},
    "imagenet": {"optimizer": "sgd", "lr": 0.01, "restore_prob": 0.001, "anchor_threshold": 0.1,
                 "loss": "symmetric"},
}


@dataclass(frozen=True)
class CoTTAConfig(OptimizerConfig):
    """CoTTA options (optimizer options as in :class:`~aqr.methods.options.OptimizerConfig`); defaults: the
    reference's CIFAR-10-C.

    Attributes:
        ema: the teacher keeps this share of its weights per step (``M_TEACHER.MOMENTUM``, 0.999).
        restore_prob: probability that an element of a trained parameter returns to its source value
            per step (``COTTA.RST``: 0.01 CIFAR, 0.001 ImageNet).
        anchor_threshold: below this mean anchor confidence the teacher averages over augmentations
            (``COTTA.AP``: 0.92 CIFAR, 0.1 ImageNet).
        augmentations: augmented copies the teacher averages over (``TEST.N_AUGMENTATIONS``, 32).
        loss: ``"ce"`` (student's cross-entropy to the teacher, CIFAR) or ``"symmetric"`` (ImageNet).
        soft_augment: the reference's milder augmentation ranges (``soft=True``).
    """

    ema: float = 0.999
    restore_prob: float = 0.01
    anchor_threshold: float = 0.92
    augmentations: int = 32
    loss: str = "ce"
    soft_augment: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_unit("ema", self.ema)
        check_unit("restore_prob", self.restore_prob)
        check_positive("anchor_threshold", self.anchor_threshold, zero=True)
        check_positive("augmentations", self.augmentations, integer=True)
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if not isinstance(self.soft_augment, bool):
            raise ValueError(f"soft_augment must be True or False, got {self.soft_augment!r}")


def soft_cross_entropy(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy of ``softmax(student)`` against the target ``softmax(teacher)``; shape ``(N,)``."""
    return -(teacher.softmax(1) * student.log_softmax(1)).sum(1)


def weight_and_bias(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` for every module's own ``weight`` and ``bias`` parameters, in module order."""
    found = []
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if pname in ("weight", "bias"):
                found.append((f"{name}.{pname}" if name else pname, p))
    return found


@torch.no_grad()
def ema_update(teacher: nn.Module, student: nn.Module, keep: float) -> None:
    """Every parameter: ``teacher <- keep * teacher + (1 - keep) * student``."""
    for t, s in zip(teacher.parameters(), student.parameters()):
        t.mul_(keep).add_(s.detach(), alpha=1.0 - keep)


def frozen_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` with every gradient off."""
    return copy.deepcopy(model).requires_grad_(False)


def grads_finite(params: list[nn.Parameter]) -> bool:
    """Whether every existing gradient of ``params`` is finite (one device sync)."""
    flags = [torch.isfinite(p.grad).all() for p in params if p.grad is not None]
    return bool(torch.stack(flags).all()) if flags else True


@method("cotta", CoTTAConfig, defaults=COTTA_DEFAULTS)
class CoTTA(TTAMethod):
    """CoTTA behind the common protocol (see the module docs)."""

    carried = ("generators", "augmented_batches")

    def configure_model(self, model: nn.Module) -> nn.Module:
        model.eval().requires_grad_(False)
        use_batch_statistics(model)
        trained = weight_and_bias(model)
        if not trained:
            raise NotApplicable("cotta needs layers with weight or bias parameters")
        self.param_names = [name for name, _ in trained]
        for _, p in trained:
            p.requires_grad_(True)
        self.teacher = frozen_copy(model)
        self.anchor = frozen_copy(model)
        self.augment_params = SOFT if self.config.soft_augment else STRONG
        self.generators = Generators(self.protocol.seed)
        self.augmented_batches = 0  # batches whose teacher prediction averaged augmentations, since the reset
        return model

    def build_optimizer(self) -> torch.optim.Optimizer:
        return self.config.build([p for _, p in weight_and_bias(self.model) if p.requires_grad])

    def reset_extra_state(self) -> None:
        self.teacher.load_state_dict(self._initial_state[0], strict=True)
        self.generators.reset()
        self.augmented_batches = 0

    def anchor_confidence(self, x: torch.Tensor) -> torch.Tensor:
        """The anchor's mean largest softmax probability on ``x`` (a 0-dim tensor)."""
        return self.anchor(x).softmax(1).amax(1).mean()

    @torch.no_grad()
    def teacher_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The teacher's logits, averaged over augmentations when the anchor is unsure (step 1)."""
        if bool(self.anchor_confidence(x) < self.config.anchor_threshold):
            self.augmented_batches += 1
            total = torch.zeros((), device=x.device)
            for _ in range(self.config.augmentations):
                total = total + self.teacher(tta_augment(x, self.generators, self.augment_params))
            return total / self.config.augmentations
        return self.teacher(x)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self.teacher_logits(x)

    def predict_held(self, x: torch.Tensor) -> torch.Tensor:
        """The teacher's plain forward: no augmentation average (which would draw from the generators)."""
        return self.teacher(x)

    def loss(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        """The consistency loss of step 2, averaged over the batch."""
        if self.config.loss == "ce":
            return soft_cross_entropy(student, teacher).mean()
        return (0.5 * soft_cross_entropy(student, teacher) + 0.5 * soft_cross_entropy(teacher, student)).mean()

    def adapt(self, x: torch.Tensor) -> torch.Tensor:
        teacher = self.teacher_logits(x)
        loss = self.loss(self.model(x), teacher)
        self.optimizer.zero_grad(set_to_none=True)
        if not bool(torch.isfinite(loss)):
            return teacher
        loss.backward()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if not grads_finite(params):
            self.optimizer.zero_grad(set_to_none=True)
            return teacher
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        ema_update(self.teacher, self.model, self.config.ema)
        self.stochastic_restore()
        return teacher

    @torch.no_grad()
    def stochastic_restore(self) -> None:
        """Each element of every trained parameter back to its source value with probability ``restore_prob``."""
        p_restore = self.config.restore_prob
        if p_restore <= 0:
            return
        source = self._initial_state[0]
        for name, p in weight_and_bias(self.model):
            if not p.requires_grad:
                continue
            gen = self.generators.on(p.device)
            mask = torch.rand(p.shape, generator=gen, device=p.device) < p_restore
            p.copy_(torch.where(mask, source[name].to(p.device, p.dtype), p))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, trained={len(self.param_names)}"
