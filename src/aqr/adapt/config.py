"""What :class:`aqr.AQR` is asked to do: :class:`AQRConfig`, and the :class:`Target` each value of its
``target`` stands for.

``AQRConfig.target`` is the string the user gives (``"batch"``, ``"stream"``, ``"robust"``; benchmark
cells are keyed by it). The code asks the :class:`Target` it names instead of comparing strings:
whether the recalibration keeps a state across batches, whether that state takes each image's
predicted class, which tails and options it allows. Which running state each layer keeps, and how one
batch weighs its own histogram against it, the stream package works out from the config
(:mod:`aqr.adapt.stream.build`): this module imports nothing of it.

Each option is declared once, as a field of :class:`AQRConfig` whose metadata names its group; the
group views (:class:`BatchOptions`, :class:`StreamOptions`, :class:`RobustOptions`), the lists of the
options a target refuses and the stream's settings (:class:`aqr.adapt.stream.running.StreamSettings`,
:class:`aqr.adapt.stream.robust.RobustSettings`, which check their values with the checks here) are
derived from those fields.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, ClassVar

from aqr.backends.subsets import MAX_SAMPLES as MAX_TARGET_SAMPLES
from aqr.core.qmap import DEFAULT_GAUSSIAN_P, check_tail
from aqr.core.stats import SOURCE_MOMENTS

# The groups of options, each named after the target whose view checks it (BatchOptions: every target's)
BATCH, STREAM, ROBUST, MIXED = "batch", "stream", "robust", "mixed"
GROUP = "group"  # the metadata key of an AQRConfig field that names its group


def option(default: Any, group: str) -> Any:
    """An :class:`AQRConfig` field: its default and its group (the one place an option is declared)."""
    return field(default=default, metadata={GROUP: group})


def options_of(group: str) -> tuple[str, ...]:
    """The names of the options of ``group``, in :class:`AQRConfig`'s order."""
    return tuple(f.name for f in fields(AQRConfig) if f.metadata.get(GROUP) == group)


def stream_options() -> tuple[str, ...]:
    """The options only the running targets (``"stream"``, ``"robust"``) read."""
    return options_of(STREAM)


def robust_options() -> tuple[str, ...]:
    """The options only ``target="robust"`` reads (``passes`` is left out: each target lists the passes it
    takes)."""
    return tuple(name for name in options_of(ROBUST) if name != "passes")


def mixed_options() -> tuple[str, ...]:
    """The options only ``target="mixed"`` reads."""
    return options_of(MIXED)


# ---------------------------------------------------------------------- the running options' checks
# Checked here for AQRConfig and by the stream's settings classes for their own values (the same
# messages either way).

ESTIMATORS = ("cdf-ema", "knot-ema")
MAX_STREAM_COUNT = 1 << 20  # the most images (or cells) of a stream's window, group or table
MAX_GROUPS = 4096


