"""Streaming AQR for streams that mix domains: a shared running estimate, and one per cluster of images.

A stream whose batches draw from many corruptions at once has a pooled per-channel distribution that fits
none of them: ``target="stream"`` maps every image with that mixture's quantiles, and each domain is
mapped with the others' shift. ``aqr.AQR(model, stats, target="mixed")`` keeps, per recalibrated layer, the
running state ``"stream"`` keeps (the *shared* state, stepped by every image) and ``components`` more, one
per *cluster* of images, and maps each image as ``blend`` times its cluster's map plus ``1 - blend`` times
the shared state's.

Clusters (:class:`ComponentRouter`, one per :class:`aqr.AQR`). At the first recalibrated layers (a third of
them, :class:`aqr.core.descriptors.DescriptorStats`'s ``layers``) each image's *descriptor* is read: per
channel its mean and log standard deviation, standardized by the layer's source knots
(:func:`aqr.core.descriptors.image_descriptors`); those layers map every image with the shared state. The
descriptors, concatenated, are *whitened* by their covariance over the source images (stored with the
statistics, ``aqr.calibrate(..., descriptors=True)``): what content alone spreads becomes round, so the
distance between images measures what the domain moved. A causal mini-batch k-means of ``components``
centres assigns each image to the nearest centre before the later layers run; after a batch is committed
the centres move to their images by a running mean over all the images they took. The centres are seeded
from the first :data:`SEED_IMAGES` images (k-means++, greedy, with a generator of fixed seed); until then
every image maps with the shared state alone. A centre that took fewer than :data:`REASSIGN_RATIO` of the
largest one's images is moved onto an image of the batch (where a centre has taken none, or every
:data:`REASSIGN_EVERY` ``x components`` batches), so no centre stays stranded on an outlier.

Per later layer (:meth:`MixedLayerStream.batch_step`) the shared state steps the whole batch, and each
cluster's images step that cluster's state as ``"stream"`` steps a batch of that many images; a cluster's
state starts, on its first images, as a copy of the shared one. Why the blend: a domain split into several
clusters by its images' content maps each part onto the whole source distribution, which costs accuracy
on a stream of one domain at a time; the shared half of the map keeps it (measured in ``docs/method.md``).

The assignment is read on the host (the members of each cluster), so the target runs on the CPU only (off
it, a clear ``ValueError``): off the CPU it would stall the device's queue.

A batch enters the state only when the whole forward pass was finite (as ``"stream"``: staged, then
committed; the router's centres once per batch, at the commit). The layers' states (:meth:`export_state`)
and the router's (:meth:`ComponentRouter.export_state`) are plain values in ``state_dict``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from aqr.adapt.config import AQRConfig, check_blend, check_components
from aqr.adapt.layer_maps import host_reads_are_cheap
from aqr.adapt.stream.base import Flag, StreamKernels, all_finite
from aqr.adapt.stream.batch import BatchCommit, BatchValues
from aqr.adapt.stream.running import BatchKnots, LayerStream, Staged, StreamSettings
from aqr.backends import Affine
from aqr.core.descriptors import DescriptorStats, image_descriptors

# The images the centres are seeded from (every image maps with the shared state until then).
SEED_IMAGES = 64
# A centre that took fewer than this share of the largest centre's images is moved onto an image of the batch.
REASSIGN_RATIO = 0.01
# ... checked where a centre took no image yet, else every REASSIGN_EVERY x components batches.
REASSIGN_EVERY = 10
ROUTER_SEED = 0  # the seed of the centres' draws: the same stream gives the same clusters


@dataclass(frozen=True)
class Assignment:
    """One batch's images grouped by cluster: ``of`` ``(N,)`` each image's cluster (CPU, int64; -1: none, the
    shared state's map alone) and ``members`` ``[(cluster, images' indices)]`` in cluster order."""

    of: torch.Tensor
    members: tuple[tuple[int, torch.Tensor], ...]

    @classmethod
    def of_components(cls, of: torch.Tensor) -> Assignment:
        """The assignment ``of`` (each image's cluster), its members worked out."""
        members = tuple((int(k), (of == k).nonzero().view(-1)) for k in torch.unique(of).tolist() if k >= 0)
        return cls(of, members)


def squared_distances(z: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """``(N, K)``: each row of ``z`` ``(N, D)``'s squared Euclidean distance to each centre ``(K, D)``."""
    return (z.unsqueeze(1) - centres.unsqueeze(0)).square().sum(dim=-1)


def seed_centres(z: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """``k`` rows of ``z`` ``(N, D)`` (``N >= k``) as centres by greedy k-means++: each next centre the best, by
    the sum of squared distances to the nearest centre, of ``2 + ln k`` candidates drawn in proportion to
    that distance."""
    n = z.shape[0]
    chosen = [int(torch.randint(n, (1,), generator=generator))]
    nearest = squared_distances(z, z[chosen]).view(-1)
    trials = 2 + int(math.log(k))
    for _ in range(k - 1):
        weights = nearest.clamp_min(0)
        if float(weights.sum()) <= 0:  # every row is a centre already: repeat one
            chosen.append(chosen[-1])
            continue
        candidates = torch.multinomial(weights, trials, replacement=True, generator=generator)
        potential = torch.minimum(nearest.unsqueeze(0), squared_distances(z[candidates], z))
        best = int(torch.argmin(potential.sum(dim=1)))
        chosen.append(int(candidates[best]))
        nearest = potential[best]
    return z[chosen].clone()


class ComponentRouter:
    """The clusters of one :class:`aqr.AQR`'s images (see the module docs): which layers give descriptors, the
    whitening, the k-means centres (float64, CPU) and, for the batch in flight, its descriptors and
    assignment."""

    def __init__(self, descriptors: DescriptorStats, components: int) -> None:
        check_components(components)
        self.layers = tuple(descriptors.layers)
        self.mean = descriptors.mean.detach().to("cpu", torch.float64)
        self.whitening = descriptors.whitening.detach().to("cpu", torch.float64)
        self.components = components
        self.reset()
        self.begin()

    @classmethod
    def of(cls, config: AQRConfig, descriptors: DescriptorStats | None) -> ComponentRouter:
        """The router of ``config``'s ``components`` on the statistics' ``descriptors``; ``ValueError`` where the
        statistics hold none."""
        if descriptors is None:
            raise ValueError("target='mixed' clusters images by their statistics at the first layers, whitened "
                             "by their spread over the source images: calibrate with descriptors=True "
                             "(aqr calibrate --descriptors)")
        return cls(descriptors, config.components)

    def check_layers(self, recalibrated: list[str]) -> None:
        """Raise ``ValueError`` unless every descriptor layer is among the ``recalibrated`` layers (a layer left
        out would never give its descriptors, and no image would ever be clustered)."""
        missing = [name for name in self.layers if name not in recalibrated]
        if missing:
            raise ValueError(f"target='mixed' reads its images' descriptors at {list(self.layers)}, but this AQR "
                             f"does not recalibrate {missing}: recalibrate them too (layers=...)")

    def reset(self) -> None:
        """No centre: the next :data:`SEED_IMAGES` images seed them."""
        d = self.mean.numel()
        self.centres = torch.zeros(self.components, d, dtype=torch.float64)
        self.counts = torch.zeros(self.components, dtype=torch.float64)
        self.seeded = False
        self.pending = torch.zeros(0, d, dtype=torch.float64)  # the whitened descriptors before the seeding
        self.batches = 0  # batches committed since the seeding
        self.since = 0  # batches since the last check for stranded centres
        # how often each centre was moved onto a new image: a layer's state of an older generation starts again
        self.generation = torch.zeros(self.components, dtype=torch.int64)

    # ---- the batch in flight -----------------------------------------------------------------
    def begin(self) -> None:
        """A new batch (or a second pass over one): nothing recorded."""
        self._recorded: dict[str, torch.Tensor] = {}
        self._whitened: torch.Tensor | None = None
        self._assignment: Assignment | None = None

    def record(self, layer: str, descriptors: torch.Tensor) -> None:
        """The batch's descriptors ``(N, 2 C)`` at ``layer`` (one of :attr:`layers`)."""
        self._recorded[layer] = descriptors.detach().to("cpu", torch.float64)

    def assignment(self) -> Assignment | None:
        """The batch's clusters, worked out once all of :attr:`layers` recorded; ``None`` before that or before
        the centres are seeded (every image maps with the shared state)."""
        if self._whitened is None:
            if any(name not in self._recorded for name in self.layers):
                return None
            joined = torch.cat([self._recorded[name] for name in self.layers], dim=1)
            self._whitened = (joined - self.mean) @ self.whitening
            if self.seeded:
                of = squared_distances(self._whitened, self.centres).argmin(dim=1)
                # an image whose descriptor overflowed (finite values of 1e20 have an infinite spread) joins none
                of = of.masked_fill(~torch.isfinite(self._whitened).all(dim=1), -1)
                self._assignment = Assignment.of_components(of)
        return self._assignment

    def commit(self) -> None:
        """A committed batch moves the centres (once per batch: the layers' commits call it through
        :meth:`aqr.adapt.stream.batch.BatchCommit.once`)."""
        self.assignment()  # works out the batch's whitened descriptors where every descriptor layer recorded
        z = self._whitened
        if z is None:
            return  # a forward pass that skipped a descriptor layer: nothing to learn from
        z = z[torch.isfinite(z).all(dim=1)]  # an overflowed descriptor moves no centre
        if len(z) == 0:
            return
        if not self.seeded:
            self.pending = torch.cat([self.pending, z])
            if len(self.pending) < max(SEED_IMAGES, self.components):
                return
            z, self.pending = self.pending, self.pending[:0]
            self.centres = seed_centres(z, self.components, self._generator())
            self.seeded = True
        self._update(z, squared_distances(z, self.centres).argmin(dim=1))

    def _generator(self) -> torch.Generator:
        """The generator of the next draw: fixed by the batches seen, so a loaded state draws as the saved one."""
        return torch.Generator().manual_seed(ROUTER_SEED * 1_000_003 + self.batches)

    def _update(self, z: torch.Tensor, of: torch.Tensor) -> None:
        """Each centre a running mean of every image it took; stranded centres moved onto the batch's images."""
        k = self.components
        sizes = torch.bincount(of, minlength=k).double()
        sums = torch.zeros_like(self.centres).index_add_(0, of, z)
        self.counts += sizes
        took = sizes > 0
        self.centres[took] += (sums[took] - sizes[took, None] * self.centres[took]) / self.counts[took, None]
        self.batches += 1
        self.since += 1
        if bool((self.counts == 0).any()) or self.since >= REASSIGN_EVERY * k:
            self.since = 0
            stranded = (self.counts < REASSIGN_RATIO * self.counts.max()).nonzero().view(-1)
            stranded = stranded[: max(1, len(z) // 2)]
            if len(stranded):
                pick = torch.randperm(len(z), generator=self._generator())[: len(stranded)]
                self.centres[stranded[: len(pick)]] = z[pick]
                self.generation[stranded[: len(pick)]] += 1
                rest = self.counts[self.counts >= REASSIGN_RATIO * self.counts.max()]
                self.counts[stranded[: len(pick)]] = rest.min() if len(rest) else 1.0

    # ---- state --------------------------------------------------------------------------------
    def export_state(self) -> dict[str, object]:
        """The router's state as plain values (tensors cloned): what :meth:`load_state` takes back."""
        return {"centres": self.centres.clone(), "counts": self.counts.clone(), "seeded": self.seeded,
                "pending": self.pending.clone(), "batches": self.batches, "since": self.since,
                "generation": self.generation.clone()}

    def check_state(self, values: object) -> None:
        """Raise ``ValueError`` unless ``values`` is a state :meth:`export_state` of a router like this gave."""
        names = {"centres", "counts", "seeded", "pending", "batches", "since", "generation"}
        if not isinstance(values, Mapping) or set(values) != names:
            raise ValueError(f"the clusters' state must have the parts {sorted(names)}")
        k, d = self.centres.shape
        for name, shape in (("centres", (k, d)), ("counts", (k,))):
            t = values[name]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != torch.float64:
                raise ValueError(f"the clusters' state {name!r}: expected a float64 tensor {shape}")
            if not bool(torch.isfinite(t).all()) or (name == "counts" and bool((t < 0).any())):
                raise ValueError(f"the clusters' state {name!r} holds NaN, Inf or negative counts")
        generation = values["generation"]
        if (not isinstance(generation, torch.Tensor) or tuple(generation.shape) != (k,)
                or generation.dtype != torch.int64 or bool((generation < 0).any())):
            raise ValueError(f"the clusters' state 'generation': expected {k} int64 counts >= 0")
        pending = values["pending"]
        if (not isinstance(pending, torch.Tensor) or pending.ndim != 2 or pending.shape[1] != d
                or pending.dtype != torch.float64 or not bool(torch.isfinite(pending).all())):
            raise ValueError(f"the clusters' state 'pending': expected finite float64 rows of {d} values")
        if type(values["seeded"]) is not bool:
            raise ValueError(f"the clusters' state 'seeded': expected a bool, got {values['seeded']!r}")
        for name in ("batches", "since"):
            if type(values[name]) is not int or values[name] < 0:
                raise ValueError(f"the clusters' state {name!r}: expected a count >= 0, got {values[name]!r}")

    def load_state(self, values: Mapping[str, object]) -> None:
        """Take the state ``values`` (from :meth:`export_state`; checked first)."""
        self.check_state(values)
        self.centres = values["centres"].clone()  # type: ignore[union-attr]
        self.counts = values["counts"].clone()  # type: ignore[union-attr]
        self.pending = values["pending"].clone()  # type: ignore[union-attr]
        self.generation = values["generation"].clone()  # type: ignore[union-attr]
        self.seeded = bool(values["seeded"])
        self.batches = int(values["batches"])  # type: ignore[call-overload]
        self.since = int(values["since"])  # type: ignore[call-overload]

    def __getstate__(self) -> dict[str, object]:
        # a copy holds the state between two batches: the batch in flight stays behind
        state = self.__dict__.copy()
        state.update(_recorded={}, _whitened=None, _assignment=None)
        return state


@dataclass(frozen=True)
class LayerRoute:
    """Where a layer stands in its router: ``router`` and the layer's ``name``."""

    router: ComponentRouter
    name: str

    @property
    def describes(self) -> bool:
        """Whether the layer gives descriptors (one of the first layers), which map with the shared state alone."""
        return self.name in self.router.layers


@dataclass
class MixedStaged:
    """What a batch leaves to a layer's commit: the shared state's update and ``(cluster, starts, staged)`` per
    cluster that took images (``starts``: the cluster's state is first a copy of the shared one)."""

    shared: Staged
    parts: list[tuple[int, bool, Staged]]


def _select(x: torch.Tensor, images: int, index: torch.Tensor) -> torch.Tensor:
    """The rows of the images ``index`` of ``x`` (A, C, B), in that order."""
    a, c, b = x.shape
    return x.reshape(images, -1).index_select(0, index).reshape(len(index) * (a // images), c, b)


SHARED = "shared."  # the prefix of the shared state's entries in a layer's exported state


class MixedLayerStream:
    """One layer's shared running state and, after the descriptor layers, one per cluster (see the module
    docs): ``shared`` and ``parts[k]`` are :class:`~aqr.adapt.stream.running.LayerStream`'s. It answers what a
    layer map asks of its state as a :class:`~aqr.adapt.stream.running.LayerStream` does."""

    target: ClassVar[str] = "mixed"
    takes_small_steps: ClassVar[bool] = False  # each cluster's images are selected first: the general step

    def __init__(self, source: torch.Tensor, settings: StreamSettings, kernels: StreamKernels,
                 batch_knots: BatchKnots, route: LayerRoute, blend: float) -> None:
        check_blend(blend)
        self.settings = settings
        self.kernels = kernels
        self.route = route
        self.blend = float(blend)
        self.shared = LayerStream(source, settings, kernels, batch_knots)
        clusters = 0 if route.describes else route.router.components
        self.parts = [LayerStream(source, settings, kernels, batch_knots) for _ in range(clusters)]
        # the router's generation of each cluster when its state here started (an older one starts again)
        self.generations = torch.zeros(clusters, dtype=torch.int64)
        self.source = self.shared.source

    @property
    def knots(self) -> torch.Tensor:
        """The shared state's running knots (what a gradient through the map reads)."""
        return self.shared.knots

    def _starts(self, k: int) -> bool:
        """Whether cluster ``k``'s state here starts (again) from the shared one: it has none, or its centre was
        moved onto a new image since it started."""
        return not self.parts[k].started or int(self.generations[k]) != int(self.route.router.generation[k])

    @classmethod
    def from_config(cls, config: AQRConfig, source: torch.Tensor, settings: StreamSettings, kernels: StreamKernels,
                    batch_knots: BatchKnots, group_source: torch.Tensor | None = None,
                    route: LayerRoute | None = None) -> MixedLayerStream:
        """One layer's states for ``config`` (``group_source`` is not taken: no class groups); ``route``: the
        layer's place in its :class:`aqr.AQR`'s router, which this target needs."""
        if route is None:
            raise ValueError("target='mixed' needs the router of its aqr.AQR (built with the statistics' descriptors)")
        return cls(source, settings, kernels, batch_knots, route, config.blend)

    @classmethod
    def batch_shares(cls, recent: list[int], config: AQRConfig) -> tuple[float, float]:
        """``(own, runs)``: this state reads no predicted classes, ``(0, 1)`` as ``"stream"``."""
        return 0.0, 1.0

    def _view(self, part: LayerStream) -> LayerStream:
        """``part`` stepped by this state's kernels (a view sharing its buffers where they differ)."""
        if part.kernels is self.kernels:
            return part
        view = object.__new__(LayerStream)
        view.__dict__.update(part.__dict__)
        view.kernels = self.kernels
        view._bound = None
        return view

    @property
    def started(self) -> bool:
        """Whether the shared state has started (the first batch starts it)."""
        return self.shared.started

    @property
    def channels(self) -> int:
        return self.shared.channels

    def _assignment(self, x: torch.Tensor, images: int, pre: Affine | None) -> Assignment | None:
        """Record the descriptors (a descriptor layer) or read the batch's clusters (a later one); ``ValueError``
        off the CPU, where reading the members on the host would stall the device."""
        if not host_reads_are_cheap(x.device):
            raise ValueError(f"target='mixed' runs on the CPU only (its clusters are read on the host, which "
                             f"would stall {x.device}'s queue); use target='stream' there")
        router = self.route.router
        if self.route.describes:
            router.record(self.route.name, image_descriptors(x, images, pre, self.source))
            return None
        return router.assignment() if self.blend > 0 else None

    def _blend_in(self, rows: torch.Tensor, index: torch.Tensor, mapped: torch.Tensor) -> None:
        """The rows ``index`` of the shared map ``rows`` (images, values) become ``blend`` of the way to their
        cluster's map ``mapped`` (those images' values, in that order)."""
        mine = mapped.reshape(len(index), -1).to(rows.dtype)
        rows.index_copy_(0, index, torch.lerp(rows.index_select(0, index), mine, self.blend))

    # ---- one batch ----------------------------------------------------------------------------
    def batch_step(self, x: torch.Tensor, batch: BatchValues,
                   pre: Affine | None = None) -> tuple[torch.Tensor | None, MixedStaged | None, Flag]:
        """The shared state steps ``x`` (A, C, B); each cluster's images step its state (a new one's, the shared
        state's), blended into theirs: ``(y, staged, finite)`` as :meth:`LayerStream.flagged_step`."""
        images = batch.images
        assignment = self._assignment(x, images, pre)
        y, shared, finite = self._view(self.shared).flagged_step(x, images, pre)
        if finite is False or y is None:
            return None, None, False
        staged = MixedStaged(shared, [])  # type: ignore[arg-type]
        if assignment is None:
            return y, staged, finite
        y = y.contiguous()
        rows = y.view(images, -1)
        for k, index in assignment.members:
            starts = self._starts(k)
            mapped, step, ok = self._view(self.shared if starts else self.parts[k]).flagged_step(
                _select(x, images, index), len(index), pre)
            if ok is False or mapped is None:
                return None, None, False
            self._blend_in(rows, index, mapped)
            staged.parts.append((k, starts, step))  # type: ignore[arg-type]
            finite = all_finite(finite, ok)
        return y, staged, finite

    def flagged_held(self, x: torch.Tensor, images: int,
                     pre: Affine | None = None) -> tuple[torch.Tensor | None, Flag]:
        """``x`` mapped with the committed states (a cluster that has none, the shared one's alone), staging
        nothing: ``(y, finite)``."""
        assignment = self._assignment(x, images, pre)
        y, finite = self._view(self.shared).flagged_held(x, images, pre)
        if finite is False or y is None or assignment is None:
            return y, finite
        y = y.contiguous()
        rows = y.view(images, -1)
        for k, index in assignment.members:
            if self._starts(k):
                continue
            mapped, ok = self._view(self.parts[k]).flagged_held(_select(x, images, index), len(index), pre)
            if ok is False or mapped is None:
                return None, False
            self._blend_in(rows, index, mapped)
            finite = all_finite(finite, ok)
        return y, finite

    def commit_batch(self, staged: MixedStaged, commit: BatchCommit) -> None:
        """Apply what :meth:`batch_step` staged: a cluster's new state first copies the shared one (as it was before
        this batch), then each cluster and the shared state commit, and the router moves its centres (once)."""
        for k, starts, _ in staged.parts:
            if starts:
                self.parts[k].load_state(self.shared.export_state())
                self.generations[k] = self.route.router.generation[k]
        for k, _, step in staged.parts:
            self.parts[k].commit(step)
        self.shared.commit(staged.shared)
        router = self.route.router
        commit.once(("mixed-router", id(router)), router.commit)

    # ---- state --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Every state back to its initial one, and the router's centres (every layer resets it; once is enough)."""
        self.shared.reset()
        for part in self.parts:
            part.reset()
        self.generations.zero_()
        self.route.router.reset()

    def export_state(self) -> dict[str, object]:
        """The running state as plain values: ``"knots"`` (the shared state's, naming the device), the shared
        state's :meth:`LayerStream.export_state` under ``"shared.<name>"`` and each cluster's under
        ``"<k>.<name>"``."""
        values: dict[str, object] = {"knots": self.shared.knots.detach().clone(),
                                     "generations": self.generations.clone()}
        values.update({SHARED + name: value for name, value in self.shared.export_state().items()})
        for k, part in enumerate(self.parts):
            values.update({f"{k}.{name}": value for name, value in part.export_state().items()})
        return values

    def _split(self, values: Mapping[str, object]) -> tuple[dict[str, object], list[dict[str, object]]]:
        """``values`` (from :meth:`export_state`) as the shared state and one per cluster; ``ValueError`` where it is
        not one."""
        if not isinstance(values, Mapping) or "knots" not in values:
            raise ValueError("a mixed stream state holds 'knots', the shared state's parts and each cluster's")
        shared: dict[str, object] = {}
        parts: list[dict[str, object]] = [{} for _ in self.parts]
        for name, value in values.items():
            if name in ("knots", "generations"):
                continue
            if name.startswith(SHARED):
                shared[name[len(SHARED):]] = value
                continue
            k, _, rest = name.partition(".")
            if not k.isdigit() or int(k) >= len(self.parts):
                raise ValueError(f"a mixed stream state of {len(self.parts)} clusters has no part {name!r}")
            parts[int(k)][rest] = value
        return shared, parts

    def check_state(self, values: Mapping[str, object]) -> None:
        """Raise ``ValueError`` unless ``values`` is a state :meth:`export_state` of a state like this one gave."""
        shared, parts = self._split(values)
        generations = values.get("generations")
        if (not isinstance(generations, torch.Tensor) or tuple(generations.shape) != (len(self.parts),)
                or generations.dtype != torch.int64 or bool((generations < 0).any())):
            raise ValueError(f"a mixed stream state's 'generations': expected {len(self.parts)} int64 counts >= 0")
        self.shared.check_state(shared)
        for k, (part, state) in enumerate(zip(self.parts, parts)):
            try:
                part.check_state(state)
            except ValueError as err:
                raise ValueError(f"cluster {k}: {err}") from None

    def load_state(self, values: Mapping[str, object]) -> None:
        """Take the running state ``values`` (from :meth:`export_state`; checked first)."""
        self.check_state(values)
        shared, parts = self._split(values)
        self.generations = values["generations"].clone()  # type: ignore[union-attr]
        self.shared.load_state(shared)
        for part, state in zip(self.parts, parts):
            part.load_state(state)

    def memory_bytes(self) -> int:
        """Bytes of the running states (fixed)."""
        return self.shared.memory_bytes() + sum(part.memory_bytes() for part in self.parts)
