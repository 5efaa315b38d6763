"""What the synthetic experiments (:mod:`~aqr.experiments.shapes`, :mod:`~aqr.experiments.mlp`,
:mod:`~aqr.experiments.rates`) share: the two corrections they compare, slope fits and strict JSON.

AQR is always :func:`aqr.quantile_map` with source knots from :func:`aqr.channel_quantiles` and the
target knots taken from the mapped batch itself (``target_q=None``), as the library does at test time.
TTN is the affine map ``mu_S + sigma_S (z - mu_T) / sigma_T`` with the moments of the same two samples.
Every experiment is a pure ``run_*`` function (config dataclass in, result dataclass out, every
random draw from a ``torch.Generator`` seeded by the config) and a ``plot_*`` function writing a PNG.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from aqr.core.qmap import channel_quantiles, quantile_map


def aqr_correct(target: torch.Tensor, source: torch.Tensor, num_quantiles: int, dim: int = 0) -> torch.Tensor:
    """AQR-correct ``target`` (channels on ``dim``) towards ``source`` with ``num_quantiles`` knots.

    Source knots are the exact per-channel quantiles of ``source``; target knots are those of
    ``target`` itself. Returns a tensor shaped like ``target``.
    """
    source_q = channel_quantiles(source, num_quantiles, dim=dim)
    return quantile_map(target, source_q, None, tail="standard", dim=dim)


def ttn_correct(target: torch.Tensor, source: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """TTN-correct ``target``: per channel, match its mean/std (population) to those of ``source``."""
    other = [d for d in range(target.ndim) if d != dim % target.ndim]
    mu_t, sd_t = target.mean(dim=other, keepdim=True), target.std(dim=other, correction=0, keepdim=True)
    mu_s, sd_s = source.mean(dim=other, keepdim=True), source.std(dim=other, correction=0, keepdim=True)
    return mu_s + sd_s * (target - mu_t) / sd_t


@dataclass(frozen=True)
class Slope:
    """A fitted log-log slope with a two-sided 95 % confidence interval."""

    slope: float
    ci_low: float
    ci_high: float
    method: str

    def to_dict(self) -> dict[str, float | str]:
        return asdict(self)


def loglog_slope(x: Sequence[float], y: Sequence[float]) -> float:
    """Ordinary least-squares slope of ``log y`` on ``log x``."""
    lx, ly = np.log(np.asarray(x, dtype=float)), np.log(np.asarray(y, dtype=float))
    return float(np.polyfit(lx, ly, 1)[0])


def replicate_slope(x: Sequence[float], ys: np.ndarray) -> Slope:
    """Mean of the per-replicate log-log slopes of ``ys`` (replicates x points) with a t-interval.

    Replicates are independent (separately seeded draws), so the per-replicate slopes are i.i.d. and
    ``mean +- t_{0.975, R-1} * sd / sqrt(R)`` is a 95 % confidence interval for the expected slope.
    """
    from scipy import stats

    slopes = np.array([loglog_slope(x, row) for row in np.atleast_2d(ys)])
    r = len(slopes)
    mean = float(slopes.mean())
    if r < 2:
        return Slope(mean, float("nan"), float("nan"), "single replicate")
    half = float(stats.t.ppf(0.975, r - 1) * slopes.std(ddof=1) / math.sqrt(r))
    return Slope(mean, mean - half, mean + half, f"mean of {r} per-seed OLS slopes, 95% t-interval")


def jsonable(obj: Any) -> Any:
    """``obj`` with tuples as lists and non-finite floats as the strings ``"inf"``, ``"-inf"``, ``"nan"``.

    The result serialises to strict JSON (no ``Infinity`` / ``NaN`` tokens).
    """
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        v = float(obj)
        return v if math.isfinite(v) else str(v)
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.bool_):
        return bool(obj)
    return obj


def generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``: every random draw of the experiments comes from one."""
    return torch.Generator().manual_seed(int(seed))
