"""The interface every fast-path backend implements: one object per layer (and device).

A layer's fast map needs the same few things on every batch: the source knots, the tail strategy
with what it reads (source location and scale, the Gaussian tail's probits), the lookup table's
size and the positions sampled for the target knots. :class:`LayerSource` holds the source side;
a :class:`LayerBackend` holds a ``LayerSource`` and the :class:`SubsetCache` of its positions,
and maps batches with three operations on the ``(A, C, B)`` view of the layer output (channels in
the middle, see :func:`aqr.core.layers.as_acb`):

* :meth:`LayerBackend.target_knots`: the batch's knots ``(C, K)``: inner knots from the sampled
  positions, p0 and p100 from every value; with the sample's mean and std for the parametric tails
  and whether every value was finite;
* :meth:`LayerBackend.apply`: the lookup-table map with given target knots;
* :meth:`LayerBackend.recalibrate`: both for one batch (a backend may fuse them).

Splitting knots from map lets a caller bring target knots from elsewhere (running estimates over
several batches, say) and lets another device's backend implement the same object. ``pre`` is an
optional per-channel affine step ``scale * x + shift`` applied to ``x`` first: an eval-mode
BatchNorm folded into the map, which then reads the BatchNorm's input.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from aqr.backends.subsets import SubsetCache
from aqr.core.layers import as_acb
from aqr.core.qmap import PARAMETRIC_TAILS, check_tail, gaussian_z

TAIL_CODES = {"standard": 0, "average": 0, "none": 1, "clip": 2, "interval": 3, "gaussian": 4, "clip-source": 5}  # as the kernels read them
Affine = tuple[torch.Tensor, torch.Tensor]  # per-channel (scale, shift), float32 (C,): read scale * x + shift


@dataclass(frozen=True)
class LayerSource:
    """What one layer's map needs from the source side, on one device (float32 tensors).

    Attributes:
        knots: ``(C, K)`` source knots to map onto (with the tail strategy's p0/p100).
        tail: the tail strategy, one of :data:`aqr.TAILS`.
        loc, scale: ``(C,)`` source location and scale (read by the parametric tails).
        z: the Gaussian tail's probits at p0 and p_{K-2} (:func:`aqr.core.qmap.gaussian_z`), computed
            ahead because ``torch.compile`` cannot trace them; ``None`` for the other tails.
        cells: cells of the lookup table between the first and last inner target knots.
    """

    knots: torch.Tensor
    tail: str
    loc: torch.Tensor | None
    scale: torch.Tensor | None
    z: tuple[float, float] | None
    cells: int

    @classmethod
    def create(cls, knots: torch.Tensor, tail: str, loc: torch.Tensor | None, scale: torch.Tensor | None,
               gaussian_p: float, cells: int) -> LayerSource:
        """Check the tail and its inputs, cast to float32 and compute the Gaussian tail's probits once."""
        check_tail(tail)
        if tail in PARAMETRIC_TAILS and (scale is None or (tail == "gaussian" and loc is None)):
            raise ValueError(f'tail="{tail}" needs the source moments (loc and scale)')
        if cells < 1:
            raise ValueError(f"the lookup table needs at least one cell, got {cells}")
        z = gaussian_z(knots.shape[1], gaussian_p) if tail == "gaussian" else None
        return cls(knots.float(), tail, _per_channel(loc), _per_channel(scale), z, cells)

    @property
    def num_quantiles(self) -> int:
        return self.knots.shape[1]

    @property
    def needs_moments(self) -> bool:
        """Whether the tail reads the sample's mean and std."""
        return self.tail in PARAMETRIC_TAILS

    @property
    def device(self) -> torch.device:
        return self.knots.device

    def to(self, device: torch.device | str) -> LayerSource:
        """This source on ``device``."""
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return replace(self, knots=move(self.knots), loc=move(self.loc), scale=move(self.scale))


def _per_channel(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.reshape(-1).contiguous().float()


@dataclass(frozen=True)
class Targets:
    """A batch's target knots and what the tails read from it.

    Attributes:
        knots: ``(C, K)`` float32; column 0 and K-1 are the extremes of every value.
        mean, std: ``(C, 1)`` moments of the sampled values (``None`` unless the tail reads them).
        finite: 0-d bool tensor, whether every value was finite (a non-finite channel's knots are NaN).
    """

    knots: torch.Tensor
    mean: torch.Tensor | None
    std: torch.Tensor | None
    finite: torch.Tensor


class LayerBackend(abc.ABC):
    """One layer's fast map on one device: its :class:`LayerSource` and its sampled positions."""

    name: ClassVar[str] = ""

    def __init__(self, source: LayerSource, subsets: SubsetCache) -> None:
        self.source = source
        self.subsets = subsets

    def folds(self, x: torch.Tensor) -> bool:
        """Whether folding a BatchNorm into the map (``pre``) saves a pass over ``x`` (the BatchNorm's
        input, channels on dim 1) here."""
        return False

    @abc.abstractmethod
    def target_knots(self, x: torch.Tensor, pre: Affine | None = None) -> Targets:
        """The target knots of ``x`` (A, C, B): inner ones from the sampled positions, p0/p100 from every value."""

    @abc.abstractmethod
    def apply(self, x: torch.Tensor, targets: Targets, pre: Affine | None = None) -> torch.Tensor:
        """``x`` (A, C, B) mapped from ``targets`` onto the source knots by each channel's lookup table."""

    def recalibrate(self, x: torch.Tensor, pre: Affine | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` (A, C, B) mapped with its own target knots, and whether every value was finite (0-d bool)."""
        targets = self.target_knots(x, pre)
        return self.apply(x, targets, pre), targets.finite

    def recalibrate_output(self, out: torch.Tensor, channel_dim: int,
                           pre: Affine | None = None) -> tuple[torch.Tensor, torch.Tensor | bool]:
        """:meth:`recalibrate` of a layer output with its channels on ``channel_dim``, in ``out``'s shape
        (a backend may skip the ``(A, C, B)`` views; whether every value was finite may come as a bool)."""
        y, finite = self.recalibrate(as_acb(out, channel_dim), pre)
        return y.reshape(out.shape), finite
