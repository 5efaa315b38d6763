"""The paper's Figs. 4 and 5 from result rows: their numbers and their plots (PNG and PDF).

* :func:`severity_curves` / :func:`plot_severity` -- Fig. 4: accuracy vs severity per method.
* :func:`architecture_bars` / :func:`plot_architectures` -- Fig. 5: one group of bars per model.

Standard errors are ``std / sqrt(n)`` over the per-seed means.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aqr.harness.report.tables import group_by, method_label, variant_order, variants_in
from aqr.harness.results import Row
from aqr.util.plots import axes_row, save, styles


def mean_se(values: Sequence[float]) -> tuple[float, float, int]:
    """Mean, standard error (sample std / sqrt n; 0 for one value) and count."""
    arr = np.asarray(values, dtype=float)
    se = float(arr.std(ddof=1) / math.sqrt(arr.size)) if arr.size > 1 else 0.0
    return float(arr.mean()), se, int(arr.size)


def _seed_means(rows: Iterable[Row], key: Callable[[Row], Any]) -> list[float]:
    """Mean accuracy over seeds of each experimental condition (``key``) among the ok rows."""
    groups = group_by((r for r in rows if r.status == "ok" and r.accuracy is not None), key)
    return [float(np.mean([r.accuracy for r in g])) for g in groups.values()]


def severity_curves(rows: Sequence[Row]) -> dict[str, dict[str, dict[str, list]]]:
    """Fig. 4 numbers: panel -> variant -> severity, mean, se, n over (model, corruption, batch size).

    Panel ``<dataset>`` pools the models, keeping only the methods that ran on every one of them
    (a method that is n/a on some models would otherwise be averaged over easier ones); with
    several models, panels ``<dataset> / <model>`` follow with every method. Seeds are averaged
    within a condition first, so the standard error is across conditions.
    """
    out: dict[str, dict[str, dict[str, list]]] = {}
    for dataset, drows in sorted(group_by(rows, lambda r: r.dataset).items()):
        models = sorted({r.model for r in drows})
        ok_models = {v: {r.model for r in drows if r.variant == v and r.status == "ok"} for v in variants_in(drows)}
        pooled = [r for r in drows if ok_models[r.variant] == set(models)]
        panels = [(dataset, pooled)]
        if len(models) > 1:
            panels += [(f"{dataset} / {m}", [r for r in drows if r.model == m]) for m in models]
        for name, prows in panels:
            curves = _severity_panel(prows)
            if curves:
                out[name] = curves
    return out


def _severity_panel(rows: Sequence[Row]) -> dict[str, dict[str, list]]:
    curves = {}
    for variant in variants_in(rows):
        vrows = [r for r in rows if r.variant == variant]
        curve: dict[str, list] = {"severity": [], "mean": [], "se": [], "n": []}
        for severity in sorted({r.severity for r in vrows}):
            values = _seed_means((r for r in vrows if r.severity == severity),
                                 lambda r: (r.model, r.corruption, r.batch_size))
            if values:
                for k, v in zip(("mean", "se", "n"), mean_se(values)):
                    curve[k].append(v)
                curve["severity"].append(severity)
        if curve["severity"]:
            curves[variant] = curve
    return curves


def architecture_bars(rows: Sequence[Row], severity: int = 3) -> dict[str, dict[str, dict[str, Any]]]:
    """Fig. 5 numbers: model -> variant -> mean, se, n over (corruption, batch size), or status n/a."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    chosen = [r for r in rows if r.severity == severity]
    for model in sorted({r.model for r in chosen}):
        mrows = [r for r in chosen if r.model == model]
        bars = {}
        for variant in variants_in(mrows):
            vrows = [r for r in mrows if r.variant == variant]
            values = _seed_means(vrows, lambda r: (r.corruption, r.batch_size))
            if values:
                bars[variant] = dict(zip(("mean", "se", "n"), mean_se(values)))
            elif any(r.status == "n/a" for r in vrows):
                bars[variant] = {"status": "n/a"}
        out[model] = bars
    return out


def closest_severity(rows: Sequence[Row], wanted: int = 3) -> int | None:
    """The severity with ok rows nearest to ``wanted`` (the lower on a tie), or ``None``."""
    severities = {r.severity for r in rows if r.status == "ok"}
    return min(severities, key=lambda s: (abs(s - wanted), s)) if severities else None


def plot_severity(rows: Sequence[Row], path: str | Path) -> list[Path]:
    """Fig. 4: accuracy vs severity per method (panels as in :func:`severity_curves`), SE error bars; PNG and PDF."""
    curves = severity_curves(rows)
    if not curves:
        raise ValueError("no ok rows to plot")
    fig, axes = axes_row(len(curves), (4.0 * len(curves), 3.6))
    style = styles(sorted({v for by_variant in curves.values() for v in by_variant}, key=variant_order))
    handles: dict[str, Any] = {}
    for ax, (panel, by_variant) in zip(axes, curves.items()):
        for i, (variant, c) in enumerate(by_variant.items()):
            dodge = 0.03 * (i - (len(by_variant) - 1) / 2)  # keep error bars of close methods apart
            line = ax.errorbar(np.add(c["severity"], dodge), c["mean"], yerr=c["se"], label=method_label(variant),
                               marker=style[variant].marker, ms=4, capsize=3, color=style[variant].color)
            handles.setdefault(variant, line)
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("severity")
        ax.set_xticks(sorted({s for c in by_variant.values() for s in c["severity"]}))
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
    ordered = sorted(handles, key=variant_order)
    axes[-1].legend([handles[v] for v in ordered], [method_label(v) for v in ordered], fontsize=8,
                    loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return save(fig, path, formats=("png", "pdf"), tight=True)


def plot_architectures(rows: Sequence[Row], path: str | Path, severity: int = 3) -> list[Path]:
    """Fig. 5: grouped bars, one group per model, one bar per method, SE error bars; PNG and PDF."""
    bars = architecture_bars(rows, severity)
    if not any("mean" in b for m in bars.values() for b in m.values()):
        raise ValueError(f"no ok rows at severity {severity} to plot")
    variants = sorted({v for m in bars.values() for v in m}, key=variant_order)
    style = styles(variants)
    width = 0.8 / len(variants)
    fig, (ax,) = axes_row(1, (max(5.0, 0.35 * len(bars) * len(variants) + 1.5), 3.8))
    labelled: set[str] = set()
    for i, variant in enumerate(variants):
        for g, by_variant in enumerate(bars.values()):
            bar = by_variant.get(variant)
            x = g - 0.4 + width * (i + 0.5)
            if bar is None:
                continue
            if "mean" not in bar:  # method not applicable to this model
                ax.text(x, 1, "n/a", ha="center", va="bottom", rotation=90, fontsize=7)
                continue
            label = None if variant in labelled else method_label(variant)
            labelled.add(variant)
            ax.bar(x, bar["mean"], width, yerr=bar["se"], capsize=2, color=style[variant].color,
                   hatch=style[variant].hatch, edgecolor="white", linewidth=0.0, label=label)
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels(list(bars))
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"severity {severity}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return save(fig, path, formats=("png", "pdf"), tight=True)


def finish_figure(fig: Any, axes: Sequence[Any], handles: dict[str, Any], path: str | Path) -> list[Path]:
    """One legend entry per method drawn in any panel, in the table order, beside the last panel; the
    figure saved as PNG and PDF."""
    ordered = sorted(handles, key=variant_order)
    axes[-1].legend([handles[v] for v in ordered], [method_label(v) for v in ordered], fontsize=8,
                    loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    return save(fig, path, formats=("png", "pdf"), tight=True)