def check_estimator(estimator: object) -> None:
    """Raise ``ValueError`` unless ``estimator`` names a running estimator."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; expected one of {', '.join(ESTIMATORS)}")


def check_horizon(horizon: object) -> None:
    """Raise ``ValueError`` unless ``horizon`` is a finite number of images >= 1."""
    if not (isinstance(horizon, (int, float)) and math.isfinite(horizon) and horizon >= 1):
        raise ValueError(f"horizon must be a number of images >= 1, got {horizon!r}")


def check_stream_count(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` (the stream's setting ``name``) is an integer in
    ``[1, MAX_STREAM_COUNT]``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_STREAM_COUNT:
        raise ValueError(f"{name} must be an integer in [1, {MAX_STREAM_COUNT}], got {value!r}")


def check_groups(groups: object) -> None:
    """Raise ``ValueError`` unless ``groups`` is an integer in ``[1, MAX_GROUPS]``."""
    if isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= MAX_GROUPS:
        raise ValueError(f"groups must be an integer in [1, {MAX_GROUPS}], got {groups!r}")


def check_images(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` (the horizon ``name``) is a finite number of images >= 1."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 1 <= value < float("inf"):
        raise ValueError(f"{name} must be a number of images >= 1, got {value!r}")


MAX_COMPONENTS = 64


def check_components(components: object) -> None:
    """Raise ``ValueError`` unless ``components`` is an integer in ``[1, MAX_COMPONENTS]``."""
    if (isinstance(components, bool) or not isinstance(components, int)
            or not 1 <= components <= MAX_COMPONENTS):
        raise ValueError(f"components must be an integer in [1, {MAX_COMPONENTS}], got {components!r}")


def check_blend(blend: object) -> None:
    """Raise ``ValueError`` unless ``blend`` is a number in ``[0, 1]``."""
    if isinstance(blend, bool) or not isinstance(blend, (int, float)) or not 0.0 <= blend <= 1.0:
        raise ValueError(f"blend must be a number in [0, 1], got {blend!r}")


def check_balance(balance: object) -> None:
    """Raise ``ValueError`` unless ``balance`` is a number in [0, 1]."""
    if isinstance(balance, bool) or not isinstance(balance, (int, float)) or not 0 <= balance <= 1:
        raise ValueError(f"balance must be a number in [0, 1], got {balance!r}")


def refuse_ignored(config: AQRConfig, names: tuple[str, ...], owner: str, target: str) -> None:
    """Raise ``ValueError`` where ``config`` sets one of ``names`` (options of ``owner`` only) to another
    value than its default: ``target`` would ignore it."""
    defaults = {f.name: f.default for f in fields(AQRConfig)}
    changed = [f"{name}={getattr(config, name)!r}" for name in names if getattr(config, name) != defaults[name]]
    if changed:
        raise ValueError(f"{', '.join(changed)}: {'options' if len(changed) > 1 else 'an option'} of "
                         f"{owner} only, which target={target!r} would ignore")


def config_from_options(options: dict[str, Any], owner: str) -> AQRConfig:
    """``AQRConfig(**options)``; an option it does not take is a ``TypeError`` naming the closest one."""
    taken = [f.name for f in fields(AQRConfig)]
    unknown = [key for key in options if key not in taken]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, taken, n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise TypeError(f"{owner} takes no option {', '.join(hints)}; its options are the fields of aqr.AQRConfig")
    return AQRConfig(**options)


class SmallBatchWarning(UserWarning):
    """A per-batch target (``target="batch"``) got a batch too small for its own quantiles
    (:attr:`Target.min_batch_images`); ``target="stream"`` is the one for small batches."""


class Target:
    """Per-batch AQR (``target="batch"``): each batch's target quantiles are its own; nothing is kept.

    The base of every target: the answers of a target that keeps no state.
    """

    name: ClassVar[str] = "batch"
    keeps_state: ClassVar[bool] = False  # a running state across batches: AQR serializes its calls, has reset()
    needs_classes: ClassVar[bool] = False  # the state takes each image's predicted class (the model returns logits)
    needs_descriptors: ClassVar[bool] = False  # the statistics hold the images' descriptors (descriptors=True)
    passes: ClassVar[tuple[int, ...]] = (1,)  # the forward passes per batch it allows
    # Below this many images a batch's own quantiles describe its images more than the shift: per-batch AQR
    # falls below the unadapted model at batch 4 (GN ResNet-20, ViT) and to ~10 % at batch 1, and is level
    # with the running targets from batch 16 on (docs/results/stream). A running target has no such floor.
    min_batch_images: ClassVar[int] = 16

    def small_batch_warning(self, images: int) -> str | None:
        """The warning for a batch of ``images`` images, too few for this target's quantiles; ``None``: enough."""
        if images >= self.min_batch_images:
            return None
        return (f"target={self.name!r} maps each batch with its own quantiles, and a batch of {images} image"
                f"{'' if images == 1 else 's'} is too small for them (below {self.min_batch_images} images it can "
                "fall below the unadapted model); for small batches and streams use target='stream' "
                "(target='robust' where classes come in runs). Shown once per wrapper.")

    def check(self, config: AQRConfig) -> None:
        """Raise ``ValueError`` for an option of ``config`` this target does not take."""
        if config.passes not in self.passes:
            raise ValueError(f"passes={config.passes} is not an option of target={self.name!r} (it takes "
                             f"{' or '.join(map(str, self.passes))})")
        self.check_stream_options(config)
        self.check_robust_options(config)
        self.check_mixed_options(config)

    def check_stream_options(self, config: AQRConfig) -> None:
        """Raise ``ValueError`` where ``config`` sets an option of the running targets to another value than
        its default: this target keeps no running estimate and would ignore it."""
        refuse_ignored(config, stream_options(), "target='stream' and 'robust'", self.name)

    def check_robust_options(self, config: AQRConfig) -> None:
        """Raise ``ValueError`` where ``config`` sets an option of ``target="robust"`` alone to another value
        than its default: this target would ignore it."""
        refuse_ignored(config, robust_options(), "target='robust'", self.name)

    def check_mixed_options(self, config: AQRConfig) -> None:
        """Raise ``ValueError`` where ``config`` sets an option of ``target="mixed"`` alone to another value
        than its default: this target would ignore it."""
        refuse_ignored(config, mixed_options(), "target='mixed'", self.name)

    def describe(self, config: AQRConfig) -> str:
        """The target's part of :class:`aqr.AQR`'s ``repr``."""
        return ""


