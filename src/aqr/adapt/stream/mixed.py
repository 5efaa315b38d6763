"""Streaming AQR for streams that mix domains: per layer several running estimates, one per domain it tells apart.

A stream whose batches draw from many corruptions at once has a pooled per-channel distribution that fits
none of them: ``target="stream"`` maps every image with that mixture's quantiles, and each domain is
mapped with the others' shift. ``aqr.AQR(model, stats, target="mixed")`` keeps, per recalibrated layer, up
to ``components`` running states (:class:`~aqr.adapt.stream.running.LayerStream`'s, on the same kernels)
and maps each image with the one its *component* owns.

Assignment (:class:`ComponentAssigner`, one per layer, as UnMix-TNS assigns instances per layer). Each
image gets a descriptor at the layer, its per-channel mean and log standard deviation, standardized by the
layer's source median and inter-quartile range (:func:`image_descriptors`), and goes to the component whose
centre is nearest (:func:`descriptor_distance`: the median over the descriptor's values of the squared
differences, so a shift that moves most channels counts and content that moves a few does not). An image
farther than ``spawn`` times its nearest component's spread (the running mean of that component's images'
distances) starts a new component: one per batch, the farthest such image; at most ``components``; where all
are in use, one that took no image for :data:`IDLE_HORIZONS` horizons is taken over; a component of fewer
than :data:`MIN_SEEN` images starts none. The new component's state starts as a copy of the state of the
component nearest to that image (where ``"stream"`` would be) and moves to its own images. The centres and
spreads are running means with the stream's ``horizon``, in images of that component.

Per layer (:meth:`MixedLayerStream.batch_step`) the images of each component are stepped through that
component's state as ``"stream"`` steps a batch of that many images: a component that takes fewer than
``rebuild_every`` images of a batch counts them, and merges them every ``rebuild_every`` of its images.
A batch whose images all go to one component is stepped whole, without copies: with ``components=1`` this
target is ``"stream"``, value for value.

A descriptor read on the host decides each image's component, so the target runs on the CPU only (off it,
a clear ``ValueError``): off the CPU it would stall the device's queue in every layer.

A batch enters the state only when the whole forward pass was finite (as ``"stream"``: staged, then
committed); :meth:`MixedLayerStream.export_state` and the assigner's :meth:`ComponentAssigner.export_state`
give the running state as plain values (:mod:`aqr.adapt.stream.saved`).

Memory: ``components`` times ``"stream"``'s per layer, and ``components x 2 C`` float64 centres per layer of
``C`` channels. What it gains and loses, measured: ``docs/method.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from aqr.adapt.layer_maps import host_reads_are_cheap
from aqr.adapt.config import AQRConfig, check_components, check_horizon, check_spawn
from aqr.adapt.stream.base import Flag, StreamKernels, all_finite
from aqr.adapt.stream.batch import BatchCommit, BatchValues
from aqr.adapt.stream.running import BatchKnots, LayerStream, Staged, StreamSettings, batch_weight
from aqr.backends import Affine

# A component that took no image for this many horizons may be taken over by a new one (a domain that left).
IDLE_HORIZONS = 4.0
# The images a component takes before its spread decides whether an image is far from it.
MIN_SEEN = 16
# The floor of a descriptor's standard deviation, in units of the source's inter-quartile range: a flat image
# (one value per channel) is not infinitely far from every other.
STD_FLOOR = 0.05


def image_descriptors(x: torch.Tensor, images: int, pre: Affine | None, source: torch.Tensor) -> torch.Tensor:
    """Each image's descriptor ``(images, 2 C)`` float32 from the layer output ``x`` (A, C, B), read as
    ``pre[0] * x + pre[1]`` where ``pre`` is given: its per-channel mean and log standard deviation over its
    rows and positions, standardized by the source knots ``source`` (C, K): ``(mean - median) / iqr`` and
    ``log(std / iqr + STD_FLOOR)``."""
    a, c, b = x.shape
    v = x.reshape(images, a // images, c, b).float()
    if pre is not None:
        v = v * pre[0].view(1, 1, c, 1) + pre[1].view(1, 1, c, 1)
    var, mean = torch.var_mean(v.transpose(1, 2).reshape(images, c, -1), dim=2, correction=0)
    k = source.shape[1]
    median = source[:, (k - 1) // 2].to(mean)
    iqr = (source[:, 3 * (k - 1) // 4] - source[:, (k - 1) // 4]).to(mean).clamp_min(1e-6)
    return torch.cat([(mean - median) / iqr, torch.log(var.sqrt() / iqr + STD_FLOOR)], dim=1)


def descriptor_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The distance of descriptors ``a`` and ``b`` (broadcast; the last dimension the descriptor's values): the
    median of their squared differences, so a shift of the domain, which moves most of a layer's channels,
    counts, and an image whose content moves a few channels far does not."""
    return (a - b).square().median(dim=-1).values


