"""The layer maps of an exported graph: small ``nn.Module``\\ s of pure torch that an exporter traces.

* :class:`BatchMap`: per-batch AQR (``target="batch"``), the exact map of :func:`aqr.quantile_map`: the
  batch's per-channel quantiles (a sort and a linear interpolation) mapped onto the source knots, held as
  constants.
* :class:`FrozenMap`: a streaming (or robust) target's map frozen as it stands: the running state's lookup
  table, a fixed per-channel piecewise-linear function (no sort: for batch 1 and runtimes without one).
* :class:`StreamMap`: streaming AQR (``target="stream"``) with its running state as tensors that come in
  and go out of the graph (:class:`StateSlots` carries them past the user's model).

Each reads one layer's output, or, where it folds an eval BatchNorm (the frozen and stream maps, as eager
AQR does), the BatchNorm's input with its affine step applied first.
"""

from __future__ import annotations

import torch
from torch import nn

from aqr.adapt.stream.running import COUNT_CELLS, COUNT_STRIDE, StreamSettings, extreme_weights
from aqr.adapt.stream.torch_kernels import saturate
from aqr.core.qmap import gaussian_z, tail_lines
from aqr.core.tails import PARAMETRIC_TAILS
from aqr.deploy.graph_ops import (eval_levels, exact_quantiles, histogram, interp_levels, merged_knots, table_lines,
                                  table_map)

# the tails whose edge lines replace Eq. 1 below p1 and from p_{K-2} on (quantile_map's map_rows)
LINE_TAILS = ("none", "clip", "clip-source", "interval", "gaussian")

# the parts of one layer's running state in the stream graph, in the order of its inputs and outputs
STATE_PARTS = ("knots", "slopes", "intercepts", "glo", "ginv", "ring_lo", "ring_hi", "counts", "gmin", "gmax",
               "counters")
COUNTERS = ("started", "seen", "grouped", "filled", "head")  # the int64 counters, in this order


