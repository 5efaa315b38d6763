"""Synthetic experiments that test the paper's own analysis.

Three experiments, each a pure ``run_*`` function (config dataclass in, result dataclass out, every
random draw from a ``torch.Generator`` seeded by the config) and a ``plot_*`` function that writes a
PNG with matplotlib's Agg canvas (no pyplot, so no global figure state):

* :func:`run_shapes` -- paper Fig. 1: a multi-modal source, a non-affine monotone shift, and the
  Wasserstein-1 distance to the source of the shifted, TTN-corrected and AQR-corrected values.
* :func:`run_mlp` -- paper Sec. "Analysis of a One-Hidden-Layer Model": per-neuron strictly
  increasing corruptions of the hidden layer of a one-hidden-layer leaky-ReLU MLP; MSE of AQR and TTN
  against the clean hidden layer and the error of the network's output, over a grid of ``n`` and ``K``.
* :func:`run_rates` -- paper App. "Finite-Sample and Finite Quantile Discretization Analysis": MSE of
  AQR against ``K`` and against ``n_S`` / ``n_T`` on a density that meets the appendix's assumptions,
  log-log slopes with 95 % confidence intervals, and the theorem's explicit bound at every point.

AQR is always :func:`aqr.quantile_map` with source knots from :func:`aqr.channel_quantiles` and the
target knots taken from the mapped batch itself (``target_q=None``), as the library does at test time.
TTN is the affine map ``mu_S + sigma_S (z - mu_T) / sigma_T`` with the moments of the same two samples.

Knot counts: the library's ``K`` (``num_quantiles``) counts knots at levels ``j / (K - 1)``; the
paper's appendix puts knots at ``j / K``, ``j = 0..K``, so the paper's ``K`` is the number of
*intervals*, ``num_quantiles - 1``. The rates experiment states ``K`` as intervals so that the
theorem's ``K^-4`` term is evaluated with the paper's meaning.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from aqr.core.qmap import channel_quantiles, quantile_map, sorted_quantiles
from aqr.core.calibrate import dkw_epsilon

# ---------------------------------------------------------------------------------------------
# shared pieces
# ---------------------------------------------------------------------------------------------


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


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


def _figure(ncols: int, figsize: tuple[float, float], **kwargs):
    """A figure and its axes drawn by the Agg canvas, without pyplot (no global figure state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, ncols, **kwargs)


# ---------------------------------------------------------------------------------------------
# 1. shapes (paper Fig. 1)
# ---------------------------------------------------------------------------------------------

# the source: 30 % N(-2, 0.5^2) + 45 % N(0.2, 0.6^2) + 25 % N(2.5, 0.4^2)
TRIMODAL = ((0.30, -2.0, 0.5), (0.45, 0.2, 0.6), (0.25, 2.5, 0.4))


def mixture_sample(n: int, g: torch.Generator, components=TRIMODAL) -> torch.Tensor:
    """``n`` float64 draws from a 1-D Gaussian mixture given as ``(weight, mean, std)`` triples."""
    w = torch.tensor([c[0] for c in components], dtype=torch.float64)
    idx = torch.multinomial(w, n, replacement=True, generator=g)
    mean = torch.tensor([c[1] for c in components], dtype=torch.float64)[idx]
    std = torch.tensor([c[2] for c in components], dtype=torch.float64)[idx]
    return mean + std * torch.randn(n, generator=g, dtype=torch.float64)


def shapes_shift(x: torch.Tensor) -> torch.Tensor:
    """The non-affine, strictly increasing test-time shift of the shapes experiment: ``exp(0.6 x)``."""
    return torch.exp(0.6 * x)


@dataclass(frozen=True)
class ShapesConfig:
    """Sizes of the shapes experiment: ``n_source`` calibration draws, a test batch of ``n_target``."""

    n_source: int = 50_000
    n_target: int = 50_000
    num_quantiles: int = 101
    seed: int = 0

    @classmethod
    def quick(cls, seed: int = 0) -> ShapesConfig:
        return cls(n_source=5_000, n_target=5_000, seed=seed)


@dataclass
class ShapesResult:
    """W1 distances to the clean test values; ``values`` holds the samples for plotting."""

    config: ShapesConfig
    w1_shifted: float
    w1_ttn: float
    w1_aqr: float
    values: dict[str, np.ndarray] = field(repr=False, default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "experiment": "shapes",
            "config": asdict(self.config),
            "shift": "exp(0.6 x)",
            "source": "mixture " + ", ".join(f"{w:g} N({m:g}, {s:g}^2)" for w, m, s in TRIMODAL),
            "w1_shifted": self.w1_shifted,
            "w1_ttn": self.w1_ttn,
            "w1_aqr": self.w1_aqr,
        }


