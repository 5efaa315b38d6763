"""RoTTA: robust test-time adaptation in dynamic scenarios (Yuan et al., CVPR 2023), the whole method.

Three parts, following the test-time-adaptation benchmark repository (mariodoebler/test-time-adaptation,
``methods/rotta.py``) and the authors' code (BIT-DA/RoTTA):

* **Robust BatchNorm** (RBN): every BatchNorm layer becomes a
  :class:`~aqr.methods.rbn.RobustBatchNorm` that normalizes with global statistics, starting from the
  source statistics and moved by EMA (``bn_momentum`` 0.05) towards the statistics of each batch
  that trains the model; the student's and the teacher's layers keep statistics of their own.
* **Category-balanced memory with timeliness and uncertainty** (CSTU,
  :class:`~aqr.methods.rotta_memory.ClassBalancedMemory`): every test image is offered, with the teacher's
  predicted class and the entropy of its prediction (``-sum p log(p + 1e-6)``, as in the reference).
* **Teacher-student training**: after every ``update_every`` images offered (64, the memory's
  capacity) the memory's images ``m_i`` of ages ``a_i`` train the student by one optimizer step
  (Adam, lr 1e-3, beta1 0.9) on

      L = mean_i  w(a_i) * CE(softmax(teacher(m_i)), student(augment(m_i))),
      w(a) = exp(-a / capacity) / (1 + exp(-a / capacity))         (timeliness reweighting)

  with the strong augmentation of :func:`~aqr.methods.augment.tta_augment`; both passes move their
  model's RBN statistics (the student's with the augmented images). Then the teacher moves towards the
  student: ``teacher <- (1 - nu) teacher + nu student`` for every parameter (``nu`` 0.001).

Trained parameters: the affine weight and bias of the RBN layers and of any LayerNorm/GroupNorm layer.
The scored logits are the teacher's, with its global statistics, computed before the batch enters the
memory (online). The episodic protocol resets the memory, the statistics and both models before every
batch, adapts on the batch (an update only when it holds ``update_every`` images or more), then scores
the teacher. Options are :class:`RoTTAConfig`; the defaults are the reference's CIFAR-10-C settings,
which its ImageNet-C settings repeat (``defaults="imagenet"``).

Differences from the reference: the copies stay in eval mode except for the RBN layers' updates
(RoTTA switches the whole model to train mode for the memory pass, which matters only for dropout);
augmentations come from a generator seeded by the protocol's ``seed`` (re-seeded by ``reset()``);
images whose input or teacher logits are not finite are scored but never offered to the memory, and a
step whose loss or gradients are not finite changes nothing. (The reference repository calls its loss
with an argument its signature lacks outside mixed precision; this follows the intended computation.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from aqr.methods.rotta_memory import ClassBalancedMemory

from .augment import SOFT, STRONG, Generators, tta_augment
from .base import NotApplicable, SerializedCalls, TTAMethod
from .declaration import method
from .cotta import ema_update, frozen_copy, grads_finite, soft_cross_entropy
from .norm_layers import batchnorm_layers
from .options import OptimizerConfig, check_positive, check_unit
from .rbn import RobustBatchNorm, use_robust_batchnorm

#: The reference's settings per benchmark (``cfgs/cifar10_c/rotta.yaml``, ``cfgs/imagenet_c/rotta.yaml``: the same).
ROTTA_DEFAULTS: dict[str, dict[str, Any]] = {"cifar10": {}, "imagenet": {}}


@dataclass(frozen=True)
class RoTTAConfig(OptimizerConfig):
    """RoTTA options (optimizer options as in :class:`~aqr.methods.options.OptimizerConfig`).

    Attributes:
        bn_momentum: EMA weight of a batch's statistics in the RBN layers (``ROTTA.ALPHA``, 0.05).
        nu: the student's weight in the teacher's update (``ROTTA.NU``, 0.001).
        capacity: images the memory holds (``ROTTA.MEMORY_SIZE``, 64).
        update_every: images offered between two training steps (``ROTTA.UPDATE_FREQUENCY``, 64);
            ``None`` means ``capacity``.
        lambda_t, lambda_u: weights of age and uncertainty in the memory's replacement score (1, 1).
        num_classes: classes of the memory; ``None`` takes the width of the model's logits.
        soft_augment: the milder augmentation ranges (the reference uses the strong ones).
    """

    bn_momentum: float = 0.05
    nu: float = 0.001
    capacity: int = 64
    update_every: int | None = None
    lambda_t: float = 1.0
    lambda_u: float = 1.0
    num_classes: int | None = None
    soft_augment: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_unit("bn_momentum", self.bn_momentum, low_open=True)
        check_unit("nu", self.nu)
        check_positive("capacity", self.capacity, integer=True)
        if self.update_every is not None:
            check_positive("update_every", self.update_every, integer=True)
        if self.num_classes is not None and (isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int)
                                             or self.num_classes < 2):
            raise ValueError(f"num_classes must be an integer >= 2, got {self.num_classes!r}")
        check_positive("lambda_t", self.lambda_t, zero=True)
        check_positive("lambda_u", self.lambda_u, zero=True)
        if not isinstance(self.soft_augment, bool):
            raise ValueError(f"soft_augment must be True or False, got {self.soft_augment!r}")

    @property
    def update_interval(self) -> int:
        return self.update_every if self.update_every is not None else self.capacity


def timeliness_weights(ages: np.ndarray | torch.Tensor, capacity: int) -> torch.Tensor:
    """RoTTA's per-item loss weight ``exp(-a) / (1 + exp(-a))`` with ``a = age / capacity`` (float32)."""
    a = torch.as_tensor(np.asarray(ages, dtype=np.float64) / capacity, dtype=torch.float32)
    return torch.sigmoid(-a)


