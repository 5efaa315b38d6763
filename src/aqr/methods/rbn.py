"""RBN: the normalization part of RoTTA (Yuan et al., "Robust Test-Time Adaptation in Dynamic
Scenarios", CVPR 2023), without its teacher-student training.

Every BatchNorm layer of a private copy of the model becomes a :class:`RobustBatchNorm`: it normalizes
with *global* statistics, which start as the layer's running (source) statistics and move as an
exponential moving average, ``global <- (1 - momentum) * global + momentum * batch``, with RoTTA's
momentum 0.05. The batches that feed it are not the test batches but the contents of a
:class:`~aqr.methods.rotta_memory.ClassBalancedMemory` of recent test images filed by predicted class
(RoTTA's CSTU: capacity 64, lambda_t = lambda_u = 1), so a run of one class cannot pull the
statistics towards that class. Per test batch, as in RoTTA's code:

1. the batch is scored with the current global statistics (no update);
2. its images are offered to the memory one by one with their predicted class and the entropy of
   the prediction; after every ``update_every`` images offered (RoTTA: 64, the memory's capacity)
   the memory's images go through the model once, and each layer's global statistics take one EMA
   step towards the mean and biased variance of its input on that memory batch.

Images whose input or logits are not finite are scored but never offered to the memory. The model
stays in eval mode throughout (RoTTA switches it to train mode for the memory pass, which only
matters for dropout). It needs ``protocol="online"`` and refuses the episodic protocol, whose reset
before every batch would score every batch with the source statistics, as ``source`` does. A lock
serializes calls, so threads sharing one instance each see a consistent state (in an order the
threads decide).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .base import NotApplicable, SerializedCalls, TTAMethod, softmax_entropy
from .declaration import method
from .norm_layers import MovingStatsBatchNorm, replace_batchnorms
from .rotta_memory import ClassBalancedMemory


@dataclass(frozen=True)
class RBNConfig:
    """RBN options; the defaults are RoTTA's published CIFAR settings.

    Attributes:
        momentum: EMA weight of a memory batch's statistics (RoTTA's ``ALPHA``, 0.05).
        capacity: images the class-balanced memory holds (``MEMORY_SIZE``, 64).
        update_every: images offered between two updates of the statistics (``UPDATE_FREQUENCY``,
            64); ``None`` means ``capacity``.
        lambda_t, lambda_u: weights of an image's age and uncertainty in the memory's replacement
            score (1 and 1).
        num_classes: classes of the memory; ``None`` takes the width of the model's logits.
    """

    momentum: float = 0.05
    capacity: int = 64
    update_every: int | None = None
    lambda_t: float = 1.0
    lambda_u: float = 1.0
    num_classes: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.momentum, (int, float)) and 0 < self.momentum <= 1):
            raise ValueError(f"momentum must lie in (0, 1], got {self.momentum!r}")
        for name in ("capacity", "update_every", "num_classes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_classes is not None and self.num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {self.num_classes}")
        for name in ("lambda_t", "lambda_u"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")

    @property
    def update_interval(self) -> int:
        return self.update_every if self.update_every is not None else self.capacity


class RobustBatchNorm(MovingStatsBatchNorm):
    """A BatchNorm layer that normalizes with global statistics moved by EMA while :attr:`updating`.

    Built from a BatchNorm layer with running statistics, whose affine parameters and ``eps`` it
    shares; the global statistics are ``mean``/``var``, and ``source_mean``/``source_var`` keep the
    running statistics they started from.
    """

    def __init__(self, bn: _BatchNorm, momentum: float) -> None:
        super().__init__(bn, momentum, "rbn")
        self.updating = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.updating:
            return self.normalize(x)
        # the batch is normalized with the moved statistics, through which gradients reach the batch's
        # own mean and variance (RoTTA's training pass); the buffers keep them detached
        dims = [0, *range(2, x.ndim)]
        batch_var, batch_mean = torch.var_mean(x, dim=dims, correction=0)
        mean = self.mean.lerp(batch_mean.to(self.mean.dtype), self.momentum)
        var = self.var.lerp(batch_var.to(self.var.dtype), self.momentum)
        self.mean.copy_(mean.detach())
        self.var.copy_(var.detach())
        if not mean.requires_grad:
            return self.normalize(x)
        shape = [1, -1] + [1] * (x.ndim - 2)  # F.batch_norm takes no gradient through its statistics
        out = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.weight is not None:
            out = out * self.weight.view(shape)
        if self.bias is not None:
            out = out + self.bias.view(shape)
        return out


def use_robust_batchnorm(model: nn.Module, momentum: float) -> list[RobustBatchNorm]:
    """Replace every BatchNorm layer of ``model`` (in place; meant for a private copy) by a
    :class:`RobustBatchNorm`; returns the new layers. The model itself must not be a BatchNorm layer."""
    return replace_batchnorms(model, lambda bn: RobustBatchNorm(bn, momentum), "rbn")  # type: ignore[return-value]


@method("rbn", RBNConfig)
class RBN(SerializedCalls, TTAMethod):
    """RoTTA's robust BatchNorm fed by its class-balanced memory (see module docs); no weights change."""

    carried = ("memory", "offered", "updates")

    def configure_model(self, model: nn.Module) -> nn.Module:
        if self.protocol.episodic:
            raise ValueError("rbn adapts across batches: create it with protocol='online' (the episodic protocol "
                             "resets before every batch, which leaves the source model)")
        model.eval().requires_grad_(False)
        self.layers = use_robust_batchnorm(model, self.config.momentum)
        if not self.layers:
            raise NotApplicable("rbn needs BatchNorm layers; this model has none")
        self.memory: ClassBalancedMemory | None = None
        self.offered = 0  # images offered to the memory since the last reset
        self.updates = 0  # EMA steps taken since the last reset
        self.make_lock()
        return model

    @property
    def holds_state(self) -> bool:
        return True  # always online: its statistics carry over (forward_held normalizes with them, no update)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Score ``x`` with the current statistics, then let it update the memory and the statistics."""
        with self._lock:
            logits = super().forward(x)
            self._observe(x.detach(), logits)
            return logits

    def reset_extra_state(self) -> None:
        for layer in self.layers:
            layer.reset()
        if self.memory is not None:
            self.memory.reset()
        self.offered = 0
        self.updates = 0

    def _observe(self, x: torch.Tensor, logits: torch.Tensor) -> None:
        finite = torch.isfinite(logits).all(1) & torch.isfinite(x.flatten(1)).all(1)
        if not bool(finite.all()):
            x, logits = x[finite], logits[finite]
        if len(x) == 0:
            return
        if self.memory is None:
            classes = self.config.num_classes or logits.shape[1]
            if classes < 2:
                raise ValueError(f"rbn needs at least 2 classes to balance its memory, the model gives {classes}")
            self.memory = ClassBalancedMemory(self.config.capacity, classes, self.config.lambda_t,
                                              self.config.lambda_u)
        predicted = logits.argmax(1)
        uncertainty = softmax_entropy(logits.float()).clamp_min(0)
        interval = self.config.update_interval
        start = 0
        while start < len(x):  # the statistics move exactly when the count of offered images reaches a multiple
            stop = min(len(x), start + interval - self.offered % interval)
            self.memory.add(x[start:stop], predicted[start:stop], uncertainty[start:stop])
            self.offered += stop - start
            if self.offered % interval == 0:
                self._update_statistics()
            start = stop

    def _update_statistics(self) -> None:
        """One EMA step of every layer's global statistics on the memory's images."""
        batch = self.memory.items()
        for layer in self.layers:
            layer.updating = True
        try:
            with torch.no_grad():
                self.model(batch)
        finally:
            for layer in self.layers:
                layer.updating = False
        self.updates += 1

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layers={len(self.layers)}"