def run_shapes(config: ShapesConfig) -> ShapesResult:
    """Shift a tri-modal source by ``exp(0.6 x)`` and correct it with TTN and with AQR.

    Source statistics come from ``n_source`` calibration draws; the test batch is ``n_target``
    independent draws, shifted. Each W1 is measured against the batch's own clean (pre-shift) values,
    a source sample independent of the calibration one.
    """
    from scipy.stats import wasserstein_distance

    g = _generator(config.seed)
    source = mixture_sample(config.n_source, g)
    clean = mixture_sample(config.n_target, g)
    shifted = shapes_shift(clean)
    ttn = ttn_correct(shifted[None], source[None], dim=0)[0]
    aqr = aqr_correct(shifted[None], source[None], config.num_quantiles, dim=0)[0]
    values = {k: v.numpy() for k, v in {"source": clean, "shifted": shifted, "ttn": ttn, "aqr": aqr}.items()}
    w1 = {k: float(wasserstein_distance(values[k], values["source"])) for k in ("shifted", "ttn", "aqr")}
    return ShapesResult(config, w1["shifted"], w1["ttn"], w1["aqr"], values)


def plot_shapes(result: ShapesResult, path: str | Path) -> Path:
    """Kernel density plots: source vs shifted (left), source vs TTN and AQR corrections (right)."""
    from scipy.stats import gaussian_kde

    v = result.values
    fig, axes = _figure(2, (11, 4))
    styles = {
        "source": ("source (clean)", "black", "-"),
        "shifted": (f"shifted exp(0.6x), W1={result.w1_shifted:.3f}", "tab:gray", "--"),
        "ttn": (f"TTN (mean/std), W1={result.w1_ttn:.3f}", "tab:orange", "-"),
        "aqr": (f"AQR K={result.config.num_quantiles}, W1={result.w1_aqr:.3f}", "tab:blue", "-"),
    }
    for ax, keys in zip(axes, (("source", "shifted"), ("source", "ttn", "aqr"))):
        lo = min(np.quantile(v[k], 0.001) for k in keys)
        hi = max(np.quantile(v[k], 0.999) for k in keys)
        grid = np.linspace(lo - 0.1 * (hi - lo), hi + 0.1 * (hi - lo), 512)
        for k in keys:
            label, color, ls = styles[k]
            sub = v[k][:: max(1, len(v[k]) // 20_000)]  # the KDE on at most ~20k points
            ax.plot(grid, gaussian_kde(sub)(grid), color=color, ls=ls, lw=2 if k == "aqr" else 1.5, label=label)
        ax.set_xlabel("activation value")
        ax.set_ylabel("density (KDE)")
        ax.legend(fontsize=8)
    axes[0].set_title("source and non-affine monotone shift")
    axes[1].set_title("corrections (W1 to the clean values)")
    fig.tight_layout()
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


# ---------------------------------------------------------------------------------------------
# 2. one-hidden-layer MLP (paper Sec. "Analysis of a One-Hidden-Layer Model")
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corruption:
    """A strictly increasing map ``k`` of one hidden neuron; ``affine`` says whether it is affine."""

    name: str
    fn: Callable[[torch.Tensor], torch.Tensor]
    affine: bool


def _affine(a: float, c: float) -> Corruption:
    return Corruption(f"{a:g}h{c:+g}", lambda h: a * h + c, True)


def mixed_corruptions() -> list[Corruption]:
    """Three affine and three non-affine strictly increasing ``k_i`` (the "mixed" scenario)."""
    return [
        _affine(1.5, 0.5),
        _affine(0.6, -0.3),
        _affine(2.0, 0.0),
        Corruption("exp(h)", torch.exp, False),
        Corruption("h+0.3h^3", lambda h: h + 0.3 * h**3, False),
        Corruption("2h if h>0 else 0.5h", lambda h: torch.where(h > 0, 2.0 * h, 0.5 * h), False),
    ]


def affine_corruptions(m: int, g: torch.Generator) -> list[Corruption]:
    """``m`` random affine ``k_i(h) = a_i h + c_i`` with ``a_i`` in [0.5, 2], ``c_i`` in [-1, 1]."""
    a = 0.5 + 1.5 * torch.rand(m, generator=g, dtype=torch.float64)
    c = 2.0 * torch.rand(m, generator=g, dtype=torch.float64) - 1.0
    return [_affine(round(float(ai), 3), round(float(ci), 3)) for ai, ci in zip(a, c)]


@dataclass(frozen=True)
class MLPConfig:
    """One-hidden-layer MLP ``y = w^T leaky_relu(W x + b)`` with ``d`` inputs and ``m = 6`` neurons.

    ``ns`` are the sample sizes used for both ``n_S`` (calibration) and ``n_T`` (test batch);
    ``num_quantiles`` the library's ``K`` values; each grid point is averaged over ``repeats`` draws.
    """

    d: int = 4
    negative_slope: float = 0.2
    ns: tuple[int, ...] = (1_000, 10_000, 100_000, 1_000_000)
    num_quantiles: tuple[int, ...] = (11, 101, 1001)
    repeats: int = 3
    seed: int = 0

    @classmethod
    def quick(cls, seed: int = 0) -> MLPConfig:
        return cls(ns=(1_000, 10_000, 100_000), num_quantiles=(11, 101), repeats=1, seed=seed)


@dataclass(frozen=True)
class MLPNetwork:
    """Weights of the one-hidden-layer MLP and the input mixture (``supp(P) = R^d``)."""

    W: torch.Tensor  # (m, d)
    b: torch.Tensor  # (m,)
    w: torch.Tensor  # (m,)
    negative_slope: float

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """``h = leaky_relu(W x + b)`` for ``x`` of shape ``(n, d)``; returns ``(n, m)``."""
        return torch.nn.functional.leaky_relu(x @ self.W.T + self.b, self.negative_slope)

    def output(self, h: torch.Tensor) -> torch.Tensor:
        """``y = w^T h`` for each row of ``h``."""
        return h @ self.w


def make_network(m: int, d: int, negative_slope: float, g: torch.Generator) -> MLPNetwork:
    """Random weights: ``W ~ N(0, 1/d)``, ``b ~ N(0, 0.5^2)``, ``w ~ N(0, 1/m)``."""
    W = torch.randn(m, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    b = 0.5 * torch.randn(m, generator=g, dtype=torch.float64)
    w = torch.randn(m, generator=g, dtype=torch.float64) / math.sqrt(m)
    return MLPNetwork(W, b, w, negative_slope)


def mlp_inputs(n: int, d: int, g: torch.Generator) -> torch.Tensor:
    """``n`` inputs from ``0.5 N(-1, I) + 0.5 N(+1.5, 0.5^2 I)`` on ``R^d`` (full support, bimodal)."""
    mode = torch.rand(n, 1, generator=g, dtype=torch.float64) < 0.5
    z = torch.randn(n, d, generator=g, dtype=torch.float64)
    return torch.where(mode, z - 1.0, 0.5 * z + 1.5)


@dataclass
class MLPCell:
    """Errors at one ``(n, K)``: hidden MSE averaged over neurons, per neuron, and output MSE."""

    scenario: str
    n: int
    num_quantiles: int
    mse_aqr: float
    mse_ttn: float
    output_mse_aqr: float
    output_mse_ttn: float
    mse_aqr_per_neuron: list[float]
    mse_ttn_per_neuron: list[float]


@dataclass
class MLPResult:
    """All grid cells of both scenarios ("mixed": 3 affine + 3 non-affine ``k_i``; "affine": all affine)."""

    config: MLPConfig
    corruptions: dict[str, list[str]]
    nonaffine: dict[str, list[bool]]
    cells: list[MLPCell]

    def cell(self, scenario: str, n: int, num_quantiles: int) -> MLPCell:
        return next(c for c in self.cells if (c.scenario, c.n, c.num_quantiles) == (scenario, n, num_quantiles))

    def largest(self, scenario: str = "mixed") -> MLPCell:
        return self.cell(scenario, max(self.config.ns), max(self.config.num_quantiles))

    def to_dict(self) -> dict:
        top, aff = self.largest("mixed"), self.largest("affine")
        return {
            "experiment": "mlp",
            "config": asdict(self.config),
            "mse_aqr": top.mse_aqr,
            "mse_ttn": top.mse_ttn,
            "output_mse_aqr": top.output_mse_aqr,
            "output_mse_ttn": top.output_mse_ttn,
            "affine_mse_aqr": aff.mse_aqr,
            "affine_mse_ttn": aff.mse_ttn,
            "affine_output_mse_aqr": aff.output_mse_aqr,
            "affine_output_mse_ttn": aff.output_mse_ttn,
            "mse_definition": "mean over neurons and test samples of (T_i(h_i^T) - h_i^S)^2; output: mean (w^T T(h^T) - w^T h^S)^2",
            "corruptions": self.corruptions,
            "nonaffine": self.nonaffine,
            "cells": [asdict(c) for c in self.cells],
        }


def run_mlp(config: MLPConfig) -> MLPResult:
    """AQR and TTN on the corrupted hidden layer of a one-hidden-layer MLP, over ``ns x num_quantiles``.

    For each ``n`` and repeat, ``n_S = n`` source inputs give the source hidden samples; an independent
    test batch of ``n_T = n`` inputs gives the clean ``h^S`` and the corrupted ``h^T = k(h^S)``
    (neuron-wise). AQR uses ``K`` source knots and the batch's own knots; TTN the two samples' moments.
    Errors are against the batch's clean hidden values and clean outputs, averaged over repeats.
    """
    g = _generator(config.seed)
    scenarios = {"mixed": mixed_corruptions()}
    scenarios["affine"] = affine_corruptions(len(scenarios["mixed"]), g)
    m = len(scenarios["mixed"])
    net = make_network(m, config.d, config.negative_slope, g)
    acc: dict[tuple[str, int, int], list[np.ndarray]] = {}
    for n in config.ns:
        for _ in range(config.repeats):
            h_source = net.hidden(mlp_inputs(n, config.d, g))
            h_clean = net.hidden(mlp_inputs(n, config.d, g))
            y_clean = net.output(h_clean)
            for scen, ks in scenarios.items():
                h_target = torch.stack([k.fn(h_clean[:, i]) for i, k in enumerate(ks)], dim=1)
                ttn = ttn_correct(h_target, h_source, dim=1)
                ttn_err = _errors(ttn, h_clean, y_clean, net)
                for kq in config.num_quantiles:
                    aqr = aqr_correct(h_target, h_source, kq, dim=1)
                    acc.setdefault((scen, n, kq), []).append(np.concatenate([_errors(aqr, h_clean, y_clean, net), ttn_err]))
    cells = []
    for (scen, n, kq), rows in acc.items():
        e = np.mean(rows, axis=0)  # [aqr per neuron (m), aqr out, ttn per neuron (m), ttn out]
        aqr_n, aqr_out, ttn_n, ttn_out = e[:m], e[m], e[m + 1 : 2 * m + 1], e[2 * m + 1]
        cells.append(
            MLPCell(scen, n, kq, float(aqr_n.mean()), float(ttn_n.mean()), float(aqr_out), float(ttn_out), aqr_n.tolist(), ttn_n.tolist())
        )
    return MLPResult(
        config,
        {s: [k.name for k in ks] for s, ks in scenarios.items()},
        {s: [not k.affine for k in ks] for s, ks in scenarios.items()},
        cells,
    )


def _errors(h_hat: torch.Tensor, h_clean: torch.Tensor, y_clean: torch.Tensor, net: MLPNetwork) -> np.ndarray:
    per_neuron = ((h_hat - h_clean) ** 2).mean(dim=0)
    out = ((net.output(h_hat) - y_clean) ** 2).mean()
    return np.concatenate([per_neuron.numpy(), [float(out)]])


def plot_mlp(result: MLPResult, path: str | Path) -> Path:
    """Hidden-layer MSE (solid) and output MSE (dashed) against ``n`` for each ``K``, and TTN."""
    from matplotlib import colormaps

    ns = list(result.config.ns)
    fig, axes = _figure(2, (11, 4.2), sharey=True)
    colors = colormaps["Blues"](np.linspace(0.45, 0.95, len(result.config.num_quantiles)))
    for ax, scen in zip(axes, ("mixed", "affine")):
        for color, kq in zip(colors, result.config.num_quantiles):
            cells = [result.cell(scen, n, kq) for n in ns]
            ax.loglog(ns, [c.mse_aqr for c in cells], "o-", color=color, label=f"AQR K={kq} hidden")
            ax.loglog(ns, [c.output_mse_aqr for c in cells], "o--", color=color, alpha=0.6, label=f"AQR K={kq} output")
        cells = [result.cell(scen, n, result.config.num_quantiles[0]) for n in ns]
        ax.loglog(ns, [c.mse_ttn for c in cells], "s-", color="tab:orange", label="TTN hidden")
        ax.loglog(ns, [c.output_mse_ttn for c in cells], "s--", color="tab:orange", alpha=0.6, label="TTN output")
        title = "3 affine + 3 non-affine $k_i$" if scen == "mixed" else "all $k_i$ affine"
        ax.set_title(title)
        ax.set_xlabel("$n_S = n_T = n$")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("MSE vs clean (mean over neurons)")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle("One-hidden-layer leaky-ReLU MLP: AQR vs TTN on corrupted hidden units")
    fig.tight_layout()
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------
# 3. finite-sample and discretisation rates (paper App. "Finite-Sample ... Analysis of AQR")
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CosineDensity:
    """``f(x) = 1 - a cos(2 pi modes x)`` on ``[0, 1]``: smooth, ``modes``-modal, ``>= 1 - a > 0``.

    Meets the appendix's assumptions exactly: ``f_min = 1 - a``, ``M = 1 + a``, ``f`` is C^1 on its
    support with ``L = ||f'||_inf = 2 pi modes a``. ``a = 0`` is the uniform density.
    """

    a: float = 0.6
    modes: int = 2

    @property
    def f_min(self) -> float:
        return 1.0 - self.a

    @property
    def lipschitz(self) -> float:
        return 2.0 * math.pi * self.modes * self.a

    def pdf(self, x: torch.Tensor) -> torch.Tensor:
        return 1.0 - self.a * torch.cos(2.0 * math.pi * self.modes * x)

    def cdf(self, x: torch.Tensor) -> torch.Tensor:
        w = 2.0 * math.pi * self.modes
        return x - self.a * torch.sin(w * x) / w

    def quantile(self, u: torch.Tensor, iters: int = 40) -> torch.Tensor:
        """``F^{-1}(u)`` by bracketed Newton (bisection when a step leaves the bracket), to ~1e-15."""
        u = u.to(torch.float64)
        lo, hi, x = torch.zeros_like(u), torch.ones_like(u), u.clone()
        for _ in range(iters):
            r = self.cdf(x) - u
            lo = torch.where(r < 0, x, lo)
            hi = torch.where(r > 0, x, hi)
            step = x - r / self.pdf(x)
            x_new = torch.where((step >= lo) & (step <= hi), step, 0.5 * (lo + hi))
            moved = float((x_new - x).abs().max())
            x = x_new
            if moved < 1e-9:  # quadratic convergence: the last step is then accurate to ~1e-17
                break
        return x

    def sample(self, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
        """Inverse-transform draws of the given shape (float64)."""
        return self.quantile(torch.rand(shape, generator=g, dtype=torch.float64))


def rates_corruption(h: torch.Tensor) -> torch.Tensor:
    """The non-affine corruption of the rates experiment, ``k(h) = exp(2 h)`` (fixed a priori)."""
    return torch.exp(2.0 * h)


def theorem_bound(density: CosineDensity, intervals: float, n_source: float, n_target: float, delta: float) -> float:
    """The appendix theorem's right-hand side, ``K`` = ``intervals``; ``n = inf`` drops its term."""
    f, lip = density.f_min, density.lipschitz
    eps_s = 0.0 if math.isinf(n_source) else dkw_epsilon(int(n_source), delta)
    eps_t = 0.0 if math.isinf(n_target) else dkw_epsilon(int(n_target), delta)
    return 3.0 * (lip / (8.0 * f**3)) ** 2 * intervals**-4 + 3.0 / f**2 * (eps_s**2 + eps_t**2)


@dataclass(frozen=True)
class RatesConfig:
    """Grids of the rates experiment.

    ``intervals`` (paper's ``K``; library ``num_quantiles = K + 1``) for the sampled ``K`` sweep at
    ``n_S = n_T = n_large``; ``population_intervals`` for the same sweep with exact knots (``n = inf``);
    ``ns`` for the ``n_S`` sweep (``n_T = n_large``) and the ``n_T`` sweep (``n_S = n_large``), both
    at ``intervals_large``. ``repeats`` independent seeds per point; theorem checked at ``delta``.
    """

    density_a: float = 0.6
    density_modes: int = 2
    intervals: tuple[int, ...] = (2, 3, 4, 6, 8, 12, 16)
    population_intervals: tuple[int, ...] = (2, 4, 8, 16, 32, 64, 128, 256)
    population_grid: int = 1 << 20
    ns: tuple[int, ...] = (100, 316, 1_000, 3_162, 10_000, 31_623, 100_000)
    intervals_large: int = 1024
    n_large: int = 4_000_000
    repeats: int = 8
    delta: float = 0.05
    seed: int = 0

    @classmethod
    def quick(cls, seed: int = 0) -> RatesConfig:
        return cls(
            intervals=(2, 4, 8),
            population_intervals=(3, 12, 48),
            population_grid=1 << 16,
            ns=(100, 1_000, 10_000),
            n_large=200_000,
            repeats=4,
            seed=seed,
        )

    @property
    def density(self) -> CosineDensity:
        return CosineDensity(self.density_a, self.density_modes)


@dataclass
class Sweep:
    """One sweep: x values, MSE per repeat (repeats x points), theorem bound per point, fitted slope."""

    name: str
    x: list[float]
    mse: list[list[float]]
    bound: list[float]
    slope: Slope
    fixed: dict[str, float]

    @property
    def mean(self) -> np.ndarray:
        return np.mean(self.mse, axis=0)

    @property
    def violations(self) -> int:
        return int((np.asarray(self.mse) > np.asarray(self.bound)[None, :]).sum())

    @property
    def max_ratio(self) -> float:
        """Largest ``MSE / bound`` over repeats and points (``inf`` where the bound is 0 and MSE > 0)."""
        mse, bound = np.asarray(self.mse), np.asarray(self.bound)[None, :]
        with np.errstate(divide="ignore", invalid="ignore"):
            return float(np.where(mse > 0, mse / bound, 0.0).max())

    @property
    def local_slopes(self) -> list[float]:
        """Log-log slopes of the mean MSE between consecutive points (shows pre-asymptotic bends)."""
        return [loglog_slope(self.x[i : i + 2], self.mean[i : i + 2]) for i in range(len(self.x) - 1)]

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "x": self.x,
            "fixed": self.fixed,
            "mse_mean": self.mean.tolist(),
            "mse": self.mse,
            "bound": self.bound,
            "slope": self.slope.to_dict(),
            "local_slopes": self.local_slopes,
            "bound_violations": self.violations,
            "max_mse_over_bound": self.max_ratio,
        }


@dataclass
class RatesResult:
    """The four sweeps (``K`` sampled, ``K`` population, ``n_S``, ``n_T``) and the bound check."""

    config: RatesConfig
    sweeps: dict[str, Sweep]
    uniform_population: Sweep  # side check: the a = 0 (uniform, L = 0) source, exact knots
    predicted: dict[str, float]  # first-order constants for the cosine source, see predicted_constants
    predicted_uniform: dict[str, float]

    @property
    def bound_holds(self) -> bool:
        return all(s.violations == 0 for s in self.sweeps.values())

    def to_dict(self) -> dict:
        d = self.config.density
        s = self.sweeps
        return {
            "experiment": "rates",
            "config": asdict(self.config),
            "density": f"f(x) = 1 - {d.a:g} cos(2 pi {d.modes} x) on [0, 1]",
            "corruption": "k(h) = exp(2 h)",
            "f_min": d.f_min,
            "L": d.lipschitz,
            "K_meaning": "number of quantile intervals (paper's K) = library num_quantiles - 1",
            "slope_K": s["K"].slope.slope,
            "slope_K_ci": [s["K"].slope.ci_low, s["K"].slope.ci_high],
            "slope_K_population": s["K_population"].slope.slope,
            "slope_n_source": s["n_source"].slope.slope,
            "slope_n_source_ci": [s["n_source"].slope.ci_low, s["n_source"].slope.ci_high],
            "slope_n_target": s["n_target"].slope.slope,
            "slope_n_target_ci": [s["n_target"].slope.ci_low, s["n_target"].slope.ci_high],
            "bound_holds": self.bound_holds,
            "bound_violations": {k: v.violations for k, v in s.items()},
            "max_mse_over_bound": {k: v.max_ratio for k, v in s.items()},
            "predicted_K4_mse": self.predicted["K4_mse"],
            "predicted_n_mse": self.predicted["n_mse"],
            "measured_K4_mse_at_largest_population_K": float(s["K_population"].mean[-1] * s["K_population"].x[-1] ** 4),
            "uniform_source_population": self.uniform_population.to_dict(),
            "uniform_predicted_K4_mse": self.predicted_uniform["K4_mse"],
            "uniform_bound_holds": self.uniform_population.violations == 0,
            "sweeps": {k: v.to_dict() for k, v in s.items()},
        }


def aqr_mse(
    source: torch.Tensor, clean: torch.Tensor, intervals: int, *, source_sorted: bool = False, clean_sorted: bool = False
) -> torch.Tensor:
    """Per-row MSE of AQR with ``intervals + 1`` knots on ``(R, n)`` rows (one row per replicate).

    ``source`` gives the source knots, ``clean`` the test batch before the corruption; the batch is
    corrupted by :func:`rates_corruption`, mapped with its own knots, and compared to ``clean``.
    ``*_sorted=True`` promises rows sorted ascending: the knots are then read off without re-sorting
    (:func:`aqr.core.qmap.sorted_quantiles`, the function :func:`aqr.channel_quantiles` itself ends with),
    which gives the same numbers as sorting again.
    """
    k = intervals + 1
    target = rates_corruption(clean)  # strictly increasing: sorted stays sorted
    source_q = sorted_quantiles(source, k) if source_sorted else channel_quantiles(source, k)
    target_q = sorted_quantiles(target, k) if clean_sorted else None  # None: the batch's own knots
    mapped = quantile_map(target, source_q, target_q, tail="standard")
    return ((mapped - clean) ** 2).mean(dim=1)


def population_mse(density: CosineDensity, intervals: int, grid: int) -> float:
    """MSE of the library's map with *exact* knots (``n_S = n_T = inf``), by midpoint quadrature in ``u``.

    ``E_{z ~ Q}[(T_K(z) - k^{-1}(z))^2] = int_0^1 (T_K(H_T(u)) - H_S(u))^2 du`` with
    ``H_T = k o H_S``; the knots are ``H_S(j/K)`` and ``H_T(j/K)``.
    """
    levels = torch.linspace(0.0, 1.0, intervals + 1, dtype=torch.float64)
    source_q = density.quantile(levels)[None]
    target_q = rates_corruption(source_q)
    u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    h = density.quantile(u)[None]
    mapped = quantile_map(rates_corruption(h), source_q, target_q, tail="standard")
    return float(((mapped - h) ** 2).mean())


def predicted_constants(density: CosineDensity, grid: int = 1 << 16) -> dict[str, float]:
    """First-order predictions for this implementation with ``k(h) = exp(2 h)`` (see the README).

    * ``K4_mse``: ``lim K^4 MSE`` at ``n = inf``. With exact knots the library's map is the
      piecewise-linear interpolant of ``k^{-1}`` on the *target* knots ``H_T(j/K)``, whose error is
      ``(1/2) |(k^{-1})''| (z - z_j)(z_{j+1} - z)``; averaging its square gives
      ``(1/120) int (H_S'' - H_S' H_T''/H_T')^2 du``, which for ``k = exp(2h)`` is
      ``(1/30) int f^{-3} dx`` -- it depends on ``f_min`` but not on ``L``.
    * ``n_mse``: ``lim n MSE`` from either side alone, ``int u (1 - u) / f(H_S(u))^2 du`` (the variance
      of a sample quantile, or of a sample CDF carried through ``H_S``).
    """
    u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    f = density.pdf(density.quantile(u))
    return {"K4_mse": float((f**-4).mean() / 30.0), "n_mse": float((u * (1 - u) / f**2).mean())}


def run_rates(config: RatesConfig) -> RatesResult:
    """Measure AQR's MSE against ``K``, ``n_S`` and ``n_T``; fit slopes; check the theorem everywhere.

    Replicate ``r`` uses its own generator (seed ``config.seed * 1000 + r``) for every sweep; within a
    replicate the ``n`` sweeps use nested prefixes of one large draw, so a per-replicate slope is a fit
    to one coherent curve. The bound uses the exact ``f_min`` and ``L`` of the density and ``delta``.
    """
    dens, cfg = config.density, config
    bound = lambda k, ns, nt: theorem_bound(dens, k, ns, nt, cfg.delta)  # noqa: E731
    mse_k, mse_ns, mse_nt = [], [], []
    for r in range(cfg.repeats):
        g = _generator(cfg.seed * 1000 + r)
        # the large samples are used whole, so they are sorted once (the MSE does not depend on order)
        big_source = torch.sort(dens.sample((1, cfg.n_large), g), dim=1).values
        big_clean = torch.sort(dens.sample((1, cfg.n_large), g), dim=1).values
        big = {"source_sorted": True, "clean_sorted": True}
        mse_k.append([float(aqr_mse(big_source, big_clean, k, **big)) for k in cfg.intervals])
        small_source = dens.sample((1, max(cfg.ns)), g)  # prefixes of these are the smaller samples
        small_clean = dens.sample((1, max(cfg.ns)), g)
        kl = cfg.intervals_large
        mse_ns.append([float(aqr_mse(small_source[:, :n], big_clean, kl, clean_sorted=True)) for n in cfg.ns])
        mse_nt.append([float(aqr_mse(big_source, small_clean[:, :n], kl, source_sorted=True)) for n in cfg.ns])

    def sweep(name, x, mse, bounds, fixed) -> Sweep:
        return Sweep(name, [float(v) for v in x], mse, bounds, replicate_slope(x, np.asarray(mse)), fixed)

    nl, kl = cfg.n_large, cfg.intervals_large
    sweeps = {
        "K": sweep("K", cfg.intervals, mse_k, [bound(k, nl, nl) for k in cfg.intervals], {"n_source": nl, "n_target": nl}),
        "K_population": sweep(
            "K_population",
            cfg.population_intervals,
            [[population_mse(dens, k, cfg.population_grid) for k in cfg.population_intervals]],
            [bound(k, math.inf, math.inf) for k in cfg.population_intervals],
            {"n_source": math.inf, "n_target": math.inf},
        ),
        "n_source": sweep("n_source", cfg.ns, mse_ns, [bound(kl, n, nl) for n in cfg.ns], {"K": kl, "n_target": nl}),
        "n_target": sweep("n_target", cfg.ns, mse_nt, [bound(kl, nl, n) for n in cfg.ns], {"K": kl, "n_source": nl}),
    }
    uniform = CosineDensity(0.0, dens.modes)
    uniform_sweep = sweep(
        "K_population_uniform_source",
        cfg.population_intervals,
        [[population_mse(uniform, k, cfg.population_grid) for k in cfg.population_intervals]],
        [theorem_bound(uniform, k, math.inf, math.inf, cfg.delta) for k in cfg.population_intervals],
        {"n_source": math.inf, "n_target": math.inf, "a": 0.0},
    )
    return RatesResult(config, sweeps, uniform_sweep, predicted_constants(dens), predicted_constants(uniform))


def plot_rates(result: RatesResult, path: str | Path) -> Path:
    """Three log-log panels (MSE vs ``K``, vs ``n_S``, vs ``n_T``) with the theorem's bound and slopes."""
    s = result.sweeps
    fig, axes = _figure(3, (15, 4.3))

    def panel(ax, sw: Sweep, label: str, color: str) -> None:
        mse = np.asarray(sw.mse)
        x = np.asarray(sw.x)
        if mse.shape[0] > 1:
            ax.fill_between(x, mse.min(axis=0), mse.max(axis=0), color=color, alpha=0.2)
        sl = sw.slope
        ci = "" if math.isnan(sl.ci_low) else f" [{sl.ci_low:.2f}, {sl.ci_high:.2f}]"
        ax.loglog(x, sw.mean, "o-", color=color, label=f"{label}: slope {sl.slope:.2f}{ci}")
        ax.loglog(x, sw.bound, ":", color=color, label=f"{label}: theorem bound")

    panel(axes[0], s["K"], f"AQR, n_S=n_T={result.config.n_large:.0e}", "tab:blue")
    panel(axes[0], s["K_population"], "AQR, exact knots (n=inf)", "tab:green")
    u = result.uniform_population
    axes[0].loglog(u.x, u.mean, "^-", color="tab:red", label=f"uniform source (L=0), exact knots: slope {u.slope.slope:.2f}")
    axes[0].set_xlabel("K (number of quantile intervals)")
    panel(axes[1], s["n_source"], f"AQR, K={result.config.intervals_large}, n_T={result.config.n_large:.0e}", "tab:purple")
    axes[1].set_xlabel("$n_S$")
    panel(axes[2], s["n_target"], f"AQR, K={result.config.intervals_large}, n_S={result.config.n_large:.0e}", "tab:brown")
    axes[2].set_xlabel("$n_T$")
    from matplotlib.ticker import NullFormatter

    for ax in axes:
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel("MSE vs clean")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    d = result.config.density
    fig.suptitle(
        f"AQR rates on f(x) = 1 - {d.a:g} cos(2$\\pi$ {d.modes} x), k(h)=exp(2h); "
        f"f_min={d.f_min:.2f}, L={d.lipschitz:.2f}, delta={result.config.delta:g}; band = min..max over seeds"
    )
    fig.tight_layout()
    return _save(fig, path)
