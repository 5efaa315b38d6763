"""Paper Fig. 1: a multi-modal source, a non-affine monotone shift, and the Wasserstein-1 distance to
the source of the shifted, TTN-corrected and AQR-corrected values (``aqr synth shapes``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from aqr.experiments.synthetic_tools import aqr_correct, generator, ttn_correct
from aqr.util.plots import axes_row, save


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

    g = generator(config.seed)
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
    fig, axes = axes_row(2, (11, 4))
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
    return save(fig, path, dpi=120)[0]
