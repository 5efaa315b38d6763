"""Test-time adaptation methods behind one interface: source, TTN, TENT, SAR, AQR, its control (moments), RBN,
bn-ema, and the field's ETA/EATA, ROID, DeYO, CoTTA, RoTTA and LAME as in the test-time-adaptation
benchmark code.

>>> method = create("tent", model)              # online (the default): adapts across batches
>>> method = create("tent", model, protocol="episodic")  # the AQR paper's protocol: reset before every batch
>>> plan("tent", {"lr": 1e-3}).config           # the checked config, without a model
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
>>> method = create("aqr:target=stream", model, stats=stats)  # a spec in the bench's method syntax
>>> method = create(RECOMMENDED["offline"], model, stats=stats)  # when you do not know your stream

``create`` deep-copies ``model``; the user's model is never modified. Options are the fields of
:class:`ProtocolConfig` (``protocol``, ``steps``, ``seed``) plus the method's own config dataclass
(``plan(name).config``), and ``defaults="cifar10"`` or ``"imagenet"``, the reference's option sets, for the
methods that have them (other options override them). The compositions ``aqr+tent``, ``aqr+eta``, ``aqr+roid`` and ``aqr+lame`` take AQR's options and their
partner's side by side (:mod:`aqr.methods.compose`; the first three need statistics taken before the
affine step, ``aqr.calibrate(..., point="pre-affine")``, the point they declare).
Every method is declared once, in its own file, by ``@method(name, Config, defaults=..., needs=...)``
(:mod:`aqr.methods.declaration`): :func:`declaration` reads it (what a caller must supply: ``needs.stats``,
the point where its statistics are taken, for AQR, moments and the compositions; ``needs.batch_size`` for
TENT and SAR; ``needs.source`` for EATA), and :func:`plan` checks options against it without a model.
:func:`create` and :func:`plan` also take a method as ``aqr bench --methods`` spells it, ``"aqr:target=stream"``
(:func:`~aqr.methods.declaration.parse_spec`); an option may be set in the spec or as a keyword, not both.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from torch import nn

# Importing a method's module registers it (its @method declaration); the order here is the order of available().
from . import source, ttn, tent, sar, aqr_method, moments, rbn, bn_ema, eata, roid, deyo, cotta, rotta, lame  # noqa: F401
from . import unmixtns, rdumb  # noqa: F401
from . import compose  # noqa: F401  (after its partners)
from .aqr_method import AQRMethod, AQRMethodConfig
from .base import NotApplicable, ProtocolConfig, TTAMethod, softmax_entropy
from .bn_ema import BNEma, BNEmaConfig, EmaBatchNorm
from .compose import (AQRETA, AQRLAME, AQRROID, AQRETAConfig, AQRLAMEConfig, AQRROIDConfig, AQRTent,
                      AQRTentConfig)
from .cotta import CoTTA, CoTTAConfig
from .declaration import REGISTRY, MethodDeclaration, MethodPlan, Needs, method, parse_spec
from .deyo import DeYO, DeYOConfig
from .eata import EATA, ETA, EATAConfig, ETAConfig
from .lame import LAME, LAMEConfig
from .moments import Moments, MomentsConfig
from .rbn import RBN, RBNConfig, RobustBatchNorm
from .roid import ROID, ROIDConfig
from .rotta import RoTTA, RoTTAConfig
from .sar import FREEZE_RULES, SAR, SARConfig
from .source import Source
from .tent import Tent, TentConfig, default_lr, infer_arch
from .ttn import TTN
from .unmixtns import UnMixTNS, UnMixTNSConfig
from .rdumb import RDumb, RDumbConfig

#: The registered methods by name, a read-only view of the registry (:func:`declaration` for what each declares).
METHODS: Mapping[str, MethodDeclaration] = REGISTRY.view

RECOMMENDED: Mapping[str, str] = MappingProxyType({"offline": "aqr+roid:target=robust", "realtime": "aqr:target=mixed"})
"""What to pick when you do not know your stream: one AQR configuration per protocol, as a spec for
:func:`create` (``"offline"``: every batch adapted on; ``"realtime"``: the stream does not wait for the method).
Build its statistics as :func:`plan` says: ``aqr.calibrate(model, batches, point=plan(spec).stats_point,
descriptors=plan(spec).stats_descriptors)``.

Chosen by :func:`aqr.harness.report.field_target.choose_recommended` (the highest mean accuracy over every
setting and model of the ``field`` preset's seed-1 draw at batch 64: continual, correlated, mixed_domains and
mixed_domains_correlated on the BN and GN ResNet-20 and the ViT) on ``docs/results/field/recommend.db``, and a
test checks it against that database. The offline choice trains (ROID on AQR's robust target: a backward pass
per batch); the best gradient-free one there is ``"aqr:target=mixed"``, which runs on any device.
"""


def available() -> list[str]:
    """Names accepted by :func:`create`, in a fixed order."""
    return list(REGISTRY)


def declaration(name: str) -> MethodDeclaration:
    """What method ``name`` declares (class, config, option sets, needs); ``KeyError`` for an unknown name."""
    return REGISTRY[name]


def method_class(name: str) -> type[TTAMethod]:
    """The class of method ``name``; ``KeyError`` for an unknown name."""
    return REGISTRY[name].cls


def plan(name: str, options: Mapping[str, Any] | None = None, *, batch_size: int | None = None) -> MethodPlan:
    """Method ``name`` (or a spec, ``"aqr:target=stream"``) with ``options`` checked, without a model: its configs and what it needs
    (:class:`MethodPlan`). ``batch_size`` fills the option of a method that needs it. ``KeyError`` for an
    unknown method, ``TypeError`` for an option it does not take, ``ValueError`` for a value it refuses."""
    return REGISTRY.plan(name, options, batch_size=batch_size)


def create(name: str, model: nn.Module, *, stats: Any = None, source: Any = None,  # noqa: F811 (not the module)
           **options: Any) -> TTAMethod:
    """Build method ``name`` (a name, or a spec with options: ``"aqr:target=stream"``) around a private copy
    of ``model``.

    ``stats``: the :class:`aqr.SourceStats` of a method that needs them; ``source``: EATA's clean source
    images. Returns an ``nn.Module`` whose ``forward(x)`` gives the scored logits and whose ``reset()``
    restores the original state. The protocol is ``"online"`` (the method adapts across batches) unless
    ``protocol="episodic"`` (reset before every batch, the paper's tables) is given. Raises ``KeyError`` for an unknown name, ``TypeError`` for an unknown
    option, a missing ``stats``/``source`` or an option set both in the spec and as a keyword, ``ValueError`` for
    a malformed spec or a value the method refuses, and :class:`NotApplicable` when the method cannot run on this model.
    """
    return plan(name, options).build(model, stats=stats, source=source)


__all__ = [
    "METHODS",
    "MethodDeclaration",
    "MethodPlan",
    "Needs",
    "NotApplicable",
    "ProtocolConfig",
    "RECOMMENDED",
    "TTAMethod",
    "available",
    "create",
    "declaration",
    "method",
    "method_class",
    "parse_spec",
    "plan",
    "softmax_entropy",
]
