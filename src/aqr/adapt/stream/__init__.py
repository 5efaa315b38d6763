"""Streaming AQR: each layer's target distribution as a running estimate across batches.

:mod:`~aqr.adapt.stream.running` keeps one layer's running state (``target="stream"``) and
:mod:`~aqr.adapt.stream.robust` its class-balanced form (``target="robust"``); each state class answers
for its target (its shares of a batch, its step and commit), and :mod:`~aqr.adapt.stream.build` builds
a layer's state from an :class:`aqr.AQRConfig` with the class its target names.
:mod:`~aqr.adapt.stream.base` is the interface of the kernels they run on, in torch
(:mod:`~aqr.adapt.stream.torch_kernels`, any device) and in C (:mod:`~aqr.adapt.stream.native_kernels`,
``_stream_kernels.c``, CPU); :mod:`~aqr.adapt.stream.stream_maps` gives :class:`aqr.AQR` a layer map
per recalibrated layer that steps them, sharing one :class:`~aqr.adapt.stream.stream_maps.SharedStream`
whose batches (:mod:`~aqr.adapt.stream.batch`) the layers stage their updates on, and
:mod:`~aqr.adapt.stream.saved` its running state as plain values (its ``state_dict()`` entry and its
copies). The package imports :mod:`aqr.adapt.config` (the options), never the other way round; nothing is
imported here, so that importing one module loads only what it needs.
"""
