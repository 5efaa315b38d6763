"""One batch of a stream as its layers see it: fixed values, and what the layers leave for its commit.

A streaming :class:`aqr.AQR` (and :class:`aqr.adapt.pre_affine.PreAffineAQR`) runs one batch at a time
through layers that share a :class:`aqr.adapt.stream.stream_maps.SharedStream`. For each batch it begins,
the shared stream makes a :class:`StreamBatch`: its :class:`BatchValues` are fixed for the whole batch
(how many images, whether it is held, the shares the target gives it); the layers record on it only through
:meth:`StreamBatch.stage` (an update to commit) and :meth:`StreamBatch.mark_nonfinite`. The commit hands
every layer's stream one :class:`BatchCommit` (the predicted classes and what is worked out from them once).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from aqr.adapt.layer_maps import host_reads_are_cheap

if TYPE_CHECKING:
    from aqr.adapt.stream.running import LayerStream


@dataclass(frozen=True)
class BatchValues:
    """What every layer reads of the batch in flight, fixed when it begins.

    ``images``: the batch's images; ``held``: mapped with the committed state, staging nothing
    (:meth:`aqr.AQR.forward_held`); ``own``: the share of its own histogram a batch's target takes and
    ``runs``: how clearly the recent predicted classes come in runs (``target="robust"``'s; see
    :meth:`aqr.adapt.stream.running.LayerStream.batch_shares`).
    """

    images: int = 0
    held: bool = False
    own: float = 0.0
    runs: float = 1.0


class StreamBatch:
    """The batch in flight: its :class:`BatchValues` (read-only) and the updates its layers stage."""

    def __init__(self, values: BatchValues) -> None:
        self._values = values
        self._staged: list[tuple[LayerStream, object]] = []
        self._nonfinite = False
        self._flags: torch.Tensor | None = None  # the layers' finite flags left on their device (note_finite)

    @property
    def values(self) -> BatchValues:
        return self._values

    @property
    def images(self) -> int:
        return self._values.images

    @property
    def held(self) -> bool:
        return self._values.held

    @property
    def finite(self) -> bool:
        """Whether no layer has marked the batch's values non-finite so far (:meth:`mark_nonfinite`; the flags
        left on a device, :meth:`note_finite`, are :attr:`flag`'s)."""
        return not self._nonfinite

    @property
    def flag(self) -> bool | torch.Tensor:
        """Whether every layer found the batch's values finite so far: ``False`` once one marked it, else the
        conjunction of the flags the layers left on their device (a 0-d bool tensor, not read), else ``True``."""
        if self._nonfinite:
            return False
        return True if self._flags is None else self._flags

    def note_finite(self, flag: torch.Tensor) -> None:
        """A layer's finite flag (0-d bool tensor), left on its device: the commit reads it with the logits' once."""
        self._flags = flag if self._flags is None else self._flags & flag

    @property
    def staged(self) -> tuple[tuple[LayerStream, object], ...]:
        """The ``(stream, update)`` pairs staged so far, in the order the layers staged them."""
        return tuple(self._staged)

    def stage(self, stream: LayerStream, update: object) -> None:
        """Record ``stream``'s update for the commit. A held batch stages nothing: ``RuntimeError``."""
        if self._values.held:
            raise RuntimeError("a held batch stages nothing: it is mapped with the committed state")
        self._staged.append((stream, update))

    def mark_nonfinite(self) -> None:
        """A layer found NaN or Inf: the batch will not be committed."""
        self._nonfinite = True

    def again(self) -> StreamBatch:
        """The same batch once more (its values; nothing staged, finite): a second pass over it."""
        return StreamBatch(self._values)

    def take_staged(self) -> list[tuple[LayerStream, object]]:
        """The staged updates, which this batch then no longer holds (a commit applies them once)."""
        staged, self._staged = self._staged, []
        return staged

    def __getstate__(self) -> dict[str, object]:
        # a copy made while the batch runs holds the state before it: nothing staged is copied
        return {"_values": self._values, "_staged": [], "_nonfinite": False, "_flags": None}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_flags", None)


class BatchCommit:
    """What the commit of one finite batch gives every layer's stream: each image's predicted class
    (``labels``, or ``None`` where the target takes none), the batch's ``runs``, and values worked out from
    them once for every layer (:meth:`once`); ``host_labels``: the classes on the CPU where they were read there."""

    def __init__(self, labels: torch.Tensor | None, runs: float, host_labels: torch.Tensor | None = None) -> None:
        self.labels = labels
        self.runs = runs
        self.host_labels = host_labels  # the same classes on the CPU, where the caller read them already
        self._once: dict[object, Any] = {}

    def once(self, key: object, make: Callable[[], Any]) -> Any:
        """``make()``, called on the first use of ``key`` in this commit; the same value afterwards."""
        if key not in self._once:
            self._once[key] = make()
        return self._once[key]


class HostOutcome(NamedTuple):
    """What :func:`host_outcome` read: whether the batch was finite, the predicted classes and the ``extra``
    tensors on the CPU (``None`` and ``()`` where the batch was not finite)."""

    finite: bool
    labels: torch.Tensor | None
    extra: tuple[torch.Tensor, ...]


def host_outcome(finite: bool | torch.Tensor, labels: torch.Tensor | None = None,
                 extra: Sequence[torch.Tensor] = ()) -> HostOutcome:
    """The one read a stream's forward pass makes on the host: whether the batch was finite (``finite``, a
    ``bool`` or a 0-d bool tensor) and, where it was, the predicted classes ``labels`` (on the logits' device;
    int64 on the CPU) and the ``extra`` tensors a target commits from (``target="mixed"``'s clusters), all in
    one copy."""
    if finite is False:
        return HostOutcome(False, None, ())
    reads = ([finite.view(1)] if isinstance(finite, torch.Tensor) else []) + \
        ([labels.long()] if labels is not None else []) + list(extra)
    host = one_copy(reads)
    ok = bool(host.pop(0)) if isinstance(finite, torch.Tensor) else True
    if not ok:
        return HostOutcome(False, None, ())
    return HostOutcome(True, host.pop(0) if labels is not None else None, tuple(host))


def one_copy(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` on the CPU (their shapes and dtypes), copied off their device in one transfer: their bytes
    side by side (a transfer makes the host wait for the device's queue; one is the least). Tensors on other
    devices (the CPU's too: logits a model moved there) join the first one's without waiting."""
    off = [t.device for t in tensors if not host_reads_are_cheap(t.device)]
    if not off:
        return [t.detach() for t in tensors]
    flat = [t.detach().contiguous().view(-1).to(off[0], non_blocking=True) for t in tensors]
    raw = torch.cat([f.view(torch.uint8) for f in flat]).cpu()
    out, at = [], 0
    for t, f in zip(tensors, flat):
        size = f.numel() * f.element_size()
        # a copy of the slice starts its own storage: viewing it as a wider type needs the alignment
        out.append(raw[at : at + size].clone().view(t.dtype).view(t.shape))
        at += size
    return out
