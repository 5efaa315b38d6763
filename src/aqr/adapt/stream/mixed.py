"""Streaming AQR for streams that mix domains: a shared running estimate, and one per cluster of images.

A stream whose batches draw from many corruptions at once has a pooled per-channel distribution that fits
none of them: ``target="stream"`` maps every image with that mixture's quantiles, and each domain is
mapped with the others' shift. ``aqr.AQR(model, stats, target="mixed")`` keeps, per recalibrated layer, the
running state ``"robust"`` keeps (the *shared* state, stepped by every image, class-balanced while the
predicted classes come in runs: :mod:`aqr.adapt.stream.robust`) and ``components`` more, one per *cluster* of
images, each a running state of ``"stream"``, and maps each image as ``b`` times its cluster's map plus
``1 - b`` times the shared state's, ``b = blend * (1 - runs)``: a cluster's running estimate holds the content
of a run of one class, so its share fades as the predicted classes come in runs (``runs``, robust AQR's, of
the batch; a held batch takes the last committed one's).

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

Per later layer (:meth:`MixedLayerStream.batch_step`) the shared state steps the whole batch as ``"robust"``
does; then one kernel call (:meth:`aqr.adapt.stream.base.StreamKernels.cluster_scan`) scans each clustered image
alone on its cluster's state as it was before the batch: the image's map (its edge lines stretched to its own
extremes) is blended into the shared map, and its values are counted on the cluster's bins. At the commit one
more call (:meth:`~aqr.adapt.stream.base.StreamKernels.cluster_push`) pushes each cluster's images into its tail
window and pending group, as a small batch of ``"stream"``; a cluster rebuilds its knots and table every
:data:`CLUSTER_REBUILD_EVERY` of its images (each takes a few images of every batch: rebuilding all of them at
every batch would cost more than mapping them). A cluster's state starts, on its first images, as a copy of the
shared one's running estimate (its knots, tail window and counts, not its class groups). The clusters count
their images while their share is 0 too, so they are ready when it grows.

Why the blend: a domain split into several clusters by its images' content maps each part onto the whole
source distribution, which costs accuracy on a stream of one domain at a time; the shared part of the map
keeps it (measured in ``docs/method.md``).

Off the CPU nothing of this is read inside the forward pass: the descriptors, whitened, and the assignment stay on
the device (the centres are copied there once they move), the clusters' states are gathered per image by the
assignment on the device (:meth:`aqr.adapt.stream.torch_kernels.TorchStreamKernels.cluster_scan`), and the
whitened descriptors and the assignment come to the host with the logits, in the forward's one read
(:meth:`ComponentRouter.device_reads`, :func:`aqr.adapt.stream.batch.host_outcome`), for the commit, where the
centres move (on the host, in float64) and each cluster's images are pushed.

A batch enters the state only when the whole forward pass was finite (as ``"robust"``: staged, then
committed with the batch's predicted classes; the router's centres once per batch, at the commit). The
layers' states (:meth:`export_state`) and the router's (:meth:`ComponentRouter.export_state`) are plain
values in ``state_dict``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from aqr.adapt.config import AQRConfig, check_blend, check_components
from aqr.adapt.layer_maps import host_reads_are_cheap
from aqr.adapt.stream.base import ClusterScan, Flag, StreamKernels, all_finite, cluster_sizes, on_device
from aqr.adapt.stream.batch import BatchCommit, BatchValues, one_copy
from aqr.adapt.stream.robust import RobustLayerStream, RobustSettings, RobustStaged
from aqr.adapt.stream.running import COUNT_CELLS, COUNT_STRIDE, BatchKnots, LayerStream, StreamSettings
from aqr.backends import Affine
from aqr.core.descriptors import DescriptorStats, image_descriptors

# The images the centres are seeded from (every image maps with the shared state until then).
SEED_IMAGES = 64
# A centre that took fewer than this share of the largest centre's images is moved onto an image of the batch.
REASSIGN_RATIO = 0.01
# ... checked where a centre took no image yet, else every REASSIGN_EVERY x components batches.
REASSIGN_EVERY = 10
# A cluster's state rebuilds its knots and table every this many of its images (at least).
CLUSTER_REBUILD_EVERY = 32
ROUTER_SEED = 0  # the seed of the centres' draws: the same stream gives the same clusters


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
    whitening, the k-means centres (float64, CPU; copied to the device of the images where they run) and, for the
    batch in flight, its descriptors and assignment (on the images' device) and their host copies."""

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
        self._copies: dict[tuple[str, torch.device], torch.Tensor] = {}  # values copied to a device (moved())

    # ---- the batch in flight -----------------------------------------------------------------
    def begin(self) -> None:
        """A new batch (or a second pass over one): nothing recorded."""
        self._recorded: dict[str, torch.Tensor] = {}
        self._whitened: torch.Tensor | None = None
        self._assignment: torch.Tensor | None = None
        self._host: tuple[torch.Tensor, ...] = ()  # device_reads()' tensors, read on the host (took())

    def record(self, layer: str, descriptors: torch.Tensor) -> None:
        """The batch's descriptors ``(N, 2 C)`` at ``layer`` (one of :attr:`layers`), kept on their device."""
        self._recorded[layer] = descriptors.detach().to(torch.float64)

    def _on(self, name: str, device: torch.device) -> torch.Tensor:
        """The router's tensor ``name`` (``mean``, ``whitening``, ``centres``) on ``device``, copied once (until the
        centres move: :meth:`moved`) without waiting for the device's queue."""
        value = getattr(self, name)
        if device == value.device:
            return value
        key = (name, device)
        if key not in self._copies:
            self._copies[key] = on_device(value, device)
        return self._copies[key]

    def moved(self) -> None:
        """The centres changed: their copies on devices are stale."""
        self._copies = {key: t for key, t in self._copies.items() if key[0] != "centres"}

    def assignment(self) -> torch.Tensor | None:
        """The batch's clusters ``(N,)`` (int64, on the descriptors' device; -1: none, the shared state's map alone),
        worked out once all of :attr:`layers` recorded; ``None`` before that or before the centres are seeded
        (every image maps with the shared state)."""
        if self._whitened is None:
            if any(name not in self._recorded for name in self.layers):
                return None
            joined = torch.cat([self._recorded[name] for name in self.layers], dim=1)
            device = joined.device
            self._whitened = (joined - self._on("mean", device)) @ self._on("whitening", device)
            if self.seeded:
                of = squared_distances(self._whitened, self._on("centres", device)).argmin(dim=1)
                # an image whose descriptor overflowed (finite values of 1e20 have an infinite spread) joins none
                self._assignment = of.masked_fill(~torch.isfinite(self._whitened).all(dim=1), -1)
        return self._assignment

    def device_reads(self) -> tuple[torch.Tensor, ...]:
        """What the commit needs on the host and the batch left on a device: its whitened descriptors and, once
        the centres are seeded, its assignment (``()`` on the CPU, or where no descriptor was recorded)."""
        self.assignment()
        if self._whitened is None or host_reads_are_cheap(self._whitened.device):
            return ()
        return (self._whitened,) if self._assignment is None else (self._whitened, self._assignment)

    def took(self, host: tuple[torch.Tensor, ...]) -> None:
        """:meth:`device_reads`' tensors as the forward's one read copied them to the host (``()``: none taken)."""
        self._host = tuple(host)

    def _read(self) -> tuple[torch.Tensor, ...]:
        """:meth:`device_reads`' tensors on the host: as :meth:`took` got them, else read here once for the batch
        (a caller that gave none, as :class:`aqr.adapt.pre_affine.PreAffineAQR`)."""
        if not self._host:
            self._host = tuple(one_copy(self.device_reads()))
        return self._host

    def on_host(self, of: torch.Tensor) -> torch.Tensor:
        """The batch's assignment ``of`` on the CPU (its host copy where ``of`` is off it)."""
        if host_reads_are_cheap(of.device):
            return of
        host = self._read()
        if len(host) != 2 or host[1].shape != of.shape:
            raise RuntimeError(f"target='mixed': the host copy of the batch's clusters does not fit its {len(of)} "
                               f"images (the commit was given another batch's)")
        return host[1]

    def commit(self) -> None:
        """A committed batch moves the centres (once per batch: the layers' commits call it through
        :meth:`aqr.adapt.stream.batch.BatchCommit.once`)."""
        self.assignment()  # works out the batch's whitened descriptors where every descriptor layer recorded
        z = self._whitened
        if z is None:
            return  # a forward pass that skipped a descriptor layer: nothing to learn from
        self._commit(z if host_reads_are_cheap(z.device) else self._read()[0])
        self.moved()

    def _commit(self, z: torch.Tensor) -> None:
        """:meth:`commit` of the batch's whitened descriptors ``z`` (float64, CPU)."""
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
        self.moved()

    def __getstate__(self) -> dict[str, object]:
        # a copy holds the state between two batches: the batch in flight stays behind, and the device copies
        state = self.__dict__.copy()
        state.update(_recorded={}, _whitened=None, _assignment=None, _host=(), _copies={})
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_copies", {})
        self.__dict__.setdefault("_host", ())


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
    """What a batch leaves to a layer's commit: the shared state's update and, where the images were clustered,
    each image's cluster ``of``, extremes ``lo``/``hi`` and each cluster's histogram ``counts`` (on its knots'
    bins: the shared state's where it ``starts``, i.e. first copies the shared one), with the router's
    ``generations`` of the clusters when the batch ran."""

    shared: RobustStaged
    of: torch.Tensor | None = None
    lo: torch.Tensor | None = None
    hi: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    starts: tuple[bool, ...] = ()
    generations: torch.Tensor | None = None