def prediction_entropy(logits: torch.Tensor) -> torch.Tensor:
    """``-sum p log(p + 1e-6)`` per row, the reference's uncertainty (clamped at 0)."""
    p = logits.float().softmax(1)
    return (-(p * torch.log(p + 1e-6)).sum(1)).clamp_min(0)


def set_updating(layers: list[RobustBatchNorm], on: bool) -> None:
    for layer in layers:
        layer.updating = on


@method("rotta", RoTTAConfig, defaults=ROTTA_DEFAULTS)
class RoTTA(SerializedCalls, TTAMethod):
    """RoTTA behind the common protocol (see the module docs); :class:`NotApplicable` without BatchNorm."""

    carried = ("memory", "generators", "offered", "updates", "last_loss")

    def configure_model(self, model: nn.Module) -> nn.Module:
        if not batchnorm_layers(model):
            raise NotApplicable("rotta needs BatchNorm layers; this model has none")
        model.eval().requires_grad_(False)
        self.layers = use_robust_batchnorm(model, self.config.bn_momentum)
        trained = self.trained_parameters(model)
        for _, p in trained:
            p.requires_grad_(True)
        self.param_names = [name for name, _ in trained]
        self.teacher = frozen_copy(model)
        self.teacher_layers = [m for m in self.teacher.modules() if isinstance(m, RobustBatchNorm)]
        self.augment_params = SOFT if self.config.soft_augment else STRONG
        self.generators = Generators(self.protocol.seed)
        self.memory: ClassBalancedMemory | None = None
        self.offered = 0  # images offered to the memory since the last reset
        self.updates = 0  # training steps since the last reset
        self.last_loss: float | None = None
        self.make_lock()
        return model

    @staticmethod
    def trained_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        """Affine weight and bias of the RBN, LayerNorm and GroupNorm layers."""
        found = []
        for name, m in model.named_modules():
            if isinstance(m, (RobustBatchNorm, nn.LayerNorm, nn.GroupNorm)):
                for pname in ("weight", "bias"):
                    p = getattr(m, pname, None)
                    if isinstance(p, nn.Parameter):
                        found.append((f"{name}.{pname}" if name else pname, p))
        return found

    def build_optimizer(self) -> torch.optim.Optimizer:
        return self.config.build([p for _, p in self.trained_parameters(self.model)])

    def reset_extra_state(self) -> None:
        self.teacher.load_state_dict(self._initial_state[0], strict=True)
        if self.memory is not None:
            self.memory.reset()
        self.generators.reset()
        self.offered = 0
        self.updates = 0
        self.last_loss = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self._lock:
            return super().forward(x)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.teacher(x)

    def predict_held(self, x: torch.Tensor) -> torch.Tensor:
        """The teacher with its robust BatchNorm's current statistics (not updated); nothing enters the memory."""
        return self.teacher(x)

    def adapt(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.predict(x)
        finite = torch.isfinite(logits).all(1) & torch.isfinite(x.flatten(1)).all(1)
        images, kept = (x, logits) if bool(finite.all()) else (x[finite], logits[finite])
        if len(images):
            self.observe(images.detach(), kept)
        return logits

    def observe(self, x: torch.Tensor, logits: torch.Tensor) -> None:
        """Offer the images to the memory in order; train after every ``update_every`` images offered."""
        if self.memory is None:
            classes = self.config.num_classes or logits.shape[1]
            if classes < 2:
                raise ValueError(f"rotta needs at least 2 classes to balance its memory, the model gives {classes}")
            self.memory = ClassBalancedMemory(self.config.capacity, classes, self.config.lambda_t,
                                              self.config.lambda_u)
        predicted = logits.argmax(1)
        uncertainty = prediction_entropy(logits)
        interval = self.config.update_interval
        start = 0
        while start < len(x):
            stop = min(len(x), start + interval - self.offered % interval)
            self.memory.add(x[start:stop], predicted[start:stop], uncertainty[start:stop])
            self.offered += stop - start
            if self.offered % interval == 0:
                self.train_step()
            start = stop

    def memory_loss(self) -> torch.Tensor:
        """The timeliness-weighted consistency loss on the memory's images (moves both models' RBN statistics)."""
        batch = self.memory.items()
        weights = timeliness_weights(self.memory.ages(), self.memory.capacity).to(batch.device)
        strong = tta_augment(batch, self.generators, self.augment_params)
        set_updating(self.teacher_layers, True)
        set_updating(self.layers, True)
        try:
            with torch.no_grad():
                teacher = self.teacher(batch)
            student = self.model(strong)
        finally:
            set_updating(self.teacher_layers, False)
            set_updating(self.layers, False)
        return (soft_cross_entropy(student, teacher) * weights).mean()

    def train_step(self) -> None:
        """One optimizer step on the memory, then the teacher's EMA update."""
        with torch.enable_grad():
            loss = self.memory_loss()
            self.optimizer.zero_grad(set_to_none=True)
            if not bool(torch.isfinite(loss)):
                return
            loss.backward()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if not grads_finite(params):
            self.optimizer.zero_grad(set_to_none=True)
            return
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        ema_update(self.teacher, self.model, 1.0 - self.config.nu)
        self.updates += 1
        self.last_loss = float(loss.detach())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layers={len(self.layers)}"
