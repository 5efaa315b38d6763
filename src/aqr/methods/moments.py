"""Moment matching: the control for AQR's quantile shape.

Each selected normalization output is mapped, channel by channel, from this batch's mean and std
onto the source's measured mean and std: the same layers, statistics file and machinery as AQR
(:class:`aqr.AQR` with ``match="moments"``, see :class:`aqr.adapt.layer_maps.MomentMap`), with an affine
map where AQR has the quantile map. What AQR gains over it is what the quantile shape adds; what it
gains over TTN, which assumes the source outputs of a BatchNorm have mean beta and std |gamma|, is
what the measured source moments add. Stateless, like AQR.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aqr.core.stats import SourceStats

from .aqr_method import AQRMethod


@dataclass(frozen=True)
class MomentsConfig:
    """Options of the ``"moments"`` method.

    Attributes:
        stats: the :class:`aqr.SourceStats` from :func:`aqr.calibrate` (AQR's file; its ``mean``/``std``).
        layers: as :class:`aqr.AQRConfig` ``layers``: ``"all"``, ``"top-half"``, ``"bottom-half"`` or names.
        on_nonfinite: ``"raise"`` or ``"skip"`` a layer whose batch has NaN/Inf values.
    """

    stats: SourceStats | None = field(default=None, repr=False)
    layers: str | Sequence[str] | None = None
    on_nonfinite: str = "raise"

    def aqr_config(self) -> dict[str, Any]:
        """Keyword options of :class:`aqr.AQR` that make it the moment-matching control."""
        return {"match": "moments", "layers": self.layers, "on_nonfinite": self.on_nonfinite}


class Moments(AQRMethod):
    """Per-channel mean/std matching onto the measured source moments; no weights are updated."""

    name = "moments"
    Config = MomentsConfig
    uses_quantile_map = False  # an affine map: no fast path of AQR's (its statistics, though)