@dataclass(frozen=True)
class Assignment:
    """One batch's images grouped by component: ``of`` ``(N,)`` each image's component (CPU, int64), ``members``
    ``[(component, images' indices)]`` in component order, ``spawned`` the component the batch starts (``None``:
    none) and ``parent`` the one whose state it starts from (``None``: the first component, from the batch's
    own knots); ``update``: what the batch leaves to the assigner's commit (``None``: a held batch)."""

    of: torch.Tensor
    members: tuple[tuple[int, torch.Tensor], ...]
    spawned: int | None = None
    parent: int | None = None
    update: AssignmentUpdate | None = None

    @classmethod
    def of_components(cls, of: torch.Tensor, spawned: int | None = None, parent: int | None = None,
                      update: AssignmentUpdate | None = None) -> Assignment:
        """The assignment ``of`` (each image's component), its members worked out."""
        members = tuple((int(k), (of == k).nonzero().view(-1)) for k in torch.unique(of).tolist())
        return cls(of, members, spawned, parent, update)


@dataclass(frozen=True)
class AssignmentUpdate:
    """What a batch's assignment leaves to :meth:`ComponentAssigner.commit`: the started component's centre
    (where one was started), each component's images, mean descriptor and mean squared distance to its centre."""

    spawned_centre: torch.Tensor | None
    sizes: torch.Tensor  # (K,) int64
    means: torch.Tensor  # (K, D) float64
    spreads: torch.Tensor  # (K,) float64