class StreamTarget(Target):
    """Streaming AQR (``target="stream"``): each layer maps with a running estimate of its target
    distribution across batches (:class:`aqr.adapt.stream.running.LayerStream`, which the stream package
    builds for this target)."""

    name: ClassVar[str] = "stream"
    keeps_state: ClassVar[bool] = True
    min_batch_images: ClassVar[int] = 1  # the running estimate maps a batch of one image
    tails: ClassVar[tuple[str, ...]] = ("standard", "average")  # those whose edge lines the stream's table holds (Eq. 1)

    def check(self, config: AQRConfig) -> None:
        super().check(config)
        if config.mode != "fast":
            raise ValueError(f"target={self.name!r} runs the fast path: mode='exact' is not available with it")
        if config.match != "quantiles":
            raise ValueError(f"target={self.name!r} maps running quantiles: match='moments' has no streaming form yet")

    def check_stream_options(self, config: AQRConfig) -> None:
        """Its own options: nothing to refuse."""

    def check_tail(self, tail: str) -> None:
        """Raise ``ValueError`` unless the running state can map with the tail strategy ``tail``."""
        if tail not in self.tails:
            raise ValueError(f"target={self.name!r} maps with the tail strategies {' or '.join(self.tails)} (Eq. 1 "
                             f"at the running ends), not {tail!r}")

    def uses_group_sources(self, config: AQRConfig) -> bool:
        """Whether each layer maps onto its groups' own source knots (statistics calibrated with groups)."""
        return False

    def describe(self, config: AQRConfig) -> str:
        return f", target={self.name!r}, estimator={config.estimator!r}, horizon={config.horizon:g}"


class RobustTarget(StreamTarget):
    """Class-balanced streaming AQR (``target="robust"``): while the predicted classes come in runs, a
    mixture of running estimates per group of predicted classes
    (:class:`aqr.adapt.stream.robust.RobustLayerStream`)."""

    name: ClassVar[str] = "robust"
    needs_classes: ClassVar[bool] = True
    passes: ClassVar[tuple[int, ...]] = (1, 2)

    def uses_group_sources(self, config: AQRConfig) -> bool:
        return config.balance < 1

    def check_robust_options(self, config: AQRConfig) -> None:
        """Its own options: nothing to refuse."""

    def describe(self, config: AQRConfig) -> str:
        text = f", target={self.name!r}, groups={config.groups}, class_horizon={config.class_horizon:g}"
        text += "" if config.own_batch else ", own_batch=False"
        return text + (f", balance={config.balance:g}, recent_horizon={config.recent_horizon:g}"
                       if config.balance < 1 else "")


