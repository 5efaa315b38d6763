"""Test-time recalibration: the :class:`AQR` wrapper and the :func:`recalibrating` context manager.

On every forward pass, each selected normalization layer's output is mapped, channel by channel,
from this batch's quantiles onto the stored source quantiles (:func:`aqr.quantile_map`). Nothing is
learned and nothing persists between batches. With ``target="stream"``, :class:`AQR` instead keeps
a running estimate of each layer's target distribution across batches and maps every batch with it
(:mod:`aqr.core.stream`), for batches down to one image; with ``target="robust"``, the running
estimate is, while the predicted classes come in runs, a mixture of per-class ones
(:mod:`aqr.core.robust`), for streams whose classes come in runs.

:class:`AQR` never changes the user's model: it runs a structural twin of it (:mod:`aqr.core.twin`)
whose selected norm layers map their outputs, so several threads may call one ``AQR`` at once and
get the outputs of sequential calls. :func:`recalibrating` recalibrates ``model(x)`` itself inside
its block, through the hook registry of :mod:`aqr.core.hooks` (thread-aware, undone by the last block
to end, in any order).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from aqr.backends import Affine, LayerBackend, LayerSource, SubsetCache, choose_backend
from aqr.backends.subsets import MAX_SAMPLES as MAX_TARGET_SAMPLES
from aqr.core.hooks import instrumented
from aqr.core.layers import LayerError, NonFiniteActivationError, as_acb, check_named_layers, check_output, select_layers
from aqr.core.qmap import DEFAULT_GAUSSIAN_P, channel_quantiles, check_tail, quantile_map
from aqr.core.stats import SOURCE_MOMENTS, SourceStats
from aqr.core.twin import structural_twin

if TYPE_CHECKING:
    from aqr.core.stream_map import StreamBatch

NONFINITE_POLICIES = ("raise", "skip")
MODES = ("fast", "exact")
TARGETS = ("batch", "stream", "robust")
STREAM_TARGETS = ("stream", "robust")  # the targets that keep a running state
MAX_GRID = 1 << 16  # cells per table; C * (grid + 2) indexes the tables in int32
MATCHES = ("quantiles", "moments")


@dataclass(frozen=True)
class AQRConfig:
    """How batches are recalibrated.

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
            ``"stream"``: a running estimate per layer across batches (:mod:`aqr.core.stream`; fast
            mode, tails ``"standard"``/``"average"``), for small batches; :class:`AQR` then has a
            ``reset()`` and serializes its calls; ``"robust"``: the same, class-balanced while the
            predicted classes come in runs (a mixture of running estimates per group of predicted
            classes; without runs the running estimate of all images, :mod:`aqr.core.robust`), for
            streams whose classes come in runs; the model must return logits ``(N, classes)``.
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
            onto the source's measured mean and std (:class:`MomentMap`; the quantile options
            ``tail``, ``mode``, ... do not apply to it).
        groups: ``target="robust"``: the most groups of predicted classes (class ``y`` in group
            ``y % groups``), each with a running CDF; memory grows with it.
        class_horizon: ``target="robust"``: each group's EMA horizon, in images of that group.
        own_batch: ``target="robust"``: while the recent predicted classes show no runs, a batch of
            ``rebuild_every`` or more images joins its own target as in ``target="stream"``
            (:func:`aqr.core.robust.own_batch_share`), by the part of its difference from the target
            that sampling does not explain (:func:`aqr.core.robust.shift_share`); ``False``: every
            batch is mapped with the state its predecessors left.
        balance: ``target="robust"``: the share of the groups' weights spread equally; 1 (default): the
            groups' equal mixture mapped onto the source knots. Below 1 the rest goes to each group in
            proportion to its share of the last ``recent_horizon`` images (an EMA), and the target is
            mapped onto the same mixture of the groups' own source knots, so a run of one class is
            mapped mostly onto its class (needs statistics from ``aqr.calibrate(..., groups=groups)``).
            Either way the groups weigh ``runs`` in the target, the running estimate of all images
            ``1 - runs`` (``runs``: how clearly the recent predictions come in runs).
        recent_horizon: ``balance < 1``: the EMA horizon of the groups' shares, in images.
    """

    tail: str | None = None
    layers: str | Sequence[str] | None = None
    source_moments: str = "affine"
    gaussian_p: float = DEFAULT_GAUSSIAN_P
    on_nonfinite: str = "raise"
    mode: str = "fast"
    target_samples: int = 8_192
    samples_per_row: int = 64
    grid: int = 1024
    compile: bool = True
    native: bool = True
    triton: bool = False
    target: str = "batch"
    estimator: str = "cdf-ema"
    horizon: float = 128.0
    tail_window: int = 128
    rebuild_every: int = 8
    stream_grid: int = 512
    match: str = "quantiles"
    groups: int = 16
    class_horizon: float = 32.0
    passes: int = 1
    own_batch: bool = True
    balance: float = 1.0
    recent_horizon: float = 64.0

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
        if self.target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {self.target!r}")
        from aqr.core.stream import StreamSettings

        StreamSettings(self.estimator, self.horizon, self.tail_window, 100, self.rebuild_every, self.stream_grid)  # checks
        from aqr.core.robust import RobustSettings

        RobustSettings(self.groups, self.class_horizon, self.balance, self.recent_horizon)  # checks
        if self.passes not in (1, 2) or isinstance(self.passes, bool):
            raise ValueError(f"passes must be 1 or 2, got {self.passes!r}")
        if not isinstance(self.own_batch, bool):
            raise ValueError(f"own_batch must be True or False, got {self.own_batch!r}")
        if self.passes == 2 and self.target != "robust":
            raise ValueError("passes=2 is an option of target='robust'")
        if self.target in STREAM_TARGETS and self.mode != "fast":
            raise ValueError(f"target={self.target!r} runs the fast path: mode='exact' is not available with it")
        if self.target in STREAM_TARGETS and self.match != "quantiles":
            raise ValueError(f"target={self.target!r} maps running quantiles: match='moments' has no streaming form yet")


def host_reads_are_cheap(device: torch.device) -> bool:
    """Whether reading a flag from ``device`` costs nothing (CPU), or stalls a queue of kernels (GPU)."""
    return device.type == "cpu"


class LayerMap:
    """The recalibration of one layer: its source side, and the fast-path backend chosen per device.

    Called as a forward hook, it returns the layer's output recalibrated; :meth:`folded_forward`
    replaces an eval-mode BatchNorm's forward instead (in :class:`AQR`'s twin). One map serves any
    number of threads at once: it keeps no per-batch state, and its per-device caches are filled
    idempotently (a race builds an equal object twice and keeps the first).
    """

    def __init__(self, stats: SourceStats, name: str, config: AQRConfig, tail: str,
                 subsets: SubsetCache | None = None, logits_checked: bool = False) -> None:
        self.info = stats.layers[name].info
        self.tail = tail
        self.on_nonfinite = config.on_nonfinite
        loc, scale = stats.source_moments(name, config.source_moments)
        self.source = LayerSource.create(stats.source_quantiles(name, tail), tail, loc, scale, config.gaussian_p,
                                         config.grid)
        self._sources: dict[torch.device, LayerSource] = {}
        self._backends: dict[torch.device, LayerBackend] = {}
        self.config = config
        self.subsets = subsets or SubsetCache(config.target_samples, config.samples_per_row)
        self.logits_checked = logits_checked  # AQR's forward checks the logits for NaN/Inf
        self._fold_cache: dict[torch.device, tuple[tuple[object, ...], Affine]] = {}

    def source_on(self, device: torch.device) -> LayerSource:
        """The layer's source side on ``device`` (moved once)."""
        source = self._sources.get(device)
        if source is None:
            source = self._sources.setdefault(device, self.source.to(device))
        return source

    def backend(self, device: torch.device) -> LayerBackend:
        """The fast-path backend for ``device``, chosen on first use."""
        backend = self._backends.get(device)
        if backend is None:
            # outside any graph torch.compile traces: choosing builds or loads kernels (file system,
            # ctypes). Wrapped here, not with a decorator: that would import torch._dynamo (and with
            # it triton) whenever aqr is imported
            backend = torch.compiler.disable(self._create_backend)(device)
        return backend

    def _create_backend(self, device: torch.device) -> LayerBackend:
        return self._backends.setdefault(device, choose_backend(
            self.source_on(device), self.subsets, native=self.config.native, triton=self.config.triton,
            compile=self.config.compile))

    def __call__(self, _module: nn.Module, _inputs: object, output: object) -> torch.Tensor:
        """Forward hook: the layer's output, recalibrated."""
        out = check_output(self.info, output)
        if out.numel() == 0:  # an empty batch: nothing to recalibrate
            return out
        if self.config.mode == "fast":
            return self._fast(out)
        source = self.source_on(out.device)
        dim = self.info.channel_dim % out.ndim
        tq = channel_quantiles(out, source.num_quantiles, dim)
        # NaN sorts last and +-Inf sit at the ends, so finite end knots mean finite activations.
        if not bool(torch.isfinite(tq[:, 0]).all() and torch.isfinite(tq[:, -1]).all()):
            return self._nonfinite(out)
        return quantile_map(out, source.knots, tq, self.tail, dim=dim, source_loc=source.loc,
                            source_scale=source.scale, gaussian_p=self.config.gaussian_p)

    def _fast(self, x: torch.Tensor, pre: Affine | None = None,
              unmapped: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """The fast map of the layer output ``x``; with ``pre``, of ``pre[0] * x + pre[1]`` per
        channel (a folded BatchNorm, whose own output ``unmapped()`` computes)."""
        y, finite = self.backend(x.device).recalibrate(as_acb(x, self.info.channel_dim), pre)
        y = y.reshape(x.shape)
        if self.logits_checked and not host_reads_are_cheap(x.device):
            # Reading ``finite`` would stall the GPU at every layer. A non-finite value makes its
            # channel's map NaN, which reaches the logits, and AQR.forward checks those once.
            # ("skip" is never folded here: it needs the unmapped output, see folded_forward.)
            return torch.where(finite, y, x) if self.on_nonfinite == "skip" else y
        if bool(finite):
            return y
        return self._nonfinite(x if unmapped is None else unmapped())

    def foldable(self, module: nn.Module) -> bool:
        """Whether this layer is a BatchNorm with running statistics that aqr's kernels (C on CPU,
        Triton on a GPU) can absorb into the map."""
        return (
            self.config.mode == "fast" and (self.config.native or self.config.triton)
            and isinstance(module, nn.modules.batchnorm._BatchNorm)
            and module.track_running_stats and module.running_mean is not None and module.running_var is not None
        )

    def folded_forward(self, module: nn.modules.batchnorm._BatchNorm,
                       forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        """A replacement ``forward`` for an eval-mode BatchNorm: the map reads the BN's input and
        applies its affine step itself, which saves the BN's pass over the activations.

        Anything the backend cannot fold (training mode, GPU, float64, autograd, no C kernels) runs
        the BN's own ``forward`` and the hook's map instead.
        """

        def run(x: torch.Tensor) -> torch.Tensor:
            if (module.training or x.ndim < 2 or x.shape[1] != self.info.channels or x.numel() == 0
                    or not self.backend(x.device).folds(as_acb(x, 1))
                    # on a GPU "skip" would need the unmapped output too (no host read of `finite`)
                    or (self.on_nonfinite == "skip" and not host_reads_are_cheap(x.device))):
                return self(module, (x,), forward(x))
            return self._fast(x, self._folded_affine(module), lambda: forward(x))

        return run

    def _folded_affine(self, module: nn.modules.batchnorm._BatchNorm) -> Affine:
        """The eval-mode BatchNorm as ``(scale, shift)`` per channel, as ATen's eval batch_norm computes it.

        Kept until one of the BN's tensors changes (replaced, or updated in place: its version
        moves), so a forward pass does not recompute it in a handful of small ops per layer.
        """
        tensors = (module.running_var, module.running_mean, module.weight, module.bias)
        key = (module.eps, *((id(t), t._version) if t is not None else None for t in tensors))
        cached = self._fold_cache.get(module.running_var.device)
        if cached is not None and cached[0] == key:
            return cached[1]
        alpha = 1.0 / torch.sqrt(module.running_var.float() + module.eps)
        if module.weight is not None:
            alpha = alpha * module.weight.float()
        beta = -module.running_mean.float() * alpha
        if module.bias is not None:
            beta = module.bias.float() + beta
        affine = (alpha.contiguous(), beta.contiguous())
        self._fold_cache[module.running_var.device] = (key, affine)
        return affine

    def _nonfinite(self, out: torch.Tensor) -> torch.Tensor:
        if self.on_nonfinite == "skip":
            return out
        raise NonFiniteActivationError(
            f"layer {self.info.name!r} produced NaN or Inf activations on this batch; AQR cannot "
            "recalibrate them (pass on_nonfinite='skip' to leave such layers untouched)"
        )


class MomentMap(LayerMap):
    """The moment-matching control on one layer: each channel mapped affinely from the batch's mean
    and std onto the source's measured mean and std (``LayerStats.mean``/``std``, the same statistics
    file as AQR). AQR's layer selection, hooks and non-finite policy; no quantiles, no folding.

    ``y = m_src + (x - m_batch) * s_src / s_batch`` per channel, with the batch moments over every
    value of the channel (population std) in float32; a constant channel maps to ``m_src``.
    """

    def __init__(self, stats: SourceStats, name: str, config: AQRConfig, tail: str,
                 subsets: SubsetCache | None = None, logits_checked: bool = False) -> None:
        super().__init__(stats, name, config, tail, subsets, logits_checked)
        layer = stats.layers[name]
        self.target_moments = (layer.mean.float(), layer.std.float())
        self._moments_on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def foldable(self, module: nn.Module) -> bool:
        return False

    def __call__(self, _module: nn.Module, _inputs: object, output: object) -> torch.Tensor:
        """Forward hook: the layer's output with each channel's mean and std moved onto the source's."""
        out = check_output(self.info, output)
        if out.numel() == 0:  # an empty batch: nothing to map
            return out
        dim = self.info.channel_dim % out.ndim
        shape = [1] * out.ndim
        shape[dim] = out.shape[dim]
        reduce = [d for d in range(out.ndim) if d != dim]
        x = out.float()
        var, mean = torch.var_mean(x, dim=reduce, keepdim=True, correction=0)
        if not bool(torch.isfinite(mean).all() and torch.isfinite(var).all()):
            return self._nonfinite(out)
        src_mean, src_std = self.moments_on(out.device)
        std = var.sqrt()
        gain = torch.where(std > 0, src_std.reshape(shape) / std, torch.zeros_like(std))
        return torch.addcmul(src_mean.reshape(shape), x - mean, gain).to(out.dtype)

    def moments_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The source mean and std on ``device`` (moved once)."""
        moments = self._moments_on.get(device)
        if moments is None:  # a race moves them twice and keeps the first (as LayerMap.source_on)
            moments = self._moments_on.setdefault(device, tuple(t.to(device) for t in self.target_moments))  # type: ignore[arg-type]
        return moments


MAP_CLASSES: dict[str, type[LayerMap]] = {"quantiles": LayerMap, "moments": MomentMap}


def _layer_maps(stats: SourceStats, config: AQRConfig, logits_checked: bool = False,
                batch: StreamBatch | None = None) -> dict[str, LayerMap]:
    """The maps of the selected layers; with ``batch``, streaming ones sharing it (:mod:`aqr.core.stream_map`)."""
    tail = config.tail or stats.tail
    infos = [layer.info for layer in stats.layers.values()]
    chosen = select_layers(infos, "all" if config.layers is None else config.layers, stats.layer_names)
    subsets = SubsetCache(config.target_samples, config.samples_per_row)  # shared: layers of one shape share one index
    if batch is not None:
        from aqr.core.stream_map import StreamLayerMap

        return {info.name: StreamLayerMap(stats, info.name, config, tail, subsets, batch) for info in chosen}
    cls = MAP_CLASSES[config.match]
    return {info.name: cls(stats, info.name, config, tail, subsets, logits_checked) for info in chosen}


@contextlib.contextmanager
def recalibrating(model: nn.Module, stats: SourceStats, **options: object) -> Iterator[nn.Module]:
    """Within the block, ``model(x)`` is recalibrated by AQR in this thread; afterwards the model is as before.

    ``options`` are the fields of :class:`AQRConfig`. The model runs in eval mode while any thread is
    inside such a block; other threads' plain calls are not recalibrated, and blocks may end in any
    order (:mod:`aqr.core.hooks`). Blocks nested in one thread compose: each maps the output the
    one entered before it produced. :class:`AQR` is the faster way (it folds eval BatchNorms into the map).
    """
    stats.check_model(model)
    config = AQRConfig(**options)  # type: ignore[arg-type]
    if config.target in STREAM_TARGETS:
        raise ValueError(f"target={config.target!r} keeps a state across batches, which a context manager cannot: "
                         f"use aqr.AQR(model, stats, target={config.target!r})")
    check_named_layers(model, config.layers)
    maps = _layer_maps(stats, config)
    with instrumented(model) as tools:
        for name, layer_map in maps.items():
            tools.hook(name, layer_map)
        yield model


class RecalibratedForward:
    """The ``forward`` of a selected norm layer's copy in :class:`AQR`'s twin: the layer's own
    computation and then its map (an eval BatchNorm folded into the native map where it can be).

    Run through the copy's ``__call__``, the user's hooks of the layer see the recalibrated output.
    """

    def __init__(self, module: nn.Module, layer_map: LayerMap) -> None:
        self.module = module
        self.plain = module.forward  # the class's forward bound to the copy (or the user's own)
        self.layer_map = layer_map
        self.called = False  # set by the first call: AQR checks that the twin reaches every layer

    def __call__(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        self.called = True
        if not args and not kwargs and self.layer_map.foldable(self.module):
            return self.layer_map.folded_forward(self.module, self.plain)(x)
        return self.layer_map(self.module, (x, *args), self.plain(x, *args, **kwargs))


def recalibrated_twin(model: nn.Module, maps: Mapping[str, LayerMap]) -> nn.Module:
    """:func:`aqr.core.twin.structural_twin` of ``model`` whose layers in ``maps`` are recalibrated."""
    _check_reachable(model, maps)
    return structural_twin(model, {name: lambda m, lm=layer_map: RecalibratedForward(m, lm)
                                   for name, layer_map in maps.items()})


def _check_reachable(model: nn.Module, maps: Mapping[str, LayerMap]) -> None:
    """Warn about a selected layer that a module also holds outside its module tree (in a plain
    attribute, list, tuple or dict): if the model calls it through that reference, AQR's twin does
    not reach it (the first forward pass then raises :class:`LayerError`)."""
    named = dict(model.named_modules())
    selected = {id(named[name]): name for name in maps}
    for owner, module in named.items():
        for attribute, value in vars(module).items():
            if attribute in ("_modules", "_parameters", "_buffers"):
                continue
            found = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
            for item in found:
                if isinstance(item, nn.Module) and id(item) in selected:
                    warnings.warn(
                        f"layer {selected[id(item)]!r} is also held outside the model's module tree (attribute "
                        f"{attribute!r} of {owner or type(model).__name__!r}); if the model calls it through "
                        "that, AQR cannot recalibrate it: register it as a submodule (nn.ModuleList/ModuleDict)",
                        stacklevel=4)
                    return


class AQR(nn.Module):
    """``model`` with every selected normalization output recalibrated on each batch.

    ``AQR(model, stats)(x)`` returns what ``model(x)`` gives under :func:`recalibrating`, without
    gradients. ``self.model`` is the original model, never modified: the forward pass runs a
    structural twin of it (:mod:`aqr.core.twin`), built once here, in eval mode, sharing the model's
    parameters, buffers and hooks (later weight changes and hooks are seen; a changed module tree
    needs a new ``AQR``). Several threads may call one ``AQR`` at once. Options are the fields of
    :class:`AQRConfig` (``tail``, ``layers``, ``source_moments``, ``gaussian_p``, ``on_nonfinite``,
    ``mode``, ``target_samples``, ``grid``, ``compile``, ``native``).

    In the twin, a BatchNorm with running statistics runs its map folded (on CPU with the native
    kernels): the map reads the BN's input and applies its affine step itself, one pass instead
    of two. The layers' forward hooks run and see the recalibrated output.

    With ``target="stream"`` each layer keeps a running estimate of its target distribution
    (:mod:`aqr.core.stream`; options ``estimator``, ``horizon``, ``tail_window``, ``rebuild_every``);
    with ``target="robust"`` a class-balanced one (:mod:`aqr.core.robust`; options ``groups``,
    ``class_horizon``, ``own_batch``, ``balance``, ``tail_window``, ``rebuild_every``; the logits' argmax
    assigns each image its class; ``balance < 1`` needs statistics calibrated with ``groups``):
    every batch updates it and is mapped with it. The state's memory is fixed (:meth:`memory_bytes`),
    :meth:`reset` returns to the initial state, and a batch enters the state only if every layer
    and the logits were finite (with NaN/Inf, ``on_nonfinite="raise"`` raises and ``"skip"`` returns
    the output; neither changes the state). The stream is one sequence: calls from several threads
    are serialized by a lock, each batch seeing the state its predecessors left.
    """

    def __init__(self, model: nn.Module, stats: SourceStats, **options: object) -> None:
        super().__init__()
        stats.check_model(model)
        self.model = model
        self.stats = stats
        self.config = AQRConfig(**options)  # type: ignore[arg-type]
        check_named_layers(model, self.config.layers)
        self._batch: StreamBatch | None = None
        if self.config.target in STREAM_TARGETS:
            from aqr.core.stream_map import StreamBatch

            self._batch = StreamBatch()
            self._lock = threading.Lock()
            self._owner: int | None = None
        # "skip" needs no check; "raise" is checked on the logits in forward
        self._maps = _layer_maps(stats, self.config, logits_checked=True, batch=self._batch)
        object.__setattr__(self, "_twin", recalibrated_twin(model, self._maps))  # not a submodule
        self._reach_checked = False

    @property
    def layer_names(self) -> list[str]:
        """The layers recalibrated, in forward execution order."""
        return list(self._maps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._batch is not None:
            return self._stream_forward(x)
        with torch.no_grad():
            out = self._twin(x)
        if not self._reach_checked:
            self._check_every_layer_called()
        if (self.config.match == "quantiles" and self.config.mode == "fast" and self.config.on_nonfinite == "raise"
                and isinstance(out, torch.Tensor)):
            # The fast path checks only the sampled positions of each layer (none on a GPU); NaN/Inf
            # elsewhere reaches the output. Re-run exactly to name the first layer that produced it.
            if not bool(torch.isfinite(out).all()):
                exact = {name: LayerMap(self.stats, name, replace(self.config, mode="exact"), m.tail) for name, m in self._maps.items()}
                with torch.no_grad():
                    recalibrated_twin(self.model, exact)(x)
        return out

    def _stream_forward(self, x: torch.Tensor) -> torch.Tensor:
        """One batch of the stream: mapped with the running estimate, which it updates if all was finite."""
        if self._owner == threading.get_ident():
            raise RuntimeError("a streaming AQR was called from inside its own forward pass")
        with self._lock:
            self._owner = threading.get_ident()
            batch = self._batch
            try:
                batch.begin(int(x.shape[0]) if x.ndim else 0)
                if self.config.target == "robust":
                    from aqr.core.robust import own_batch_share

                    share = own_batch_share(batch.recent)
                    batch.own, batch.runs = (share if self.config.own_batch else 0.0), 1.0 - share
                with torch.no_grad():
                    out = self._twin(x)
                if not self._reach_checked:
                    self._check_every_layer_called()
                finite = not batch.nonfinite and (not isinstance(out, torch.Tensor) or bool(torch.isfinite(out).all()))
                if finite:
                    batch.commit(self._predicted(out, batch.images) if self.config.target == "robust" else None)
                    if self.config.passes == 2:  # the batch again, mapped with the state it just updated
                        batch.begin(batch.images)
                        with torch.no_grad():
                            out = self._twin(x)
                        batch.staged = []
                elif self.config.on_nonfinite == "raise":
                    raise NonFiniteActivationError("the logits are NaN or Inf on this batch; the stream's state is "
                                                   "unchanged (on_nonfinite='skip' returns them)")
                return out
            finally:
                batch.begin(0)
                self._owner = None

    def _predicted(self, out: object, images: int) -> torch.Tensor:
        """Each image's predicted class from the logits (``target="robust"``)."""
        if not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != images or out.shape[1] < 1:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"target='robust' needs the model to return logits (N, classes) for N = {images} "
                             f"images, got {shape}; the stream's state is unchanged")
        return out.argmax(dim=1)

    def reset(self) -> None:
        """Forget the stream (``target="stream"``): every layer back to its state before the first batch."""
        if self._batch is None:
            return
        with self._lock:
            for layer_map in self._maps.values():
                layer_map.reset()  # type: ignore[attr-defined]
            self._batch.recent = []

    def memory_bytes(self) -> int:
        """Bytes of the running state (``target="stream"``; fixed, 0 before the first batch and for batches)."""
        if self._batch is None:
            return 0
        layers = sum(m.memory_bytes() for m in self._maps.values())  # type: ignore[attr-defined]
        return layers + 8 * len(self._batch.recent)  # target="robust": the recent predicted classes

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state.pop("_lock", None)  # locks cannot be copied; a copy gets its own
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        if self._batch is not None:
            self._lock = threading.Lock()

    def _check_every_layer_called(self) -> None:
        """After the first forward pass: every selected layer's map ran (else the model reaches that
        layer outside its module tree, and AQR cannot recalibrate it)."""
        for name, module in self._twin.named_modules():
            forward = module.__dict__.get("forward")
            if isinstance(forward, RecalibratedForward) and not forward.called:
                raise LayerError(f"layer {name!r} was not called through the model's module tree in the forward "
                                 "pass, so AQR did not recalibrate it (does the model keep it outside its "
                                 "submodules, or skip it for this input?)")
        self._reach_checked = True

    def extra_repr(self) -> str:
        if self.config.match == "moments":
            return f"layers={len(self._maps)}, match='moments'"
        text = f"layers={len(self._maps)}, tail={self.config.tail or self.stats.tail!r}, K={self.stats.num_quantiles}"
        if self._batch is not None:
            c = self.config
            if c.target == "robust":
                text += f", target='robust', groups={c.groups}, class_horizon={c.class_horizon:g}"
                text += "" if c.own_batch else ", own_batch=False"
                text += f", balance={c.balance:g}, recent_horizon={c.recent_horizon:g}" if c.balance < 1 else ""
            else:
                text += f", target='stream', estimator={c.estimator!r}, horizon={c.horizon:g}"
        return text
