"""Streaming AQR: each layer's target distribution as a running estimate across batches.

:mod:`~aqr.adapt.stream.running` keeps one layer's running state (``target="stream"``) and
:mod:`~aqr.adapt.stream.robust` its class-balanced form (``target="robust"``);
:mod:`~aqr.adapt.stream.base` is the interface of the kernels they run on, in torch
(:mod:`~aqr.adapt.stream.torch_kernels`, any device) and in C (:mod:`~aqr.adapt.stream.native_kernels`,
``_stream_kernels.c``, CPU); :mod:`~aqr.adapt.stream.stream_maps` gives :class:`aqr.AQR` a layer map
per recalibrated layer that steps them, and :mod:`~aqr.adapt.stream.saved` its running state as plain
values (its ``state_dict()`` entry and its copies). Nothing is imported here: :mod:`aqr.adapt.config` reads the
running states' settings without the layer maps, which import it.
"""
