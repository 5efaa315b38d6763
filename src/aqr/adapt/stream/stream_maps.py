"""The layer maps of ``aqr.AQR(model, stats, target="stream")``: each layer maps with its running estimate.

A :class:`StreamLayerMap` is a :class:`aqr.adapt.layer_maps.LayerMap` whose fast map steps the layer's
:class:`aqr.adapt.stream.running.LayerStream` (the one its :class:`aqr.adapt.config.StreamTarget` builds)
instead of reading the batch's own knots. Every map of one
:class:`aqr.AQR` shares a :class:`StreamBatch`: the batch's image count, and the updates its layers
stage while it runs, which :meth:`StreamBatch.commit` applies once the whole forward pass was
finite (:class:`aqr.AQR` serializes forward passes, so one batch runs at a time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from aqr.adapt.config import AQRConfig, StreamTarget
from aqr.adapt.layer_maps import PLAIN_BATCH_NORMS, LayerMap, batch_norm_tensors
from aqr.adapt.stream.base import StreamKernels
from aqr.adapt.stream.native_kernels import NativeStreamKernels, native_stream_kernels
from aqr.adapt.stream.robust import MARGINAL_WINDOW, BatchGroups, RobustLayerStream
from aqr.adapt.stream.running import LayerStream, Staged, StreamSettings
from aqr.adapt.stream.torch_kernels import TorchStreamKernels
from aqr.backends import Affine, LayerBackend, SubsetCache, Targets
from aqr.backends.native import NativeBackend, native_takes
from aqr.core.layers import as_acb
from aqr.core.stats import SourceStats


@dataclass
class StreamBatch:
    """The batch a streaming :class:`aqr.AQR` is running: its images and the layers' staged updates."""

    images: int = 0
    staged: list[tuple[LayerStream, Staged]] = field(default_factory=list)
    nonfinite: bool = False
    own: float = 0.0  # target="robust": the share of its own histogram a batch's target takes
    runs: float = 1.0  # target="robust": how clearly the recent predicted classes come in runs (1 - own_batch_share)
    recent: list[int] = field(default_factory=list)  # target="robust": the last MARGINAL_WINDOW predicted classes
    held: bool = False  # the batch is mapped with the committed state and stages nothing (AQR.forward_held)

    def begin(self, images: int) -> None:
        self.images, self.staged, self.nonfinite = images, [], False

    def commit(self, labels: torch.Tensor | None = None) -> None:
        """Apply every staged update (the batch was finite everywhere); ``labels``: each image's predicted
        class, which class-balanced layers (``target="robust"``) need."""
        grouped: dict[tuple[torch.device, int], BatchGroups] = {}  # the labels as groups, once for every layer
        for stream, staged in self.staged:
            if isinstance(stream, RobustLayerStream):
                key = (staged.counts.device, stream.robust.groups)
                if labels is not None and key not in grouped:
                    grouped[key] = BatchGroups.of_labels(labels, key[1], key[0])
                stream.commit(staged, labels, self.runs, grouped.get(key))
            else:
                stream.commit(staged)
        self.staged = []
        if labels is not None:
            self.recent = (self.recent + labels.tolist())[-MARGINAL_WINDOW:]


def stream_settings(config: AQRConfig, stats: SourceStats) -> StreamSettings:
    """The running estimate's settings from an :class:`aqr.AQRConfig` (``tail_batch`` from the statistics)."""
    return StreamSettings(config.estimator, float(config.horizon), config.tail_window, stats.tail_batch,
                          config.rebuild_every, config.stream_grid)


def stream_kernels(device: torch.device, native: bool) -> StreamKernels:
    """aqr's C kernels on CPU when ``native`` and built, else the torch kernels."""
    if native and device.type == "cpu":
        lib = native_stream_kernels()
        if lib is not None:
            return NativeStreamKernels(lib)
    return TorchStreamKernels()


