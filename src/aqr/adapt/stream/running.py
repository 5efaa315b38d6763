"""Streaming AQR: each layer's target distribution as a running estimate over the stream.

Per-batch AQR reads a layer's target quantiles from the current batch alone, which needs large
batches (at batch 1 it maps one image onto the whole source distribution). With
``aqr.AQR(model, stats, target="stream")`` every recalibrated layer keeps, per channel, a running
estimate of its target distribution, updates it with every batch and maps the batch with it.

Estimators (``estimator=``; measured in ``docs/results/stream/``):

``"cdf-ema"`` (default)
    an exponential moving average of the per-channel *CDFs*: the running CDF is piecewise linear
    through K knots at levels ``j / (K - 1)``; a group of new values, as a histogram on bins fixed
    by those knots, is mixed in with its weight and the mixture's K quantiles are the new knots
    (exact for the two piecewise-linear CDFs involved). It estimates the quantiles of the pooled
    recent stream, which is what the source knots are (quantiles of the pooled source images).
``"knot-ema"``
    an exponential moving average of each batch's own knots. It averages quantile *functions*,
    which at batch 1 is the mean per-image quantile function: narrower than the pooled
    distribution whenever images differ, so it under-corrects at small batches.

Weights are per image: a batch of ``b`` images gets weight ``1 - (1 - 1/H)^b``, so the horizon
``H`` (``horizon=``, images) does not depend on the batch size; until ``H`` images are seen the
weight is ``b / seen`` (a running mean: the first image is not over-weighted by a cold start).
The EMA's effective sample size is ``2H - 1`` images (:func:`effective_images`).

Tails. The source's p0/p100 are Average Sample Tails: the mean, over draws, of the minimum
(maximum) over ``tail_batch`` images (100). At batch 1 a batch's own extremes are one image's, far
inside those. The stream's p0 (p100) is the same statistic of the recent stream: the mean, over
every subset of ``tail_batch`` of the last ``W`` images (``tail_window=``, 128), of the subset's
minimum of per-image minima. That U-statistic is the unbiased, minimum-variance estimate of
E[min over ``tail_batch`` images] from the window (:func:`extreme_weights`); with fewer than
``tail_batch`` images seen it is their minimum. A batch's own extremes always bound its map's ends,
so no value is extrapolated beyond the batch's range (per-batch AQR's ends are the batch's extremes).

Cost. Per batch and layer one pass over the values (:meth:`StreamKernels.scan`): the map through
a lookup table built from the running knots, each image's extremes, the NaN/Inf check and a
histogram of every ``COUNT_STRIDE``-th value on ``COUNT_CELLS`` cells. Batches of fewer than
``rebuild_every`` (R) images are mapped with the state of the images before them and their
histograms pool into a pending group; every R images (every batch until H images were seen) the
group is merged into the knots and the table rebuilt, O(C (K + cells + G)) per layer. A batch of R
or more images is merged first and mapped with the result (a counting pass, then the mapping pass,
with the merge and a table between them: :meth:`StreamKernels.large`, one call of the C kernels);
the layer's own table is then built again only when something reads it (a smaller batch, a held one,
the exported state: :meth:`LayerStream.current_table`), so a stream of large batches builds one table
per batch.
The first batch after a reset is mapped with its own knots (per-batch AQR) and starts the state.

Memory per recalibrated channel, fixed (float32): K running knots, 2 (G + 2) + 2 table entries,
4 W window entries (ring and sorted, minima and maxima), ``COUNT_CELLS + 4`` int32 counts and the
group's two extremes: ``4 (K + 2G + 4W + COUNT_CELLS + 12)`` bytes (6.7 KB at K = 101, G = 512, W = 128;
:meth:`LayerStream.memory_bytes`).

A batch enters the state only when the whole forward pass was finite: each layer's update is staged
while the batch runs and committed after it (:meth:`LayerStream.commit`), so a batch with NaN/Inf
anywhere leaves the state bit for bit. :meth:`LayerStream.export_state` gives the whole state as plain
values and :meth:`LayerStream.load_state` takes one back, checked first (:mod:`aqr.adapt.stream.saved`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import ClassVar, Union

import torch

from aqr.adapt.config import AQRConfig, check_estimator, check_horizon, check_stream_count
from aqr.adapt.stream.batch import BatchCommit, BatchValues
from aqr.adapt.stream.base import (COUNT, MAP, Flag, PendingGroup, StreamKernels, StreamTable, TailWindow, all_finite,
                                   cloned, copy_into, settled)
from aqr.backends import Affine, Targets
from aqr.core.stats import SourceStats

COUNT_CELLS = 64  # inner cells of a group's histogram
# Every COUNT_STRIDE-th value (flat position within a channel) enters the histogram. Odd, and prime
# to common row widths: a stride sharing a factor with the width would sample whole columns.
COUNT_STRIDE = 5


@dataclass(frozen=True)
class StreamSettings:
    """How a layer's running target estimate evolves: the stream options of :class:`aqr.AQRConfig` (their
    defaults and checks are the config's; ``grid`` is its ``stream_grid``) and the statistics' ``tail_batch``."""

    estimator: str = AQRConfig.estimator
    horizon: float = AQRConfig.horizon
    tail_window: int = AQRConfig.tail_window
    tail_batch: int = SourceStats.tail_batch
    rebuild_every: int = AQRConfig.rebuild_every
    grid: int = AQRConfig.stream_grid

    def __post_init__(self) -> None:
        check_estimator(self.estimator)
        check_horizon(self.horizon)
        for name in ("tail_window", "tail_batch", "rebuild_every", "grid"):
            check_stream_count(name, getattr(self, name))

    @classmethod
    def of(cls, config: AQRConfig, tail_batch: int) -> StreamSettings:
        """The settings of ``config``'s stream options, with the statistics' ``tail_batch``."""
        return cls(config.estimator, float(config.horizon), config.tail_window, tail_batch, config.rebuild_every,
                   config.stream_grid)


def batch_weight(images: int, seen: int, horizon: float) -> float:
    """The weight of ``images`` new images after ``seen``: ``1 - (1 - 1/H)^images``, and at least
    ``images / (seen + images)`` (a running mean until about ``H`` images were seen)."""
    ema = 1.0 - (1.0 - 1.0 / horizon) ** images
    return max(ema, images / (seen + images))


def effective_images(horizon: float) -> float:
    """Kish's effective sample size (images) of the per-image EMA with weight ``a = 1/H``: ``(2 - a) / a``."""
    a = 1.0 / horizon
    return (2.0 - a) / a


