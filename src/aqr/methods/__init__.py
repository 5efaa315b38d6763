"""Test-time adaptation methods behind one interface: source, TTN, TENT, SAR, AQR, its control (moments), RBN,
bn-ema, and the field's ETA/EATA, ROID, DeYO, CoTTA, RoTTA and LAME as in the test-time-adaptation
benchmark code.

>>> method = create("tent", model)              # episodic, the AQR paper's protocol
>>> logits = method(x)                          # scored logits for batch x
>>> method = create("sar", model, protocol="online", lr=1e-3)
>>> method = create("aqr", model, stats=stats)  # stats from aqr.calibrate
>>> method = create("moments", model, stats=stats)  # AQR's control: mean/std onto the source's
>>> method = create("rbn", model, protocol="online")  # RoTTA's robust BatchNorm, for streams
>>> method = create("bn-ema", model, protocol="online")  # BatchNorm on EMA statistics of the stream
>>> method = create("eata", model, protocol="online", source=clean_images)  # Fisher from source images
>>> method = create("roid", model, protocol="online", defaults="imagenet")  # the ImageNet-C preset
>>> method = create("cotta", model, protocol="online")  # mean teacher, augmentation averaging, stochastic restore
>>> method = create("rotta", model, protocol="online", defaults="imagenet")  # RBN + balanced memory + teacher
>>> method = create("lame", model)              # Laplacian-regularized output correction, no weight update
>>> method = create("aqr+tent", model, stats=pre_affine_stats, protocol="online")  # AQR's map before TENT's affine
>>> method = create("aqr+lame", model, stats=stats, target="stream")  # LAME on the AQR-recalibrated outputs

``create`` deep-copies ``model``; the user's model is never modified. Options are the fields of
:class:`ProtocolConfig` (``protocol``, ``steps``, ``seed``) plus the method's own config dataclass
(``TentConfig``, ``SARConfig``, ``AQRMethodConfig``, ``MomentsConfig``, ``RBNConfig``, ``BNEmaConfig``,
``ETAConfig``, ``EATAConfig``, ``ROIDConfig``, ``DeYOConfig``, ``CoTTAConfig``, ``RoTTAConfig``, ``LAMEConfig``;
the field's methods also take ``defaults="cifar10"`` or ``"imagenet"``, the reference's presets, which other
options override). The compositions ``aqr+tent``, ``aqr+eta``, ``aqr+roid`` and ``aqr+lame`` take AQR's options and their
partner's side by side (:mod:`aqr.methods.compose`; the first three need statistics taken before the
affine step, ``aqr.calibrate(..., point="pre-affine")``, their ``stats_point``).
A method class declares what a caller must supply: ``needs_stats`` (AQR, moments, the compositions),
``needs_batch_size`` (TENT, SAR) and ``needs_source`` (EATA); see :func:`method_class`.
"""

from __future__ import annotations

from dataclasses import fields
from types import MappingProxyType
from typing import Any, Mapping

from torch import nn

from .aqr_method import AQRMethod, AQRMethodConfig
from .base import NotApplicable, ProtocolConfig, TTAMethod, softmax_entropy
from .bn_ema import BNEma, BNEmaConfig, EmaBatchNorm
from .compose import (AQRETA, AQRLAME, AQRROID, AQRETAConfig, AQRLAMEConfig, AQRROIDConfig, AQRTent,
                      AQRTentConfig)
from .cotta import COTTA_PRESETS, CoTTA, CoTTAConfig
from .deyo import DeYO, DeYOConfig
from .eata import EATA, ETA, EATAConfig, ETAConfig
from .lame import LAME, LAMEConfig
from .moments import Moments, MomentsConfig
from .rbn import RBN, RBNConfig, RobustBatchNorm
from .roid import ROID, ROIDConfig
from .rotta import RoTTA, RoTTAConfig
from .sar import FREEZE_PRESETS, SAR, SARConfig
from .source import Source
from .tent import Tent, TentConfig, default_lr, infer_arch
from .ttn import TTN

METHODS: Mapping[str, type[TTAMethod]] = MappingProxyType(
    {cls.name: cls for cls in (Source, TTN, Tent, SAR, AQRMethod, Moments, RBN, BNEma, ETA, EATA, ROID, DeYO, CoTTA,
                               RoTTA, LAME, AQRTent, AQRETA, AQRROID, AQRLAME)}
)

_PROTOCOL_KEYS = frozenset(f.name for f in fields(ProtocolConfig))


def available() -> list[str]:
    """Names accepted by :func:`create`, in a fixed order."""
    return list(METHODS)


def method_class(name: str) -> type[TTAMethod]:
    """The class of method ``name`` (read its ``needs_*`` declarations); ``KeyError`` for an unknown name."""
    try:
        return METHODS[name]
    except KeyError:
        raise KeyError(f"unknown method {name!r}; available: {', '.join(METHODS)}") from None


def create(name: str, model: nn.Module, **options: Any) -> TTAMethod:
    """Build method ``name`` around a private copy of ``model``.

    Returns an ``nn.Module`` whose ``forward(x)`` gives the scored logits and whose ``reset()``
    restores the original state. Raises ``KeyError`` for an unknown name, ``TypeError`` for an
    unknown option and :class:`NotApplicable` when the method cannot run on this model.
    """
    cls = method_class(name)
    protocol = ProtocolConfig(**{k: v for k, v in options.items() if k in _PROTOCOL_KEYS})
    config = cls.from_options(**{k: v for k, v in options.items() if k not in _PROTOCOL_KEYS})
    return cls(model, config, protocol)


__all__ = [
    "AQRETA",
    "AQRETAConfig",
    "AQRLAME",
    "AQRLAMEConfig",
    "AQRROID",
    "AQRROIDConfig",
    "AQRTent",
    "AQRTentConfig",
    "AQRMethod",
    "AQRMethodConfig",
    "BNEma",
    "BNEmaConfig",
    "COTTA_PRESETS",
    "CoTTA",
    "CoTTAConfig",
    "DeYO",
    "DeYOConfig",
    "EATA",
    "EATAConfig",
    "ETA",
    "ETAConfig",
    "EmaBatchNorm",
    "FREEZE_PRESETS",
    "LAME",
    "LAMEConfig",
    "METHODS",
    "Moments",
    "MomentsConfig",
    "NotApplicable",
    "ProtocolConfig",
    "RBN",
    "RBNConfig",
    "ROID",
    "ROIDConfig",
    "RoTTA",
    "RoTTAConfig",
    "RobustBatchNorm",
    "SAR",
    "SARConfig",
    "Source",
    "TTAMethod",
    "TTN",
    "Tent",
    "TentConfig",
    "available",
    "create",
    "default_lr",
    "infer_arch",
    "method_class",
    "softmax_entropy",
]
