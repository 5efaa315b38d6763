"""Test-time recalibration: the :class:`AQR` wrapper and the :func:`recalibrating` context manager.

On every forward pass, each selected normalization layer's output is mapped, channel by channel,
from this batch's quantiles onto the stored source quantiles (:func:`aqr.quantile_map`). Nothing is
learned and nothing persists between batches. With ``target="stream"``, :class:`AQR` instead keeps
a running estimate of each layer's target distribution across batches and maps every batch with it
(:mod:`aqr.adapt.stream.running`), for batches down to one image; with ``target="robust"``, the running
estimate is, while the predicted classes come in runs, a mixture of per-class ones
(:mod:`aqr.adapt.stream.robust`), for streams whose classes come in runs.

:class:`AQR` never changes the user's model: it runs a structural twin of it (:mod:`aqr.core.twin`)
whose selected norm layers map their outputs, so several threads may call one ``AQR`` at once and
get the outputs of sequential calls. :func:`recalibrating` recalibrates ``model(x)`` itself inside
its block, through the hook registry of :mod:`aqr.core.hooks` (thread-aware, undone by the last block
to end, in any order).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import types
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from aqr.adapt.config import AQRConfig, SmallBatchWarning, config_from_options
from aqr.adapt.layer_maps import MAP_CLASSES, LayerMap
from aqr.adapt.stream.base import all_finite
from aqr.adapt.stream.batch import host_outcome
from aqr.adapt.stream.build import component_router
from aqr.adapt.stream.saved import load_running_state, load_stream_record, running_state, stream_record
from aqr.adapt.stream.stream_maps import SharedStream, StreamBatch, StreamLayerMap
from aqr.backends import SubsetCache
from aqr.core.hooks import instrumented
from aqr.core.layers import LayerError, NonFiniteActivationError, check_named_layers, select_layers
from aqr.core.stats import SourceStats
from aqr.core.twin import structural_twin


STATE_KEY = "_extra_state"  # the running state's key in AQR.state_dict(), torch's name for a module's extra state


def build_layer_maps(stats: SourceStats, config: AQRConfig, logits_checked: bool = False,
                     batch: SharedStream | None = None) -> dict[str, LayerMap]:
    """The maps of the selected layers; with ``batch``, streaming ones sharing it (:mod:`aqr.adapt.stream.stream_maps`)."""
    tail = config.tail or stats.tail
    infos = [layer.info for layer in stats.layers.values()]
    chosen = select_layers(infos, "all" if config.layers is None else config.layers, stats.layer_names)
    subsets = SubsetCache(config.target_samples, config.samples_per_row)  # shared: layers of one shape share one index
    if batch is not None:
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
    stats.check_point("output", "aqr.recalibrating")
    config = config_from_options(options, "aqr.recalibrating")
    if config.target_kind.keeps_state:
        raise ValueError(f"target={config.target!r} keeps a state across batches, which a context manager cannot: "
                         f"use aqr.AQR(model, stats, target={config.target!r})")
    check_named_layers(model, config.layers)
    maps = build_layer_maps(stats, config)
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

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        if inspect.ismethod(self.plain) and self.plain.__self__ is self.module:
            # the class's forward: kept as the function, bound again to the copy (pickle would look the
            # method up on the copy, whose ``forward`` is this object)
            state["plain"], state["bound"] = self.plain.__func__, True
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        bound = state.pop("bound", False)
        self.__dict__.update(state)
        if bound:
            self.plain = types.MethodType(self.plain, self.module)

    def __call__(self, x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        self.called = True
        if not args and not kwargs:
            return self.layer_map.layer_forward(self.module, self.plain, x)
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


def _are_logits(out: object, images: int) -> bool:
    """Whether ``out`` is logits ``(images, classes)``, whose argmax gives each image's predicted class."""
    return isinstance(out, torch.Tensor) and out.ndim == 2 and out.shape[0] == images and out.shape[1] >= 1


