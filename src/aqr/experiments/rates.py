"""Paper App. "Finite-Sample and Finite Quantile Discretization Analysis" (``aqr synth rates``).

MSE of AQR against ``K`` and against ``n_S`` / ``n_T`` on a density that meets the appendix's
assumptions, log-log slopes with 95 % confidence intervals, and the theorem's explicit bound at
every point.

Knot counts: the library's ``K`` (``num_quantiles``) counts knots at levels ``j / (K - 1)``; the
paper's appendix puts knots at ``j / K``, ``j = 0..K``, so the paper's ``K`` is the number of
*intervals*, ``num_quantiles - 1``. This experiment states ``K`` as intervals so that the
theorem's ``K^-4`` term is evaluated with the paper's meaning.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from aqr.core.calibrate import dkw_epsilon
from aqr.core.qmap import channel_quantiles, quantile_map, sorted_quantiles
from aqr.experiments.synthetic_tools import Slope, generator, loglog_slope, replicate_slope
from aqr.util.plots import axes_row, save


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
        g = generator(cfg.seed * 1000 + r)
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
    fig, axes = axes_row(3, (15, 4.3))

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
    return save(fig, path, dpi=120)[0]
