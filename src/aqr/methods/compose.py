"""AQR composed with the field's methods: ``aqr+tent``, ``aqr+eta``, ``aqr+roid`` and ``aqr+lame``.

The gradient methods (TENT, ETA, ROID) train the affine weight and bias of the normalization layers;
AQR maps each channel onto the source quantiles. Mapping the layer's *output*, as ``aqr`` does,
would undo the affine update (whatever weight and bias do, the output is sent back onto the source
quantiles). So in ``aqr+tent``, ``aqr+eta`` and ``aqr+roid`` the map sits *before* the affine step:
each selected layer computes ``weight * map(x_hat) + bias``, ``x_hat`` its normalized values (a
BatchNorm on batch statistics, as the gradient method sets it), ``map`` AQR's quantile map onto the
source quantiles of ``x_hat``, and the gradient method owns and trains ``weight`` and ``bias``
(:mod:`aqr.adapt.pre_affine`). Before the first update this is exactly ``aqr``'s output (the map of a
channel does not change under a positive scale and shift of its input); afterwards the update acts
on top of the recalibrated values.

Gradients pass through the maps of later layers by each map's segment slopes, the knots held constant
(:mod:`aqr.core.qmap_grad`); the map's value always comes from AQR's own path (C kernels, Triton,
streaming kernels), which runs alone where no gradient is needed.

Statistics: these three read the normalized values before the affine step, so they need statistics
taken there, ``aqr.calibrate(model, data, point="pre-affine")``; a benchmark cell computes and caches
them under their own key (``point`` joins the statistics options for these methods) and they refuse
statistics of the output point (and ``aqr`` refuses theirs).

``aqr+lame``: LAME corrects the outputs (the logits, by the features' affinities) and changes no
weight, so it composes with AQR as it is: the model recalibrated by ``aqr`` on the layers' outputs
(statistics of the output point, the ones ``aqr`` uses), LAME on its features and logits.

Options: every option of AQR (the fields of :class:`aqr.AQRConfig`: ``target``, ``tail``, ``layers``,
...) and every option of the partner method (``lr``, ``defaults``, ...) are given flat, side by side
(``aqr+tent:target=stream,lr=1e-4``); no name belongs to both. The compositions differ from their two
parts in two defaults only: ``on_nonfinite="skip"`` (a NaN/Inf layer output is left unmapped for that
batch, so non-finite images go where the partner alone sends them), and the gradient compositions
refuse ``match="moments"`` and ``passes=2``.
"""

from __future__ import annotations

import warnings
from dataclasses import MISSING, field, fields, make_dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from aqr.adapt import AQR, AQRConfig
from aqr.adapt.pre_affine import PreAffineAQR
from aqr.core.points import OUTPUT, PRE_AFFINE
from aqr.core.stats import SourceStats

from .eata import ETA, ETAConfig
from .lame import LAME, LAMEConfig
from .roid import ROID, ROIDConfig
from .tent import Tent, TentConfig

#: AQR's options whose default differs in a composition
COMPOSED_DEFAULTS: dict[str, Any] = {"on_nonfinite": "skip"}


def aqr_options(config: Any) -> dict[str, Any]:
    """The :class:`aqr.AQRConfig` fields of a composed config, as keyword options of :class:`aqr.AQR`."""
    return {f.name: getattr(config, f.name) for f in fields(AQRConfig)}


