"""The test-time adaptation protocol, in one place.

A method is an ``nn.Module`` that owns a private deep copy of the user's model (the user's model is
never modified) and returns, from ``forward(x)``, the logits that are scored. Subclasses only say how
to configure their copy, which optimizer (if any) adapts it, and what one adaptation step does;
:class:`TTAMethod` decides when to reset, how many steps to take and which forward pass is returned.

Protocols (``ProtocolConfig.protocol``):

``"online"`` (default; continual adaptation, as in the official TENT/SAR code)
    Never reset. Each batch takes ``steps`` adaptation steps and the scored logits are those of the
    forward pass that computed the (last) loss, i.e. predictions made *before* that update.
``"episodic"`` (the AQR paper's setting: ask for it with ``protocol="episodic"``)
    Every batch starts from the original weights and optimizer state (``reset()`` runs first).
    Weight-updating methods take ``steps`` adaptation steps on the batch, then a separate forward
    pass under ``no_grad`` produces the scored logits. Nothing carries over between batches.

Stateless methods (source, TTN, AQR) behave identically under both protocols.

Batch size 1 (``ProtocolConfig.window``, the test-time-adaptation benchmark's ``TEST.WINDOW_LENGTH``): a method
fed one image at a time with ``window = W > 1`` keeps the last ``W`` images in a sliding window. Once every
``W`` images (when the window's slot ``W - 1`` has just been filled) it runs its ordinary step on the whole
window (adapting, under the protocol) and scores the image from that forward; every other image is scored
from a forward of the window with the state the method holds, which it does not change
(:meth:`TTAMethod.predict_held`; a method that holds no state: :meth:`TTAMethod.predict` on the window). So
batch statistics, LAME's affinities or per-batch AQR's quantiles come from the ``W`` most recent images,
and a method adapts on every ``W`` images, as it would at batch ``W``. Batches of more than one image
ignore the window.

Batches a method has no time to adapt on (the realtime protocol, where the stream runs at the speed of
the plain model): :meth:`TTAMethod.forward_held` predicts them with the state the method holds from its
last adapted batch, and they change nothing. A method holds a state (:attr:`TTAMethod.holds_state`)
only under ``"online"`` and only if it carries something across batches (weights, running statistics,
a running estimate); otherwise, episodic or stateless, what it holds between batches is the model the
user gave (eval mode, BatchNorm on its running statistics), which is what ``forward_held`` returns.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator

import torch
from torch import nn

from aqr.util.seeds import check_seed

from .carried import pack_carried, unpack_carried
from .held import RebuiltCache, running_statistics, source_view

PROTOCOLS = ("episodic", "online")
#: The longest sliding window a method keeps at batch size 1 (every image of it is forwarded per image).
MAX_WINDOW = 4096


class NotApplicable(Exception):
    """The method cannot be applied to this model (e.g. TTN on a model without BatchNorm).

    Benchmarks catch this and record the cell as "n/a".
    """


@dataclass(frozen=True)
class ProtocolConfig:
    """When a method resets and how often it adapts.

    Attributes:
        protocol: ``"online"`` (the default: never reset, the method adapts across batches) or
            ``"episodic"`` (reset before every batch; the paper's reproduction asks for it).
        steps: adaptation steps per batch for weight-updating methods (ignored by the others).
            The paper's "episodic (2 steps)" is ``steps=1``: one adaptation step, then the
            scored forward pass.
        seed: seeds the torch RNG seen by the model during ``forward`` (inside ``fork_rng``, so
            the caller's global RNG is neither read nor advanced). Batch ``k`` after the last reset
            sees ``seed + k``; in episodic mode that is always ``seed``. The methods keep the
            model in eval mode (no dropout); most draw no random numbers, so on CPU their outputs
            are deterministic anyway, while ROID's augmentation and DeYO's patch shuffle draw
            theirs here. The seed makes any randomness inside a user's model reproducible too.
            Seeded sections of methods in different threads take turns (one process-wide lock), so
            each restores what it found; a caller drawing from the global RNG in another thread
            during a forward pass still shares it.
            ``None`` leaves the global RNG alone.
        window: images of the sliding window a method keeps when it is fed one image at a time (see the
            module docs); 1, the default, adapts on each image alone. The reference's batch-1 form; the
            field's batch-1 runs use 64, its batch size.
    """

    protocol: str = "online"
    steps: int = 1
    seed: int | None = 0
    window: int = 1

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.seed is not None:
            check_seed(self.seed)
        if isinstance(self.window, bool) or not isinstance(self.window, int) or not 1 <= self.window <= MAX_WINDOW:
            raise ValueError(f"window must be an integer in [1, {MAX_WINDOW}], got {self.window!r}")

    @property
    def episodic(self) -> bool:
        return self.protocol == "episodic"


#: The format of what :meth:`TTAMethod.get_extra_state` saves; a state of another format is refused.
STATE_FORMAT = 1

#: The process's torch RNG is one for every thread: a seeded forward forks and reseeds it under this lock,
#: so two methods in two threads never restore each other's seeded state into the caller's.
_GLOBAL_RNG_LOCK = threading.RLock()

#: The calls of a method that read or change its state, serialized on its lock (also where a subclass overrides them).
SERIALIZED_CALLS = ("forward", "forward_held", "reset", "state_dict", "load_state_dict")


def serialized(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` made to hold the method's re-entrant lock (``self._lock``) while it runs."""
    @functools.wraps(call)
    def locked(self: "TTAMethod", *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return call(self, *args, **kwargs)

    locked.serialized = True  # type: ignore[attr-defined]
    return locked


class SerializedCalls:
    """Kept for methods written against it: every :class:`TTAMethod` now serializes its calls itself
    (``self._lock``, created before ``configure_model``), so this mixin adds nothing."""

    def make_lock(self) -> None:
        """Nothing to do: the lock exists from the start of ``TTAMethod.__init__``."""


def softmax_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per-sample Shannon entropy (nats) of ``softmax(logits)`` over dim 1; shape ``(N,)``."""
    return -(logits.softmax(1) * logits.log_softmax(1)).sum(1)


@dataclass(frozen=True)
class NoOptions:
    """Configuration of a method that has no options."""


class TTAMethod(nn.Module):
    """Base class: wraps a private copy of ``model`` and runs the protocol.

    A subclass is declared once with ``@method(name, Config, defaults=..., needs=...)``
    (:mod:`aqr.methods.declaration`), which sets its ``name``, ``Config`` and ``declaration``, and
    overrides the hooks :meth:`configure_model`, :meth:`build_optimizer` and, if it updates weights,
    :meth:`adapt`. What the declaration says it needs arrives here: ``stats`` (its
    :class:`aqr.SourceStats`, as :attr:`stats`) and ``source`` (clean source images, as
    :attr:`supplied_source` while :meth:`configure_model` runs).

    Threads sharing one method see the outputs of some sequential order of their calls: ``forward``,
    ``forward_held``, ``reset``, ``state_dict`` and ``load_state_dict`` hold the method's re-entrant lock,
    also where a subclass overrides them. ``state_dict()`` carries everything a later batch reads (the
    modules' tensors, the optimizer's state, the batch counter and the attributes a class lists in
    :attr:`carried`); a fresh method of the same configuration that loads it continues bit for bit, and
    a state of another configuration or format is refused (``ValueError``, one line).
    """

    name: ClassVar[str] = ""
    Config: ClassVar[type] = NoOptions
    declaration: ClassVar[Any] = None  # the MethodDeclaration, set by the registration
    #: attributes of this class (beyond its modules' tensors and the optimizer) that carry over from one batch
    #: to the next, saved by :meth:`get_extra_state`; a subclass lists its own, its bases' are added
    carried: ClassVar[tuple[str, ...]] = ("_window", "_window_slot")  # the batch-1 sliding window

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for call in SERIALIZED_CALLS:  # an override holds the lock too (re-entrant: super() calls nest)
            own = cls.__dict__.get(call)
            if callable(own) and not getattr(own, "serialized", False):
                setattr(cls, call, serialized(own))

    def __init__(self, model: nn.Module, config: Any = None, protocol: ProtocolConfig | None = None, *,
                 stats: Any = None, source: Any = None) -> None:
        super().__init__()
        self._lock = threading.RLock()  # serializes the calls that read or change the state (SERIALIZED_CALLS)
        if self.declaration is None or self.declaration.cls is not type(self):
            raise TypeError(f"{type(self).__qualname__} is not a registered method (decorate it with "
                            "aqr.methods.method(name, Config, ...))")
        needs = self.declaration.needs
        if needs.stats is None and stats is not None:
            raise TypeError(f"the {self.name!r} method takes no stats=")
        if needs.stats is not None and stats is None:
            raise TypeError(f"the {self.name!r} method needs stats= (from aqr.calibrate"
                            + (f"(..., point={needs.stats!r})" if needs.stats != "output" else "") + ")")
        if not needs.source and source is not None:
            raise TypeError(f"the {self.name!r} method takes no source=")
        self.config = config if config is not None else self.declaration.build_config({})
        self.protocol = protocol if protocol is not None else ProtocolConfig()
        #: the source statistics the method reads (``None`` for a method that needs none)
        self.stats = stats
        self.supplied_source = source  # read while the copy is configured (EATA's Fisher), then dropped
        private = copy.deepcopy(model)
        # the user's BatchNorm statistics, which configure_model may drop or replace (forward_held needs them)
        self._source_statistics = running_statistics(private)
        self._source_views = RebuiltCache()  # device -> the copy's twin that computes the user's model
        self.model = self.configure_model(private)
        self.supplied_source = None
        self.optimizer = self.build_optimizer()
        self._initial_state = self._snapshot() if self.optimizer is not None else None
        self._batches_since_reset = 0
        self._window: torch.Tensor | None = None  # the last images seen one at a time (protocol.window > 1)
        self._window_slot = 0  # where the next single image goes in the window

    # ---- hooks --------------------------------------------------------------------------
    def configure_model(self, model: nn.Module) -> nn.Module:
        """Prepare the private copy (modes, requires_grad, norm layers); return the module to use."""
        return model.eval().requires_grad_(False)

    def build_optimizer(self) -> Any:
        """Return the optimizer that adapts ``self.model``, or ``None`` for stateless methods."""
        return None

    def adapt(self, x: torch.Tensor) -> torch.Tensor:
        """One adaptation step on ``x``; return the logits of the forward that computed the loss."""
        raise NotImplementedError

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the current (possibly adapted) model, without gradients or updates."""
        with torch.no_grad():
            return self.model(x)

    def reset_extra_state(self) -> None:
        """Reset method-specific state beyond weights and optimizer (e.g. SAR's loss EMA)."""

    def predict_held(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the state held from the last adapted batch (only called when :attr:`holds_state`),
        under ``no_grad``, updating nothing: by default the configured model with its current weights."""
        return self.model(x)

    def predict_window(self, window: torch.Tensor) -> torch.Tensor:
        """Logits of the sliding window between its steps (batch 1, ``window > 1``), under ``no_grad``, changing
        nothing: by default :meth:`predict_held` with :attr:`holds_state`, else :meth:`predict`. A method whose
        held prediction leaves out per-batch work the window is there for overrides it (per-batch AQR's map in a
        composition: the window is the batch its quantiles come from)."""
        return self.predict_held(window) if self.holds_state else self.predict(window)

    # ---- protocol -----------------------------------------------------------------------
    @property
    def updates_weights(self) -> bool:
        return self.optimizer is not None

    @serialized
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the scored logits for batch ``x`` (detached), adapting first if the method does."""
        if self.protocol.window > 1 and x.shape[0] == 1:
            return self._forward_windowed(x)
        try:
            return self._forward_batch(x)
        except ValueError as err:
            if x.shape[0] == 1 and "more than 1 value per channel" in str(err):
                raise ValueError(f"{self.name} normalizes with the statistics of the batch, and a BatchNorm layer of "
                                 "this model sees one value per channel for one image: it runs from batch 2, or at "
                                 "batch 1 with a sliding window (window=64: the last 64 images)") from err
            raise

    def _forward_windowed(self, x: torch.Tensor) -> torch.Tensor:
        """One image through the sliding window (see the module docs): the window's step once it has just
        filled slot ``window - 1``, else a forward of the window with the state held."""
        size, slot = self.protocol.window, self._window_slot
        window = self._window
        if window is None or window.shape[1:] != x.shape[1:] or window.device != x.device or window.dtype != x.dtype:
            window, slot = x.detach().clone(), 0  # a first image, or images of another kind: a new window
        elif len(window) < size:
            window = torch.cat([window, x.detach()])
        else:
            window[slot] = x[0].detach()
        self._window, self._window_slot = window, (slot + 1) % size
        if slot == size - 1:
            return self._forward_batch(window, keep_window=True)[slot:slot + 1]
        if self.protocol.episodic:
            self.reset_keeping_window()
        with self._seeded(x.device), torch.no_grad():
            try:
                logits = self.predict_window(window)
            except ValueError as err:
                if len(window) > 1 or "more than 1 value per channel" not in str(err):
                    raise
                # a window of one image and BatchNorm over (N, C) vectors: the reference's BatchNorm1d layers
                # stay in eval mode until the window holds two images; here the whole model as given does
                logits = self.source_logits(window)
        self._batches_since_reset += 1
        return logits[slot:slot + 1].detach()

    def reset_keeping_window(self) -> None:
        """:meth:`reset` without clearing the sliding window (the episodic protocol resets before each image)."""
        window, slot = self._window, self._window_slot
        self.reset()
        self._window, self._window_slot = window, slot

    def _forward_batch(self, x: torch.Tensor, keep_window: bool = False) -> torch.Tensor:
        if self.protocol.episodic:
            self.reset_keeping_window() if keep_window else self.reset()
        with self._seeded(x.device):
            if not self.updates_weights:
                logits = self.predict(x)
            else:
                for _ in range(self.protocol.steps):
                    with torch.enable_grad():
                        logits = self.adapt(x)
                if self.protocol.episodic:
                    logits = self.predict(x)
        self._batches_since_reset += 1
        return logits.detach()

    @property
    def holds_state(self) -> bool:
        """Whether an adapted state carries over from one batch to the next (the online protocol of a method
        that adapts weights, statistics or a running estimate): :meth:`forward_held` predicts with it."""
        return not self.protocol.episodic and self.updates_weights

    @serialized
    def forward_held(self, x: torch.Tensor) -> torch.Tensor:
        """Scored logits for a batch the method has no time to adapt on: the predictions of the state it
        holds from its last adapted batch; ``x`` leaves no trace.

        Detached, computed without gradients. Nothing changes: no weight, optimizer, statistic, memory,
        teacher or stream update, no reset, and the batch counter that seeds ``forward`` does not move, so
        later ``forward`` calls give what they would had ``x`` never been seen. With :attr:`holds_state`
        the logits are :meth:`predict_held`'s (the current state as the method configures its model, e.g.
        TENT's current weights normalizing with the batch's statistics); otherwise (episodic, or a method
        that keeps nothing across batches) the user's model as given: eval mode, BatchNorm on its running
        statistics, the initial weights.
        """
        with self._seeded(x.device), torch.no_grad():
            logits = self.predict_held(x) if self.holds_state else self.source_logits(x)
        return logits.detach()

    def source_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The user's model as given on ``x`` (eval mode, its BatchNorm running statistics, the initial
        weights), computed over the private copy without changing it (:func:`aqr.methods.held.source_view`)."""
        with torch.no_grad():
            return self._source_view(x.device)(x)

    def _source_view(self, device: torch.device) -> nn.Module:
        view = self._source_views.get(device)
        if view is None:
            initial = {}
            if self._initial_state is not None:  # trained parameters read their initial values
                trained = {name for name, p in self.model.named_parameters() if p.requires_grad}
                initial = {k: v for k, v in self._initial_state[0].items() if k in trained}
            view = self._source_views.setdefault(device, source_view(self.model, self._source_statistics, initial,
                                                                     device))
        return view

    @serialized
    def reset(self) -> None:
        """Restore the original weights, buffers and optimizer state, clear extra state and the sliding window."""
        self.restore_initial_state()
        self._batches_since_reset = 0
        self._window, self._window_slot = None, 0

    def restore_initial_state(self) -> None:
        """Weights, buffers, optimizer state and extra state back to what they were at creation."""
        if self._initial_state is not None:
            model_state, optim_state = self._initial_state
            self.model.load_state_dict(model_state, strict=True)
            # deep copy: optimizers adopt the given tensors and update them in place
            self.optimizer.load_state_dict(copy.deepcopy(optim_state))
        self.reset_extra_state()

    def _snapshot(self) -> tuple[dict, dict]:
        model_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        return model_state, copy.deepcopy(self.optimizer.state_dict())

    @contextlib.contextmanager
    def _seeded(self, device: torch.device) -> Iterator[None]:
        if self.protocol.seed is None:
            yield
            return
        if device.type == "cpu":
            fork = torch.random.fork_rng(devices=[])
        else:
            fork = torch.random.fork_rng(devices=[device], device_type=device.type)
        with _GLOBAL_RNG_LOCK, fork:  # no other method forks and reseeds it meanwhile
            torch.manual_seed(self.protocol.seed + self._batches_since_reset)
            yield

    # ---- state ----------------------------------------------------------------------------
    @serialized
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The modules' tensors and, under ``"_extra_state"``, the rest of the state (:meth:`get_extra_state`)."""
        return super().state_dict(*args, **kwargs)

    @serialized
    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a state saved by a method of the same configuration (:meth:`set_extra_state` refuses another)."""
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def configuration(self) -> str:
        """What a saved state must have been made under: the method, its options and its protocol."""
        return f"{self.name} {self.config!r} {self.protocol!r}"

    def carried_state(self) -> dict[str, Any]:
        """The attributes listed in :attr:`carried` by this class and its bases (a subclass with state
        outside attributes, as a composition's AQR stream, adds it here and in :meth:`load_carried_state`)."""
        names = dict.fromkeys(n for cls in reversed(type(self).__mro__) for n in cls.__dict__.get("carried", ()))
        return {name: getattr(self, name) for name in names}

    def load_carried_state(self, state: dict[str, Any]) -> None:
        """Set what :meth:`carried_state` returned (on a method of the same configuration)."""
        for name, value in state.items():
            setattr(self, name, value)

    def get_extra_state(self) -> dict[str, Any]:
        """The state beyond the modules' tensors: the format, the configuration, the batch counter that seeds
        ``forward``, the optimizer's state and the carried attributes; copies of tensors, readable by
        ``torch.load(..., weights_only=True)``."""
        optimizer = self.optimizer.state_dict() if self.optimizer is not None else None
        return {"format": STATE_FORMAT, "configuration": self.configuration(),
                "batches_since_reset": self._batches_since_reset,
                "optimizer": copy.deepcopy(optimizer), "carried": pack_carried(self.carried_state())}

    def set_extra_state(self, state: Any) -> None:
        """Continue from ``state`` (:meth:`get_extra_state`'s); a state of another format or configuration is
        refused with a ``ValueError`` of one line, before anything changes."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"the {self.name!r} method's saved state has format {found}; this version reads "
                             f"format {STATE_FORMAT}")
        if state.get("configuration") != self.configuration():
            raise ValueError(f"the saved state is of another configuration ({state.get('configuration')}) than "
                             f"this method's ({self.configuration()}); build the method with the same options")
        carried = unpack_carried(state["carried"], self.carried_state())
        if self.optimizer is not None:
            self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))  # optimizers adopt given tensors
        self._batches_since_reset = int(state["batches_since_reset"])
        self.load_carried_state(carried)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_lock", None)  # locks cannot be copied; a copy gets its own
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._lock = threading.RLock()

    def train(self, mode: bool = True) -> "TTAMethod":
        """Only flips this wrapper's flag: the wrapped model's modes are fixed by the method."""
        self.training = mode
        return self

    def extra_repr(self) -> str:
        return f"protocol={self.protocol.protocol}, steps={self.protocol.steps}, config={self.config}"
