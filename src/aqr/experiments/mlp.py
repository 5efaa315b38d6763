"""Paper Sec. "Analysis of a One-Hidden-Layer Model" (``aqr synth mlp``): per-neuron strictly increasing
corruptions of the hidden layer of a one-hidden-layer leaky-ReLU MLP; MSE of AQR and TTN against the
clean hidden layer and the error of the network's output, over a grid of ``n`` and ``K``."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from aqr.experiments.synthetic_tools import aqr_correct, generator, ttn_correct
from aqr.util.plots import axes_row, require_matplotlib, save


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
    g = generator(config.seed)
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
    require_matplotlib("the MLP figure")
    from matplotlib import colormaps

    ns = list(result.config.ns)
    fig, axes = axes_row(2, (11, 4.2), sharey=True)
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
    return save(fig, path, dpi=120)[0]