def composed_config(partner: type, name: str, pre_affine: bool) -> type:
    """A frozen dataclass with the partner config's fields (it subclasses ``partner``, so the partner's
    code reads it as its own), every field of :class:`aqr.AQRConfig` and ``stats``; built, it checks both
    parts (``pre_affine``: and refuses what AQR before the affine step does not take)."""
    own = {f.name for f in fields(partner)}
    clash = sorted(own & {f.name for f in fields(AQRConfig)} | own & {"stats"})
    if clash:
        raise TypeError(f"{partner.__name__} and AQRConfig both have the options {clash}: a composition needs "
                        "distinct names")
    added = []
    for f in fields(AQRConfig):
        default = COMPOSED_DEFAULTS.get(f.name, f.default)
        if default is MISSING:
            raise TypeError(f"AQRConfig.{f.name} has no default")
        added.append((f.name, f.type, field(default=default)))
    added.append(("stats", "SourceStats | None", field(default=None, repr=False)))

    def __post_init__(self: Any) -> None:
        check = getattr(partner, "__post_init__", None)
        if check is not None:
            check(self)
        AQRConfig(**aqr_options(self))  # raises ValueError naming a bad AQR option
        if pre_affine and self.match != "quantiles":
            raise ValueError(f"match={self.match!r}: {name} maps quantiles before the affine step (match='quantiles')")
        if pre_affine and self.passes != 1:
            raise ValueError(f"passes={self.passes}: {name} maps each batch in one pass")

    doc = (f"Options of ``{name}``: the partner's (:class:`{partner.__module__}.{partner.__name__}`), every field "
           f"of :class:`aqr.AQRConfig` (``on_nonfinite`` defaults to ``'skip'``) and ``stats``, the "
           ":class:`aqr.SourceStats` from :func:`aqr.calibrate`.")
    return make_dataclass(f"AQR{partner.__name__}", added, bases=(partner,), frozen=True,
                          namespace={"__post_init__": __post_init__, "__doc__": doc,
                                     "aqr_config": lambda self: AQRConfig(**aqr_options(self))})


AQRTentConfig = composed_config(TentConfig, "aqr+tent", True)
AQRETAConfig = composed_config(ETAConfig, "aqr+eta", True)
AQRROIDConfig = composed_config(ROIDConfig, "aqr+roid", True)
AQRLAMEConfig = composed_config(LAMEConfig, "aqr+lame", False)
for _config in (AQRTentConfig, AQRETAConfig, AQRROIDConfig, AQRLAMEConfig):
    _config.__module__ = __name__


def _needs_stats(name: str, options: dict[str, Any]) -> None:
    if options.get("stats") is None:
        raise TypeError(f"the {name!r} method needs stats= (from aqr.calibrate)")


def _warn_episodic_stream(method: Any, config: AQRConfig) -> None:
    if method.protocol.episodic and config.target_kind.keeps_state:
        warnings.warn(f"{method.name}:target={config.target} keeps a running estimate across batches, but the "
                      "episodic protocol restarts it before every batch; use protocol='online'",
                      UserWarning, stacklevel=4)