def kish_size(weights: torch.Tensor) -> float:
    """Kish's effective sample size ``(sum w)^2 / sum w^2`` of the weights ``weights``."""
    w = weights.double()
    return float(w.sum() ** 2 / (w * w).sum())


@functools.lru_cache(maxsize=512)
def extreme_weights(n: int, m: int) -> torch.Tensor:
    """``w_i``, ``i = 1..n - m + 1`` (float64): the probability that the ``i``-th smallest of ``n`` values
    is the minimum of a random ``m``-subset, ``C(n - i, m - 1) / C(n, m)``. ``sum_i w_i x_(i)`` is the
    unbiased, minimum-variance estimate of E[min of ``m`` draws] from ``n`` i.i.d. values."""
    if not 1 <= m <= n:
        raise ValueError(f"need 1 <= m <= n, got m={m}, n={n}")
    i = torch.arange(1, n - m + 2, dtype=torch.float64)
    log_w = (torch.lgamma(n - i + 1) - torch.lgamma(n - i - m + 2) - math.lgamma(m)
             - (math.lgamma(n + 1) - math.lgamma(m + 1) - math.lgamma(n - m + 1)))
    w = log_w.exp()
    return w / w.sum()


# ------------------------------------------------------------------------------------ staging
# What a batch leaves to commit, per layer: computed during the forward pass, applied after it.


@dataclass
class StagedFirst:
    """The first batch after a reset: the state its own knots start (knots, table, extremes)."""

    knots: torch.Tensor
    table: StreamTable
    lo: torch.Tensor
    hi: torch.Tensor


@dataclass
class StagedSmall:
    """A batch of fewer than ``rebuild_every`` images: its extremes and histogram (or knots) join the group."""

    lo: torch.Tensor
    hi: torch.Tensor
    counts: torch.Tensor | None  # cdf-ema
    batch_knots: torch.Tensor | None  # knot-ema


@dataclass
class StagedBound:
    """A batch of fewer than ``rebuild_every`` images through the bound kernels (:meth:`LayerStream.small_step`):
    its extremes and histogram in one buffer (:meth:`aqr.adapt.stream.native_kernels.BoundStream.map_count`)."""

    stage: torch.Tensor
    images: int


