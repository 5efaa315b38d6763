"""The running state of a streaming :class:`aqr.AQR` as plain values: its ``state_dict()`` entry and its copies.

:func:`running_state` gives every layer's running state (per device it ran on; tensors cloned, ints,
floats, bools, lists) and the recent predicted classes; :func:`load_running_state` checks such a state
against an AQR's layers and only then takes it, in place. :func:`stream_record` adds what identifies
the stream (the target, the options that shape the state, a digest of the source knots), so that
:func:`load_stream_record` refuses the state of another target, configuration or set of statistics
with a ``ValueError`` instead of silently restarting. Everything is a tensor, a number, a string, a
list or a dict: ``torch.load(..., weights_only=True)`` reads it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import fields

import torch

from aqr.adapt.config import AQRConfig
from aqr.adapt.stream.mixed import ComponentRouter
from aqr.adapt.stream.robust import MARGINAL_WINDOW
from aqr.adapt.stream.running import LayerStream
from aqr.adapt.stream.stream_maps import SharedStream, StreamLayerMap

FORMAT = "aqr.AQR running state"
VERSION = 1
# how a stream is run, not what it is: a state saved with one value continues with another
RUN_OPTIONS = ("compile", "native", "triton", "on_nonfinite")


def running_state(maps: Mapping[str, StreamLayerMap], shared: SharedStream) -> dict[str, object]:
    """Every layer's running state, one entry per device it ran on, and the recent predicted classes.

    The caller holds the lock that keeps the state from changing meanwhile."""
    layers = {name: [stream.export_state() for stream in list(layer_map.streams.values())]
              for name, layer_map in maps.items()}
    state: dict[str, object] = {"layers": layers, "recent": torch.tensor(shared.recent, dtype=torch.int64)}
    if shared.router is not None:  # target="mixed": the clusters' centres, which every layer shares
        state["clusters"] = shared.router.export_state()
    return state


def load_running_state(state: Mapping[str, object], maps: Mapping[str, StreamLayerMap], shared: SharedStream) -> None:
    """Take ``state`` (from :func:`running_state`): every part is checked before any is written; a layer's
    stream on a device the state does not name goes back to its initial state."""
    layers, recent = state.get("layers"), state.get("recent")
    if not isinstance(layers, Mapping) or list(layers) != list(maps):
        saved = list(layers) if isinstance(layers, Mapping) else layers
        raise ValueError(f"the state was saved for the layers {saved}; this AQR recalibrates {list(maps)}")
    if (not isinstance(recent, torch.Tensor) or recent.dtype != torch.int64 or recent.ndim != 1
            or len(recent) > MARGINAL_WINDOW or bool((recent < 0).any())):
        raise ValueError(f"the state's recent classes must be an int64 vector of at most {MARGINAL_WINDOW} "
                         f"classes >= 0, got {recent!r}")
    if shared.router is not None:
        if "clusters" not in state:
            raise ValueError("the state holds no clusters' state ('clusters'), which target='mixed' keeps")
        shared.router.check_state(state["clusters"])
    plan: list[tuple[LayerStream, Mapping[str, object]]] = []
    for name, entries in layers.items():
        if not isinstance(entries, list):
            raise ValueError(f"the state of layer {name!r} must be a list (one entry per device)")
        layer_map, devices = maps[name], set()
        for values in entries:
            knots = values.get("knots") if isinstance(values, Mapping) else None
            if not isinstance(knots, torch.Tensor):
                raise ValueError(f"the state of layer {name!r} has an entry without its knots tensor")
            if knots.device in devices:
                raise ValueError(f"the state of layer {name!r} holds two entries for {knots.device}")
            devices.add(knots.device)
            # a copy has its streams already; only a fresh AQR makes one (and its kernels) here
            stream = layer_map.streams.get(knots.device) or layer_map.stream(knots.device)
            try:
                stream.check_state(values)
            except ValueError as err:
                raise ValueError(f"layer {name!r}: {err}") from None
            plan.append((stream, values))
    taken = {id(stream) for stream, _ in plan}
    for layer_map in maps.values():
        for stream in layer_map.streams.values():
            if id(stream) not in taken:
                stream.reset()
    for stream, values in plan:
        stream.load_state(values)
    if shared.router is not None:
        shared.router.load_state(state["clusters"])  # type: ignore[arg-type]
    shared.recent = recent.tolist()


def config_record(config: AQRConfig) -> dict[str, object]:
    """The options that shape the running state (all but :data:`RUN_OPTIONS`), as plain values."""
    record = {}
    for f in fields(config):
        if f.name not in RUN_OPTIONS:
            value = getattr(config, f.name)
            record[f.name] = list(value) if isinstance(value, (list, tuple)) else value
    return record


def source_digest(maps: Mapping[str, StreamLayerMap], router: ComponentRouter | None = None) -> str:
    """A sha256 of what each layer maps onto: its name, tail strategy and source knots (the groups' too), and
    where ``router`` is given (``target="mixed"``) the space its centres live in (the descriptors' mean and
    whitening)."""
    digest = hashlib.sha256()
    for name, layer_map in maps.items():
        digest.update(f"{name}\0{layer_map.tail}\0".encode())
        for t in (layer_map.source.knots, layer_map.group_quantiles):
            if t is not None:
                t = t.detach().to("cpu", torch.float32).contiguous()
                digest.update(f"{tuple(t.shape)}\0".encode())
                digest.update(t.numpy().tobytes())
    if router is not None:
        for t in (router.mean, router.whitening):
            digest.update(f"{tuple(t.shape)}\0".encode())
            digest.update(t.to(torch.float64).contiguous().numpy().tobytes())
    return digest.hexdigest()


def stream_record(config: AQRConfig, maps: Mapping[str, StreamLayerMap], shared: SharedStream) -> dict[str, object]:
    """:func:`running_state` with what identifies the stream: the entry of :meth:`aqr.AQR.state_dict`."""
    return {"format": FORMAT, "version": VERSION, "target": config.target, "config": config_record(config),
            "source": source_digest(maps, shared.router), **running_state(maps, shared)}


def load_stream_record(record: object, config: AQRConfig, maps: Mapping[str, StreamLayerMap],
                       shared: SharedStream) -> None:
    """Take a state :func:`stream_record` gave; ``ValueError`` (nothing changed) if it is not one, or is one
    of another target, configuration or set of statistics."""
    if not isinstance(record, Mapping) or record.get("format") != FORMAT:
        raise ValueError(f"not a running state of aqr.AQR (expected a dict with format={FORMAT!r})")
    if record.get("version") != VERSION:
        raise ValueError(f"the running state has format version {record.get('version')!r}; this aqr reads "
                         f"version {VERSION}")
    if record.get("target") != config.target:
        raise ValueError(f"the running state is one of target={record.get('target')!r}; this AQR has "
                         f"target={config.target!r}")
    saved, mine = record.get("config"), config_record(config)
    if not isinstance(saved, Mapping):
        raise ValueError("the running state names no options")
    differ = [f"{k}={saved.get(k)!r} (this AQR: {v!r})" for k, v in mine.items() if saved.get(k) != v]
    differ += [f"{k}={v!r} (not an option of this aqr)" for k, v in saved.items() if k not in mine]
    if differ:
        raise ValueError(f"the running state was saved with other options: {', '.join(differ)}")
    if record.get("source") != source_digest(maps, shared.router):
        raise ValueError("the running state was saved for other source statistics (the layers' source knots or "
                         "the descriptors' whitening differ): build the AQR with the statistics it was saved with")
    load_running_state(record, maps, shared)
