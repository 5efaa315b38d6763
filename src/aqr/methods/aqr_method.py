"""AQR (Adaptive Quantile Recalibration) behind the common method interface.

A thin wrapper: :class:`aqr.AQR` does the work (it never changes the model's parameters or buffers
and runs under ``no_grad``); this module only gives it the same construction, ``reset()`` and
protocol handling as the baselines. Per-batch AQR is stateless, so both protocols give the same
logits; streaming AQR (``target="stream"`` or ``"robust"``) keeps its running estimate under ``protocol="online"``
and restarts it before every batch under the episodic protocol.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from torch import nn

from aqr.adapt import AQR, AQRConfig
from aqr.core.stats import SourceStats

from .base import TTAMethod


@dataclass(frozen=True)
class AQRMethodConfig(AQRConfig):
    """Options of the ``"aqr"`` method: ``stats``, the :class:`aqr.SourceStats` from
    :func:`aqr.calibrate`, and every field of :class:`aqr.AQRConfig`."""

    stats: SourceStats | None = field(default=None, repr=False)

    def aqr_config(self) -> dict[str, Any]:
        """The :class:`aqr.AQRConfig` fields, as keyword options of :class:`aqr.AQR`."""
        return {f.name: getattr(self, f.name) for f in fields(AQRConfig)}


class AQRMethod(TTAMethod):
    """Quantile recalibration against fixed source statistics; no weights are updated."""

    name = "aqr"
    Config = AQRMethodConfig
    needs_stats = True
    #: the method maps with AQR's quantile map: its cells' keys carry the fast path's version
    uses_quantile_map: ClassVar[bool] = True

    @classmethod
    def from_options(cls, **options: Any) -> Any:
        if options.get("stats") is None:
            raise TypeError(f"the {cls.name!r} method needs stats= (from aqr.calibrate)")
        return cls.Config(**options)

    def configure_model(self, model: nn.Module) -> nn.Module:
        if self.config.stats is None:
            raise TypeError(f"the {self.name!r} method needs stats= (from aqr.calibrate)")
        model.eval().requires_grad_(False)
        target = getattr(self.config, "target_kind", None)  # moments' config has no target
        if self.protocol.episodic and target is not None and target.keeps_state:
            warnings.warn(f"aqr:target={self.config.target} keeps a running estimate across batches, but the "
                          "episodic protocol restarts it before every batch (per-batch AQR); use protocol='online'",
                          UserWarning, stacklevel=3)
        self.adapter = AQR(model, self.config.stats, **self.config.aqr_config())
        return model

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.adapter(x)

    @property
    def holds_state(self) -> bool:
        """Streaming AQR under the online protocol: its running estimate carries over."""
        target = getattr(self.config, "target_kind", None)  # moments' config has no target
        return not self.protocol.episodic and target is not None and target.keeps_state

    def predict_held(self, x: torch.Tensor) -> torch.Tensor:
        """The map from the running estimate as it stands, which the batch does not update (:meth:`aqr.AQR.forward_held`)."""
        return self.adapter.forward_held(x)

    def reset_extra_state(self) -> None:
        reset = getattr(self.adapter, "reset", None)
        if callable(reset):
            reset()
