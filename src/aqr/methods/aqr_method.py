"""AQR (Adaptive Quantile Recalibration) behind the common method interface.

A thin wrapper: ``aqr.core.adapt.AQR`` does the work (it never changes the model's parameters or buffers
and runs under ``no_grad``); this module only gives it the same construction, ``reset()`` and
protocol handling as the baselines. AQR is stateless, so both protocols give the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .base import TTAMethod


@dataclass(frozen=True)
class AQRMethodConfig:
    """Options of the ``"aqr"`` method (not ``aqr.core.adapt.AQRConfig``): ``stats``, the
    ``aqr.SourceStats`` from ``aqr.calibrate``; ``options``, keyword options
    passed unchanged to ``aqr.AQR``."""

    stats: Any = None
    options: dict[str, Any] = field(default_factory=dict)


class AQRMethod(TTAMethod):
    """Quantile recalibration against fixed source statistics; no weights are updated."""

    name = "aqr"
    Config = AQRMethodConfig

    @classmethod
    def from_options(cls, **options: Any) -> AQRMethodConfig:
        if options.get("stats") is None:
            raise TypeError("the 'aqr' method needs stats= (from aqr.calibrate)")
        stats = options.pop("stats")
        return AQRMethodConfig(stats=stats, options=options)

    def configure_model(self, model: nn.Module) -> nn.Module:
        from aqr.core.adapt import AQR

        if self.config.stats is None:
            raise TypeError("the 'aqr' method needs stats= (from aqr.calibrate)")
        model.eval().requires_grad_(False)
        self.adapter = AQR(model, self.config.stats, **self.config.options)
        return model

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.adapter(x)

    def reset_extra_state(self) -> None:
        reset = getattr(self.adapter, "reset", None)
        if callable(reset):
            reset()
