"""The positions a layer's target knots are estimated from: a fixed random subset per tensor shape.

Target quantiles come from a subset of the positions of each layer output (the same positions for
every channel, drawn once per shape with a fixed seed, so a batch's result never depends on earlier
batches). Of an ``(A, C, B)`` output (``A`` images of a convolution's ``(N, C, H, W)``, or ``N * L``
tokens of a ``(N, L, C)`` one) it takes ``min(A * B, max(size, per_row * A))`` positions: at least
``size``, and ``per_row`` per image (token) as the batch grows, so the sample's share of the batch
stays fixed. A fixed-size sample would make the knots' precision independent of the batch size beyond
``size / per_row`` images (DKW: 8,192 values keep the sample CDF within 0.015 of the batch CDF with
probability 0.95, whatever the batch), while the exact map's knots get more precise with every image.
"""

from __future__ import annotations

import torch

_SUBSET_SEED = 0x5EED
MAX_SAMPLES = 1 << 24  # the kernels' histograms count in int32: no sample grows beyond this


class SubsetCache:
    """Fixed random position subsets, one per ``(A, C, B)`` shape, so results are history-free.

    ``size``: the fewest positions sampled (all of them when there are fewer); ``per_row``: positions
    per leading index ``A`` (an image, or a token) beyond that, up to ``MAX_SAMPLES``; 0 keeps the
    sample at ``size``.
    """

    def __init__(self, size: int, per_row: int = 0) -> None:
        if not 1 <= size <= MAX_SAMPLES or per_row < 0:
            raise ValueError(f"a subset needs size >= 1 and per_row >= 0, got {size} and {per_row}")
        self.size = size
        self.per_row = per_row
        self._cache: dict[tuple[int, int, int, torch.device], torch.Tensor] = {}
        self._offsets: dict[tuple[object, ...], torch.Tensor] = {}

    def count(self, rows: int, positions: int) -> int:
        """How many of a channel's ``positions`` values (over ``rows`` leading indices) are sampled."""
        return min(positions, max(self.size, min(self.per_row * rows, MAX_SAMPLES)))

    def draw(self, positions: int, rows: int = 1) -> torch.Tensor:
        """``(S,)`` sorted int64 indices into a channel's ``positions`` values over ``rows`` leading indices:
        all of them when :meth:`count` says so, else a random subset drawn with a seed fixed by the counts
        (the same for every batch of that shape)."""
        count = self.count(rows, positions)
        if count >= positions:
            return torch.arange(positions)
        g = torch.Generator().manual_seed(_SUBSET_SEED + positions)
        return torch.randperm(positions, generator=g)[:count].sort().values

    def positions(self, x: torch.Tensor) -> torch.Tensor:
        """``(S,)`` int64 flat offsets of the subset positions of channel 0 in contiguous ``x`` (A, C, B).

        ``S`` is :meth:`count` of ``(A, A * B)``. Channel ``c``'s values are at these offsets plus ``c * B``.
        """
        a, c, b = x.shape
        key = (a, c, b, x.device)
        if key not in self._cache:
            pos = self.draw(a * b, a)
            # drawn on the host; copied without waiting for the device's queue (a new batch size mid-stream)
            self._cache[key] = (pos // b * (c * b) + pos % b).to(x.device, non_blocking=True)
        return self._cache[key]

    def strided_positions(self, x: torch.Tensor) -> torch.Tensor:
        """``(S,)`` int64 element offsets of the subset positions of channel 0 in ``x`` (A, C, B) with any
        strides (channel ``c``'s values are at these offsets plus ``c * x.stride(1)``)."""
        a, _, b = x.shape
        sa, _, sb = x.stride()
        key = (a, b, sa, sb, x.device, "strided")
        if key not in self._offsets:
            pos = self.draw(a * b, a)
            self._offsets[key] = ((pos // b) * sa + (pos % b) * sb).to(x.device, non_blocking=True)
        return self._offsets[key]

    def offsets(self, x: torch.Tensor) -> torch.Tensor:
        """``(C, S)`` int64 flat offsets into contiguous ``x`` (A, C, B): each channel's subset positions."""
        a, c, b = x.shape
        key = (a, c, b, x.device, "offsets")
        if key not in self._offsets:
            # torch.take on flat offsets reads about a third faster than advanced indexing plus a
            # transposed copy
            self._offsets[key] = self.positions(x)[None, :] + (torch.arange(c, device=x.device) * b)[:, None]
        return self._offsets[key]

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """``(C, S)`` float32 values of every channel at the subset positions of ``x`` (A, C, B)."""
        return torch.take(x if x.is_contiguous() else x.contiguous(), self.offsets(x)).float()
