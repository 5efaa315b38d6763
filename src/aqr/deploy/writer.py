"""``aqr.export``: an adapted model as a graph that runs without aqr, in ONNX Runtime or from ``torch.export``.

Three forms (``form=``):

* ``"batch"``: per-batch AQR. The graph computes each selected layer's per-channel quantiles from the batch
  (a sort, a linear interpolation) and maps with them onto the source knots, held as constants: the exact
  map (``mode="exact"``) whatever mode the wrapper runs in.
* ``"frozen"``: the map of a streaming or robust target frozen at its current state: a fixed per-channel
  piecewise-linear function (the running state's lookup table), no sort; for batch 1 and for runtimes
  without one. The graph maps as :meth:`aqr.AQR.forward_held` does.
* ``"stream"``: streaming AQR (``target="stream"``, ``estimator="cdf-ema"``) with its running state as
  explicit inputs and outputs of the graph: a server keeps the state and passes it back with the next
  batch. :func:`stream_state` gives the state to start from.

The graph is traced from pure-torch layer maps (:mod:`aqr.deploy.maps`) in a twin of the user's model
(:mod:`aqr.core.twin`): it needs no aqr, no custom operator and no C kernel at run time. The batch size
is dynamic; the graph computes in float32.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from aqr.adapt import AQR
from aqr.adapt.layer_maps import LayerMap, batch_norm_tensors
from aqr.adapt.stream.running import COUNT_CELLS, LayerStream, StreamSettings
from aqr.adapt.stream.stream_maps import StreamLayerMap
from aqr.core.layers import LayerError
from aqr.core.twin import structural_twin
from aqr.deploy.maps import COUNTERS, STATE_PARTS, BatchMap, FrozenMap, LayerRows, MappedLayer, StateSlots, StreamMap
from aqr.methods.base import TTAMethod

FORMATS = ("onnx", "torch")
FORMS = ("batch", "frozen", "stream")
INSTALL = "pip install 'aqr[export]'"
OPSET = 18


class ExportError(ValueError):
    """What was asked cannot be exported (the message says why, in one line)."""


def export(adapted: nn.Module, example_input: torch.Tensor, path: str | os.PathLike[str], format: str = "onnx",
           form: str | None = None) -> Path:
    """Write ``adapted`` (an :class:`aqr.AQR`, or the ``"aqr"`` method) as a graph to ``path`` and return the path.

    ``format``: ``"onnx"`` (``torch.onnx.export``'s TorchScript-based exporter, opset 18: a fraction of the
    dynamo exporter's time on these graphs; needs ``pip install 'aqr[export]'``) or ``"torch"``
    (a ``torch.export`` program saved with ``torch.export.save``). ``form``: ``"batch"``, ``"frozen"`` or
    ``"stream"`` (see :mod:`aqr.deploy.writer`); by default ``"batch"`` for ``target="batch"`` and ``"stream"``
    for ``target="stream"``, ``"frozen"`` for ``target="robust"``. ``example_input``: one batch the model takes
    (float32); the exported graph takes any batch size. The stream graph's inputs are the batch and the state
    (named ``state.<layer>.<part>``, :func:`stream_state`), its outputs the logits and the new state.
    Raises :class:`ExportError` for what cannot be exported, ``ImportError`` without ONNX.
    """
    aqr = _the_aqr(adapted)
    if format not in FORMATS:
        raise ExportError(f"format must be one of {', '.join(FORMATS)}, got {format!r}")
    form = _the_form(aqr, form)
    if format == "onnx":
        require_onnx()
    if not isinstance(example_input, torch.Tensor) or not example_input.is_floating_point() or example_input.ndim < 2:
        raise ExportError("example_input must be a float batch (N, ...) the model takes, got "
                          f"{_describe(example_input)}")
    module = export_module(aqr, form)
    x = _example_batch(example_input.detach().float().cpu())
    inputs = (x, *stream_state(aqr).values()) if form == "stream" else (x,)
    with torch.no_grad():
        module(*inputs)  # eager: the maps note that they were called
    _check_reached(module)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    shapes = ({0: batch}, *([None] * (len(inputs) - 1)))
    names = input_names(aqr, form)
    if format == "torch":
        program = torch.export.export(module, inputs, dynamic_shapes=shapes, strict=False)
        torch.export.save(program, path)
        return path
    outputs = ["logits", *(f"new_{name}" for name in names[1:])]
    with warnings.catch_warnings():  # the TorchScript-based exporter's deprecation notice
        warnings.simplefilter("ignore")
        torch.onnx.export(module, inputs, str(path), input_names=names, output_names=outputs,
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=OPSET,
                          dynamo=False)
    return path


def require_onnx() -> None:
    """Raise ``ImportError`` naming the extra to install unless ``onnx`` imports."""
    if importlib.util.find_spec("onnx") is None:
        raise ImportError(f"aqr.export(format='onnx') needs the onnx package: {INSTALL}")


def export_module(adapted: AQR, form: str) -> nn.Module:
    """The module ``aqr.export`` traces for ``form``: a twin of ``adapted.model`` whose selected norm layers
    are followed by pure-torch maps (:mod:`aqr.deploy.maps`); for ``"stream"`` one that takes and returns
    the running state besides (:class:`StreamGraph`)."""
    adapted = _the_aqr(adapted)
    form = _the_form(adapted, form)
    slots = StateSlots()
    maps: dict[str, LayerRows] = {}
    twin = structural_twin(adapted.model)
    for name, layer_map in adapted._maps.items():  # noqa: SLF001  (the wrapper's own maps, read only)
        norm = twin.get_submodule(name)
        maps[name] = _layer_module(adapted, name, layer_map, norm, form, slots)
        twin.set_submodule(name, MappedLayer(norm, maps[name]))
    if form == "stream":
        return StreamGraph(twin, slots, list(maps)).eval()
    return PlainGraph(twin).eval()


class PlainGraph(nn.Module):
    """The twin with its maps: ``forward(x)`` gives the logits."""

    def __init__(self, twin: nn.Module) -> None:
        super().__init__()
        self.twin = twin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.twin(x)


class StreamGraph(nn.Module):
    """The twin with its streaming maps: ``forward(x, *state)`` gives the logits and the new state (the
    layers' parts :data:`aqr.deploy.maps.STATE_PARTS`, layer by layer)."""

    def __init__(self, twin: nn.Module, slots: StateSlots, layers: list[str]) -> None:
        super().__init__()
        self.twin = twin
        self.slots = slots
        self.layers = layers

    def forward(self, x: torch.Tensor, *state: torch.Tensor) -> tuple[torch.Tensor, ...]:
        parts = len(STATE_PARTS)
        if len(state) != parts * len(self.layers):
            raise ValueError(f"the stream graph takes {parts * len(self.layers)} state tensors, got {len(state)}")
        self.slots.inputs = {name: dict(zip(STATE_PARTS, state[i * parts:(i + 1) * parts]))
                             for i, name in enumerate(self.layers)}
        self.slots.outputs = {}
        try:
            out = self.twin(x)
            new = [self.slots.outputs[name][part] for name in self.layers for part in STATE_PARTS]
        finally:
            self.slots.inputs, self.slots.outputs = {}, {}
        return (out, *new)


def input_names(adapted: AQR, form: str) -> list[str]:
    """The graph's input names: ``"input"``, then for ``"stream"`` ``state.<layer>.<part>``."""
    names = ["input"]
    if form == "stream":
        names += [f"state.{layer}.{part}" for layer in _the_aqr(adapted).layer_names for part in STATE_PARTS]
    return names


def stream_state(adapted: nn.Module) -> dict[str, torch.Tensor]:
    """The running state of a streaming ``adapted`` as the stream graph's state inputs (``state.<layer>.<part>``):
    its state on CPU as it stands (read through ``state_dict()``), or the initial state before its first batch.
    Pass it with the first batch; each call of the graph returns the next one."""
    aqr = _the_aqr(adapted)
    _check_stream(aqr)
    record = aqr.state_dict()["_extra_state"]
    state: dict[str, torch.Tensor] = {}
    for name, layer_map in aqr._maps.items():  # noqa: SLF001
        entries = [e for e in record["layers"][name] if e["knots"].device.type == "cpu"]
        values = _graph_state(entries[0]) if entries else _initial_state(layer_map)
        state.update({f"state.{name}.{part}": values[part] for part in STATE_PARTS})
    return state


def _graph_state(values: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """A layer's state as :meth:`LayerStream.export_state` gives it, in the graph's parts."""
    pairs = values["table.pairs"]
    counters = [int(values["started"]), int(values["seen"]), int(values["group.images"]),
                int(values["window.filled"]), int(values["window.head"])]
    return {"knots": values["knots"].float(), "slopes": pairs[..., 0].contiguous(),
            "intercepts": pairs[..., 1].contiguous(), "glo": values["table.glo"], "ginv": values["table.ginv"],
            "ring_lo": values["window.ring_lo"], "ring_hi": values["window.ring_hi"],
            "counts": values["group.counts"].long(), "gmin": values["group.gmin"], "gmax": values["group.gmax"],
            "counters": torch.tensor(counters, dtype=torch.int64)}


def _initial_state(layer_map: StreamLayerMap) -> dict[str, torch.Tensor]:
    """A layer's state before its first batch (what :meth:`LayerStream.reset` leaves)."""
    c, k = layer_map.source.knots.shape
    s = layer_map.settings
    zeros = lambda *shape: torch.zeros(*shape)  # noqa: E731
    return {"knots": zeros(c, k), "slopes": zeros(c, s.grid + 2), "intercepts": zeros(c, s.grid + 2),
            "glo": zeros(c), "ginv": zeros(c), "ring_lo": zeros(s.tail_window, c), "ring_hi": zeros(s.tail_window, c),
            "counts": torch.zeros(c, COUNT_CELLS + 4, dtype=torch.int64), "gmin": torch.full((c,), float("inf")),
            "gmax": torch.full((c,), float("-inf")), "counters": torch.zeros(len(COUNTERS), dtype=torch.int64)}


# ------------------------------------------------------------------------------------------- checks


def _the_aqr(adapted: object) -> AQR:
    """``adapted`` as the :class:`aqr.AQR` to export; :class:`ExportError` for anything else."""
    if isinstance(adapted, AQR):
        return adapted
    inner = getattr(adapted, "aqr", None)
    if isinstance(adapted, TTAMethod) and isinstance(inner, AQR):  # the "aqr" method wraps one
        return inner
    if isinstance(adapted, TTAMethod):
        kind = "takes gradient steps" if getattr(adapted, "optimizer", None) is not None else "is not AQR"
        raise ExportError(f"method {adapted.name!r} cannot be exported: it {kind}, and aqr.export writes AQR's "
                          "inference-only map (an aqr.AQR or the 'aqr' method)")
    raise ExportError(f"aqr.export takes an aqr.AQR (or the 'aqr' method), got {_describe(adapted)}")


def _the_form(adapted: AQR, form: str | None) -> str:
    """The form to export (``form``, or the target's default), checked against the wrapper's target."""
    target = adapted.config.target
    if form is None:
        form = {"batch": "batch", "stream": "stream"}.get(target, "frozen")
    if form not in FORMS:
        raise ExportError(f"form must be one of {', '.join(FORMS)}, got {form!r}")
    if adapted.config.match != "quantiles":
        raise ExportError(f"match={adapted.config.match!r} has no exported form yet; export AQR's quantile map")
    if form == "batch" and target != "batch":
        raise ExportError(f"form='batch' exports per-batch AQR: this wrapper has target={target!r} (export "
                          "form='frozen' or 'stream', or wrap the model with target='batch')")
    if target == "mixed":
        raise ExportError("target='mixed' has no exported form yet: each image's map depends on its cluster, which "
                          "a frozen map would drop; export a target='stream' wrapper (its shared state) instead")
    if form in ("frozen", "stream") and target == "batch":
        raise ExportError(f"form={form!r} exports a running state, which target='batch' does not keep "
                          "(use form='batch', or wrap the model with target='stream')")
    if form == "stream":
        _check_stream(adapted)
    return form


def _check_stream(adapted: AQR) -> None:
    if adapted.config.target != "stream":
        raise ExportError(f"form='stream' exports target='stream' (its state in and out of the graph), not "
                          f"target={adapted.config.target!r}; export form='frozen'")
    if adapted.config.estimator != "cdf-ema":
        raise ExportError(f"form='stream' exports estimator='cdf-ema', not {adapted.config.estimator!r}")


def _layer_module(adapted: AQR, name: str, layer_map: LayerMap, norm: nn.Module, form: str,
                  slots: StateSlots) -> LayerRows:
    """The pure-torch map of layer ``name`` for ``form``."""
    info = layer_map.info
    source = layer_map.source_on(torch.device("cpu"))
    if form == "batch":
        return BatchMap(source.knots, layer_map.tail, info.channel_dim, source.loc, source.scale,
                        adapted.config.gaussian_p)
    # eager AQR folds an eval BatchNorm into the streaming map where its kernels can (LayerMap.foldable)
    pre = _folded_batch_norm(layer_map, norm) if adapted.config.native or adapted.config.triton else None
    if form == "stream":
        settings: StreamSettings = layer_map.settings  # type: ignore[attr-defined]
        return StreamMap(name, slots, source.knots, settings, info.channel_dim, pre)
    stream = _cpu_stream(layer_map)
    if stream is None or not stream.started:
        raise ExportError(f"form='frozen' needs a running state: layer {name!r} has seen no batch on CPU yet "
                          "(run batches through the wrapper first)")
    values = stream.export_state()
    return FrozenMap(values["knots"], stream.source, stream.settings.grid, info.channel_dim, pre)


def _cpu_stream(layer_map: LayerMap) -> LayerStream | None:
    streams = getattr(layer_map, "streams", {})
    return streams.get(torch.device("cpu"))


def _folded_batch_norm(layer_map: LayerMap, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An eval BatchNorm with running statistics as its ``(scale, shift)`` per channel (eager AQR folds it
    into the map), else ``None``."""
    if not (isinstance(norm, nn.modules.batchnorm._BatchNorm) and norm.track_running_stats):
        return None
    var, mean, weight, bias = batch_norm_tensors(norm)
    if var is None or mean is None:
        return None
    return layer_map._affine_of(norm, var, mean, weight, bias)  # noqa: SLF001  (as ATen's eval batch_norm)


def _check_reached(module: nn.Module) -> None:
    """Raise :class:`LayerError` for a map the model's forward pass did not call."""
    for name, sub in module.named_modules():
        if isinstance(sub, LayerRows) and not sub.called:
            layer = name.removeprefix("twin.").removesuffix(".layer_map")
            raise LayerError(f"layer {layer!r} is not called through the model's module tree, so the exported "
                             "graph cannot map it (register it as a submodule, e.g. in nn.ModuleList)")


def _example_batch(x: torch.Tensor) -> torch.Tensor:
    """``x`` with at least two images: a traced batch of 1 would fix the graph's batch size."""
    return torch.cat([x, x.flip(0)]) if x.shape[0] == 1 else x


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor {tuple(value.shape)}"
    return type(value).__name__
