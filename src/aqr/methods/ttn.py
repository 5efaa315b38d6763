"""TTN: test-time (prediction-time) batch normalization.

Schneider et al. 2020 / Nado et al. 2020, as the AQR paper uses it (not Lim et al.'s "TTN" with
learned interpolation): every BatchNorm layer normalizes with the current batch's mean and biased
variance and its own ``eps``, then applies its affine parameters; running statistics are neither
used nor updated. Everything else runs in eval mode. Stateless.
"""

from __future__ import annotations

from torch import nn

from .base import NoOptions, NotApplicable, TTAMethod
from .declaration import method
from .norm_layers import use_batch_statistics


@method("ttn", NoOptions, stateless=True)
class TTN(TTAMethod):
    """Batch-statistics BatchNorm; raises :class:`NotApplicable` on models without BatchNorm."""

    def configure_model(self, model: nn.Module) -> nn.Module:
        model.eval().requires_grad_(False)
        if use_batch_statistics(model) == 0:
            raise NotApplicable("TTN needs BatchNorm layers; this model has none")
        return model