def same_values(saved: object, current: torch.Tensor) -> bool:
    """Whether ``saved`` is a tensor of ``current``'s shape, dtype and values."""
    return (isinstance(saved, torch.Tensor) and saved.shape == current.shape and saved.dtype == current.dtype
            and torch.equal(saved.to(current.device), current))


def _check_input(x: object) -> None:
    """Refuse images stored as integers (token ids, 2-D, pass): torch would only say the dtypes differ;
    and refuse being recorded by ``torch.jit.trace`` (or an exporter built on it), whose graph would be wrong."""
    if torch.jit.is_tracing():
        raise RuntimeError("aqr.AQR cannot be recorded by torch.jit.trace (nor torch.onnx's tracing export): its map is "
                           "computed from each batch's values, partly in C kernels, so the trace would replay the traced "
                           "batch's map on every input; call the wrapper in eager PyTorch")
    if isinstance(x, torch.Tensor) and not x.is_floating_point() and (x.dtype in (torch.uint8, torch.bool) or x.ndim >= 3):
        raise TypeError(f"aqr.AQR got a {x.dtype} batch {tuple(x.shape)}; models take float images, e.g. x.float() / 255")


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
    (:mod:`aqr.adapt.stream.running`; options ``estimator``, ``horizon``, ``tail_window``, ``rebuild_every``);
    with ``target="robust"`` a class-balanced one (:mod:`aqr.adapt.stream.robust`; options ``groups``,
    ``class_horizon``, ``own_batch``, ``balance``, ``tail_window``, ``rebuild_every``; the logits' argmax
    assigns each image its class; ``balance < 1`` needs statistics calibrated with ``groups``):
    every batch updates it and is mapped with it. The state's memory is fixed (:meth:`memory_bytes`),
    :meth:`reset` returns to the initial state, and a batch enters the state only if every layer
    and the logits were finite (with NaN/Inf, ``on_nonfinite="raise"`` raises and ``"skip"`` returns
    the output; neither changes the state). The stream is one sequence: calls from several threads
    are serialized by a lock, each batch seeing the state its predecessors left. Under ``torch.compile`` a
    running target's forward runs eagerly (a graph break: its state lives in C kernels and locks), with the
    same outputs; for an exported graph use ``aqr.export``.

    The running state is in :meth:`state_dict` (``"_extra_state"``: tensors and plain values, which
    ``torch.load(..., weights_only=True)`` reads): an ``AQR`` of the same model, statistics and
    options that loads it continues the stream bit for bit, and one of another target, options or
    statistics refuses it. ``copy.deepcopy``, ``pickle`` and ``torch.save`` of the wrapper work at any
    time, also while another thread is inside a forward pass (the copy holds the state before that
    batch, and locks of its own); the C kernels and compiled paths are loaded again on the copy's first use.
    """

    def __init__(self, model: nn.Module, stats: SourceStats, **options: object) -> None:
        super().__init__()
        stats.check_model(model)
        stats.check_point("output", "aqr.AQR")
        self.model = model
        self.stats = stats
        self.config = config_from_options(options, "aqr.AQR")
        check_named_layers(model, self.config.layers)
        self._target = self.config.target_kind
        self._batch: SharedStream | None = None  # the stream the layer maps share (its batches, recent classes)
        if self._target.keeps_state:
            self._batch = SharedStream(self.config, component_router(self.config, stats))
            self._lock = threading.Lock()  # one batch at a time
            self._state_lock = threading.Lock()  # held while the running state changes or is read whole
            self._owner: int | None = None
        # "skip" needs no check; "raise" is checked on the logits in forward
        self._maps = build_layer_maps(stats, self.config, logits_checked=True, batch=self._batch)
        if self._batch is not None and self._batch.router is not None:
            self._batch.router.check_layers(list(self._maps))
        object.__setattr__(self, "_twin", recalibrated_twin(model, self._maps))  # not a submodule
        self._reach_checked = False
        self._small_batch_warned = False  # SmallBatchWarning is shown once per wrapper

    @property
    def layer_names(self) -> list[str]:
        """The layers recalibrated, in forward execution order."""
        return list(self._maps)

    def train(self, mode: bool = True) -> "AQR":
        """Set the wrapper's own ``training`` flag only: the user's model keeps its mode (the twin maps in
        eval mode either way), so a plain ``model(x)`` afterwards behaves as before."""
        if not isinstance(mode, bool):
            raise ValueError(f"training mode is expected to be boolean, got {mode!r}")
        self.training = mode
        return self

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]  # nn.Module's signature
        """Refuse a conversion (``.half()``, ``.double()``, ``.to(dtype or device)``, ``.cuda()``) that would change
        the user's model in place; one that changes none of its tensors (``.to`` where it already is) passes.
        A stream's running state moves with a move of device (``model.cuda()``, then ``adapter.cuda()``: the
        stream continues there); it stays float32 whatever the dtype asked."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        if any(fn(t) is not t for t in tensors):
            raise ValueError("aqr.AQR never converts the user's model in place: this conversion would change its "
                             "parameters' dtype or device; convert the model itself and wrap it again, e.g. "
                             "aqr.AQR(model.double(), stats)")
        result = super()._apply(fn, recurse)
        if self._batch is not None:
            with self._exclusive():
                for layer_map in self._maps.values():
                    for device in list(layer_map.streams):  # type: ignore[attr-defined]
                        target = fn(torch.empty(0, device=device)).device  # where the conversion sends a tensor
                        layer_map.move_stream(device, target)  # type: ignore[attr-defined]
        return result

    def requires_grad_(self, requires_grad: bool = True) -> "AQR":
        """Refuse to change the user's model's ``requires_grad`` flags (the wrapper has no parameters of its own);
        a call that changes none of them passes."""
        if any(p.requires_grad != requires_grad for p in self.model.parameters()):
            raise ValueError("aqr.AQR never changes the user's model: requires_grad_ would change its parameters' "
                             "flags; set them on the model itself (model.requires_grad_(...))")
        return self

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a state :meth:`state_dict` gave (the running state of a streaming target). Its ``model.*``
        entries are the user's model's: they are compared with it, never written into it, and a state whose
        values differ is refused (``ValueError`` naming the first entry) before anything changes. A state of
        another target (a running state where this one keeps none, none where it keeps one, or another running
        target's) is refused in one line naming both."""
        if strict:
            saved = state_dict.get(STATE_KEY)
            theirs = (saved.get("target") if isinstance(saved, Mapping) else "stream or robust") if saved is not None \
                else "batch"
            if theirs != self.config.target:
                held = "a running state" if saved is not None else f"no running state ({STATE_KEY!r})"
                raise RuntimeError(f"the state holds {held}, of target={theirs!r}; this aqr.AQR has "
                                   f"target={self.config.target!r}: build it with target={theirs!r} to load it")
        own = self.model.state_dict()
        differ = [k for k, v in own.items() if f"model.{k}" in state_dict and not same_values(state_dict[f"model.{k}"], v)]
        if differ:
            raise ValueError(f"the state holds other values of the user's model (model.{differ[0]}"
                             + (f" and {len(differ) - 1} more" if len(differ) > 1 else "") + "): aqr.AQR never "
                             "changes the model; load those weights into the model itself and wrap it again")
        # the wrapper's own entries only (torch's load would also write the model's, BatchNorm's counters included)
        rest = {k: v for k, v in state_dict.items() if not k.startswith("model.")}
        metadata = getattr(state_dict, "_metadata", None)
        missing: list[str] = [f"model.{k}" for k in own if f"model.{k}" not in state_dict]
        unexpected: list[str] = [k for k in state_dict if k.startswith("model.") and k[len("model."):] not in own]
        errors: list[str] = []
        self._load_from_state_dict(rest, "", {} if metadata is None else metadata.get("", {}), True, missing,
                                   unexpected, errors)
        checked = (("Missing", missing), ("Unexpected", unexpected)) if strict else ()
        if errors or any(keys for _, keys in checked):  # torch's own message
            quoted = {what: ", ".join(f'"{k}"' for k in keys) for what, keys in checked if keys}
            parts = [*(f"{what} key(s) in state_dict: {keys}. " for what, keys in quoted.items()), *errors]
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}:\n\t" + "\n\t".join(parts))
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x)
        if self._batch is not None:
            if torch.compiler.is_compiling():  # the running state (C kernels, locks) runs outside the graph
                return torch.compiler.disable(self._stream_forward)(x)
            return self._stream_forward(x)
        if not self.__dict__.get("_small_batch_warned", True):
            self._warn_small_batch(x)
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

    def _warn_small_batch(self, x: torch.Tensor) -> None:
        """Warn (once per wrapper) that a per-batch target got a batch too small for its quantiles."""
        message = self._target.small_batch_warning(int(x.shape[0])) if isinstance(x, torch.Tensor) and x.ndim else None
        if message is not None:
            self._small_batch_warned = True
            warnings.warn(f"aqr.AQR: {message}", SmallBatchWarning, stacklevel=3)

    def _stream_forward(self, x: torch.Tensor) -> torch.Tensor:
        """One batch of the stream: mapped with the running estimate, which it updates if all was finite."""
        with self._stream_batch(x, held=False) as batch:
            out, flag = self._mapped(x, batch)
            labels = None
            if self._target.needs_classes and flag is not False and _are_logits(out, batch.images):
                labels = out.argmax(dim=1)  # type: ignore[union-attr]
            # the forward's one read on the host (with what the target commits from: target="mixed"'s clusters)
            finite, host_labels, host_reads = host_outcome(flag, labels, self._batch.device_reads())  # type: ignore[union-attr]
            if finite:
                if self._target.needs_classes and labels is None:
                    labels = self._predicted(out, batch.images)  # (raises: not logits)
                with self._state_lock:
                    self._batch.commit(labels, host_labels, host_reads)  # type: ignore[union-attr]
                if self.config.passes == 2:  # the batch again, mapped with the state it just updated
                    self._batch.again()  # type: ignore[union-attr]
                    with torch.no_grad():
                        out = self._twin(x)  # what this pass stages is dropped at the batch's end
            elif self.config.on_nonfinite == "raise":
                raise NonFiniteActivationError("the logits are NaN or Inf on this batch; the stream's state is "
                                               "unchanged (on_nonfinite='skip' returns them)")
            return out

    @contextlib.contextmanager
    def _stream_batch(self, x: torch.Tensor, held: bool) -> Iterator[StreamBatch]:
        """The stream's batch, begun for ``x`` (``held``: mapped with the committed state, staging nothing),
        under the stream lock, and ended again on the way out."""
        if self._owner == threading.get_ident():
            raise RuntimeError("a streaming AQR was called from inside its own forward pass")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                with self._batch.running(int(x.shape[0]) if x.ndim else 0, held=held) as batch:  # type: ignore[union-attr]
                    yield batch
            finally:
                self._owner = None

    def _mapped(self, x: torch.Tensor, batch: StreamBatch) -> tuple[object, bool | torch.Tensor]:
        """The twin's output for ``x`` (no gradient) and whether it, and every layer's values, were finite: a
        ``bool``, or a 0-d bool tensor on the device, not read (:func:`aqr.adapt.stream.batch.host_outcome` reads it)."""
        with torch.no_grad():
            out = self._twin(x)
        if not self._reach_checked:
            self._check_every_layer_called()
        flag = batch.flag
        if flag is False or not isinstance(out, torch.Tensor):
            return out, flag
        return out, all_finite(flag, torch.isfinite(out).all())

    def forward_held(self, x: torch.Tensor) -> torch.Tensor:
        """The output for a batch mapped with the running state as it stands, which the batch leaves as it
        was (``target="stream"``/``"robust"``): each layer maps it as :meth:`forward` maps a batch of fewer than
        ``rebuild_every`` images, merging nothing of it, staging nothing and committing nothing. Before the
        first batch, and for ``target="batch"`` (which keeps no state), that is the model's own output in eval
        mode. NaN/Inf: as :meth:`forward` (``on_nonfinite``), and the state is unchanged either way."""
        _check_input(x)
        if self._batch is None:
            with torch.no_grad():
                return structural_twin(self.model)(x)
        if torch.compiler.is_compiling():
            return torch.compiler.disable(self._held_forward)(x)
        return self._held_forward(x)

    def _held_forward(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward_held` of a running target."""
        with self._stream_batch(x, held=True) as batch:
            out, flag = self._mapped(x, batch)
            finite = host_outcome(flag).finite
            if not finite and self.config.on_nonfinite == "raise":
                raise NonFiniteActivationError("the logits are NaN or Inf on this batch; the stream's state is "
                                               "unchanged (on_nonfinite='skip' returns them)")
            return out

    def _predicted(self, out: object, images: int) -> torch.Tensor:
        """Each image's predicted class from the logits (the targets that take them: ``"robust"``, ``"mixed"``)."""
        if not _are_logits(out, images):
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise ValueError(f"target={self._target.name!r} needs the model to return logits (N, classes) for N = {images} "
                             f"images, got {shape}; the stream's state is unchanged")
        return out.argmax(dim=1)

    def reset(self) -> None:
        """Forget the stream (``target="stream"``): every layer back to its state before the first batch."""
        if self._batch is None:
            return
        with self._exclusive():
            for layer_map in self._maps.values():
                layer_map.reset()  # type: ignore[attr-defined]
            self._batch.reset()

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Between two batches (waiting for one in flight), with the running state held."""
        if self._owner == threading.get_ident():
            raise RuntimeError("a streaming AQR's state cannot be reset or loaded from inside its own forward pass")
        with self._lock, self._state_lock:
            yield

    def memory_bytes(self) -> int:
        """Bytes of the running state (``target="stream"``; fixed, 0 before the first batch and for batches)."""
        if self._batch is None:
            return 0
        layers = sum(m.memory_bytes() for m in self._maps.values())  # type: ignore[attr-defined]
        return layers + 8 * len(self._batch.recent)  # target="robust": the recent predicted classes

    def _save_to_state_dict(self, destination: dict[str, object], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._batch is not None:  # the running state (saved.stream_record), read whole between two commits
            with self._state_lock:
                record = stream_record(self.config, self._maps, self._batch)  # type: ignore[arg-type]
            destination[prefix + STATE_KEY] = record

    def _load_from_state_dict(self, state_dict: dict[str, object], prefix: str, local_metadata: dict[str, object],
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        key = prefix + STATE_KEY
        rest = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        # (torch passes strict=True here and drops the missing and unexpected keys itself when not strict)
        if self._batch is None:
            if key in state_dict:  # a running state, which target="batch" does not keep
                unexpected_keys.append(key)
            return
        if key not in state_dict:
            missing_keys.append(key)
            return
        try:
            with self._exclusive():
                load_stream_record(state_dict[key], self.config, self._maps, self._batch)  # type: ignore[arg-type]
        except (ValueError, RuntimeError) as err:  # reported with the other keys' errors; the state is unchanged
            error_msgs.append(f"{key!r}: {err}")

    def __getstate__(self) -> dict[str, object]:
        state = super().__getstate__()
        if self._batch is not None:
            # locks and the id of a thread inside forward stay behind: a copy gets its own. The state is read
            # whole here (a batch may commit while the copy is being made) and set on the copy again
            del state["_lock"], state["_state_lock"]
            state["_owner"] = None
            with self._state_lock:
                state["_running_state"] = running_state(self._maps, self._batch)  # type: ignore[arg-type]
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        running = state.pop("_running_state", None)
        super().__setstate__(state)
        shared = SubsetCache(self.config.target_samples, self.config.samples_per_row)
        for layer_map in self._maps.values():  # one subset cache for every layer, as built
            layer_map.subsets = shared
        if self._batch is not None:
            self._lock, self._state_lock = threading.Lock(), threading.Lock()
            self._batch.end()  # no batch in flight on the copy
            if running is not None:
                load_running_state(running, self._maps, self._batch)  # type: ignore[arg-type]

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
        return text + self._target.describe(self.config)