class MixedTarget(StreamTarget):
    """Streaming AQR for streams that mix domains (``target="mixed"``): per layer robust AQR's class-balanced
    running state of every image (:class:`RobustTarget`'s, so classes that come in runs are handled as there)
    and ``components`` running estimates more, one per cluster of the images' statistics at the first layers;
    each image mapped with a blend of the two (:mod:`aqr.adapt.stream.mixed`). Needs statistics calibrated with
    ``descriptors=True``.

    The clusters group images by their domain before the forward pass reaches the logits, robust AQR's groups
    by their predicted class after it. The two groupings are not nested (that would multiply the state): the
    clusters' part of the map fades as the predicted classes come in runs (``blend`` times ``1 - runs``), since a
    cluster's running estimate of a run of one class holds its content. With ``blend=0`` it is ``"robust"``,
    value for value."""

    name: ClassVar[str] = "mixed"
    needs_classes: ClassVar[bool] = True
    needs_descriptors: ClassVar[bool] = True

    def check_robust_options(self, config: AQRConfig) -> None:
        """Robust AQR's options are its own, save ``balance < 1``: its clusters map onto the layer's source knots,
        so the shared state maps onto them too."""
        if config.balance < 1:
            raise ValueError(f"target='mixed' maps every image onto the layer's source knots: balance={config.balance:g}"
                             " (the groups' own source knots) is not supported with it")

    def check_mixed_options(self, config: AQRConfig) -> None:
        """Its own options: nothing to refuse; its clusters' states count their images' histograms, the
        ``"cdf-ema"`` estimator's input, so ``"knot-ema"`` is refused."""
        if config.estimator != "cdf-ema":
            raise ValueError(f"target='mixed' averages its clusters' CDFs (estimator='cdf-ema'); "
                             f"estimator={config.estimator!r} is not supported with it")

    def describe(self, config: AQRConfig) -> str:
        return (super().describe(config) + f", groups={config.groups}, class_horizon={config.class_horizon:g}"
                + ("" if config.own_batch else ", own_batch=False")
                + f", components={config.components}, blend={config.blend:g}")


TARGET_KINDS: dict[str, Target] = {kind.name: kind for kind in (Target(), StreamTarget(), RobustTarget(),
                                                                MixedTarget())}
TARGETS = tuple(TARGET_KINDS)
NONFINITE_POLICIES = ("raise", "skip")
MODES = ("fast", "exact")
MAX_GRID = 1 << 16  # cells per table; C * (grid + 2) indexes the tables in int32
MATCHES = ("quantiles", "moments")


