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
from dataclasses import dataclass

from aqr.adapt import AQRConfig
from aqr.core.points import OUTPUT

from .aqr_method import AQRMethod
from .declaration import Needs, method


@dataclass(frozen=True)
class MomentsConfig:
    """Options of the ``"moments"`` method.

    The statistics are supplied beside the options (AQR's file from :func:`aqr.calibrate`; its ``mean``/``std``).

    Attributes:
        layers: as :class:`aqr.AQRConfig` ``layers``: ``"all"``, ``"top-half"``, ``"bottom-half"`` or names.
        on_nonfinite: ``"raise"`` or ``"skip"`` a layer whose batch has NaN/Inf values.
    """

    layers: str | Sequence[str] | None = None
    on_nonfinite: str = "raise"

    def aqr_config(self) -> AQRConfig:
        """The :class:`aqr.AQRConfig` that makes :class:`aqr.AQR` the moment-matching control."""
        return AQRConfig(match="moments", layers=self.layers, on_nonfinite=self.on_nonfinite)


# an affine map: AQR's statistics, but none of its quantile map's fast path (maps_quantiles stays off)
@method("moments", MomentsConfig, needs=Needs(stats=OUTPUT), stateless=True)
class Moments(AQRMethod):
    """Per-channel mean/std matching onto the measured source moments; no weights are updated."""