SHARED = "shared."  # the prefix of the shared state's entries in a layer's exported state


class MixedLayerStream:
    """One layer's shared running state and, after the descriptor layers, one per cluster (see the module
    docs): ``shared`` is a :class:`~aqr.adapt.stream.robust.RobustLayerStream`, each of ``parts`` a
    :class:`~aqr.adapt.stream.running.LayerStream`. It answers what a layer map asks of its state as a
    :class:`~aqr.adapt.stream.running.LayerStream` does."""

    target: ClassVar[str] = "mixed"
    takes_small_steps: ClassVar[bool] = False  # the general step: the clusters scan the batch after it

    def __init__(self, source: torch.Tensor, settings: StreamSettings, robust: RobustSettings, kernels: StreamKernels,
                 batch_knots: BatchKnots, route: LayerRoute, blend: float) -> None:
        check_blend(blend)
        self.settings = settings
        self.kernels = kernels
        self.route = route
        self.blend = float(blend)
        self.shared = RobustLayerStream(source, settings, robust, kernels, batch_knots)
        clusters = 0 if route.describes else route.router.components
        # a cluster rebuilds every CLUSTER_REBUILD_EVERY of its images (see the module docs), or rebuild_every
        part_settings = dataclasses.replace(settings, rebuild_every=max(settings.rebuild_every, CLUSTER_REBUILD_EVERY))
        self.parts = [LayerStream(source, part_settings, kernels, batch_knots) for _ in range(clusters)]
        # the router's generation of each cluster when its state here started (an older one starts again)
        self.generations = torch.zeros(clusters, dtype=torch.int64)
        self.source = self.shared.source

    @property
    def knots(self) -> torch.Tensor:
        """The shared state's running knots (what a gradient through the map reads)."""
        return self.shared.knots

    def _starts(self) -> list[bool]:
        """Whether each cluster's state here starts (again) from the shared one: it has none, or its centre was
        moved onto a new image since it started."""
        moved = (self.generations != self.route.router.generation).tolist()
        return [not part.started or m for part, m in zip(self.parts, moved)]

    @classmethod
    def from_config(cls, config: AQRConfig, source: torch.Tensor, settings: StreamSettings, kernels: StreamKernels,
                    batch_knots: BatchKnots, group_source: torch.Tensor | None = None,
                    route: LayerRoute | None = None) -> MixedLayerStream:
        """One layer's states for ``config`` (``group_source`` is not taken: the target maps onto the layer's source
        knots); ``route``: the layer's place in its :class:`aqr.AQR`'s router, which this target needs."""
        if route is None:
            raise ValueError("target='mixed' needs the router of its aqr.AQR (built with the statistics' descriptors)")
        return cls(source, settings, RobustSettings.of(config), kernels, batch_knots, route, config.blend)

    @classmethod
    def batch_shares(cls, recent: list[int], config: AQRConfig) -> tuple[float, float]:
        """``(own, runs)`` from the recent predicted classes, as ``"robust"``."""
        return RobustLayerStream.batch_shares(recent, config)

    def _blend(self, runs: float) -> float:
        """The clusters' share of an image's map: ``blend`` while the predicted classes show no runs, fading to 0
        as they come in runs (``runs`` 1), where a cluster's running estimate holds the content of its run."""
        return self.blend * (1.0 - min(1.0, max(0.0, runs)))

    def _view(self, part: LayerStream) -> LayerStream:
        """``part`` stepped by this state's kernels (a view sharing its buffers where they differ)."""
        if part.kernels is self.kernels:
            return part
        view = object.__new__(type(part))
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

    def _assignment(self, x: torch.Tensor, images: int, pre: Affine | None) -> torch.Tensor | None:
        """Record the descriptors (a descriptor layer) or give the batch's clusters (a later one; on ``x``'s
        device, not read)."""
        router = self.route.router
        if self.route.describes:
            router.record(self.route.name, image_descriptors(x, images, pre, self.source))
            return None
        return router.assignment() if self.blend > 0 else None  # the clusters learn while their share is 0 too

    def _clusters(self, x: torch.Tensor, images: int, pre: Affine | None, of: torch.Tensor, maps: list[bool],
                  y: torch.Tensor, blend: float) -> ClusterScan:
        """Every clustered image scanned on its cluster's committed state, in one kernel call: counted on its
        knots' bins (a cluster that starts, on the shared state's) and, where ``maps[k]``, its rows of the shared
        map ``y`` moved ``blend`` of the way to its cluster's map (:meth:`StreamKernels.cluster_scan`)."""
        states = [(part.knots, part.current_table()) if mapped else (self.shared.knots, part.table)
                  for part, mapped in zip(self.parts, maps)]
        of = on_device(of, x.device)  # a model split over devices: the descriptor layers' may be another
        return self.kernels.cluster_scan(x, images, pre, self.source, of, states, maps, blend, y, COUNT_STRIDE,
                                         COUNT_CELLS)

    # ---- one batch ----------------------------------------------------------------------------
    def batch_step(self, x: torch.Tensor, batch: BatchValues,
                   pre: Affine | None = None) -> tuple[torch.Tensor | None, MixedStaged | None, Flag]:
        """The shared state steps ``x`` (A, C, B) as robust AQR's does; each clustered image is then mapped by its
        cluster's committed state, blended into the shared map, and counted for it (:meth:`_clusters`):
        ``(y, staged, finite)`` as :meth:`LayerStream.flagged_step`."""
        images = batch.images
        blend = self._blend(batch.runs)
        of = self._assignment(x, images, pre)
        y, shared, finite = self._view(self.shared).batch_step(x, batch, pre)
        if finite is False or y is None:
            return None, None, False
        if of is None or not self.shared.started:  # a cluster's state starts from a started shared one
            return y, MixedStaged(shared), finite  # type: ignore[arg-type]
        y = y.contiguous()
        starts = self._starts()
        r = self._clusters(x, images, pre, of, [not s for s in starts], y, blend)
        if r.finite is False:
            return None, None, False
        staged = MixedStaged(shared, of, r.lo, r.hi, r.counts, tuple(starts),  # type: ignore[arg-type]
                             self.route.router.generation.clone())
        return y, staged, all_finite(finite, r.finite)

    def flagged_held(self, x: torch.Tensor, images: int,
                     pre: Affine | None = None) -> tuple[torch.Tensor | None, Flag]:
        """``x`` mapped with the committed states (a cluster that has none, the shared one's alone; the clusters'
        share from the last committed batch's runs), staging nothing: ``(y, finite)``."""
        blend = self._blend(self.shared.runs)
        of = self._assignment(x, images, pre)
        y, finite = self._view(self.shared).flagged_held(x, images, pre)
        if finite is False or y is None or of is None or blend == 0:  # a share of 0 leaves the shared map as it is
            return y, finite
        maps = [not starts for starts in self._starts()]
        mapped = on_device(torch.tensor(maps + [False]), of.device)[of]  # of == -1 reads the last flag
        of = torch.where(mapped, of, torch.full_like(of, -1))  # a cluster without a state of its own scans nothing
        y = y.contiguous()
        r = self._clusters(x, images, pre, of, maps, y, blend)
        if r.finite is False:
            return None, False
        return y, all_finite(finite, r.finite)

    def commit_batch(self, staged: MixedStaged, commit: BatchCommit) -> None:
        """Apply what :meth:`batch_step` staged: a cluster that starts first copies the shared state (as it was
        before this batch: its running estimate of every image, without its class groups), then each cluster
        commits its images as a small batch of ``"stream"`` (extremes into its window, histogram into its group,
        its knots and table rebuilt when due), the shared state commits with the batch's predicted classes, and
        the router moves its centres (once)."""
        if staged.of is not None:
            of = self.route.router.on_host(staged.of)  # which images each cluster took decides the pushes
            starting = [k for k, (size, starts) in enumerate(zip(cluster_sizes(of, len(self.parts)),
                                                                  staged.starts)) if size and starts]
            shared = self.shared.export_stream_state() if starting else None  # as it was before this batch
            for k in starting:
                self.parts[k].take_state(shared)  # type: ignore[arg-type]
                self.generations[k] = staged.generations[k]  # type: ignore[index]
            sizes = self.kernels.cluster_push(of, staged.lo, staged.hi, staged.counts,  # type: ignore[arg-type]
                                              [(part.window, part.group) for part in self.parts])
            for part, size in zip(self.parts, sizes):
                if size:
                    part.pushed(size)
        self.shared.commit_batch(staged.shared, commit)
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