@dataclass
class ComponentAssigner:
    """The components' centres in descriptor space and what they have seen (see the module docs); on the CPU,
    float64. ``centres`` ``(K, D)`` (``D`` 0 until the first batch), ``spreads`` ``(K,)``: each component's
    running mean squared distance of its images to its centre, ``seen``/``last`` ``(K,)`` int64: images taken,
    and the stream's count of images when it last took one; ``active`` ``(K,)`` bool; ``clock``: images committed."""

    components: int
    spawn: float
    horizon: float
    centres: torch.Tensor = field(init=False)
    spreads: torch.Tensor = field(init=False)
    seen: torch.Tensor = field(init=False)
    last: torch.Tensor = field(init=False)
    active: torch.Tensor = field(init=False)
    clock: int = 0

    def __post_init__(self) -> None:
        check_components(self.components)
        check_spawn(self.spawn)
        check_horizon(self.horizon)
        self.reset()

    @classmethod
    def of(cls, config: AQRConfig) -> ComponentAssigner:
        """The assigner of ``config``'s ``components``, ``spawn`` and ``horizon``."""
        return cls(config.components, float(config.spawn), float(config.horizon))

    def reset(self) -> None:
        """No component: the next batch starts the first."""
        k = self.components
        self.centres = torch.zeros(k, 0, dtype=torch.float64)
        self.spreads = torch.zeros(k, dtype=torch.float64)
        self.seen = torch.zeros(k, dtype=torch.int64)
        self.last = torch.zeros(k, dtype=torch.int64)
        self.active = torch.zeros(k, dtype=torch.bool)
        self.clock = 0

    def distances(self, descriptors: torch.Tensor, centres: torch.Tensor | None = None) -> torch.Tensor:
        """``(N, K)``: each descriptor's mean squared difference from each active centre (inf where inactive)."""
        centres = self.centres if centres is None else centres
        d = descriptor_distance(descriptors.unsqueeze(1), centres.unsqueeze(0))
        return d.masked_fill(~self.active.unsqueeze(0), math.inf)

    def free_slot(self) -> int | None:
        """The component a new one may take: the first never used, else the one idle longest if it took no image
        for :data:`IDLE_HORIZONS` horizons; ``None``: none."""
        unused = (~self.active).nonzero()
        if len(unused):
            return int(unused[0])
        idle = self.clock - self.last
        k = int(torch.argmax(idle))
        return k if int(idle[k]) >= IDLE_HORIZONS * self.horizon else None

    def assign(self, descriptors: torch.Tensor, held: bool = False) -> Assignment:
        """Each image's component from its descriptor (``(N, D)``, any device; read on the CPU) and, unless
        ``held``, what the batch leaves to :meth:`commit`. The assigner does not change."""
        desc = descriptors.detach().to("cpu", torch.float64)
        n, d = desc.shape
        k = self.components
        if not bool(self.active.any()):  # the first batch: every image starts component 0
            of = torch.zeros(n, dtype=torch.int64)
            if held:
                return Assignment.of_components(of)
            centres = torch.zeros(k, d, dtype=torch.float64)
            centres[0] = desc.mean(dim=0)
            return Assignment.of_components(of, 0, None, self._update(desc, of, centres, centres[0]))
        if d != self.centres.shape[1]:
            raise ValueError(f"target='mixed': an image descriptor of {d} values for centres of "
                             f"{self.centres.shape[1]} (the first recalibrated layer changed its channels)")
        dist = self.distances(desc)
        nearest, of = dist.min(dim=1)
        spawned = parent = None
        centres = self.centres
        # how far each image lies beyond its nearest component's spread (a component of fewer than MIN_SEEN images
        # has no spread yet: nothing starts from it)
        ratio = nearest / self.spreads[of].clamp_min(1e-12)
        ratio = ratio.masked_fill(self.seen[of] < MIN_SEEN, 0.0)
        if not held and float(ratio.max()) > self.spawn:
            slot = self.free_slot()
            if slot is not None:
                far = int(torch.argmax(ratio))
                spawned, parent = slot, int(of[far])
                centres = self.centres.clone()
                centres[slot] = desc[far]
                active = self.active.clone()
                active[slot] = True
                d2 = descriptor_distance(desc.unsqueeze(1), centres.unsqueeze(0))
                of = d2.masked_fill(~active.unsqueeze(0), math.inf).argmin(dim=1)
        if held:
            return Assignment.of_components(of)
        spawned_centre = None if spawned is None else centres[spawned].clone()
        return Assignment.of_components(of, spawned, parent, self._update(desc, of, centres, spawned_centre))

    def _update(self, desc: torch.Tensor, of: torch.Tensor, centres: torch.Tensor,
                spawned_centre: torch.Tensor | None) -> AssignmentUpdate:
        """The batch's sizes, mean descriptors and mean squared distances per component (to ``centres``)."""
        k, d = self.components, desc.shape[1]
        sizes = torch.bincount(of, minlength=k)
        sums = torch.zeros(k, d, dtype=torch.float64).index_add_(0, of, desc)
        sq = descriptor_distance(desc, centres[of])
        spread = torch.zeros(k, dtype=torch.float64).index_add_(0, of, sq)
        taken = sizes.clamp_min(1).double()
        return AssignmentUpdate(spawned_centre, sizes, sums / taken.unsqueeze(1), spread / taken)

    def commit(self, assignment: Assignment) -> None:
        """Take a committed batch's assignment: a started component joins, each component's centre and spread move
        to its images' by the running mean's weight (``horizon`` images of that component)."""
        update = assignment.update
        if update is None:
            return
        if self.centres.shape[1] != update.means.shape[1]:
            self.centres = torch.zeros(self.components, update.means.shape[1], dtype=torch.float64)
        if assignment.spawned is not None:
            k = assignment.spawned
            self.active[k] = True
            self.centres[k] = update.spawned_centre
            self.spreads[k] = self.spreads[assignment.parent] if assignment.parent is not None else 0.0
            self.seen[k] = 0
        images = int(update.sizes.sum())
        for k, n in enumerate(update.sizes.tolist()):
            if n:
                w = batch_weight(n, int(self.seen[k]), self.horizon)
                self.centres[k] = torch.lerp(self.centres[k], update.means[k], w)
                self.spreads[k] = self.spreads[k] + w * (update.spreads[k] - self.spreads[k])
                self.seen[k] += n
                self.last[k] = self.clock + images
        self.clock += images

    # ---- state --------------------------------------------------------------------------------
    def export_state(self) -> dict[str, object]:
        """The assigner's state as plain values (tensors cloned): what :meth:`load_state` takes back."""
        return {"centres": self.centres.clone(), "spreads": self.spreads.clone(), "seen": self.seen.clone(),
                "last": self.last.clone(), "active": self.active.clone(), "clock": self.clock}

    def check_state(self, values: object) -> None:
        """Raise ``ValueError`` unless ``values`` is a state :meth:`export_state` of an assigner like this gave."""
        k = self.components
        expected = {"centres": torch.float64, "spreads": torch.float64, "seen": torch.int64, "last": torch.int64,
                    "active": torch.bool}
        if not isinstance(values, Mapping) or set(values) != {*expected, "clock"}:
            raise ValueError(f"the components' state must have the parts {sorted({*expected, 'clock'})}")
        for name, dtype in expected.items():
            t = values[name]
            shape_ok = isinstance(t, torch.Tensor) and t.shape[0] == k and t.ndim == (2 if name == "centres" else 1)
            if not shape_ok or t.dtype != dtype:
                raise ValueError(f"the components' state {name!r}: expected {k} rows of {dtype}")
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise ValueError(f"the components' state {name!r} holds NaN or Inf")
            if dtype == torch.int64 and bool((t < 0).any()):
                raise ValueError(f"the components' state {name!r} holds negative counts")
        clock = values["clock"]
        if type(clock) is not int or clock < 0:
            raise ValueError(f"the components' state 'clock': expected a count >= 0, got {clock!r}")

    def load_state(self, values: Mapping[str, object]) -> None:
        """Take the state ``values`` (from :meth:`export_state`; checked first)."""
        self.check_state(values)
        for name in ("centres", "spreads", "seen", "last", "active"):
            setattr(self, name, values[name].clone())  # type: ignore[union-attr]
        self.clock = int(values["clock"])  # type: ignore[call-overload]


