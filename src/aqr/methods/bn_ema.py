"""bn-ema: test-time BatchNorm whose statistics are an exponential moving average over the stream.

The standard answer to small test batches: TTN normalizes with each batch's own statistics, which at
batch 1 are one image's; bn-ema normalizes with running statistics that start at the layer's source
(running) statistics and move towards every test batch's, so a batch borrows the statistics of the
images before it. Per BatchNorm layer and batch of ``b`` images, *before* the batch is normalized
(it is normalized with statistics that include it, as in RoTTA's robust BatchNorm):

    a = 1 - (1 - momentum)^b
    mean <- (1 - a) mean + a mean_b
    var  <- (1 - a) (var + mean_old^2) + a (var_b + mean_b^2) - mean^2      (``pooled=True``)
    var  <- (1 - a) var + a var_b                                          (``pooled=False``)

``momentum`` is per image (default 1/64: a horizon of 64 images, the best of 64, 256 and 1,024 on the
continual CIFAR-10-C stream, ``docs/results/stream/``), so the batch momentum ``a`` is 0.016 at batch 1,
0.061 at batch 4, 0.22 at batch 16 and 0.63 at batch 64, and the statistics cover about the same
images at every batch size. ``pooled`` tracks the variance of the pooled stream: it adds the spread
of the batch means around the running mean, which PyTorch's rule (``pooled=False``, averaging
within-batch variances) misses; at batch 1 a batch's variance is one image's, and the difference
is 3 points on the BN ResNet-20 (``docs/results/stream/``). ``var_b`` is the biased batch variance.

A batch with NaN or Inf statistics in a layer leaves that layer's statistics unchanged. Under the
online protocol (the stream setting) nothing is reset; under the episodic protocol every batch
starts from the source statistics (the source statistics blended with the batch's by ``a``). A
lock serializes calls, so threads sharing one instance see the statistics of some sequential order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from aqr.core.twin import structural_twin

from .base import NotApplicable, SerializedCalls, TTAMethod
from .declaration import method
from .norm_layers import MovingStatsBatchNorm, replace_batchnorms


@dataclass(frozen=True)
class BNEmaConfig:
    """bn-ema options.

    Attributes:
        momentum: per-image EMA weight; a batch of ``b`` images moves the statistics by ``1 - (1 - momentum)^b``.
        pooled: mix in the spread of the batch means (the variance of the pooled stream), see the module docs.
    """

    momentum: float = 1.0 / 64
    pooled: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.momentum, (int, float)) and not isinstance(self.momentum, bool)
                and math.isfinite(self.momentum) and 0 < self.momentum <= 1):
            raise ValueError(f"momentum must lie in (0, 1], got {self.momentum!r}")
        if not isinstance(self.pooled, bool):
            raise ValueError(f"pooled must be True or False, got {self.pooled!r}")


class EmaBatchNorm(MovingStatsBatchNorm):
    """A BatchNorm layer normalizing with EMA statistics (see the module docs); shares the layer's
    affine parameters and ``eps``; ``source_mean``/``source_var`` keep the statistics it started from."""

    def __init__(self, bn: _BatchNorm, momentum: float, pooled: bool) -> None:
        super().__init__(bn, momentum, "bn-ema")
        self.pooled = pooled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 0:
            self._update(x.detach())
        return self.normalize(x)

    def _update(self, x: torch.Tensor) -> None:
        a = 1.0 - (1.0 - self.momentum) ** x.shape[0]
        var_b, mean_b = torch.var_mean(x, dim=[0, *range(2, x.ndim)], correction=0)
        mean_b, var_b = mean_b.to(self.mean.dtype), var_b.to(self.var.dtype)
        if not bool(torch.isfinite(mean_b).all() and torch.isfinite(var_b).all()):
            return
        mean = torch.lerp(self.mean, mean_b, a)
        if self.pooled:
            var = (1 - a) * (self.var + self.mean**2) + a * (var_b + mean_b**2) - mean**2
        else:
            var = torch.lerp(self.var, var_b, a)
        self.mean.copy_(mean)
        self.var.copy_(var.clamp(min=0))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, pooled={self.pooled}"


@method("bn-ema", BNEmaConfig)
class BNEma(SerializedCalls, TTAMethod):
    """Test-time BatchNorm with EMA statistics over the stream (see module docs); no weights change."""

    def configure_model(self, model: nn.Module) -> nn.Module:
        model.eval().requires_grad_(False)
        self.layers = replace_batchnorms(model, lambda bn: EmaBatchNorm(bn, self.config.momentum, self.config.pooled),
                                         "bn-ema")
        if not self.layers:
            raise NotApplicable("bn-ema needs BatchNorm layers; this model has none")
        self.make_lock()
        return model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self._lock:
            return super().forward(x)

    @property
    def holds_state(self) -> bool:
        return not self.protocol.episodic

    def predict_held(self, x: torch.Tensor) -> torch.Tensor:
        """Normalized with the current EMA statistics, which this batch does not move (a twin of the model
        whose layers only normalize, :mod:`aqr.core.twin`; the model itself is not touched)."""
        frozen = {name: (lambda m: m.normalize) for name, m in self.model.named_modules() if isinstance(m, EmaBatchNorm)}
        return structural_twin(self.model, frozen)(x)

    def reset_extra_state(self) -> None:
        for layer in self.layers:
            layer.reset()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layers={len(self.layers)}"