class PreAffineComposition:
    """Mixin of ``aqr+tent``, ``aqr+eta`` and ``aqr+roid``: AQR's maps before the affine step of the copy's
    normalization layers, whose affine parameters the partner method (the next base class) trains."""

    needs_stats: ClassVar[bool] = True
    #: where the statistics are read (:mod:`aqr.core.points`); a benchmark cell's statistics are keyed by it
    stats_point: ClassVar[str] = PRE_AFFINE
    #: the method maps with AQR's quantile map: its cells' keys carry the fast path's version
    uses_quantile_map: ClassVar[bool] = True

    @classmethod
    def from_options(cls, **options: Any) -> Any:
        _needs_stats(cls.name, options)  # type: ignore[attr-defined]
        return super().from_options(**options)  # type: ignore[misc]

    def configure_model(self, model: nn.Module) -> nn.Module:
        stats: SourceStats = self.config.stats  # type: ignore[attr-defined]
        if stats is None:
            raise TypeError(f"the {self.name!r} method needs stats= (from aqr.calibrate)")  # type: ignore[attr-defined]
        stats.check_point(PRE_AFFINE, f"the {self.name!r} method")  # type: ignore[attr-defined]
        stats.check_model(model)  # before the partner changes the copy's BatchNorms (no running statistics)
        config = self.config.aqr_config()  # type: ignore[attr-defined]
        _warn_episodic_stream(self, config)
        model = super().configure_model(model)  # type: ignore[misc]
        self.aqr = PreAffineAQR(model, stats, config)
        return model

    def reset_extra_state(self) -> None:
        super().reset_extra_state()  # type: ignore[misc]
        self.aqr.reset()

    def predict_held(self, x: torch.Tensor) -> torch.Tensor:
        """The partner's held prediction (its current affine weights) over what the maps hold: a streaming
        target's committed state, no map for a per-batch target; nothing is staged or committed."""
        with self.aqr.held():
            return super().predict_held(x)  # type: ignore[misc]

    def loss(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor | None:
        """The partner's loss; its auxiliary forward passes (ROID's augmented images) leave AQR's stream alone."""
        with self.aqr.frozen():
            return super().loss(x, logits)  # type: ignore[misc]


class AQRTent(PreAffineComposition, Tent):
    """TENT on top of AQR: the map before each normalization layer's affine step, TENT training the
    affine weight and bias by entropy minimization (see the module docs; statistics at
    ``point="pre-affine"``; gradients through later maps by their segment slopes)."""

    name = "aqr+tent"
    Config = AQRTentConfig


class AQRETA(PreAffineComposition, ETA):
    """ETA on top of AQR: the map before each normalization layer's affine step, ETA training the
    affine weight and bias on its reliable, non-redundant images (see the module docs; statistics at
    ``point="pre-affine"``; gradients through later maps by their segment slopes)."""

    name = "aqr+eta"
    Config = AQRETAConfig


class AQRROID(PreAffineComposition, ROID):
    """ROID on top of AQR: the map before each normalization layer's affine step, ROID training the
    affine weight and bias (weighting, consistency, weight ensembling, prior correction of the output;
    see the module docs; statistics at ``point="pre-affine"``; gradients through later maps by their
    segment slopes; the augmented images of the consistency loss do not enter AQR's stream)."""

    name = "aqr+roid"
    Config = AQRROIDConfig


class AQRLAME(LAME):
    """LAME on the outputs of the AQR-recalibrated model: :class:`aqr.AQR` maps the normalization
    layers' outputs (statistics at the output point, as ``aqr``), LAME corrects the logits with the
    affinities of the features it gives. No weight changes; no gradient."""

    name = "aqr+lame"
    Config = AQRLAMEConfig
    needs_stats: ClassVar[bool] = True
    stats_point: ClassVar[str] = OUTPUT
    uses_quantile_map: ClassVar[bool] = True

    @classmethod
    def from_options(cls, defaults: str = "cifar10", **options: Any) -> Any:
        """The config from LAME's preset ``defaults`` and ``options`` (AQR's and LAME's, side by side)."""
        _needs_stats(cls.name, options)
        return super().from_options(defaults=defaults, **options)

    def configure_model(self, model: nn.Module) -> nn.Module:
        if self.config.stats is None:
            raise TypeError(f"the {self.name!r} method needs stats= (from aqr.calibrate)")
        config = self.config.aqr_config()
        _warn_episodic_stream(self, config)
        model = super().configure_model(model)  # LAME's hook on the feature layer, which AQR's twin shares
        self.adapter = AQR(model, self.config.stats, **aqr_options(self.config))
        return model

    def logits_of(self, x: torch.Tensor) -> torch.Tensor:
        return self.adapter(x)

    @property
    def holds_state(self) -> bool:
        """Online with a streaming target, AQR's running state carries over (LAME itself keeps nothing)."""
        return not self.protocol.episodic and self.config.aqr_config().target_kind.keeps_state

    def predict_held(self, x: torch.Tensor) -> torch.Tensor:
        """AQR's held prediction (its committed running state); LAME's correction is per-batch work."""
        return self.adapter.forward_held(x)

    def source_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The user's model: AQR's plain twin of the copy (the copy itself carries AQR's hooks)."""
        from aqr.core.twin import structural_twin

        with torch.no_grad():
            return structural_twin(self.model)(x)

    def reset_extra_state(self) -> None:
        super().reset_extra_state()
        self.adapter.reset()