@dataclass
class StagedLarge:
    """A batch of ``rebuild_every`` or more images: the tentative knots it was mapped with and the tail
    window with its images' extremes pushed (2 kB per channel at the default 128 images), which the
    commit takes over. The tentative table is not kept: it would hold 4 kB per channel for every layer
    until the forward pass ends (11 % of the plain forward's peak at batch 16), so the layer's table is
    built again from the knots when something next reads it (:meth:`LayerStream.current_table`); a
    stream of large batches never does, each mapping with a tentative table of its own."""

    knots: torch.Tensor
    window: TailWindow
    images: int


Staged = Union[StagedFirst, StagedSmall, StagedBound, StagedLarge]
BatchKnots = Callable[[torch.Tensor, Union[Affine, None]], Targets]


class LayerStream:
    """One layer's running target state and its per-batch step.

    ``source``: the layer's source knots ``(C, K)``; ``batch_knots(x, pre)``: the batch's own knots
    (the layer's fast-path backend, :meth:`aqr.backends.LayerBackend.target_knots`); ``kernels``: the
    :class:`~aqr.adapt.stream.base.StreamKernels` of the device the state lives on.
    """

    target: ClassVar[str] = "stream"  # the AQRConfig target whose layers keep this state (aqr.adapt.stream.build)

    def __init__(self, source: torch.Tensor, settings: StreamSettings, kernels: StreamKernels,
                 batch_knots: BatchKnots) -> None:
        self.source = source.float().contiguous()
        self.settings = settings
        self.kernels = kernels
        self.batch_knots = batch_knots
        c, k = self.source.shape
        device = self.source.device
        self.knots = torch.zeros(c, k, device=device)
        self.table = StreamTable.empty(c, settings.grid, device)
        self.window = TailWindow.empty(c, settings.tail_window, device)
        self.group = PendingGroup.empty(c, COUNT_CELLS, device)
        self._bound: object | None = None  # the state bound to its kernels (small_step), made on first use
        self.reset()

    @classmethod
    def from_config(cls, config: AQRConfig, source: torch.Tensor, settings: StreamSettings, kernels: StreamKernels,
                    batch_knots: BatchKnots, group_source: torch.Tensor | None = None,
                    route: object | None = None) -> LayerStream:
        """One layer's running state for ``config`` (of this class's :attr:`target`) on ``source``'s device;
        ``group_source``: the groups' source knots, which only the class-balanced state takes; ``route``: the
        layer's place among its AQR's clusters, which only ``target="mixed"``'s state takes."""
        return cls(source, settings, kernels, batch_knots)

    @classmethod
    def batch_shares(cls, recent: list[int], config: AQRConfig) -> tuple[float, float]:
        """``(own, runs)`` for the next batch from the recent predicted classes: the share of its own
        histogram a batch's target takes, and how clearly the recent classes come in runs. This state
        takes neither: ``(0, 1)``."""
        return 0.0, 1.0

    @property
    def takes_small_steps(self) -> bool:
        """Whether :meth:`small_step` may map this state's small batches (where its kernels bind it,
        :meth:`bound`): a ``"cdf-ema"`` stream's."""
        return self.settings.estimator == "cdf-ema"

    def batch_step(self, x: torch.Tensor, batch: BatchValues,
                   pre: Affine | None = None) -> tuple[torch.Tensor | None, Staged | None, Flag]:
        """:meth:`flagged_step` of the layer output ``x`` (A, C, B) of the batch ``batch`` (what this state reads
        of it: its images)."""
        return self.flagged_step(x, batch.images, pre)

    def commit_batch(self, staged: Staged, commit: BatchCommit) -> None:
        """:meth:`commit` of what :meth:`batch_step` staged, for the finite batch ``commit`` (whose predicted
        classes this state does not read)."""
        self.commit(staged)

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        state["_bound"] = None  # holds the kernels' entry points, which cannot be copied: bound again on use
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_bound", None)
        self.__dict__.setdefault("table_stale", False)

    # ---- state --------------------------------------------------------------------------------
    def reset(self) -> None:
        """Back to the initial state: no batch seen (the buffers are kept, and zeroed)."""
        for t in (self.knots, self.table.pairs, self.table.glo, self.table.ginv,
                  self.window.ring_lo, self.window.sorted_lo, self.window.ring_hi, self.window.sorted_hi):
            t.zero_()
        self.window.filled = self.window.head = 0
        self.group.clear()
        self.seen = 0  # images the knots have absorbed since the reset
        self.started = False
        self.table_stale = False  # the knots moved since the table was built (current_table builds it again)

    def current_table(self) -> StreamTable:
        """The table of the committed knots, built again first where they moved since (a large batch's
        commit leaves it to its next reader)."""
        if self.table_stale:
            self.kernels.tables(self.knots, self.source, self.table)
            self.table_stale = False
        return self.table

    def _exported_table(self) -> StreamTable:
        """The table of the committed knots without writing the state's own (which a batch in flight may be
        building): a copy built from the knots where it is stale."""
        if not self.table_stale:
            return self.table
        table = StreamTable.empty(self.channels, self.settings.grid, self.knots.device)
        self.kernels.tables(self.knots, self.source, table)
        return table

    def snapshot(self) -> dict[str, object]:
        """Every part of the state (tensors cloned), for comparisons."""
        return {"knots": self.knots.clone(), "table": cloned(self._exported_table()), "window": cloned(self.window),
                "group": cloned(self.group), "seen": self.seen, "started": self.started}

    # what may hold +-Inf (the pending extremes before any image); every other float of the state is finite
    UNBOUNDED: ClassVar[tuple[str, ...]] = ("group.gmin", "group.gmax")

    def _parts(self, table: StreamTable | None = None) -> list[tuple[str, object, str]]:
        """Every part of the running state as ``(name, owner, attribute)`` (the table's from ``table``, or the
        state's own)."""
        parts = [("knots", self, "knots"), ("seen", self, "seen"), ("started", self, "started")]
        table = self.table if table is None else table
        for prefix, holder in (("table", table), ("window", self.window), ("group", self.group)):
            parts += [(f"{prefix}.{f.name}", holder, f.name) for f in fields(holder)]  # type: ignore[arg-type]
        return parts

    def export_state(self) -> dict[str, object]:
        """The running state as plain values (tensors cloned, ints, floats, bools, lists of ints), by name:
        what :meth:`load_state` takes back."""
        return self._export(self._parts(self._exported_table()))

    def export_stream_state(self) -> dict[str, object]:
        """The parts of the running state a plain :class:`LayerStream` has (a subclass's own left out), as
        :meth:`export_state` gives them: what a ``"stream"`` state of the same layer loads."""
        return self._export(LayerStream._parts(self, self._exported_table()))

    @staticmethod
    def _export(parts: list[tuple[str, object, str]]) -> dict[str, object]:
        """``parts`` (as :meth:`_parts` gives them) as plain values, by name."""
        values = {}
        for name, owner, attribute in parts:
            value = getattr(owner, attribute)
            values[name] = value.detach().clone() if isinstance(value, torch.Tensor) else \
                list(value) if isinstance(value, list) else value
        return values

    def check_state(self, values: Mapping[str, object]) -> None:
        """Raise ``ValueError`` unless ``values`` is a state :meth:`export_state` of a stream like this one gave:
        the same names, tensors of the same shapes and dtypes (NaN-free, finite but the pending extremes),
        counters within their bounds."""
        parts = {name: getattr(owner, attribute) for name, owner, attribute in self._parts()}
        if not isinstance(values, Mapping) or set(values) != set(parts):
            names = set(values) if isinstance(values, Mapping) else set()
            raise ValueError(f"a stream state has the parts {sorted(parts)}; this one lacks "
                             f"{sorted(set(parts) - names)} and has {sorted(names - set(parts))} besides")
        for name, mine in parts.items():
            value = values[name]
            if isinstance(mine, torch.Tensor):
                if not isinstance(value, torch.Tensor) or value.shape != mine.shape or value.dtype != mine.dtype:
                    got = (f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor)
                           else type(value).__name__)
                    raise ValueError(f"stream state {name!r}: expected a tensor {tuple(mine.shape)} {mine.dtype}, "
                                     f"got {got}")
                if value.is_floating_point():
                    finite = ~torch.isnan(value) if name in self.UNBOUNDED else torch.isfinite(value)
                    if not bool(finite.all()):
                        raise ValueError(f"stream state {name!r} holds NaN or Inf")
                elif bool((value < 0).any()):
                    raise ValueError(f"stream state {name!r} holds negative counts")
            elif isinstance(mine, list):
                if (not isinstance(value, list) or len(value) != len(mine)
                        or not all(type(v) is int and v >= 0 for v in value)):
                    raise ValueError(f"stream state {name!r}: expected {len(mine)} counts >= 0, got {value!r}")
            elif type(value) is not type(mine) or (type(mine) is float and not math.isfinite(value)):
                raise ValueError(f"stream state {name!r}: expected a finite {type(mine).__name__}, got {value!r}")
            elif type(mine) is int and value < 0:
                raise ValueError(f"stream state {name!r}: expected a count >= 0, got {value!r}")
        window = self.window.size
        if values["window.filled"] > window or values["window.head"] >= window:  # type: ignore[operator]
            raise ValueError(f"stream state: a tail window of {window} images cannot have filled="
                             f"{values['window.filled']} and head={values['window.head']}")

    def load_state(self, values: Mapping[str, object]) -> None:
        """Take the running state ``values`` (from :meth:`export_state`; checked by :meth:`check_state`
        first): tensors copied in place, so the buffers the kernels were handed stay."""
        self.check_state(values)
        self.take_state(values)

    def take_state(self, values: Mapping[str, object]) -> None:
        """:meth:`load_state` of ``values`` known to fit (another state of this layer exported them), unchecked:
        checking reads the values on the host, which a forward pass on a GPU must not."""
        for name, owner, attribute in self._parts():
            value = values[name]
            if isinstance(value, torch.Tensor):
                getattr(owner, attribute).copy_(value)
            else:
                setattr(owner, attribute, list(value) if isinstance(value, list) else value)
        self.table_stale = False

    def memory_bytes(self) -> int:
        """Bytes of the running state (fixed: nothing grows with the stream)."""
        tensors = [self.knots, *vars(self.table).values(), *vars(self.window).values(), *vars(self.group).values()]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    @property
    def channels(self) -> int:
        return self.knots.shape[0]

    # ---- one batch ------------------------------------------------------------------------------
    def step(self, x: torch.Tensor, images: int, pre: Affine | None = None) -> tuple[torch.Tensor | None, Staged | None]:
        """Map the layer output ``x`` (A, C, B; A rows of ``images`` images) with the running estimate.

        Returns the mapped output and what the batch leaves to :meth:`commit`, or ``(None, None)``
        when a value was NaN or Inf (nothing to commit). The state is not changed.
        """
        y, staged, finite = self.flagged_step(x, images, pre)
        return (y, staged) if finite else (None, None)

    def flagged_step(self, x: torch.Tensor, images: int,
                     pre: Affine | None = None) -> tuple[torch.Tensor | None, Staged | None, Flag]:
        """:meth:`step`, with whether the values were finite returned as a flag it does not read
        (:class:`~aqr.adapt.stream.base.ScanResult`'s ``finite``: a 0-d tensor on the torch kernels, so a GPU's
        queue never waits on the host): ``(y, staged, finite)``, both meaningless where ``finite`` is false."""
        s, kern = self.settings, self.kernels
        if not self.started:
            return self._first(x, images, pre)
        batch, finite = None, True
        if s.estimator == "knot-ema":
            targets = self.batch_knots(x, pre)
            finite = settled(targets.finite)
            if finite is False:
                return None, None, False
            batch = targets.knots.to(self.knots)
        if images < s.rebuild_every:  # map with the committed state; the update waits for the commit
            mode = MAP | (COUNT if batch is None else 0)
            r = kern.scan(x, images, pre, self.knots, self.source, self.current_table(), mode, COUNT_STRIDE,
                          COUNT_CELLS)
            if r.finite is False:
                return None, None, False
            return r.y, StagedSmall(r.lo, r.hi, r.counts, batch), all_finite(finite, r.finite)
        # a large batch: merged into a tentative state first, then mapped with it (counting reads no table)
        if batch is None:
            weight = batch_weight(self.group.images + images, self.seen, s.horizon)
            tail_weights = self._weights(min(self.window.filled + images, self.window.size))
            y, knots, window, done = kern.large_flagged(x, images, pre, self.knots, self.source, self.table,
                                                        self.window, self.group, weight, tail_weights, COUNT_STRIDE,
                                                        COUNT_CELLS)
            if done is False:
                return None, None, False
            return y, StagedLarge(knots, window, images), done  # type: ignore[arg-type]
        r = kern.scan(x, images, pre, self.knots, self.source, self.table, 0, COUNT_STRIDE, COUNT_CELLS)
        if r.finite is False:
            return None, None, False
        knots, window = self.knots.clone(), cloned(self.window)
        kern.push(window, None, None, r.lo, r.hi)
        weight = batch_weight(images, self.seen + self.group.images, s.horizon)
        knots[:, 1:-1] = torch.lerp(knots[:, 1:-1], batch[:, 1:-1], weight)
        y, mapped = self._map_tentative(x, images, pre, knots, window)
        return y, StagedLarge(knots, window, images), all_finite(finite, r.finite, mapped)

    def bound(self) -> object | None:
        """The state bound to its kernels for the calls of a small batch (:meth:`StreamKernels.bind`), or
        ``None`` where the kernels have no such form."""
        self.current_table()  # the bound kernels read the table's buffers as they are
        bound = self._bound
        if bound is None or bound.kernels is not self.kernels:  # type: ignore[attr-defined]
            bound = self._bound = self.kernels.bind(self.knots, self.source, self.table, self.window, self.group,
                                                    COUNT_STRIDE, COUNT_CELLS)
        return bound

    def small_step(self, x: torch.Tensor, images: int, pre: Affine) -> tuple[torch.Tensor | None, Staged | None]:
        """:meth:`step` of a started ``"cdf-ema"`` stream for a batch of fewer than ``rebuild_every`` images
        through :meth:`bound` (which the caller has checked is not ``None``): ``x`` a contiguous (or channels-last)
        float32 CPU tensor ``(A, C, ...)`` of at least one value, read as ``(A, C, B)``, and ``pre`` a folded BatchNorm's
        affine; the map has ``x``'s shape. The same values as :meth:`step`, which also commit alike."""
        y, stage, finite = self.bound().map_count(x, images, pre)  # type: ignore[union-attr]
        if not finite:
            return None, None
        return y, StagedBound(stage, images)

    def held(self, x: torch.Tensor, images: int, pre: Affine | None = None) -> torch.Tensor | None:
        """``x`` (A, C, B) mapped with the committed state alone, as a batch of fewer than ``rebuild_every``
        images is, but staging nothing: the batch leaves no trace. ``None`` when a value was NaN or Inf.
        Needs a started state (before the first batch there is no running estimate to map with)."""
        y, finite = self.flagged_held(x, images, pre)
        return y if finite else None

    def flagged_held(self, x: torch.Tensor, images: int, pre: Affine | None = None) -> tuple[torch.Tensor | None, Flag]:
        """:meth:`held`, with whether the values were finite as a flag it does not read: ``(y, finite)``."""
        r = self.kernels.scan(x, images, pre, self.knots, self.source, self.current_table(), MAP, COUNT_STRIDE,
                              COUNT_CELLS)
        return r.y, r.finite

    def _map_tentative(self, x: torch.Tensor, images: int, pre: Affine | None, knots: torch.Tensor,
                       window: TailWindow) -> tuple[torch.Tensor | None, Flag]:
        """``x`` mapped with tentative knots (``"knot-ema"``'s: their inner knots moved already): ``knots`` (a
        copy, changed in place) take their ends from ``window`` (the batch's extremes already pushed). A
        ``"cdf-ema"`` batch merges its histogram too, in :meth:`StreamKernels.large`."""
        kern = self.kernels
        p0, p100 = kern.tails(window, self._weights(window.filled))
        kern.merge(knots, None, 0.0, p0, p100)  # the ends only
        table = StreamTable.empty(self.channels, self.settings.grid, knots.device)
        kern.tables(knots, self.source, table)
        mapped = kern.scan(x, images, pre, knots, self.source, table, MAP, COUNT_STRIDE, COUNT_CELLS)
        return mapped.y, mapped.finite

    def _first(self, x: torch.Tensor, images: int,
               pre: Affine | None) -> tuple[torch.Tensor | None, StagedFirst | None, Flag]:
        """The first batch after a reset, mapped with its own knots: ``(y, staged, finite)`` as :meth:`flagged_step`."""
        targets = self.batch_knots(x, pre)
        finite = settled(targets.finite)
        if finite is False:
            return None, None, False
        knots = targets.knots.to(self.knots).contiguous()
        table = StreamTable.empty(self.channels, self.settings.grid, knots.device)
        self.kernels.tables(knots, self.source, table)
        r = self.kernels.scan(x, images, pre, knots, self.source, table, MAP, COUNT_STRIDE, COUNT_CELLS)
        if r.finite is False:
            return None, None, False
        return r.y, StagedFirst(knots, table, r.lo, r.hi), all_finite(finite, r.finite)

    def _weights(self, filled: int) -> torch.Tensor:
        """The tails' weights for a window holding ``filled`` images (kept for the last ``filled`` asked:
        a full window asks for the same ones at every rebuild). Read-only."""
        kept = self.__dict__.get("_kept_weights")
        if kept is None or kept[0] != filled:
            kept = self._kept_weights = (filled, extreme_weights(filled, min(self.settings.tail_batch, filled)))
        return kept[1]

    def commit(self, staged: Staged) -> None:
        """Apply what :meth:`step` staged for a batch whose whole forward pass was finite."""
        s, kern = self.settings, self.kernels
        if isinstance(staged, StagedFirst):
            self.knots.copy_(staged.knots)
            copy_into(self.table, staged.table)
            self.table_stale = False
            kern.push(self.window, None, None, staged.lo, staged.hi)
            self.group.clear()
            self.started, self.seen = True, staged.lo.shape[0]
        elif isinstance(staged, StagedBound):  # cdf-ema through the bound kernels: push and any rebuild in one call
            self._commit_bound(staged)
        elif isinstance(staged, StagedLarge):
            self.knots.copy_(staged.knots)
            self.table_stale = True  # the table the batch was mapped with, built again by its next reader
            copy_into(self.window, staged.window)
            self.seen += self.group.images + staged.images
            self.group.clear()
        else:
            images = staged.lo.shape[0]
            if staged.batch_knots is None:  # cdf-ema: the histogram joins the group
                kern.push(self.window, self.group, staged.counts, staged.lo, staged.hi)
            else:  # knot-ema: the knots move now, the table follows at the rebuild
                kern.push(self.window, self.group, None, staged.lo, staged.hi)
                weight = batch_weight(images, self.seen + self.group.images, s.horizon)
                self.knots[:, 1:-1] = torch.lerp(self.knots[:, 1:-1], staged.batch_knots[:, 1:-1], weight)
            self.pushed(images, cdf=staged.batch_knots is None)

    def pushed(self, images: int, cdf: bool = True) -> None:
        """The rest of a small batch's commit once its ``images`` were pushed into the window and the group (by
        :meth:`commit`, or for many states at once by :meth:`StreamKernels.cluster_push`): the group counts them,
        and the knots and table are rebuilt where that is due."""
        self.group.images += images
        if self._rebuild_due(self.group.images):
            self._rebuild(cdf=cdf)

    def _commit_bound(self, staged: StagedBound) -> None:
        """:meth:`commit` of a :meth:`small_step` batch: its push and, where it completes a group (or the stream
        is within its horizon), :meth:`_rebuild`, with the same values, in one call of the bound kernels."""
        group, images = self.group, staged.images
        grouped = group.images + images
        rebuild = None
        if self._rebuild_due(grouped):
            filled = min(self.window.filled + images, self.window.size)
            rebuild = (batch_weight(grouped, self.seen, self.settings.horizon), self._weights(filled))
        self.bound().commit(staged.stage, images, rebuild)  # type: ignore[union-attr]
        if rebuild is None:
            group.images = grouped
        else:  # the group was merged into the knots and cleared, the table built
            self.table_stale = False
            self.seen += grouped
            group.images = 0

    def _rebuild_due(self, grouped: int) -> bool:
        """Whether a pending group of ``grouped`` images is merged into the knots at this commit: a full group,
        or any while the stream is within its horizon."""
        return grouped >= self.settings.rebuild_every or self.seen < self.settings.horizon

    def _rebuild(self, cdf: bool) -> None:
        """The pending group into the knots (cdf-ema), the tails from the window, the table from the knots."""
        kern = self.kernels
        weight = batch_weight(self.group.images, self.seen, self.settings.horizon)
        p0, p100 = kern.tails(self.window, self._weights(self.window.filled))
        kern.merge(self.knots, self.group if cdf else None, weight, p0, p100)
        kern.tables(self.knots, self.source, self.table)
        self.table_stale = False
        self.seen += self.group.images
        self.group.clear()