@dataclass(frozen=True)
class AQRConfig:
    """How batches are recalibrated.

    Built from flat keyword options (``AQRConfig(horizon=64)``, as :class:`aqr.AQR` takes them) and read
    flat (``config.horizon``) or by group: ``config.batch`` (:class:`BatchOptions`, the map's options for
    every target), ``config.stream`` (:class:`StreamOptions`, the running estimate's) and
    ``config.robust`` (:class:`RobustOptions`, the class-balanced target's); :meth:`from_groups` builds
    one from groups.

    Attributes:
        tail: tail strategy (see :func:`aqr.quantile_map`); ``None`` uses the one stored in the stats.
        layers: ``"all"``, ``"top-half"``, ``"bottom-half"`` of the calibrated layers (forward order),
            or explicit names; ``None`` uses every calibrated layer.
        source_moments: ``"affine"`` (the layer's beta/gamma, the paper's choice) or ``"empirical"``
            (measured source mean/std) for the ``"gaussian"`` and ``"interval"`` tails.
        gaussian_p: level standing in for p0 (and 1 - p for p100) in the ``"gaussian"`` tail.
        on_nonfinite: ``"raise"`` (default) stops with an error naming the layer when a batch has
            NaN/Inf activations; ``"skip"`` leaves that layer's output untouched for that batch.
        mode: ``"fast"`` (default): inner target quantiles from a sample of the positions (see
            ``target_samples``) and a fused lookup-table map on a ``grid``-cell table (see
            :mod:`aqr.backends`); ``"exact"``: quantiles of every value and the exact piecewise-linear
            map of Eq. 1.
        target_samples: the fewest positions per layer sampled for the target quantiles in fast mode
            (every position when the layer has fewer).
        samples_per_row: beyond ``target_samples``, positions sampled per image of an ``(N, C, H, W)``
            output (per token of an ``(N, L, C)`` one), so the sample grows with the batch and the
            knots keep the batch size's precision (:class:`aqr.backends.SubsetCache`); 0 fixes the
            sample at ``target_samples``.
        grid: cells of the lookup table between the first and last inner knots in fast mode.
        compile: fuse the fast kernel with ``torch.compile`` (falls back to eager with a warning).
        native: on CPU, run the fast path in aqr's C kernels (:mod:`aqr.backends.native`, built with the
            system C compiler on first use); without a compiler it warns once and uses torch.
        triton: on a CUDA GPU, run the fast path in aqr's Triton kernels
            (:mod:`aqr.backends.triton_backend`: knots from histograms of every value, closer to
            the exact map than the torch path's sample; on an H100, ResNet-50 at batch 64 costs
            x2.4 of the plain forward against the torch path's x3.7, see ``docs/results/speed/``);
            opt-in until it reaches its cost target. Without triton it warns once and uses torch.
        target: ``"batch"`` (default): each batch's target quantiles are its own (per-batch AQR);
            ``"stream"``: a running estimate per layer across batches (:mod:`aqr.adapt.stream.running`; fast
            mode, tails ``"standard"``/``"average"``), for small batches; :class:`AQR` then has a
            ``reset()`` and serializes its calls; ``"robust"``: the same, class-balanced while the
            predicted classes come in runs (a mixture of running estimates per group of predicted
            classes; without runs the running estimate of all images, :mod:`aqr.adapt.stream.robust`), for
            streams whose classes come in runs; the model must return logits ``(N, classes)``; ``"mixed"``:
            ``"robust"``'s state and up to ``components`` running estimates more per layer, each image mapped
            with a blend of the shared map and the one its statistics at the first recalibrated layers pick
            (:mod:`aqr.adapt.stream.mixed`), for streams that mix domains; logits as ``"robust"``.
        estimator: the stream's estimate, ``"cdf-ema"`` (EMA of the per-channel CDFs; default) or
            ``"knot-ema"`` (EMA of the batches' knots; biased at small batches).
        horizon: the stream's EMA horizon in images (per-image weight ``1 / horizon``; effective
            sample size ``2 horizon - 1`` images).
        tail_window: images whose extremes give the stream's Average Sample Tails.
        rebuild_every: images between two updates of the stream's knots and table (smaller batches
            are mapped with the state of the images before them; larger ones update first).
        stream_grid: cells of the stream's lookup table between the first and last inner knots
            (rebuilt every ``rebuild_every`` images, hence smaller than ``grid``).
        match: what of the source distribution each channel is mapped onto: ``"quantiles"`` (AQR,
            the default) or ``"moments"``, the control: the affine map from the batch's mean and std
            onto the source's measured mean and std (:class:`aqr.adapt.layer_maps.MomentMap`; the quantile options
            ``tail``, ``mode``, ... do not apply to it).
        groups: ``target="robust"`` (and ``"mixed"``): the most groups of predicted classes (class ``y`` in group
            ``y % groups``), each with a running CDF; memory grows with it.
        class_horizon: ``target="robust"`` (and ``"mixed"``): each group's EMA horizon, in images of that group.
        own_batch: ``target="robust"`` (and ``"mixed"``): while the recent predicted classes show no runs, a batch of
            ``rebuild_every`` or more images joins its own target as in ``target="stream"``
            (:func:`aqr.adapt.stream.robust.own_batch_share`), by the part of its difference from the target
            that sampling does not explain (:func:`aqr.adapt.stream.robust.shift_share`); ``False``: every
            batch is mapped with the state its predecessors left.
        balance: ``target="robust"``: the share of the groups' weights spread equally; 1 (default): the
            groups' equal mixture mapped onto the source knots. Below 1 the rest goes to each group in
            proportion to its share of the last ``recent_horizon`` images (an EMA), and the target is
            mapped onto the same mixture of the groups' own source knots, so a run of one class is
            mapped mostly onto its class (needs statistics from ``aqr.calibrate(..., groups=groups)``).
            Either way the groups weigh ``runs`` in the target, the running estimate of all images
            ``1 - runs`` (``runs``: how clearly the recent predictions come in runs).
        recent_horizon: ``balance < 1``: the EMA horizon of the groups' shares, in images.
        components: ``target="mixed"``: the clusters of images (and running estimates per layer beside the
            shared one) it keeps: the domains it tells apart at once.
        blend: ``target="mixed"``: an image's map is ``blend`` times its cluster's and ``1 - blend`` times the
            shared estimate's while the predicted classes show no runs, fading to 0 as they come in runs (0 is
            ``target="robust"``, value for value).
    """

    # Each option once: its type, its default and its group (the group views are built from these)
    tail: str | None = option(None, BATCH)
    layers: str | Sequence[str] | None = option(None, BATCH)
    source_moments: str = option("affine", BATCH)
    gaussian_p: float = option(DEFAULT_GAUSSIAN_P, BATCH)
    on_nonfinite: str = option("raise", BATCH)
    mode: str = option("fast", BATCH)
    target_samples: int = option(8_192, BATCH)
    samples_per_row: int = option(64, BATCH)
    grid: int = option(1024, BATCH)
    compile: bool = option(True, BATCH)
    native: bool = option(True, BATCH)
    triton: bool = option(False, BATCH)
    target: str = "batch"  # in no group: from_groups takes it on its own
    estimator: str = option("cdf-ema", STREAM)
    horizon: float = option(128.0, STREAM)
    tail_window: int = option(128, STREAM)
    rebuild_every: int = option(8, STREAM)
    stream_grid: int = option(512, STREAM)
    match: str = option("quantiles", BATCH)
    groups: int = option(16, ROBUST)
    class_horizon: float = option(32.0, ROBUST)
    passes: int = option(1, ROBUST)
    own_batch: bool = option(True, ROBUST)
    balance: float = option(1.0, ROBUST)
    recent_horizon: float = option(64.0, ROBUST)
    components: int = option(8, MIXED)
    blend: float = option(0.3, MIXED)

    def __post_init__(self) -> None:
        if self.match not in MATCHES:
            raise ValueError(f"match must be one of {MATCHES}, got {self.match!r}")
        if self.tail is not None:
            check_tail(self.tail)
        if self.source_moments not in SOURCE_MOMENTS:
            raise ValueError(f"source_moments must be one of {SOURCE_MOMENTS}, got {self.source_moments!r}")
        if self.on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite must be one of {NONFINITE_POLICIES}, got {self.on_nonfinite!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name, low, high in (("target_samples", 16, MAX_TARGET_SAMPLES), ("samples_per_row", 0, MAX_TARGET_SAMPLES),
                                ("grid", 1, MAX_GRID)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
        if not 0.0 < self.gaussian_p < 0.5:
            raise ValueError(f"gaussian_p must be in (0, 0.5), got {self.gaussian_p}")
        if self.target not in TARGET_KINDS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
        check_estimator(self.estimator)
        check_horizon(self.horizon)
        check_stream_count("tail_window", self.tail_window)
        check_stream_count("rebuild_every", self.rebuild_every)
        check_stream_count("grid", self.stream_grid)  # the stream's table: its grid (the message as it always was)
        check_groups(self.groups)
        check_images("class_horizon", self.class_horizon)
        check_images("recent_horizon", self.recent_horizon)
        check_balance(self.balance)
        check_components(self.components)
        check_blend(self.blend)
        if self.passes not in (1, 2) or isinstance(self.passes, bool):
            raise ValueError(f"passes must be 1 or 2, got {self.passes!r}")
        if not isinstance(self.own_batch, bool):
            raise ValueError(f"own_batch must be True or False, got {self.own_batch!r}")
        self.target_kind.check(self)

    @property
    def target_kind(self) -> Target:
        """What :attr:`target` asks of the recalibration (:class:`Target`), looked up from its name."""
        return TARGET_KINDS[self.target]

    # The options grouped by what they are for (read-only views built from the flat fields; see
    # :class:`BatchOptions`, :class:`StreamOptions`, :class:`RobustOptions` and :meth:`from_groups`).

    @property
    def batch(self) -> BatchOptions:
        """The options of the map itself, used by every target (``tail``, ``mode``, ``grid``, ...)."""
        return BatchOptions(**_group_values(self, BatchOptions))

    @property
    def stream(self) -> StreamOptions:
        """The running estimate's options (``target="stream"`` and ``"robust"``)."""
        return StreamOptions(**_group_values(self, StreamOptions))

    @property
    def robust(self) -> RobustOptions:
        """The class-balanced target's options (``target="robust"`` only)."""
        return RobustOptions(**_group_values(self, RobustOptions))

    @property
    def mixed(self) -> MixedOptions:
        """The options of ``target="mixed"`` alone (``components``, ``blend``)."""
        return MixedOptions(**_group_values(self, MixedOptions))

    @classmethod
    def from_groups(cls, target: str = "batch", batch: BatchOptions | None = None, stream: StreamOptions | None = None,
                    robust: RobustOptions | None = None, mixed: MixedOptions | None = None) -> AQRConfig:
        """The config of ``target`` with the given groups of options (a group left out keeps its defaults);
        equal to ``AQRConfig(target=target, **flat options)``."""
        values: dict[str, Any] = {}
        for group in (batch, stream, robust, mixed):
            if group is not None:
                values.update(_group_values(group, type(group)))
        return cls(target=target, **values)


def _group_view(group: str, name: str, doc: str) -> type:
    """The frozen dataclass of the options of ``group`` (the fields of :class:`AQRConfig` of that group, with
    their types and defaults); building one checks it as ``AQRConfig(target=group, ...)`` does."""
    def __post_init__(self: Any) -> None:
        AQRConfig(target=group, **_group_values(self, type(self)))  # raises ValueError naming a bad option

    spec = [(f.name, f.type, field(default=f.default)) for f in fields(AQRConfig) if f.metadata.get(GROUP) == group]
    return make_dataclass(name, spec, frozen=True, namespace={"__post_init__": __post_init__, "__doc__": doc,
                                                              "__module__": __name__, "__qualname__": name})


BatchOptions = _group_view(BATCH, "BatchOptions", """The options of the map itself, for every target: the fields
    of :class:`AQRConfig` of these names (documented there). Building one checks it.""")
StreamOptions = _group_view(STREAM, "StreamOptions", """The running estimate's options (``target="stream"`` and
    ``"robust"``): the fields of :class:`AQRConfig` of these names (documented there). Building one checks it.""")
RobustOptions = _group_view(ROBUST, "RobustOptions", """The class-balanced target's options (``target="robust"``
    only; ``passes=2`` is its alone): the fields of :class:`AQRConfig` of these names (documented there).
    Building one checks it.""")


MixedOptions = _group_view(MIXED, "MixedOptions", """The options of ``target="mixed"`` alone: the fields of
    :class:`AQRConfig` of these names (documented there). Building one checks it.""")


OPTION_GROUPS: tuple[type, ...] = (BatchOptions, StreamOptions, RobustOptions, MixedOptions)


def _group_values(source: Any, group: type) -> dict[str, Any]:
    """``{name: value}`` of ``source``'s attributes named by the fields of the dataclass ``group``."""
    return {f.name: getattr(source, f.name) for f in fields(group)}
