"""The stream package builds its own state from an :class:`aqr.AQRConfig`.

The config is a plain set of options and imports nothing of this package; here each running target names
the class of the state its layers keep (:attr:`aqr.adapt.stream.running.LayerStream.target`), and
:func:`layer_stream` builds one layer's state from the config with that class's
:meth:`~aqr.adapt.stream.running.LayerStream.from_config`, on the kernels :func:`stream_kernels` picks.
"""

from __future__ import annotations

import torch

from aqr.adapt.config import AQRConfig
from aqr.adapt.stream.base import StreamKernels
from aqr.adapt.stream.mixed import ComponentRouter, LayerRoute, MixedLayerStream
from aqr.adapt.stream.native_kernels import NativeStreamKernels, native_stream_kernels
from aqr.adapt.stream.robust import RobustLayerStream
from aqr.adapt.stream.running import BatchKnots, LayerStream, StreamSettings
from aqr.adapt.stream.torch_kernels import TorchStreamKernels
from aqr.core.stats import SourceStats

# the state each running target's layers keep, by the target's name
STREAM_CLASSES: dict[str, type[LayerStream]] = {cls.target: cls for cls in (LayerStream, RobustLayerStream,
                                                                           MixedLayerStream)}  # type: ignore[misc]


def stream_class(config: AQRConfig) -> type[LayerStream]:
    """The class of the running state ``config``'s target keeps per layer; ``ValueError`` for a target that
    keeps none."""
    cls = STREAM_CLASSES.get(config.target)
    if cls is None:
        raise ValueError(f"target={config.target!r} keeps no running state: its layers map each batch alone")
    return cls


def stream_settings(config: AQRConfig, stats: SourceStats) -> StreamSettings:
    """The running estimate's settings from an :class:`aqr.AQRConfig` (``tail_batch`` from the statistics)."""
    return StreamSettings.of(config, stats.tail_batch)


def stream_kernels(device: torch.device, native: bool) -> StreamKernels:
    """aqr's C kernels on CPU when ``native`` and built, else the torch kernels."""
    if native and device.type == "cpu":
        lib = native_stream_kernels()
        if lib is not None:
            return NativeStreamKernels(lib)
    return TorchStreamKernels()


def layer_stream(config: AQRConfig, source: torch.Tensor, settings: StreamSettings, kernels: StreamKernels,
                 batch_knots: BatchKnots, group_source: torch.Tensor | None = None,
                 route: LayerRoute | None = None) -> LayerStream:
    """One layer's running state for ``config`` on ``source``'s device (``group_source``: the groups' source
    knots, where the target maps onto them; ``route``: the layer's place among the AQR's clusters, where the
    target keeps them)."""
    return stream_class(config).from_config(config, source, settings, kernels, batch_knots, group_source, route)


def component_router(config: AQRConfig, stats: SourceStats) -> ComponentRouter | None:
    """The router of the clusters of ``config``'s target where it keeps them (``target="mixed"``), else ``None``;
    ``ValueError`` where the statistics hold no descriptors for it."""
    if stream_class(config) is not MixedLayerStream:
        return None
    return ComponentRouter.of(config, stats.descriptors)
