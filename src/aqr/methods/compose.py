"""AQR composed with the field's methods: ``aqr+tent``, ``aqr+eta``, ``aqr+roid`` and ``aqr+lame``.

The gradient methods (TENT, ETA, ROID) train the affine weight and bias of the normalization layers;
AQR maps each channel onto the source quantiles. Mapping the layer's *output*, as ``aqr`` does,
would undo the affine update (whatever weight and bias do, the output is sent back onto the source
quantiles). So in ``aqr+tent``, ``aqr+eta`` and ``aqr+roid`` the map sits *before* the affine step:
each selected layer computes ``weight * map(x_hat) + bias``, ``x_hat`` its normalized values (a
BatchNorm on batch statistics, as the gradient method sets it; ``aqr+roid`` keeps BatchNorm on its
source statistics, ``use_batch_statistics=False``: a batch normalized with its own statistics loses its
shift before the streaming targets' running state sees it, which costs 16 points on a class-correlated
stream, docs/compose.md), ``map`` AQR's quantile map onto the source quantiles of ``x_hat``, and the
gradient method owns and trains ``weight`` and ``bias`` (:mod:`aqr.adapt.pre_affine`). Before the first update this is exactly ``aqr``'s output (the map of a
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

from dataclasses import MISSING, field, fields, make_dataclass
from typing import Any

import torch
from torch import nn

from aqr.adapt import AQR, AQRConfig
from aqr.adapt.pre_affine import PreAffineAQR
from aqr.core.points import OUTPUT, PRE_AFFINE
from aqr.core.stats import SourceStats

from .aqr_method import aqr_keywords, warn_episodic_stream
from .declaration import Needs, method
from .eata import ETA, ETA_DEFAULTS, ETAConfig
from .lame import LAME, LAME_DEFAULTS, LAMEConfig
from .options import OPTIMIZER_DEFAULTS
from .roid import ROID, ROIDConfig
from .tent import TENT_DEFAULTS, Tent, TentConfig

#: AQR's options whose default differs in a composition
COMPOSED_DEFAULTS: dict[str, Any] = {"on_nonfinite": "skip"}

#: ``aqr+roid``'s partner options whose default differs from ROID's: BatchNorm keeps the source statistics
#: (the streaming targets' running state then sees each batch's own shift; see the module docs)
AQR_ROID_DEFAULTS: dict[str, Any] = {"use_batch_statistics": False}


def composed_config(partner: type, name: str, pre_affine: bool, partner_defaults: dict[str, Any] | None = None
                    ) -> type:
    """A frozen dataclass with the partner config's fields (it subclasses ``partner``, so the partner's
    code reads it as its own; ``partner_defaults`` replaces some of their defaults) and every field of
    :class:`aqr.AQRConfig`; built, it checks both parts (``pre_affine``: and refuses what AQR before the
    affine step does not take)."""
    own = {f.name for f in fields(partner)}
    unknown = sorted(set(partner_defaults or {}) - own)
    if unknown:
        raise TypeError(f"{partner.__name__} has no options {unknown}")
    clash = sorted(own & {f.name for f in fields(AQRConfig)})
    if clash:
        raise TypeError(f"{partner.__name__} and AQRConfig both have the options {clash}: a composition needs "
                        "distinct names")
    added = [(f.name, f.type, field(default=(partner_defaults or {})[f.name]))
             for f in fields(partner) if f.name in (partner_defaults or {})]
    for f in fields(AQRConfig):
        default = COMPOSED_DEFAULTS.get(f.name, f.default)
        if default is MISSING:
            raise TypeError(f"AQRConfig.{f.name} has no default")
        added.append((f.name, f.type, field(default=default)))

    def __post_init__(self: Any) -> None:
        check = getattr(partner, "__post_init__", None)
        if check is not None:
            check(self)
        AQRConfig(**aqr_keywords(self))  # raises ValueError naming a bad AQR option
        if pre_affine and self.match != "quantiles":
            raise ValueError(f"match={self.match!r}: {name} maps quantiles before the affine step (match='quantiles')")
        if pre_affine and self.passes != 1:
            raise ValueError(f"passes={self.passes}: {name} maps each batch in one pass")

    changed = "".join(f", ``{k}`` to ``{v!r}``" for k, v in (partner_defaults or {}).items())
    doc = (f"Options of ``{name}``: the partner's (:class:`{partner.__module__}.{partner.__name__}`), every field "
           f"of :class:`aqr.AQRConfig` (``on_nonfinite`` defaults to ``'skip'``{changed}); the statistics are "
           "supplied beside them (``stats=``).")
    return make_dataclass(f"AQR{partner.__name__}", added, bases=(partner,), frozen=True,
                          namespace={"__post_init__": __post_init__, "__doc__": doc,
                                     "aqr_config": lambda self: AQRConfig(**aqr_keywords(self))})


AQRTentConfig = composed_config(TentConfig, "aqr+tent", True)
AQRETAConfig = composed_config(ETAConfig, "aqr+eta", True)
AQRROIDConfig = composed_config(ROIDConfig, "aqr+roid", True, AQR_ROID_DEFAULTS)
AQRLAMEConfig = composed_config(LAMEConfig, "aqr+lame", False)
for _config in (AQRTentConfig, AQRETAConfig, AQRROIDConfig, AQRLAMEConfig):
    _config.__module__ = __name__


class PreAffineComposition:
    """Mixin of ``aqr+tent``, ``aqr+eta`` and ``aqr+roid``: AQR's maps before the affine step of the copy's
    normalization layers, whose affine parameters the partner method (the next base class) trains.
    Declared with ``needs=Needs(stats=PRE_AFFINE)``: statistics taken before the affine step."""

    def configure_model(self, model: nn.Module) -> nn.Module:
        stats: SourceStats = self.stats  # type: ignore[attr-defined]
        stats.check_point(PRE_AFFINE, f"the {self.name!r} method")  # type: ignore[attr-defined]
        stats.check_model(model)  # before the partner changes the copy's BatchNorms (no running statistics)
        config = self.config.aqr_config()  # type: ignore[attr-defined]
        warn_episodic_stream(self, config)  # type: ignore[arg-type]
        model = super().configure_model(model)  # type: ignore[misc]
        self.aqr = PreAffineAQR(model, stats, config)
        return model

    def reset_extra_state(self) -> None:
        super().reset_extra_state()  # type: ignore[misc]
        self.aqr.reset()

    def carried_state(self) -> dict[str, Any]:
        """The partner's carried state and AQR's running state (a streaming target's; ``None`` for batches)."""
        return {**super().carried_state(), "aqr_running_state": self.aqr.running_record()}  # type: ignore[misc]

    def load_carried_state(self, state: dict[str, Any]) -> None:
        state = dict(state)
        self.aqr.load_running_record(state.pop("aqr_running_state"))  # checked before the partner's part is set
        super().load_carried_state(state)  # type: ignore[misc]

    def predict_held(self, x: torch.Tensor) -> torch.Tensor:
        """The partner's held prediction (its current affine weights) over what the maps hold: a streaming
        target's committed state, no map for a per-batch target; nothing is staged or committed."""
        with self.aqr.held():
            return super().predict_held(x)  # type: ignore[misc]

    def predict_window(self, window: torch.Tensor) -> torch.Tensor:
        """Between the sliding window's steps: the partner's held prediction (its current affine weights) with
        the per-batch target mapping the window by its own quantiles, as the window's step does (:meth:`predict_held`
        maps nothing for a per-batch target); a streaming target maps with its committed state (:meth:`predict_held`)."""
        if self.holds_state and self.aqr.batch is None:  # type: ignore[attr-defined]
            return super().predict_held(window)  # type: ignore[misc]
        return super().predict_window(window)  # type: ignore[misc]

    def loss(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor | None:
        """The partner's loss; its auxiliary forward passes (ROID's augmented images) leave AQR's stream alone."""
        with self.aqr.frozen():
            return super().loss(x, logits)  # type: ignore[misc]


@method("aqr+tent", AQRTentConfig, defaults=TENT_DEFAULTS, needs=Needs(stats=PRE_AFFINE, batch_size=True),
        maps_quantiles=True)
class AQRTent(PreAffineComposition, Tent):
    """TENT on top of AQR: the map before each normalization layer's affine step, TENT training the
    affine weight and bias by entropy minimization (see the module docs; statistics at
    ``point="pre-affine"``; gradients through later maps by their segment slopes)."""


@method("aqr+eta", AQRETAConfig, defaults=ETA_DEFAULTS, needs=Needs(stats=PRE_AFFINE), maps_quantiles=True)
class AQRETA(PreAffineComposition, ETA):
    """ETA on top of AQR: the map before each normalization layer's affine step, ETA training the
    affine weight and bias on its reliable, non-redundant images (see the module docs; statistics at
    ``point="pre-affine"``; gradients through later maps by their segment slopes)."""


@method("aqr+roid", AQRROIDConfig, defaults=OPTIMIZER_DEFAULTS, needs=Needs(stats=PRE_AFFINE),
        maps_quantiles=True)
class AQRROID(PreAffineComposition, ROID):
    """ROID on top of AQR: the map before each normalization layer's affine step, ROID training the
    affine weight and bias (weighting, consistency, weight ensembling, prior correction of the output;
    see the module docs; statistics at ``point="pre-affine"``; gradients through later maps by their
    segment slopes; the augmented images of the consistency loss do not enter AQR's stream)."""


@method("aqr+lame", AQRLAMEConfig, defaults=LAME_DEFAULTS, needs=Needs(stats=OUTPUT), maps_quantiles=True)
class AQRLAME(LAME):
    """LAME on the outputs of the AQR-recalibrated model: :class:`aqr.AQR` maps the normalization
    layers' outputs (statistics at the output point, as ``aqr``), LAME corrects the logits with the
    affinities of the features it gives. No weight changes; no gradient."""

    def configure_model(self, model: nn.Module) -> nn.Module:
        config = self.config.aqr_config()
        warn_episodic_stream(self, config)
        model = super().configure_model(model)  # LAME's hook on the feature layer, which AQR's twin shares
        self.aqr = AQR(model, self.stats, **aqr_keywords(config))
        return model

    def logits_of(self, x: torch.Tensor) -> torch.Tensor:
        return self.aqr(x)

    @property
    def holds_state(self) -> bool:
        """Online with a streaming target, AQR's running state carries over (LAME itself keeps nothing)."""
        return not self.protocol.episodic and self.config.aqr_config().target_kind.keeps_state

    def predict_held(self, x: torch.Tensor) -> torch.Tensor:
        """AQR's held prediction (its committed running state); LAME's correction is per-batch work."""
        return self.aqr.forward_held(x)

    def source_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The user's model: AQR's plain twin of the copy (the copy itself carries AQR's hooks)."""
        from aqr.core.twin import structural_twin

        with torch.no_grad():
            return structural_twin(self.model)(x)

    def reset_extra_state(self) -> None:
        super().reset_extra_state()
        self.aqr.reset()