class LayerRows(nn.Module):
    """A layer map's frame: its values as channel rows ``(C, M)`` and back to the layer's shape; an
    optional per-channel affine step (a folded eval BatchNorm) applied to the rows first."""

    def __init__(self, channels: int, channel_dim: int, pre: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        super().__init__()
        self.channels = channels
        self.channel_dim = channel_dim
        self.folds = pre is not None
        if pre is not None:
            self.register_buffer("pre_scale", pre[0].detach().float().reshape(-1, 1).clone())
            self.register_buffer("pre_shift", pre[1].detach().float().reshape(-1, 1).clone())
        self.called = False  # set by an eager call: aqr.export checks that the model reaches every map

    def rows(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``'s channels as float32 rows ``(C, M)`` (affine step applied) and ``x`` with its channel first."""
        if not torch.compiler.is_compiling() and not torch.jit.is_tracing():
            self.called = True
        moved = x.movedim(self.channel_dim % x.ndim, 0)
        rows = moved.reshape(self.channels, -1).float()
        if self.folds:
            rows = rows * self.pre_scale + self.pre_shift
        return rows, moved

    def back(self, y: torch.Tensor, moved: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Rows ``y`` in the shape and dtype of the layer's values ``like``."""
        return y.reshape(moved.shape).movedim(0, self.channel_dim % like.ndim).to(like.dtype)


class BatchMap(LayerRows):
    """Per-batch AQR in mode ``"exact"``: each channel mapped from this batch's quantiles onto ``source``
    (``(C, K)``) with the tail strategy ``tail`` (``loc``/``scale`` ``(C,)``: the parametric tails' source
    moments), as :meth:`aqr.adapt.layer_maps.LayerMap.__call__` maps it."""

    def __init__(self, source: torch.Tensor, tail: str, channel_dim: int, loc: torch.Tensor | None = None,
                 scale: torch.Tensor | None = None, gaussian_p: float = 1e-3) -> None:
        c, k = source.shape
        super().__init__(c, channel_dim, None)
        self.tail = tail
        self.register_buffer("source", source.detach().float().contiguous().clone())
        self.register_buffer("levels", torch.linspace(0.0, 1.0, k, dtype=torch.float64))
        for name, value in (("loc", loc), ("scale", scale)):
            self.register_buffer(name, None if value is None else value.detach().float().reshape(-1, 1).clone())
        self.z = gaussian_z(k, gaussian_p) if tail == "gaussian" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, moved = self.rows(x)
        tq = exact_quantiles(rows, self.levels)
        y = eval_levels(interp_levels(rows, tq), self.source)
        if self.tail in LINE_TAILS:
            mean = std = None
            if self.tail in PARAMETRIC_TAILS:
                var, mean = torch.var_mean(rows.double(), dim=1, correction=0, keepdim=True)
                mean, std = mean.float(), var.sqrt().float()
            a_lo, b_lo, a_hi, b_hi = tail_lines(self.source, tq, self.tail, mean, std, self.loc, self.scale, z=self.z)
            k = int(tq.shape[1])
            y = torch.where(rows < tq[:, 1:2], a_lo * rows + b_lo, y)
            y = torch.where(rows >= tq[:, k - 2 : k - 1], a_hi * rows + b_hi, y)
        return self.back(y, moved, x)


class FrozenMap(LayerRows):
    """A running state's map, frozen: the lookup table built from ``knots`` onto ``source`` (both ``(C, K)``),
    its edge lines stretched to the batch's extremes, as :meth:`aqr.AQR.forward_held` maps a batch."""

    def __init__(self, knots: torch.Tensor, source: torch.Tensor, grid: int, channel_dim: int,
                 pre: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__(knots.shape[0], channel_dim, pre)
        knots, source = knots.detach().float().contiguous(), source.detach().float().contiguous()
        slopes, intercepts, glo, ginv = table_lines(knots, source, grid)
        for name, value in (("knots", knots), ("source", source), ("slopes", slopes), ("intercepts", intercepts),
                            ("glo", glo), ("ginv", ginv)):
            self.register_buffer(name, value.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, moved = self.rows(x)
        y = table_map(rows, self.knots, self.source, self.slopes, self.intercepts, self.glo, self.ginv)
        return self.back(y, moved, x)


class StateSlots:
    """The running state's way past the user's model: the stream graph puts each layer's state here before
    the model runs and takes the updated state back after it (a plain object, not traced)."""

    def __init__(self) -> None:
        self.inputs: dict[str, dict[str, torch.Tensor]] = {}
        self.outputs: dict[str, dict[str, torch.Tensor]] = {}


class StreamMap(LayerRows):
    """Streaming AQR's step of one layer (``estimator="cdf-ema"``) with its state taken from and given back
    to :class:`StateSlots`: the batch mapped with the running estimate, which it updates, as
    :class:`aqr.adapt.stream.running.LayerStream` steps and commits it (the first batch maps with its own
    knots and starts the state; a batch of ``rebuild_every`` or more images is merged first)."""

    def __init__(self, name: str, slots: StateSlots, source: torch.Tensor, settings: StreamSettings,
                 channel_dim: int, pre: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        c, k = source.shape
        super().__init__(c, channel_dim, pre)
        self.name = name
        self.slots = slots
        self.grid = settings.grid
        self.horizon = float(settings.horizon)
        self.rebuild_every = settings.rebuild_every
        window = settings.tail_window
        self.register_buffer("source", source.detach().float().contiguous().clone())
        self.register_buffer("levels", torch.linspace(0.0, 1.0, k, dtype=torch.float64))
        table = torch.zeros(window + 1, window, dtype=torch.float64)  # row f: the tails' weights at f images
        for filled in range(1, window + 1):
            w = extreme_weights(filled, min(settings.tail_batch, filled))
            table[filled, : len(w)] = w
        self.register_buffer("tail_weights", table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, moved = self.rows(x)
        state = self.slots.inputs[self.name]
        y, new = self.step(rows, x.shape[0], state)
        self.slots.outputs[self.name] = new
        return self.back(y, moved, x)

    def step(self, v: torch.Tensor, images: int, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor,
                                                                                        dict[str, torch.Tensor]]:
        """``v`` ``(C, M)`` (the batch's ``images`` images in order) mapped, and the state after the batch."""
        c = self.channels
        grid, r_every = self.grid, self.rebuild_every
        knots, slopes, intercepts, glo, ginv = (state[p] for p in STATE_PARTS[:5])
        ring_lo, ring_hi, counts, gmin, gmax, counters = (state[p] for p in STATE_PARTS[5:])
        started, seen, grouped0, filled, head = counters.unbind(0)
        per_image = v.reshape(c, images, -1)
        lo_img, hi_img = per_image.amin(dim=2).t(), per_image.amax(dim=2).t()  # (N, C)
        n = torch.ones_like(lo_img[:, 0], dtype=torch.int64).sum()
        bmin, bmax = v.amin(dim=1), v.amax(dim=1)

        # a batch of fewer than rebuild_every images: mapped with the committed state
        y_small = table_map(v, knots, self.source, slopes, intercepts, glo, ginv)
        own = exact_quantiles(v, self.levels)  # the first batch's own knots, which start the state

        # the images' extremes into the tail window (the oldest leave)
        size = int(ring_lo.shape[0])
        slot = torch.remainder(torch.arange(size, device=v.device) - head, size)  # 0: the first new image's row
        arriving = slot < n
        last = slot + size * torch.div(torch.clamp(n - 1 - slot, min=0), size, rounding_mode="floor")
        last = torch.minimum(last, n - 1)
        ring_lo = torch.where(arriving[:, None], lo_img.index_select(0, last), ring_lo)
        ring_hi = torch.where(arriving[:, None], hi_img.index_select(0, last), ring_hi)
        filled = torch.clamp(filled + n, max=size)
        head = torch.remainder(head + n, size)

        # the batch's histogram joins the pending group; a full group (or any, within the horizon) is merged
        counts = counts + histogram(v[:, ::COUNT_STRIDE], knots, COUNT_CELLS)
        gmin, gmax = torch.minimum(gmin, bmin), torch.maximum(gmax, bmax)
        grouped = grouped0 + n
        due = (grouped >= r_every) | (seen.double() < self.horizon)
        g = grouped.double()
        weight = torch.maximum(1.0 - torch.pow(torch.tensor(1.0 - 1.0 / self.horizon, dtype=torch.float64), g),
                               g / (seen.double() + g))
        p0, p100 = self.tails(ring_lo, ring_hi, filled)
        merged = merged_knots(knots, counts, gmin, gmax, weight, p0, p100)

        # the first batch and a batch of rebuild_every or more images map with the fresh knots (their own, or
        # the merged ones), a smaller one with the committed state, which a due rebuild then replaces
        first = started == 0
        fresh = torch.where(first, own, merged)
        fresh_table = table_lines(fresh, self.source, grid)
        y_fresh = table_map(v, fresh, self.source, *fresh_table)
        y = torch.where(first | (n >= r_every), y_fresh, y_small)
        moved = first | due
        keep = ~moved  # the pending group waits (a started stream's small batch, no rebuild due)
        new_knots = torch.where(moved, fresh, knots)
        table = [torch.where(moved, f, t) for f, t in zip(fresh_table, (slopes, intercepts, glo, ginv))]
        zero = torch.zeros_like(seen)
        new_counters = torch.stack([torch.ones_like(started),
                                    torch.where(first, n, torch.where(due, seen + grouped, seen)),
                                    torch.where(keep, grouped, zero), filled, head])
        new = {"knots": new_knots, "slopes": table[0], "intercepts": table[1], "glo": table[2], "ginv": table[3],
               "ring_lo": ring_lo, "ring_hi": ring_hi,
               "counts": torch.where(keep, counts, torch.zeros_like(counts)),
               "gmin": torch.where(keep, gmin, torch.full_like(gmin, float("inf"))),
               "gmax": torch.where(keep, gmax, torch.full_like(gmax, float("-inf"))),
               "counters": new_counters}
        return y, new

    def tails(self, ring_lo: torch.Tensor, ring_hi: torch.Tensor, filled: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
        """``(p0, p100)`` ``(C,)`` of the window's first ``filled`` rows: the weighted sums of the most extreme
        minima and maxima (:meth:`aqr.adapt.stream.torch_kernels.TorchStreamKernels.tails`)."""
        size = int(ring_lo.shape[0])
        valid = (torch.arange(size, device=ring_lo.device) < filled)[:, None]
        inf = torch.full_like(ring_lo, float("inf"))
        sorted_lo = torch.sort(torch.where(valid, ring_lo, inf).t(), dim=1).values.double()
        sorted_hi = torch.sort(torch.where(valid, -ring_hi, inf).t(), dim=1).values.double()
        w = self.tail_weights.index_select(0, filled.reshape(1))  # (1, W)
        used = w > 0
        p0 = torch.where(used, sorted_lo * w, torch.zeros_like(sorted_lo)).sum(dim=1)
        p100 = -torch.where(used, sorted_hi * w, torch.zeros_like(sorted_hi)).sum(dim=1)
        return saturate(p0), saturate(p100)


class MappedLayer(nn.Module):
    """A norm layer followed by its map, or, where the map folds an eval BatchNorm, the map alone."""

    def __init__(self, norm: nn.Module, layer_map: LayerRows) -> None:
        super().__init__()
        self.layer_map = layer_map
        self.norm = None if layer_map.folds else norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer_map(x if self.norm is None else self.norm(x))
