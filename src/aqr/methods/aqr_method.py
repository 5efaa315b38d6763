"""AQR (Adaptive Quantile Recalibration) behind the common method interface.

A thin wrapper: :class:`aqr.AQR` does the work (it never changes the model's parameters or buffers
and runs under ``no_grad``); this module only gives it the same construction, ``reset()`` and
protocol handling as the baselines. Per-batch AQR is stateless, so both protocols give the same
logits; streaming AQR (``target="stream"`` or ``"robust"``) keeps its running estimate under ``protocol="online"``
and restarts it before every batch under the episodic protocol.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn

from aqr.adapt import AQR, AQRConfig
from aqr.core.points import OUTPUT

from .base import TTAMethod
from .declaration import Needs, method


def aqr_keywords(config: Any) -> dict[str, Any]:
    """The :class:`aqr.AQRConfig` fields of ``config`` (an ``AQRConfig`` or a config that carries its
    fields, as the compositions' do), as keyword options of :class:`aqr.AQR`."""
    return {f.name: getattr(config, f.name) for f in fields(AQRConfig)}


@dataclass(frozen=True)
class AQRMethodConfig(AQRConfig):
    """Options of the ``"aqr"`` method: every field of :class:`aqr.AQRConfig` (the statistics are
    supplied beside them, ``create("aqr", model, stats=stats)``)."""

    def aqr_config(self) -> AQRConfig:
        """The :class:`aqr.AQRConfig` that :class:`aqr.AQR` runs with."""
        return AQRConfig(**aqr_keywords(self))


def warn_episodic_stream(method: TTAMethod, config: AQRConfig, stacklevel: int = 4) -> None:
    """Warn that the episodic protocol restarts a streaming target before every batch."""
    if method.protocol.episodic and config.target_kind.keeps_state:
        warnings.warn(f"{method.name}:target={config.target} keeps a running estimate across batches, but the "
                      "episodic protocol restarts it before every batch; use protocol='online'",
                      UserWarning, stacklevel=stacklevel)


@method("aqr", AQRMethodConfig, needs=Needs(stats=OUTPUT), maps_quantiles=True)
class AQRMethod(TTAMethod):
    """Quantile recalibration against fixed source statistics; no weights are updated."""

    def configure_model(self, model: nn.Module) -> nn.Module:
        model.eval().requires_grad_(False)
        config = self.config.aqr_config()
        warn_episodic_stream(self, config)
        self.aqr = AQR(model, self.stats, **aqr_keywords(config))
        return model

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.aqr(x)

    @property
    def holds_state(self) -> bool:
        """Streaming AQR under the online protocol: its running estimate carries over."""
        return not self.protocol.episodic and self.aqr.config.target_kind.keeps_state

    def predict_held(self, x: torch.Tensor) -> torch.Tensor:
        """The map from the running estimate as it stands, which the batch does not update (:meth:`aqr.AQR.forward_held`)."""
        return self.aqr.forward_held(x)

    def reset_extra_state(self) -> None:
        self.aqr.reset()
