"""The fast path on a GPU, in aqr's Triton kernels (:mod:`aqr.backends.triton_kernels`): :class:`TritonBackend`.

No host synchronisation. Per layer: the extremes and moments of every value; for channels of more
than ``TritonConfig.sort_max`` values, knots read off histograms of every value (within one fine
bucket of the exact quantiles), for smaller ones the sorted sample as on the torch path; the lookup
table; and the map (with an eval-mode BatchNorm's affine step folded in, so the map replaces the
BatchNorm's own pass). Any strides are read as they are (NCHW, channels_last, tokens); float32,
bfloat16 and float16 activations are mapped in float32 and written in their dtype. A channel with a
NaN or Inf value comes out all NaN, so it reaches the logits, which :class:`aqr.AQR` checks once per batch.

Needs ``triton`` >= 3.3 (it ships with CUDA builds of torch); on CPU the kernels run under Triton's
interpreter (``TRITON_INTERPRET=1``), which is how the tests check them without a GPU.

Not yet here: the marked cells of the tie rule (:mod:`aqr.backends.torch_backend`, "Marked cells"),
which the torch and C backends implement; these kernels draw each cell's line across the map's
jump at a run of tied knots (the table of ``table_map(..., mark_jumps=False)``).
"""

from __future__ import annotations

import os

import torch

from aqr.backends.base import TAIL_CODES, Affine, LayerBackend, LayerSource, Targets
from aqr.backends.subsets import SubsetCache
from aqr.core.layers import as_acb
from aqr.core.qmap import quantile_levels

try:  # the kernels need triton; without it this backend is simply unavailable
    from aqr.backends import triton_kernels as kernels
except ImportError as err:  # pragma: no cover - depends on the environment
    kernels = None  # type: ignore[assignment]
    UNAVAILABLE = str(err)
else:
    UNAVAILABLE = ""

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device``: CUDA with triton, or CPU under the interpreter."""
    return kernels is not None and (device.type == "cuda" or (device.type == "cpu" and interpreting()))


class TritonBackend(LayerBackend):
    """One layer's fast map on a GPU in aqr's Triton kernels; inputs they do not take go to ``fallback``."""

    name = "triton"

    def __init__(self, source: LayerSource, subsets: SubsetCache, fallback: LayerBackend,
                 config: kernels.TritonConfig | None = None) -> None:
        super().__init__(source, subsets)
        if kernels is None:
            raise RuntimeError(f"aqr's Triton backend is unavailable: {UNAVAILABLE}")
        self.fallback = fallback
        self.config = config or kernels.TritonConfig()
        s = source
        # stand-ins for what a tail does not read (the kernels take a pointer either way)
        self._loc = s.loc if s.loc is not None else s.knots[:, 0].contiguous()
        self._scale = s.scale if s.scale is not None else s.knots[:, 0].contiguous()
        self._z = s.z if s.z is not None else (0.0, 0.0)
        self._on_device = available(source.device)
        self._centre_subsets = SubsetCache(kernels.CENTRE_SAMPLES)  # centre the coarse histogram
        # type-7 interpolation ranks and fractions per sample size (a plain dict: torch.compile reads it)
        self._ranks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the kernels map ``x`` (A, C, B): a float activation on their device, with no gradient to keep."""
        a, _, b = x.shape
        return (self._on_device and x.device == self.source.device and x.dtype in DTYPES and a * b > 0
                and not (x.requires_grad and torch.is_grad_enabled())
                # tile indices are int32 (memory offsets are int64)
                and max(a * b, a * x.shape[1]) < 2**31 - 2**20)

    def _rank_fractions(self, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Type-7 interpolation of ``samples`` sorted values at the K levels (int32 ranks, float32 fractions)."""
        if samples not in self._ranks:
            pos = quantile_levels(self.source.num_quantiles) * (samples - 1)
            lo = pos.floor().long().clamp_(0, samples - 1)
            device = self.source.device
            self._ranks[samples] = (lo.to(torch.int32).to(device), (pos - lo.to(pos.dtype)).float().to(device))
        return self._ranks[samples]

    def folds(self, x: torch.Tensor) -> bool:
        return self.takes(as_acb(x, 1))

    def histogram(self, x: torch.Tensor) -> bool:
        """Whether the knots of ``x`` (A, C, B) come from the histogram of every value (else from the
        sorted sample, as on the torch path)."""
        a, _, b = x.shape
        return a * b > self.config.sort_max

    def target_knots(self, x: torch.Tensor, pre: Affine | None = None) -> Targets:
        if not self.takes(x):
            return self.fallback.target_knots(x, pre)
        a, _, b = x.shape
        cfg = self.config
        histogram = self.histogram(x)
        if histogram:
            ranks, fracs = self._rank_fractions(a * b)
            positions = self._centre_subsets.strided_positions(x)
        else:
            positions = self.subsets.strided_positions(x)
            ranks, fracs = self._rank_fractions(positions.shape[0])
        scale, shift = pre if pre is not None else (None, None)
        tq, moments, finite = kernels.call(kernels.targets_op, kernels.targets_impl, x, scale, shift, positions,
                                           ranks, fracs, histogram, cfg.bins, cfg.stats_tile,
                                           cfg.stats_warps, cfg.stats_programs, cfg.sort_warps)
        if self.source.needs_moments:
            return Targets(tq, moments[:, 0:1], moments[:, 1:2], finite)
        return Targets(tq, None, None, finite)

    def apply(self, x: torch.Tensor, targets: Targets, pre: Affine | None = None) -> torch.Tensor:
        if not self.takes(x):
            return self.fallback.apply(x, targets, pre)
        s, cfg = self.source, self.config
        if s.needs_moments:
            if targets.mean is None or targets.std is None:
                raise ValueError(f'tail="{s.tail}" needs the targets\' mean and std')
            mean, std = targets.mean.reshape(-1, 1), targets.std.reshape(-1, 1)
            if mean.stride(0) != std.stride(0):
                mean, std = mean.contiguous(), std.contiguous()
        else:
            mean = std = self._loc.reshape(-1, 1)  # read, then discarded by the other tails
        scale, shift = pre if pre is not None else (None, None)
        return kernels.call(kernels.apply_op, kernels.apply_impl, x, targets.knots.float().contiguous(), s.knots,
                            mean, std, self._loc, self._scale, scale, shift, TAIL_CODES[s.tail], self._z[0],
                            self._z[1], s.cells, cfg.map_tile, cfg.map_warps, cfg.table_warps)