class StreamLayerMap(LayerMap):
    """One layer of a streaming :class:`aqr.AQR`: its running state (per device, made on first use)."""

    def __init__(self, stats: SourceStats, name: str, config: AQRConfig, tail: str, subsets: SubsetCache,
                 batch: StreamBatch) -> None:
        target = config.target_kind
        if not isinstance(target, StreamTarget):
            raise ValueError(f"target={config.target!r} keeps no running state: its layers map each batch alone")
        target.check_tail(tail)
        super().__init__(stats, name, config, tail, subsets, logits_checked=True)
        self.target = target
        self.settings = stream_settings(config, stats)
        self.group_quantiles = None
        if target.uses_group_sources(config):
            if stats.groups != config.groups:
                raise ValueError(f"balance < 1 maps each group onto its own source knots: it needs statistics "
                                 f"calibrated with groups={config.groups} (these have groups={stats.groups}; "
                                 f"aqr calibrate --groups {config.groups})")
            self.group_quantiles = stats.layers[name].group_quantiles
        self.batch = batch
        self.streams: dict[torch.device, LayerStream] = {}
        # the CPU stream, once a folded batch showed it runs on the C kernels and small batches may take
        # LayerStream.small_step (see layer_forward)
        self._small: LayerStream | None = None
        self._small_kernels: StreamKernels | None = None  # its kernels then (a stream may change them)

    def __getstate__(self) -> dict[str, object]:
        state = super().__getstate__()
        state["_small"] = state["_small_kernels"] = None  # found again on the copy's first folded batch
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_small", None)
        self.__dict__.setdefault("_small_kernels", None)

    def layer_forward(self, module: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor],
                      x: torch.Tensor) -> torch.Tensor:
        """As :meth:`LayerMap.layer_forward`; an eval BatchNorm's batch of fewer than ``rebuild_every`` images
        on a started CPU stream of the C kernels goes straight to :meth:`LayerStream.small_step` (the same
        values as the general path, in one call instead of its chain of checks)."""
        stream, batch = self._small, self.batch
        if (stream is not None and stream.started and 0 < batch.images < stream.settings.rebuild_every
                and not batch.held and type(module) in PLAIN_BATCH_NORMS and not module.training
                and module.track_running_stats and native_takes(x) and x.ndim >= 2
                and x.shape[1] == self.info.channels and x.is_contiguous() and x.numel() > 0
                and stream.kernels is self._small_kernels):
            var, mean, weight, bias = batch_norm_tensors(module)
            if var is None or mean is None:  # not foldable
                return super().layer_forward(module, forward, x)
            y, staged = stream.small_step(x, batch.images, self._affine_of(module, var, mean, weight, bias))
            if staged is None:
                batch.nonfinite = True
                return self._nonfinite(forward(x))
            batch.staged.append((stream, staged))
            return y  # type: ignore[return-value]
        return super().layer_forward(module, forward, x)

    def _note_small(self, stream: LayerStream, device: torch.device, pre: Affine | None) -> None:
        """Remember ``stream`` for :meth:`layer_forward`'s direct path when it qualifies: a folded BatchNorm
        (``pre``) on CPU whose per-batch backend folds natively, a ``"stream"`` target's ``"cdf-ema"`` state
        on the C kernels, the channel on dim 1."""
        if (pre is not None and device.type == "cpu" and type(stream) is LayerStream
                and stream.settings.estimator == "cdf-ema" and isinstance(stream.kernels, NativeStreamKernels)
                and isinstance(self.backend(device), NativeBackend) and self.info.channel_dim == 1
                and stream.bound() is not None):
            self._small, self._small_kernels = stream, stream.kernels

    def stream(self, device: torch.device) -> LayerStream:
        """The layer's running state on ``device``."""
        stream = self.streams.get(device)
        if stream is None:
            source, kernels = self.source_on(device).knots, stream_kernels(device, self.config.native)
            stream = self.target.layer_stream(self.config, source, self.settings, kernels, self.batch_knots,
                                              self._group_source(source))
            self.streams[device] = stream
        elif isinstance(stream.kernels, NativeStreamKernels) and not stream.kernels.available():
            stream.kernels = TorchStreamKernels()  # a copy unpickled where the C kernels cannot be built
        return stream

    def batch_knots(self, x: torch.Tensor, pre: Affine | None) -> Targets:
        """The batch's own knots of ``x`` (A, C, B) from the layer's fast-path backend on ``x``'s device
        (looked up on each call, so a copy of the stream re-creates the backend it cannot copy)."""
        return self.backend(x.device).target_knots(x, pre)

    def _group_source(self, source: torch.Tensor) -> torch.Tensor | None:
        """``(groups, C, K)``: each group's source knots on ``source``'s device: its inner knots, the layer's
        ends (those of the tail strategy), the inner ones held between them."""
        if self.group_quantiles is None:
            return None
        g = self.group_quantiles.to(source.device, torch.float32).clone()
        lo, hi = source[:, :1], source[:, -1:]
        g[:, :, 1:-1] = torch.minimum(torch.maximum(g[:, :, 1:-1], lo), hi)
        g[:, :, 0], g[:, :, -1] = source[:, 0], source[:, -1]
        return g

    def reset(self) -> None:
        for stream in self.streams.values():
            stream.reset()

    def memory_bytes(self) -> int:
        return sum(stream.memory_bytes() for stream in self.streams.values())

    def _fast(self, x: torch.Tensor, pre: Affine | None = None,
              unmapped: Callable[[], torch.Tensor] | None = None,
              backend: LayerBackend | None = None) -> torch.Tensor:
        """The layer output ``x`` mapped with the running estimate; the batch's update is staged.
        (``backend``, the per-batch map's, is not used.)"""
        if self.batch.held:
            return self._held(x, pre, unmapped)
        state = stream = self.stream(x.device)
        acb = as_acb(x, self.info.channel_dim)
        if not stream.kernels.takes(acb):  # float64 or autograd on CPU: the torch kernels on the same state
            stream = _with_torch_kernels(stream)
        elif self._small is None:
            self._note_small(stream, x.device, pre)
        if isinstance(stream, RobustLayerStream):
            y, staged = stream.step(acb, self.batch.images, pre, self.batch.own, self.batch.runs)
        else:
            y, staged = stream.step(acb, self.batch.images, pre)
        if staged is None:
            self.batch.nonfinite = True
            return self._nonfinite(x if unmapped is None else unmapped())
        self.batch.staged.append((state, staged))
        return y.reshape(x.shape)

    def _held(self, x: torch.Tensor, pre: Affine | None, unmapped: Callable[[], torch.Tensor] | None) -> torch.Tensor:
        """``x`` mapped with the committed running estimate, staging nothing; before the first batch (no
        estimate on this device yet) the layer's own output, unmapped."""
        if x.device not in self.streams or not self.streams[x.device].started:
            return x if unmapped is None else unmapped()
        stream = self.stream(x.device)
        acb = as_acb(x, self.info.channel_dim)
        if not stream.kernels.takes(acb):
            stream = _with_torch_kernels(stream)
        y = stream.held(acb, self.batch.images, pre)
        if y is None:
            self.batch.nonfinite = True
            return self._nonfinite(x if unmapped is None else unmapped())
        return y.reshape(x.shape)


def _with_torch_kernels(stream: LayerStream) -> LayerStream:
    """``stream``'s state stepped by the torch kernels (a shallow view sharing every buffer)."""
    view = object.__new__(type(stream))
    view.__dict__.update(stream.__dict__)
    view.kernels = TorchStreamKernels()
    return view
