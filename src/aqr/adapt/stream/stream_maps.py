"""The layer maps of ``aqr.AQR(model, stats, target="stream")``: each layer maps with its running estimate.

A :class:`StreamLayerMap` is a :class:`aqr.adapt.layer_maps.LayerMap` whose fast map steps the layer's
running state (:class:`aqr.adapt.stream.running.LayerStream`, or the class its target names, built by
:mod:`aqr.adapt.stream.build`) instead of reading the batch's own knots. Every map of one
:class:`aqr.AQR` shares a :class:`SharedStream`: the recent predicted classes across batches and the
batch in flight (:class:`aqr.adapt.stream.batch.StreamBatch`), which the caller begins with its values
(its images, whether it is held) and commits once the whole forward pass was finite
(:class:`aqr.AQR` serializes forward passes, so one batch runs at a time).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from aqr.adapt.config import AQRConfig, StreamTarget
from aqr.adapt.layer_maps import PLAIN_BATCH_NORMS, LayerMap, batch_norm_tensors, host_reads_are_cheap
from aqr.adapt.stream.base import StreamKernels
from aqr.adapt.stream.batch import BatchCommit, BatchValues, StreamBatch
from aqr.adapt.stream.build import layer_stream, stream_class, stream_kernels, stream_settings
from aqr.adapt.stream.mixed import ComponentRouter, LayerRoute
from aqr.adapt.stream.native_kernels import NativeStreamKernels
from aqr.adapt.stream.robust import MARGINAL_WINDOW
from aqr.adapt.stream.running import LayerStream
from aqr.adapt.stream.torch_kernels import TorchStreamKernels
from aqr.backends import Affine, LayerBackend, SubsetCache, Targets
from aqr.backends.native import NativeBackend, native_takes
from aqr.core.layers import as_acb
from aqr.core.stats import SourceStats

__all__ = ["SharedStream", "StreamBatch", "StreamLayerMap", "stream_kernels", "stream_settings"]


class SharedStream:
    """What the layer maps of one streaming :class:`aqr.AQR` share: the recent predicted classes (the last
    :data:`~aqr.adapt.stream.robust.MARGINAL_WINDOW`, ``target="robust"``'s) and the batch in flight,
    :attr:`current` (an empty batch of 0 images between two).

    The caller runs each batch as :meth:`begin` (or :meth:`running`), the forward pass, :meth:`commit` where
    it was finite, :meth:`end`; :meth:`again` starts a second pass over the same batch.
    """

    def __init__(self, config: AQRConfig, router: ComponentRouter | None = None) -> None:
        self.config = config
        self.kind = stream_class(config)  # the layers' state class: it gives each batch its shares
        self.router = router  # target="mixed": the clusters of the images, shared by every layer
        self.recent: list[int] = []
        self.current = StreamBatch(BatchValues())

    def begin(self, images: int, held: bool = False) -> StreamBatch:
        """Start a batch of ``images`` images (``held``: mapped with the committed state, staging nothing),
        with the shares the target gives it from the recent predicted classes."""
        own, runs = (0.0, 1.0) if held else self.kind.batch_shares(self.recent, self.config)  # a held one steps nothing
        self.current = StreamBatch(BatchValues(images, held, own, runs))
        if self.router is not None:
            self.router.begin()
        return self.current

    def again(self) -> StreamBatch:
        """The batch in flight once more, with the same values and nothing staged (a second pass)."""
        self.current = self.current.again()
        if self.router is not None:
            self.router.begin()
        return self.current

    def end(self) -> None:
        """No batch in flight: what one had staged and not committed is dropped."""
        self.current = StreamBatch(BatchValues())

    @contextlib.contextmanager
    def running(self, images: int, held: bool = False) -> Iterator[StreamBatch]:
        """:meth:`begin` on the way in, :meth:`end` on the way out."""
        try:
            yield self.begin(images, held)
        finally:
            self.end()

    def device_reads(self) -> tuple[torch.Tensor, ...]:
        """What the commit of the batch in flight needs on the host and its layers left on a device (the
        clusters' values, ``target="mixed"``'s): the caller reads them with the logits', in one copy
        (:func:`aqr.adapt.stream.batch.host_outcome`), and hands them to :meth:`commit`."""
        return () if self.router is None else self.router.device_reads()

    def commit(self, labels: torch.Tensor | None = None, host_labels: torch.Tensor | None = None,
               host_reads: tuple[torch.Tensor, ...] = ()) -> None:
        """Apply every update the batch in flight staged (it was finite everywhere); ``labels``: each image's
        predicted class, which class-balanced layers (``target="robust"``) need; ``host_labels``: the same on
        the CPU where the caller has them (:func:`aqr.adapt.stream.batch.host_outcome`), else read here;
        ``host_reads``: :meth:`device_reads`'s tensors, read on the CPU (else they are read here)."""
        if self.router is not None:
            self.router.took(host_reads)
        commit = BatchCommit(labels, self.current.values.runs, host_labels)
        for stream, staged in self.current.take_staged():
            stream.commit_batch(staged, commit)
        if labels is not None:
            self.recent = (self.recent + (labels if host_labels is None else host_labels).tolist())[-MARGINAL_WINDOW:]

    def reset(self) -> None:
        """Forget the recent predicted classes (and the clusters' centres, where the target keeps them)."""
        self.recent = []
        if self.router is not None:
            self.router.reset()

    def __getstate__(self) -> dict[str, object]:
        # a copy holds the state between two batches: the batch in flight stays behind
        state = self.__dict__.copy()
        state["recent"] = list(self.recent)
        state["current"] = StreamBatch(BatchValues())
        return state


class StreamLayerMap(LayerMap):
    """One layer of a streaming :class:`aqr.AQR`: its running state (per device, made on first use)."""

    def __init__(self, stats: SourceStats, name: str, config: AQRConfig, tail: str, subsets: SubsetCache,
                 shared: SharedStream) -> None:
        target = config.target_kind
        if not isinstance(target, StreamTarget):  # a check of the caller's config, not a switch on the target
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
        self.shared = shared
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
        values as the general path, in one call instead of its chain of checks), in any memory layout."""
        stream, batch = self._small, self.shared.current
        if (stream is not None and stream.started and 0 < batch.images < stream.settings.rebuild_every
                and not batch.held and type(module) in PLAIN_BATCH_NORMS and not module.training
                and module.track_running_stats and native_takes(x) and x.ndim >= 2
                and x.shape[1] == self.info.channels and x.numel() > 0
                and stream.kernels is self._small_kernels):
            var, mean, weight, bias = batch_norm_tensors(module)
            if var is None or mean is None:  # not foldable
                return super().layer_forward(module, forward, x)
            # another layout (channels_last) is read as one contiguous block: the map's output is one, and so
            # are the layers' after it (one copy per forward, not one per layer and a general step). Reading
            # channels-last rows in place was slower at batch 1 on the ResNet-20 (x1.67 of the plain forward
            # against x1.54 with the copy, round-robin in one process), though each layer's scan took ~5 us more
            y, staged = stream.small_step(x.contiguous(), batch.images,
                                          self._affine_of(module, var, mean, weight, bias))
            if staged is None:
                batch.mark_nonfinite()
                return self._nonfinite(forward(x))
            batch.stage(stream, staged)
            return y  # type: ignore[return-value]
        return super().layer_forward(module, forward, x)

    def _note_small(self, stream: LayerStream, device: torch.device, pre: Affine | None) -> None:
        """Remember ``stream`` for :meth:`layer_forward`'s direct path when it qualifies: a folded BatchNorm
        (``pre``) on CPU whose per-batch backend folds natively, a state that takes small steps
        (:attr:`LayerStream.takes_small_steps`) on the C kernels, the channel on dim 1."""
        # (the kernels' type is asked before bound(), which would build a stale table on kernels that bind nothing)
        if (pre is not None and device.type == "cpu" and stream.takes_small_steps
                and isinstance(stream.kernels, NativeStreamKernels)
                and isinstance(self.backend(device), NativeBackend) and self.info.channel_dim == 1
                and stream.bound() is not None):
            self._small, self._small_kernels = stream, stream.kernels

    def stream(self, device: torch.device) -> LayerStream:
        """The layer's running state on ``device``."""
        stream = self.streams.get(device)
        if stream is None:
            source, kernels = self.source_on(device).knots, stream_kernels(device, self.config.native)
            route = None if self.shared.router is None else LayerRoute(self.shared.router, self.info.name)
            stream = layer_stream(self.config, source, self.settings, kernels, self.batch_knots,
                                  self._group_source(source), route)
            self.streams[device] = stream
        elif not stream.kernels.available():
            stream.kernels = TorchStreamKernels()  # a copy unpickled where the C kernels cannot be built
        return stream

    def move_stream(self, source: torch.device, target: torch.device) -> None:
        """The running state on ``source`` moves to ``target``: a state there built as :meth:`stream` builds one,
        which takes every value of it (:meth:`LayerStream.export_state`, :meth:`LayerStream.load_state`) and
        replaces any state ``target`` had; nothing where ``source`` has none or is ``target``."""
        if source == target or source not in self.streams:
            return
        old = self.streams.pop(source)
        self.streams.pop(target, None)
        if self._small is old:
            self._small = self._small_kernels = None
        self.stream(target).load_state(old.export_state())

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
        batch = self.shared.current
        if batch.held:
            return self._held(x, batch, pre, unmapped)
        state = stream = self.stream(x.device)
        acb = as_acb(x, self.info.channel_dim)
        if not stream.kernels.takes(acb):  # float64 or autograd on CPU: the torch kernels on the same state
            stream = _with_torch_kernels(stream)
        elif self._small is None:
            self._note_small(stream, x.device, pre)
        y, staged, finite = stream.batch_step(acb, batch.values, pre)
        if isinstance(finite, torch.Tensor) and not host_reads_are_cheap(x.device):
            # left on the device: the commit reads it with the logits' (a NaN/Inf batch is staged, never committed)
            batch.note_finite(finite)
            batch.stage(state, staged)
            return self._flagged(x, y.reshape(x.shape), finite, unmapped)  # type: ignore[union-attr]
        if not finite:
            batch.mark_nonfinite()
            return self._nonfinite(x if unmapped is None else unmapped())
        batch.stage(state, staged)
        return y.reshape(x.shape)  # type: ignore[union-attr]

    def _flagged(self, x: torch.Tensor, y: torch.Tensor, finite: torch.Tensor,
                 unmapped: Callable[[], torch.Tensor] | None) -> torch.Tensor:
        """The map ``y`` of ``x`` whose finite flag stays on the device: with ``on_nonfinite="skip"`` the layer's
        own output where it is false (as the host's check gives), else ``y`` (a NaN reaches the logits, which
        :class:`aqr.AQR` checks with the flags once)."""
        if self.on_nonfinite != "skip":
            return y
        return torch.where(finite, y, x if unmapped is None else unmapped())

    def _held(self, x: torch.Tensor, batch: StreamBatch, pre: Affine | None,
              unmapped: Callable[[], torch.Tensor] | None) -> torch.Tensor:
        """``x`` mapped with the committed running estimate, staging nothing; before the first batch (no
        estimate on this device yet) the layer's own output, unmapped."""
        if x.device not in self.streams or not self.streams[x.device].started:
            return x if unmapped is None else unmapped()
        stream = self.stream(x.device)
        acb = as_acb(x, self.info.channel_dim)
        if not stream.kernels.takes(acb):
            stream = _with_torch_kernels(stream)
        y, finite = stream.flagged_held(acb, batch.images, pre)
        if isinstance(finite, torch.Tensor) and not host_reads_are_cheap(x.device):
            batch.note_finite(finite)
            return self._flagged(x, y.reshape(x.shape), finite, unmapped)  # type: ignore[union-attr]
        if not finite:
            batch.mark_nonfinite()
            return self._nonfinite(x if unmapped is None else unmapped())
        return y.reshape(x.shape)  # type: ignore[union-attr]


def _with_torch_kernels(stream: LayerStream) -> LayerStream:
    """``stream``'s state stepped by the torch kernels (a shallow view sharing every buffer)."""
    view = object.__new__(type(stream))
    view.__dict__.update(stream.__dict__)
    view.kernels = TorchStreamKernels()
    return view
