"""Class-balanced streaming AQR: while classes come in runs, the target mixes per-class running estimates.

On a stream whose classes come in runs (a camera watching one object), the recent images' per-channel
distributions differ from the source's because of their content: the source statistics pool every
class, a run of one class does not. Streaming AQR (:mod:`aqr.adapt.stream.running`) then maps the content
away, as per-batch AQR and test-time BatchNorm do. ``aqr.AQR(model, stats, target="robust")`` keeps,
per layer and channel, one running CDF per *group* of predicted classes (class ``y`` in group
``y % groups``), and, while the recent predicted classes come in runs, maps with the quantiles of their
equal mixture, so a run of one class moves one group's share (``1 / active groups``) of the target, not
all of it. While they do not (an i.i.d. or a mixed stream) it maps with the running CDF of every image,
the *marginal* (over :data:`MARGINAL_HORIZON` images), as ``"stream"`` does: there the predicted classes
are the model's errors as much as the content, and balancing them reweights the corruptions. In between,
the target is the mixture of both: ``runs`` (``1 -`` :func:`own_batch_share`) for the groups, ``1 - runs``
for the marginal. At ``runs`` 0 the groups are not merged but follow the marginal (copies of it), and the
target is the marginal's knots: once runs appear, the groups start from the running CDF of every image.

Per batch and layer (:meth:`RobustLayerStream.step`): one pass maps the batch through the table of
the target knots, takes each image's extremes and counts every ``COUNT_STRIDE``-th value of each
image on the bins of those knots (the scan's ``IMAGE_COUNT`` mode; the C kernels on CPU). After
the forward pass (:meth:`RobustLayerStream.commit`) the logits' argmax assigns each image to its
group and its histogram joins the group's pending one. Every ``rebuild_every`` images each group with
pending images merges them into its CDF (an EMA of CDFs with ``class_horizon`` images of that group:
``1 - (1 - 1/H_c)^n`` for ``n`` new images, at most :data:`MAX_GROUP_STEP` once the group has a
state), so does the marginal with all of them, the target knots become the inner quantiles of the
mixture of the marginal and the groups' CDFs seen so far (:meth:`RobustLayerStream.component_weights`),
with the Average Sample Tails of the recent window as their ends (as ``"stream"``), and the
table is rebuilt (the kernels' ``group_merge`` and ``mixture``, in C on CPU). A batch is mapped
with the state its predecessors left (its classes are known only after its forward pass); the
first batch after a reset is mapped with its own knots.

The own-batch share (``own_batch=True``, the default): mapped with the state before it, a batch lags
one batch behind streaming AQR, which merges a batch into its estimate before mapping it; on i.i.d.
streams that costs the first batches after every change of corruption. While the recent predicted
classes show no runs (:func:`own_batch_share`: the last :data:`RUN_WINDOW` consecutive predictions
repeat no more often than independent draws would), a batch of ``rebuild_every`` or more images is
mapped with the target knots merged with its own histogram at streaming AQR's batch weight, times
the part of its distance to the target that sampling does not explain (:func:`shift_share` of
:func:`shift_ratio`, per layer): a batch drawn from the target (a steady stream, or a mixed one whose
every batch samples the same mixture) would add only its own noise to it. Once classes come in runs,
the share is 0 and a batch of one class does not map its own content away. The share changes only
how the batch is mapped: the update it stages is the same. Such a batch that the commit will take into
the marginal alone (no runs, nothing pending: its groups' histograms are not read) is counted as its
even and its odd images' sums only (the scan's ``PAIRED`` mode), all the shift test and the marginal need.

Class-conditional source knots (``balance < 1``, statistics from ``aqr.calibrate(..., groups=G)``): the
groups' part of the target weighs each group by ``balance / active + (1 - balance) * share`` (``share``: its
share of the last ``recent_horizon`` predicted images), and the source side is the same mixture of the
layer's source knots (the marginal's counterpart) and the groups' source knots, so while classes come in
runs a run is mapped mostly onto its own class: a map of the corruption, not of the content. With no runs
the target is the marginal and the source the layer's.

Memory per recalibrated channel: the ``"stream"`` state plus the marginal's K float32 knots and, per group,
K float32 knots and a pending histogram of ``COUNT_CELLS + 4`` counts and two extremes
(:meth:`RobustLayerStream.memory_bytes`; 16 groups at K = 101: 11.3 kB more per channel); with
``balance < 1`` also the groups' source knots and their mixture's (K + K / groups floats per group:
6.9 kB at 16 groups). Measured, with the designs compared and the cost: ``docs/method.md`` and
``docs/results/noniid``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from aqr.adapt.config import AQRConfig, check_balance, check_groups, check_images
from aqr.adapt.stream.batch import BatchCommit, BatchValues
from aqr.adapt.stream.base import (EDGE_BINS, IMAGE_COUNT, MAP, PAIRED, Flag, StreamKernels, StreamTable, TailWindow,
                                   all_finite, copy_into, on_device,
                                   per_row)
from aqr.adapt.stream.running import (COUNT_CELLS, COUNT_STRIDE, BatchKnots, LayerStream, StagedFirst, StreamSettings,
                                      batch_weight)
from aqr.backends import Affine

@dataclass(frozen=True)
class RobustSettings:
    """The class groups of ``target="robust"``: at most ``groups`` groups of predicted classes, each an
    EMA over ``class_horizon`` images of its own (the robust options of :class:`aqr.AQRConfig` a layer's
    state reads; their defaults and checks are the config's)."""

    groups: int = AQRConfig.groups
    class_horizon: float = AQRConfig.class_horizon
    balance: float = AQRConfig.balance
    recent_horizon: float = AQRConfig.recent_horizon

    def __post_init__(self) -> None:
        check_groups(self.groups)
        for name in ("class_horizon", "recent_horizon"):
            check_images(name, getattr(self, name))
        check_balance(self.balance)

    @classmethod
    def of(cls, config: AQRConfig) -> RobustSettings:
        """The settings of ``config``'s robust options."""
        return cls(config.groups, config.class_horizon, config.balance, config.recent_horizon)


MIN_GROUP_WEIGHT = 1e-3  # balance < 1: groups below this share of the largest weight are left out of both mixtures


# The most a group's CDF moves towards one batch's images (but the first): a batch mapped with the state
# before it, whose update then replaces that state, can oscillate through the layers (each layer's input
# depends on the maps before it); measured: a single group at full steps fell from 89 % to 5 % on fog.
MAX_GROUP_STEP = 0.5


def group_step(images: int, seen: int, horizon: float) -> float:
    """A group's EMA weight for ``images`` new images after ``seen``: :func:`~aqr.adapt.stream.running.batch_weight`,
    at most :data:`MAX_GROUP_STEP` once the group has a state."""
    weight = batch_weight(images, seen, horizon)
    return weight if seen == 0 else min(weight, MAX_GROUP_STEP)


# The marginal's EMA horizon, in images, while the shift test sees no shift (after one it moves at the
# stream's ``horizon`` times the shift share). Measured on the ViT's 15-corruption streams at batch 64
# (mixed, i.i.d.; without the faster step): 128: 51.56, 58.83; 256: 51.78, 58.51; 512: 51.91, 58.29;
# 1024: 51.93, 57.61 (the equal mixture of the groups: 51.59, 58.09): a stream of mixed corruptions
# wants a long horizon, changes of corruption a short one.
MARGINAL_HORIZON = 512.0
MIXTURE_GRID = 192  # points between the groups' lowest p1 and highest p99 where the mixture is evaluated


@dataclass
class RobustStaged:
    """What a batch leaves to commit: the first batch's state (or ``None``), the per-image histograms (on
    the bins of the knots the batch was mapped with, the layer's knots once committed) and extremes."""

    first: StagedFirst | None
    counts: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    shift: float | torch.Tensor = 0.0  # the own-batch share times the shift test's share (0: not measured; a 0-d
    # float64 tensor where the step ran off the CPU)
    window: TailWindow | None = None  # the tail window with the batch's extremes pushed, where the step made it
    total: torch.Tensor | None = None  # the per-image histograms summed (int32), where the step summed them
    paired: bool = False  # counts holds the even and the odd images' sums only: the batch is absorbed alone
    most: int | None = None  # a bound on each per-image count (from the shapes), where the step knew one


@dataclass(frozen=True)
class BatchGroups:
    """A batch's predicted classes as groups, worked out once for every layer: each image's group ``of`` (on
    the histograms' device) and the groups' sizes, as ints and as float64 on the CPU."""

    of: torch.Tensor
    sizes: list[int]
    weights: torch.Tensor

    @classmethod
    def of_labels(cls, labels: torch.Tensor, groups: int, device: torch.device,
                  host_labels: torch.Tensor | None = None) -> BatchGroups:
        """The groups of ``labels``; their sizes from ``host_labels`` (the same classes, on the CPU) where given, so
        a GPU's are not read back once more."""
        group_of = labels.to(device).long() % groups
        sizes = torch.bincount(group_of if host_labels is None else host_labels.long() % groups, minlength=groups)
        return cls(group_of, sizes.tolist(), sizes.double().cpu())


class RobustLayerStream(LayerStream):
    """One layer's class-balanced running target (see the module docs); the target knots, their table
    and the tail window are :class:`~aqr.adapt.stream.running.LayerStream`'s."""

    target: ClassVar[str] = "robust"

    def __init__(self, source: torch.Tensor, settings: StreamSettings, robust: RobustSettings,
                 kernels: StreamKernels, batch_knots: BatchKnots, group_source: torch.Tensor | None = None) -> None:
        self.robust = robust
        c, k = source.shape
        if (robust.balance < 1) != (group_source is not None):
            raise ValueError("balance < 1 maps onto the mixture of the groups' source knots: give them, and only then")
        if group_source is not None and group_source.shape != (robust.groups, c, k):
            raise ValueError(f"group_source has shape {tuple(group_source.shape)}, expected {(robust.groups, c, k)}")
        # balance < 1: the source side is the mixture of the groups' source knots (its ends: the layer's)
        self.group_source = None if group_source is None else group_source.float().contiguous()
        self.base_source = source.float().contiguous()
        self.group_recent = torch.zeros(robust.groups, dtype=torch.float64)  # EMA of each group's share of images
        self.runs = 1.0  # of the last commit
        self._group_knots = torch.zeros(robust.groups, c, k, device=source.device)  # read as group_knots
        self.group_seen = [0] * robust.groups
        # images committed since the last rebuild, per group: histograms on the target knots' bins
        # (which do not change until the rebuild), extremes, counts
        self.group_counts = torch.zeros(robust.groups, c, COUNT_CELLS + EDGE_BINS, dtype=torch.int32,
                                        device=source.device)
        self.group_min = torch.empty(robust.groups, c, device=source.device)
        self.group_max = torch.empty(robust.groups, c, device=source.device)
        # the running CDF of every image, whatever its class (as target="stream"): the target while no runs;
        # it has absorbed every committed image but the pending ones (``seen - pending``)
        self.marginal = torch.zeros(1, c, k, device=source.device)
        self._groups_behind = False  # the seen groups are copies of the marginal not yet written (_idle_groups)
        super().__init__(source.clone() if group_source is not None else source, settings, kernels, batch_knots)

    @classmethod
    def from_config(cls, config: AQRConfig, source: torch.Tensor, settings: StreamSettings, kernels: StreamKernels,
                    batch_knots: BatchKnots, group_source: torch.Tensor | None = None,
                    route: object | None = None) -> RobustLayerStream:
        return cls(source, settings, RobustSettings.of(config), kernels, batch_knots, group_source)

    @classmethod
    def batch_shares(cls, recent: list[int], config: AQRConfig) -> tuple[float, float]:
        """``own``: :func:`own_batch_share` where ``config.own_batch`` (else 0); ``runs``: 1 minus that share."""
        share = own_batch_share(recent)
        return (share if config.own_batch else 0.0), 1.0 - share

    @property
    def takes_small_steps(self) -> bool:
        """Never: a class-balanced batch stages per-image histograms, which :meth:`small_step` does not."""
        return False

    def batch_step(self, x: torch.Tensor, batch: BatchValues,
                   pre: Affine | None = None) -> tuple[torch.Tensor | None, RobustStaged | None, Flag]:
        """:meth:`flagged_step` with the batch's ``own`` and ``runs``."""
        return self.flagged_step(x, batch.images, pre, batch.own, batch.runs)

    def commit_batch(self, staged: RobustStaged, commit: BatchCommit) -> None:  # type: ignore[override]
        """:meth:`commit` with the batch's predicted classes and ``runs``; the classes as groups are worked out
        once per device and group count for every layer of the commit."""
        labels, grouped = commit.labels, None
        if labels is not None:
            device, groups = staged.counts.device, self.robust.groups
            grouped = commit.once((BatchGroups, device, groups),
                                  lambda: BatchGroups.of_labels(labels, groups, device, commit.host_labels))
        self.commit(staged, labels, commit.runs, grouped)

    def __setstate__(self, state: dict[str, object]) -> None:
        if "group_knots" in state:  # a copy made before the groups' copies of the marginal were written lazily
            state["_group_knots"] = state.pop("group_knots")
        if "pending_shift" in state:  # a copy made before the shift could stay on the device
            state["_pending_shift"] = state.pop("pending_shift")
        super().__setstate__(state)
        self.__dict__.setdefault("_groups_behind", False)

    @property
    def group_knots(self) -> torch.Tensor:
        """``(groups, C, K)``: each group's running CDF (as knots), the copies of the marginal that idle rebuilds
        leave for later written first."""
        self._catch_up_groups()
        return self._group_knots

    def reset(self) -> None:
        super().reset()
        self._groups_behind = False
        self._group_knots.zero_()
        self.group_seen = [0] * self.robust.groups
        self.marginal.zero_()
        self.group_recent.zero_()
        self.runs = 1.0
        if self.group_source is not None:
            self.source.copy_(self.base_source)
        self._clear_pending()

    def _clear_pending(self, histograms: bool = True) -> None:
        """No image pending; ``histograms=False`` where none was added to the pending histograms (an idle
        rebuild of one batch alone), which are still clear."""
        if histograms:
            self.group_counts.zero_()
            self.group_min.fill_(float("inf"))
            self.group_max.fill_(float("-inf"))
        self.group_pending = [0] * self.robust.groups
        self.pending_shift = 0.0  # the largest shift share among the batches since the last rebuild

    @property
    def pending_shift(self) -> float:
        """The largest shift share among the batches since the last rebuild (read on the host: for the state)."""
        return float(self._pending_shift)

    @pending_shift.setter
    def pending_shift(self, value: float) -> None:
        self._pending_shift: float | torch.Tensor = value

    @property
    def groups_idle(self) -> bool:
        """Whether the groups weigh nothing in the target (``runs`` 0: the recent predictions show no runs)."""
        return self.runs == 0.0

    @property
    def pending(self) -> int:
        """Images committed since the target knots were last rebuilt."""
        return sum(self.group_pending)

    def snapshot(self) -> dict[str, object]:
        return {**super().snapshot(), "source": self.source.clone(), "group_recent": self.group_recent.clone(),
                "runs": self.runs, "group_knots": self.group_knots.clone(), "group_seen": list(self.group_seen),
                "group_counts": self.group_counts.clone(), "group_min": self.group_min.clone(),
                "group_max": self.group_max.clone(), "group_pending": list(self.group_pending),
                "marginal": self.marginal.clone(), "pending_shift": self.pending_shift}

    UNBOUNDED: ClassVar[tuple[str, ...]] = (*LayerStream.UNBOUNDED, "group_min", "group_max")

    def _parts(self, table: StreamTable | None = None) -> list[tuple[str, object, str]]:
        mine = ("source", "group_recent", "runs", "group_knots", "group_seen", "group_counts", "group_min",
                "group_max", "group_pending", "marginal", "pending_shift")
        return super()._parts(table) + [(name, self, name) for name in mine]

    def check_state(self, values: Mapping[str, object]) -> None:
        super().check_state(values)
        if not 0.0 <= values["runs"] <= 1.0:  # type: ignore[operator]
            raise ValueError(f"stream state 'runs' must be in [0, 1], got {values['runs']!r}")

    def memory_bytes(self) -> int:
        mine = (self.group_knots, self.group_counts, self.group_min, self.group_max, self.group_recent, self.marginal)
        if self.group_source is not None:  # the groups' source knots and their mixture's
            mine += (self.group_source, self.source)
        return super().memory_bytes() + sum(t.numel() * t.element_size() for t in mine)

    def step(self, x: torch.Tensor, images: int, pre: Affine | None = None, own: float = 0.0,
             runs: float = 1.0) -> tuple[torch.Tensor | None, RobustStaged | None]:
        """Map ``x`` (A, C, B) with the target knots; stage its per-image histograms and extremes.
        ``own`` in [0, 1]: a batch of ``rebuild_every`` or more images is mapped with the target knots
        merged with its own histogram at ``own`` times :func:`shift_share` times streaming AQR's batch
        weight. ``(None, None)`` when a value was NaN or Inf."""
        y, staged, finite = self.flagged_step(x, images, pre, own, runs)
        return (y, staged) if finite else (None, None)

    def flagged_step(self, x: torch.Tensor, images: int, pre: Affine | None = None, own: float = 0.0,  # type: ignore[override]
                     runs: float = 1.0) -> tuple[torch.Tensor | None, RobustStaged | None, Flag]:
        """:meth:`step` with whether the values were finite as a flag it does not read (off the CPU a 0-d tensor):
        ``(y, staged, finite)``."""
        if not self.started:
            y, first, finite = self._first(x, images, pre)
            if finite is False:
                return None, None, False
            r = self.kernels.scan(x, images, pre, first.knots, self.source, first.table, IMAGE_COUNT, COUNT_STRIDE,
                                  COUNT_CELLS)
            return y, RobustStaged(first, compact_counts(r.counts, x, images), first.lo, first.hi,
                                   most=count_bound(x, images)), finite
        if own > 0 and images >= self.settings.rebuild_every:
            return self._flagged_step_own(x, images, pre, own, self._absorbed_alone(runs))
        r = self.kernels.scan(x, images, pre, self.knots, self.source, self.current_table(), MAP | IMAGE_COUNT,
                              COUNT_STRIDE, COUNT_CELLS)
        if r.finite is False:
            return None, None, False
        return r.y, RobustStaged(None, compact_counts(r.counts, x, images), r.lo, r.hi,
                                   most=count_bound(x, images)), r.finite

    def _absorbed_alone(self, runs: float) -> bool:
        """Whether :meth:`commit` takes a batch that rebuilds (``rebuild_every`` images or more), committed with
        ``runs``, into the marginal alone (its groups' histograms unused): the groups weigh nothing (as
        :attr:`groups_idle` will be with these runs) and none is pending."""
        return min(1.0, max(0.0, float(runs))) == 0.0 and self.pending == 0

    def _step_own(self, x: torch.Tensor, images: int, pre: Affine | None, own: float,
                  alone: bool = False) -> tuple[torch.Tensor | None, RobustStaged | None]:
        """The batch counted on the target knots' bins, merged into a copy of them, then mapped with it; ``alone``:
        the commit absorbs it alone (:meth:`_absorbed_alone`), so only its even and odd images' sums are counted.
        ``(None, None)`` when a value was NaN or Inf."""
        y, staged, finite = self._flagged_step_own(x, images, pre, own, alone)
        return (y, staged) if finite else (None, None)

    def _flagged_step_own(self, x: torch.Tensor, images: int, pre: Affine | None, own: float,
                          alone: bool = False) -> tuple[torch.Tensor | None, RobustStaged | None, Flag]:
        """:meth:`_step_own` with whether the values were finite as a flag it does not read."""
        kern = self.kernels
        r = kern.scan(x, images, pre, self.knots, self.source, self.table, IMAGE_COUNT | (PAIRED if alone else 0),
                      COUNT_STRIDE, COUNT_CELLS)  # counting reads no table
        if r.finite is False:
            return None, None, False
        # the distances (of the even and the odd images' sums: the same as of their histograms), the batch's
        # histogram (its own merge's and the marginal's) and the staged copy, in one pass
        distances, total, counts = kern.shift_test(r.counts, self.knots, not alone and small_counts(x, images))
        tail_weights = self._weights(min(self.window.filled + images, self.window.size))
        if isinstance(distances[0], torch.Tensor):  # off the CPU: decided on the device
            return self._step_own_on_device(x, images, pre, own, alone, r, distances, total, counts, tail_weights)
        shift = own * shift_share(shift_ratio(distances, images))
        weight = shift * batch_weight(images, self.seen, self.settings.horizon)
        if weight <= 0:  # the batch is as close to the target as sampling allows: map it as it is
            m = kern.scan(x, images, pre, self.knots, self.source, self.current_table(), MAP, COUNT_STRIDE, COUNT_CELLS)
            return m.y, RobustStaged(None, counts, r.lo, r.hi, total=total, paired=alone,
                                     most=count_bound(x, images)), all_finite(r.finite, m.finite)
        y, _, window, finite = kern.merge_map_flagged(x, images, pre, self.knots, self.source, self.settings.grid,
                                                      self.window, None, total, r.lo, r.hi, weight, tail_weights,
                                                      COUNT_STRIDE, COUNT_CELLS)
        if finite is False:
            return None, None, False
        return y, RobustStaged(None, counts, r.lo, r.hi, shift, window, total, alone,
                               count_bound(x, images)), all_finite(r.finite, finite)

    def _step_own_on_device(self, x: torch.Tensor, images: int, pre: Affine | None, own: float, alone: bool,
                            r: object, distances: tuple[torch.Tensor, torch.Tensor], total: torch.Tensor,
                            counts: torch.Tensor,
                            tail_weights: torch.Tensor) -> tuple[torch.Tensor | None, RobustStaged | None, Flag]:
        """:meth:`_step_own` after the shift test where its distances stay on the device: the merged copy of the knots
        and the committed ones each give a table, and one map reads the knots and table the weight picks (the
        values the host's choice gives), so no host read decides between them."""
        kern = self.kernels
        shift = own * shift_share_tensor(distances, images)
        weight = shift * batch_weight(images, self.seen, self.settings.horizon)
        knots, window = kern.merged(self.knots, self.settings.grid, self.window, None, total, r.lo, r.hi,  # type: ignore[attr-defined]
                                    weight, tail_weights, COUNT_CELLS)
        merged_table = StreamTable.empty(self.channels, self.settings.grid, knots.device)
        kern.tables(knots, self.source, merged_table)
        use = weight > 0
        current = self.current_table()
        table = StreamTable(*(torch.where(use, a, b) for a, b in ((merged_table.pairs, current.pairs),
                                                                  (merged_table.glo, current.glo),
                                                                  (merged_table.ginv, current.ginv))))
        m = kern.scan(x, images, pre, torch.where(use, knots, self.knots), self.source, table, MAP, COUNT_STRIDE,
                      COUNT_CELLS)
        staged = RobustStaged(None, counts, r.lo, r.hi, torch.where(use, shift, torch.zeros_like(shift)), window,  # type: ignore[attr-defined]
                              total, alone, count_bound(x, images))
        return m.y, staged, all_finite(r.finite, m.finite)  # type: ignore[attr-defined]

    def commit(self, staged: RobustStaged, labels: torch.Tensor | None = None,  # type: ignore[override]
               runs: float = 1.0, grouped: BatchGroups | None = None) -> None:
        """Apply a finite batch's update; ``labels`` ``(N,)``: each image's predicted class; ``runs`` in
        [0, 1]: how clearly the recent predictions come in runs (``1 -`` :func:`own_batch_share`), the
        part of ``1 - balance`` that goes to the groups' recent shares at this rebuild; ``grouped``: the
        labels as this layer's groups where the caller worked them out for every layer."""
        if labels is None:
            raise ValueError("target='robust' commits a batch with its predicted classes")
        if staged.paired and not self._absorbed_alone(runs):  # counted for the marginal alone (_step_own)
            raise RuntimeError("target='robust': a batch counted for the marginal alone was committed with other runs "
                               "than it was mapped with; the stream's state is unchanged")
        if grouped is None:
            grouped = BatchGroups.of_labels(labels, self.robust.groups, staged.counts.device)
        self.runs = min(1.0, max(0.0, float(runs)))
        if isinstance(staged.shift, torch.Tensor) or isinstance(self._pending_shift, torch.Tensor):
            self._pending_shift = torch.maximum(torch.as_tensor(self._pending_shift, dtype=torch.float64),
                                                torch.as_tensor(staged.shift, dtype=torch.float64))
        else:
            self.pending_shift = max(self.pending_shift, staged.shift)
        if staged.first is not None:
            self.knots.copy_(staged.first.knots)
            self.started, self.seen = True, 0
        if staged.window is not None:  # pushed already
            copy_into(self.window, staged.window)
        else:
            self.kernels.push(self.window, None, None, staged.lo, staged.hi)
        group_of = grouped.of
        n = staged.lo.shape[0]
        rebuild = staged.first is not None or self.pending + n >= self.settings.rebuild_every
        alone = None  # an idle rebuild of this batch alone: the marginal takes its sums, the groups nothing
        if rebuild and self._absorbed_alone(runs):  # the step's own test (it counted the batch for this)
            total = staged.counts.sum(0, dtype=torch.int32) if staged.total is None else staged.total
            alone = (total, staged.lo.amin(0), staged.hi.amax(0))
        else:
            add_counts(self.group_counts, group_of, staged.counts, staged.most)
            idx = group_of[:, None].expand(-1, staged.lo.shape[1])
            self.group_min.scatter_reduce_(0, idx, staged.lo, "amin")
            self.group_max.scatter_reduce_(0, idx, staged.hi, "amax")
        for g, size in enumerate(grouped.sizes):
            self.group_pending[g] += size
        step = batch_weight(n, self.seen, self.robust.recent_horizon)  # a running mean until about H images
        self.group_recent.mul_(1.0 - step).add_(grouped.weights, alpha=step / n)
        self.seen += n
        if rebuild and alone is not None:
            self._rebuild_idle(alone)
            self._clear_pending(histograms=False)
        elif rebuild:
            self._merge_groups()
            self._rebuild_balanced()
            self._clear_pending()

    def _merge_groups(self) -> None:
        """Each group with images since the last rebuild: their histogram (on the bins of the layer's knots,
        unchanged since) into its CDF (:meth:`~aqr.adapt.stream.base.StreamKernels.group_merge`); the
        marginal: all of them. While the groups weigh nothing (``runs`` 0: no runs) every group seen so far
        becomes a copy of the marginal instead (:meth:`_idle_groups`); one batch alone then takes
        :meth:`_rebuild_idle`."""
        c = self.group_counts.shape[1]
        k = self.knots.shape[1]
        present = [g for g in range(self.robust.groups) if self.group_pending[g] > 0]
        idle = self.groups_idle
        # the groups from the first to the last present one, as views (no gather and scatter back); a
        # group between them without images has weight 0, which leaves its knots as they are
        first, last = present[0], present[-1] + 1
        span = last - first
        counts, lo, hi = (t[first:last] for t in (self.group_counts, self.group_min, self.group_max))
        if not idle:
            weights = torch.tensor([group_step(self.group_pending[g], self.group_seen[g], self.robust.class_horizon)
                                    if self.group_pending[g] > 0 else 0.0 for g in range(first, last)],
                                   dtype=torch.float64)
            self.kernels.group_merge(self.group_knots[first:last].view(span * c, k), self.knots.repeat(span, 1),
                                     counts.reshape(span * c, -1), lo.reshape(-1), hi.reshape(-1),
                                     weights.repeat_interleave(c))
        alone = (counts.sum(0, dtype=torch.int32), lo.amin(0), hi.amax(0))
        weight = self._absorb_pending(present)
        self.kernels.group_merge(self.marginal[0], self.knots, *alone, per_row(weight, c))
        if idle:
            self._idle_groups()

    def _absorb_pending(self, present: list[int]) -> float | torch.Tensor:
        """The pending images counted as seen by their groups (``present``: those with any); the marginal's
        weight for them all (``seen`` already counts them)."""
        for g in present:
            self.group_seen[g] += self.group_pending[g]
        images = self.pending
        before = self.seen - images
        weight = group_step(images, before, MARGINAL_HORIZON)
        shift = self._pending_shift
        if isinstance(shift, torch.Tensor):  # off the CPU: decided on the device, as below
            if before > 0:
                fast = shift * batch_weight(images, before, self.settings.horizon)
                weight = torch.where(shift > 0, fast.clamp(max=MAX_GROUP_STEP).clamp(min=weight),
                                     torch.full_like(fast, weight))
        elif shift > 0 and before > 0:  # a shift the test saw: follow at the stream's pace
            fast = shift * batch_weight(images, before, self.settings.horizon)
            weight = max(weight, min(fast, MAX_GROUP_STEP))
        return weight

    def _rebuild_idle(self, alone: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """:meth:`_merge_groups` then :meth:`_rebuild_balanced` for one batch ``alone`` (its summed histogram and
        extremes) while the groups weigh nothing: the marginal takes it, the target is the marginal with the
        window's tails (:meth:`~aqr.adapt.stream.base.StreamKernels.idle_rebuild`, one call of the C kernels)."""
        weight = self._absorb_pending([g for g in range(self.robust.groups) if self.group_pending[g] > 0])
        self.kernels.idle_rebuild(self.marginal[0], self.knots, *alone, weight, self.window,
                                  self._weights(self.window.filled))
        self._idle_groups()
        if self.group_source is not None:
            self.source.copy_(self.base_source)
        self.table_stale = True

    def _idle_groups(self) -> None:
        """Every group seen so far becomes a copy of the marginal: while the recent predictions show no
        runs the groups weigh nothing in the target, so their merges (most of robust AQR's cost) are left
        out; once runs appear, the groups start from the running CDF of every image and move towards
        their classes at their own pace, and their equal mixture starts as the marginal. The copies are
        written when something next reads :attr:`group_knots` (:meth:`_catch_up_groups`): the marginal and
        the groups seen change only at a rebuild, which reads the groups first unless it is idle too (and
        then leaves the same copies, of the newer marginal, for later)."""
        self._groups_behind = True

    def _catch_up_groups(self) -> None:
        """Write the copies of the marginal :meth:`_idle_groups` left for later, where it left any."""
        if not self._groups_behind:
            return
        self._groups_behind = False
        seen = [g for g in range(self.robust.groups) if self.group_seen[g] > 0]
        if seen:
            first, last = seen[0], seen[-1] + 1
            if last - first == len(seen):  # one span (the usual case: the classes 0..n-1 seen): one copy
                self._group_knots[first:last].copy_(self.marginal.expand(last - first, -1, -1))
            else:
                self._group_knots[on_device(torch.tensor(seen), self.marginal.device)] = self.marginal

    def _rebuild_balanced(self) -> None:
        """The target knots from the marginal and the groups seen so far (:meth:`component_weights`), the
        tails from the window, the table from both; with ``balance < 1`` the source side is the same
        mixture of the layer's and the groups' source knots. Without runs the target is the marginal
        itself (its inner knots, not resampled on the mixture's grid), the source the layer's."""
        active = [g for g in range(self.robust.groups) if self.group_seen[g] > 0]
        if self.groups_idle or not active:
            self.knots[:, 1:-1].copy_(self.marginal[0, :, 1:-1])
            if self.group_source is not None:
                self.source.copy_(self.base_source)
            self._finish_rebuild()
            return
        weights = self.component_weights(active)
        kept = (weights > MIN_GROUP_WEIGHT * weights.max()).tolist()
        groups = [g for g, keep in zip(active, kept[1:]) if keep]  # the marginal is component 0
        kept_weights = weights[torch.tensor(kept)]
        self.kernels.mixture(_components(self.marginal, self.group_knots, kept[0], groups), self.knots, MIXTURE_GRID,
                             kept_weights)
        if self.group_source is not None:
            if kept[0] and not groups:
                self.source.copy_(self.base_source)
            else:
                self.kernels.mixture(_components(self.base_source[None], self.group_source, kept[0], groups),
                                     self.source, MIXTURE_GRID, kept_weights)
        self._finish_rebuild()

    def component_weights(self, active: list[int]) -> torch.Tensor:
        """The weights (float64, sum 1) of the marginal and the ``active`` groups in the mixtures:
        ``1 - runs`` for the marginal, ``runs`` for the groups, shared by :meth:`group_weights`."""
        runs = self.runs if active else 0.0
        return torch.cat([torch.tensor([1.0 - runs], dtype=torch.float64), runs * self.group_weights(active)])

    def group_weights(self, active: list[int]) -> torch.Tensor:
        """The ``active`` groups' weights among themselves (float64, sum 1): ``1 - balance`` in proportion
        to each group's share of the last ``recent_horizon`` images, ``balance`` shared equally."""
        part = 1.0 - self.robust.balance
        even = torch.full((len(active),), 1.0 / max(len(active), 1), dtype=torch.float64)
        if part == 0:  # the default: equal shares (the formula below gives them exactly, at a cost per rebuild)
            return even
        recent = self.group_recent[active]
        total = float(recent.sum())
        return even if total <= 0 else (1 - part) * even + part * recent / total

    def _finish_rebuild(self) -> None:
        """The ends from the tail window; the table is built again by its next reader
        (:meth:`~aqr.adapt.stream.running.LayerStream.current_table`: a batch mapped with its own histogram
        builds a table of its own instead)."""
        p0, p100 = self.kernels.tails(self.window, self._weights(self.window.filled))
        self.kernels.merge(self.knots, None, 0.0, p0, p100)  # the ends only
        self.table_stale = True


def _components(first: torch.Tensor, groups: torch.Tensor, keep_first: bool, kept: list[int]) -> torch.Tensor:
    """The mixture's components ``(M, C, K)``: ``first`` ``(1, C, K)`` where kept, then the ``kept`` rows of
    ``groups``; no copy where ``first`` is all of it."""
    if not kept:
        return first
    rows = groups[on_device(torch.tensor(kept), groups.device)]
    return torch.cat([first, rows]) if keep_first else rows


# A count is at most the values of one image and channel; below this bound a batch's per-image histograms
# are staged as int16: robust AQR keeps every layer's until the logits give each image's group, and at
# int32 they were 9 % of the plain forward's peak at batch 16 (the ResNet-20's first stage).
INT16_COUNTS = 1 << 15


def small_counts(x: torch.Tensor, images: int) -> bool:
    """Whether no count of ``x``'s (A, C, B) per-image histograms (``images`` images) can reach
    :data:`INT16_COUNTS`: they are then staged as int16."""
    return x.numel() // max(1, x.shape[1] * images) < INT16_COUNTS


def count_bound(x: torch.Tensor, images: int) -> int:
    """The most any count of ``x``'s (A, C, B) per-image histograms (``images`` images) can be: every
    ``COUNT_STRIDE``-th of an image's values in one channel."""
    return -(-(x.shape[0] // images * x.shape[2]) // COUNT_STRIDE)


def compact_counts(counts: torch.Tensor, x: torch.Tensor, images: int) -> torch.Tensor:
    """``counts`` (int32 per-image histograms of ``x`` (A, C, B), ``images`` images) as int16 where no
    count can reach :data:`INT16_COUNTS`, else as they are; the same values either way."""
    return counts.to(torch.int16) if small_counts(x, images) else counts


# Integers below this sum exactly in float32, in any order.
FLOAT_EXACT = 1 << 24


def add_counts(totals: torch.Tensor, index: torch.Tensor, counts: torch.Tensor, most: int | None = None) -> None:
    """``totals[index[i]] += counts[i]`` for int32 totals and int16 or int32 counts, exactly: summed in
    float32 where no sum can reach :data:`FLOAT_EXACT` (torch's float ``index_add_`` is vectorized, its
    int32 one is not), else in int32. ``most``: a bound on the counts (>= 0) known from their shapes, which
    spares reading them back (from a GPU a wait); without it their extremes are read."""
    n = counts.shape[0]
    if n == 0:
        return
    low, high = (0, most) if most is not None else (int(v) for v in torch.aminmax(counts))
    if high < FLOAT_EXACT // n and low >= 0:
        sums = torch.zeros(totals.shape, dtype=torch.float32, device=totals.device)
        totals.add_(sums.index_add_(0, index, counts.float()).to(torch.int32))
    else:
        totals.index_add_(0, index, counts.to(totals.dtype))


RUN_WINDOW = 256  # the recent predicted classes whose consecutive repeats tell whether classes come in runs
MARGINAL_WINDOW = 512  # the predicted classes whose histogram gives the repeat rate of independent draws
RUN_Z = (2.0, 3.0)  # z-scores of the repeat-rate excess at which the own-batch share starts to fall, and reaches 0


def own_batch_share(recent: list[int]) -> float:
    """How much a batch may join its own target, from the recent predicted classes (in stream order, the
    last :data:`MARGINAL_WINDOW`): 1 while the last :data:`RUN_WINDOW` consecutive predictions repeat
    no more often than independent draws from the longer window's histogram would (the excess of the
    repeat rate over ``q = sum p_c^2`` below ``RUN_Z[0]`` binomial standard errors), 0 once classes
    come in runs (above ``RUN_Z[1]``); 0 until :data:`RUN_WINDOW` classes were seen."""
    n = len(recent)
    if n < RUN_WINDOW:
        return 0.0
    last = recent[-RUN_WINDOW:]
    pairs = len(last) - 1
    same = sum(a == b for a, b in zip(last, last[1:])) / pairs
    counts = torch.bincount(torch.tensor(recent)).double()
    q = float((counts * counts).sum()) / (n * n)
    z = (same - q) / max(math.sqrt(q * (1 - q) / pairs), 1e-12)
    lo, hi = RUN_Z
    return min(1.0, max(0.0, (hi - z) / (hi - lo)))


def shift_ratio(distances: tuple[float, float], images: int) -> float:
    """How far a batch of ``images`` images lies from the running target, in units of its own sampling
    noise, from its :meth:`~aqr.adapt.stream.base.StreamKernels.shift_distances` (the channels' mean
    Kolmogorov distance to the target's CDF, and between its two halves): about 1 for a batch drawn
    from the target; ``inf`` for fewer than 2 images or halves that agree exactly on a batch away from
    the target; 0 when nothing was counted."""
    to_target, between = distances
    if images < 2:
        return math.inf
    # the halves' distance has the scale sqrt(1/a + 1/b) of two samples of a and b images, the batch's
    # distance to the target that of one sample of n = a + b: 1/sqrt(n)
    a, b = (images + 1) // 2, images // 2
    noise = between * math.sqrt(a * b) / images
    if not noise > 0:
        return math.inf if to_target > 0 else 0.0
    return to_target / noise


def shift_share_tensor(distances: tuple[torch.Tensor, torch.Tensor], images: int) -> torch.Tensor:
    """:func:`shift_share` of :func:`shift_ratio` of 0-d float64 ``distances``, as a 0-d tensor on their device
    (the same operations: no host read)."""
    to_target, between = distances
    if images < 2:
        return torch.ones_like(to_target)  # ratio inf
    a, b = (images + 1) // 2, images // 2
    noise = between * math.sqrt(a * b) / images
    zero = torch.zeros_like(to_target)
    ratio = torch.where(noise > 0, to_target / noise, torch.where(to_target > 0, torch.full_like(zero, math.inf), zero))
    return torch.where(ratio > 1, 1.0 - 1.0 / (ratio * ratio), zero)


def shift_share(ratio: float) -> float:
    """The share of a batch's distance to the target that sampling does not explain, ``1 - 1/ratio^2``
    (0 below ``ratio = 1``): its distance squared is the sum of a shift's and sampling's."""
    return 1.0 - 1.0 / (ratio * ratio) if ratio > 1 else 0.0  # (NaN: 0)