@dataclass
class MixedStaged:
    """What a batch leaves to a layer's commit: its assignment and ``(component, parent, staged)`` per component
    that took images (``parent``: the component whose state a started one copies first, else ``None``)."""

    assignment: Assignment
    parts: list[tuple[int, int | None, Staged]]


def _select(x: torch.Tensor, images: int, index: torch.Tensor) -> torch.Tensor:
    """The rows of the images ``index`` of ``x`` (A, C, B), in that order."""
    a, c, b = x.shape
    return x.reshape(images, -1).index_select(0, index).reshape(len(index) * (a // images), c, b)


ASSIGNER = "assigner."  # the prefix of the assigner's entries in a layer's exported state


class MixedLayerStream:
    """One layer's running states, one per component, and the assigner of its images (see the module docs):
    ``parts[k]`` is component ``k``'s :class:`~aqr.adapt.stream.running.LayerStream`. It answers what a layer map
    asks of its state as a :class:`~aqr.adapt.stream.running.LayerStream` does."""

    target: ClassVar[str] = "mixed"
    takes_small_steps: ClassVar[bool] = False  # each component's images are selected first: the general step

    def __init__(self, source: torch.Tensor, settings: StreamSettings, assigner: ComponentAssigner,
                 kernels: StreamKernels, batch_knots: BatchKnots) -> None:
        self.settings = settings
        self.kernels = kernels
        self.assigner = assigner
        self.parts = [LayerStream(source, settings, kernels, batch_knots) for _ in range(assigner.components)]
        self.source = self.parts[0].source

    @classmethod
    def from_config(cls, config: AQRConfig, source: torch.Tensor, settings: StreamSettings, kernels: StreamKernels,
                    batch_knots: BatchKnots, group_source: torch.Tensor | None = None) -> MixedLayerStream:
        """One layer's states for ``config`` (``group_source`` is not taken: no class groups)."""
        return cls(source, settings, ComponentAssigner.of(config), kernels, batch_knots)

    @classmethod
    def batch_shares(cls, recent: list[int], config: AQRConfig) -> tuple[float, float]:
        """``(own, runs)``: this state reads no predicted classes, ``(0, 1)`` as ``"stream"``."""
        return 0.0, 1.0

    def part(self, k: int) -> LayerStream:
        """Component ``k``'s state, stepped by this state's kernels (a view sharing its buffers where they differ)."""
        part = self.parts[k]
        if part.kernels is self.kernels:
            return part
        view = object.__new__(LayerStream)
        view.__dict__.update(part.__dict__)
        view.kernels = self.kernels
        view._bound = None
        return view

    @property
    def started(self) -> bool:
        """Whether a component has a state (the first batch starts component 0; every later one starts from a
        started one)."""
        return self.parts[0].started

    @property
    def channels(self) -> int:
        return self.parts[0].channels

    def assign(self, x: torch.Tensor, images: int, pre: Affine | None, held: bool = False) -> Assignment:
        """The components of the images of ``x`` (A, C, B) (:meth:`ComponentAssigner.assign`); ``ValueError`` off
        the CPU, where reading the descriptors on the host inside a forward pass would stall the device."""
        if not host_reads_are_cheap(x.device):
            raise ValueError(f"target='mixed' runs on the CPU only (its components are chosen on the host, which "
                             f"would stall {x.device}'s queue in every layer); use target='stream' there")
        return self.assigner.assign(image_descriptors(x, images, pre, self.source), held)

    # ---- one batch ----------------------------------------------------------------------------
    def batch_step(self, x: torch.Tensor, batch: BatchValues,
                   pre: Affine | None = None) -> tuple[torch.Tensor | None, MixedStaged | None, Flag]:
        """Each component's images of ``x`` (A, C, B) stepped through its state (a started component's through its
        parent's); ``(y, staged, finite)`` as :meth:`LayerStream.flagged_step`."""
        images = batch.images
        assignment = self.assign(x, images, pre)
        staged: list[tuple[int, int | None, Staged]] = []
        if len(assignment.members) == 1:  # no copies: the component's state steps the batch as "stream" does
            k = assignment.members[0][0]
            parent = assignment.parent if k == assignment.spawned else None
            y, step, finite = self.part(k if parent is None else parent).flagged_step(x, images, pre)
            if finite is False:
                return None, None, False
            return y, MixedStaged(assignment, [(k, parent, step)]), finite  # type: ignore[list-item]
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rows = y.view(images, -1)
        finite: Flag = True
        for k, index in assignment.members:
            parent = assignment.parent if k == assignment.spawned else None
            index = index.to(x.device, non_blocking=True)
            mapped, step, ok = self.part(k if parent is None else parent).flagged_step(_select(x, images, index),
                                                                                      len(index), pre)
            if ok is False:
                return None, None, False
            rows.index_copy_(0, index, mapped.reshape(len(index), -1).to(y.dtype))  # type: ignore[union-attr]
            staged.append((k, parent, step))  # type: ignore[arg-type]
            finite = all_finite(finite, ok)
        return y, MixedStaged(assignment, staged), finite

    def flagged_held(self, x: torch.Tensor, images: int,
                     pre: Affine | None = None) -> tuple[torch.Tensor | None, Flag]:
        """``x`` mapped with each image's component's committed state, staging nothing: ``(y, finite)``."""
        assignment = self.assign(x, images, pre, held=True)
        if len(assignment.members) == 1:
            return self.part(assignment.members[0][0]).flagged_held(x, images, pre)
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rows = y.view(images, -1)
        finite: Flag = True
        for k, index in assignment.members:
            index = index.to(x.device, non_blocking=True)
            mapped, ok = self.part(k).flagged_held(_select(x, images, index), len(index), pre)
            if ok is False:
                return None, False
            rows.index_copy_(0, index, mapped.reshape(len(index), -1).to(y.dtype))  # type: ignore[union-attr]
            finite = all_finite(finite, ok)
        return y, finite

    def commit_batch(self, staged: MixedStaged, commit: BatchCommit) -> None:
        """Apply what :meth:`batch_step` staged: a started component first takes its parent's state (as it was
        before this batch), then each component commits its images, then the assigner its centres."""
        for k, parent, _ in staged.parts:
            if parent is not None:
                self.parts[k].load_state(self.parts[parent].export_state())
        for k, _, step in staged.parts:
            self.parts[k].commit(step)
        self.assigner.commit(staged.assignment)

    # ---- state --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Every component back to its initial state, and no centre."""
        for part in self.parts:
            part.reset()
        self.assigner.reset()

    def export_state(self) -> dict[str, object]:
        """The running state as plain values: ``"knots"`` (the first component's, naming the device), each
        component's :meth:`LayerStream.export_state` under ``"<k>.<name>"`` and the assigner's under
        ``"assigner.<name>"``."""
        values: dict[str, object] = {"knots": self.parts[0].knots.detach().clone()}
        for k, part in enumerate(self.parts):
            values.update({f"{k}.{name}": value for name, value in part.export_state().items()})
        values.update({ASSIGNER + name: value for name, value in self.assigner.export_state().items()})
        return values

    def _split(self, values: Mapping[str, object]) -> tuple[list[dict[str, object]], dict[str, object]]:
        """``values`` (from :meth:`export_state`) as one state per component and the assigner's; ``ValueError``
        where it is not one."""
        if not isinstance(values, Mapping) or "knots" not in values:
            raise ValueError("a mixed stream state holds 'knots', each component's parts and the assigner's")
        parts: list[dict[str, object]] = [{} for _ in self.parts]
        assigner: dict[str, object] = {}
        for name, value in values.items():
            if name == "knots":
                continue
            if name.startswith(ASSIGNER):
                assigner[name[len(ASSIGNER):]] = value
                continue
            k, _, rest = name.partition(".")
            if not k.isdigit() or int(k) >= len(self.parts):
                raise ValueError(f"a mixed stream state of {len(self.parts)} components has no part {name!r}")
            parts[int(k)][rest] = value
        return parts, assigner

    def check_state(self, values: Mapping[str, object]) -> None:
        """Raise ``ValueError`` unless ``values`` is a state :meth:`export_state` of a state like this one gave."""
        parts, assigner = self._split(values)
        for k, (part, state) in enumerate(zip(self.parts, parts)):
            try:
                part.check_state(state)
            except ValueError as err:
                raise ValueError(f"component {k}: {err}") from None
        self.assigner.check_state(assigner)

    def load_state(self, values: Mapping[str, object]) -> None:
        """Take the running state ``values`` (from :meth:`export_state`; checked first)."""
        self.check_state(values)
        parts, assigner = self._split(values)
        for part, state in zip(self.parts, parts):
            part.load_state(state)
        self.assigner.load_state(assigner)

    def memory_bytes(self) -> int:
        """Bytes of the running states (fixed)."""
        return sum(part.memory_bytes() for part in self.parts)
