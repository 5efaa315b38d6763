"""Tables and figures of continual cells (the ``stream`` preset): accuracy against batch size, and
accuracy along the stream.

* :func:`batch_size_table` / :func:`plot_batch_sizes`: per model, each method's accuracy over the
  whole stream at each batch size (mean over seeds).
* :func:`block_table` / :func:`plot_along_stream`: per model and batch size, each method's accuracy
  on each corruption block in stream order (the table), and its moving average over the images of
  the stream (the figure, block boundaries marked).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aqr.bench.continual import along_stream, block_accuracies
from aqr.bench.grid import stream_corruptions
from aqr.bench.report.tables import (Table, _row_mean, _slug, bold_best, entry_of, flag_incomplete, group_by, has_ok,
                                     method_label, summarize, variant_order, variants_in)
from aqr.bench.results import Row
from aqr.util.plots import axes_row, save
from aqr.util.plots import colors as plot_colors

WINDOW = 100  # images in the moving average along the stream (at most a block)


def is_continual(row: Row) -> bool:
    """Whether the row is a continual cell's (one whole stream)."""
    try:
        return stream_corruptions(row.corruption) is not None
    except ValueError:
        return False


def _setting(rows: Sequence[Row]) -> str:
    ok = [r for r in rows if r.status == "ok"]
    blocks = sorted({r.detail["block_size"] for r in ok if r.detail})
    streams = sorted({r.corruption for r in ok})
    return (f"{', '.join(streams)} at severity {', '.join(map(str, sorted({r.severity for r in ok})))}, "
            f"blocks of {', '.join(map(str, blocks))} images, protocol {', '.join(sorted({r.protocol for r in ok}))}")


def batch_size_table(rows: Sequence[Row], model: str) -> Table | None:
    """Accuracy (%) over the whole stream per method and batch size, for one model."""
    chosen = [r for r in rows if r.model == model and is_continual(r)]
    if not has_ok(chosen):
        return None
    sizes = sorted({r.batch_size for r in chosen})
    cells = group_by(chosen, lambda r: (r.variant, r.batch_size))
    variants = variants_in(chosen)
    entries = flag_incomplete([[entry_of(cells.get((v, b), []), with_std=False) for b in sizes] for v in variants])
    note = f"Accuracy (%) over the whole continual stream ({_setting(chosen)}), mean over seeds."
    return Table(f"stream_{_slug(model)}_batch_sizes", f"{model}: continual stream, accuracy by batch size",
                 ("Method", *(f"bs {b}" for b in sizes)), tuple(method_label(v) for v in variants),
                 bold_best(entries), note)


def block_table(rows: Sequence[Row], model: str, batch_size: int) -> Table | None:
    """Accuracy (%) on each corruption block, in stream order, per method, for one model and batch size."""
    chosen = [r for r in rows if r.model == model and r.batch_size == batch_size and is_continual(r)]
    with_detail = [r for r in chosen if r.status == "ok" and r.detail]
    if not with_detail:
        return None
    names = list(dict.fromkeys(n for r in with_detail for n in r.detail["corruptions"]))
    variants = variants_in(chosen)
    per_block = {r.key: block_accuracies(r.detail) for r in with_detail}
    entries = []
    for v in variants:
        runs = [per_block[r.key] for r in with_detail if r.variant == v]
        row = [summarize([b[n] for b in runs if n in b], with_std=False) if any(n in b for b in runs)
               else entry_of([r for r in chosen if r.variant == v], with_std=False) for n in names]
        entries.append(row)
    entries = flag_incomplete(entries)
    for row in entries:
        row.append(_row_mean(row, [e.mean for e in row if e.mean is not None], len(names)))
    note = f"Accuracy (%) on each block of the stream, in stream order ({_setting(chosen)}), mean over seeds."
    return Table(f"stream_{_slug(model)}_bs{batch_size}_blocks",
                 f"{model}: continual stream at batch size {batch_size}, accuracy per block",
                 ("Method", *names, "mean"), tuple(method_label(v) for v in variants), bold_best(entries), note)


def stream_tables(rows: Sequence[Row]) -> list[Table]:
    """Every stream table the rows support: by batch size, then per block for each batch size."""
    continual = [r for r in rows if is_continual(r)]
    tables = []
    for model in sorted({r.model for r in continual}):
        tables.append(batch_size_table(continual, model))
        for size in sorted({r.batch_size for r in continual if r.model == model}):
            tables.append(block_table(continual, model, size))
    return [t for t in tables if t is not None]


def batch_size_curves(rows: Sequence[Row]) -> dict[str, dict[str, dict[str, list]]]:
    """model -> variant -> batch sizes and mean accuracies over seeds (ok continual rows)."""
    out: dict[str, dict[str, dict[str, list]]] = {}
    for (model, variant), group in sorted(group_by([r for r in rows if is_continual(r) and r.status == "ok"],
                                                   lambda r: (r.model, r.variant)).items()):
        by_size = group_by(group, lambda r: r.batch_size)
        sizes = sorted(by_size)
        out.setdefault(model, {})[variant] = {
            "batch_size": sizes, "accuracy": [float(np.mean([r.accuracy for r in by_size[b]])) for b in sizes]}
    return out


def plot_batch_sizes(rows: Sequence[Row], path: str | Path) -> list[Path]:
    """Accuracy over the stream against batch size (log scale), one panel per model; PNG and PDF."""
    curves = batch_size_curves(rows)
    if not curves:
        raise ValueError("no ok continual rows to plot")
    variants = sorted({v for m in curves.values() for v in m}, key=variant_order)
    colors = plot_colors(variants)
    fig, axes = axes_row(len(curves), (4.0 * len(curves), 3.6))
    handles: dict[str, Any] = {}
    for ax, (model, by_variant) in zip(axes, curves.items()):
        for variant in sorted(by_variant, key=variant_order):
            c = by_variant[variant]
            (handles[variant],) = ax.plot(c["batch_size"], c["accuracy"], marker="o", ms=4, color=colors[variant])
        ax.set_xscale("log", base=2)
        sizes = sorted({b for c in by_variant.values() for b in c["batch_size"]})
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(b) for b in sizes])
        ax.set_title(model, fontsize=10)
        ax.set_xlabel("batch size")
        ax.set_ylabel("accuracy over the stream (%)")
        ax.grid(alpha=0.3)
    _legend(axes[-1], handles)
    fig.tight_layout()
    return save(fig, path, formats=("png", "pdf"), tight=True)


def plot_along_stream(rows: Sequence[Row], path: str | Path, batch_size: int, window: int = WINDOW) -> list[Path]:
    """Accuracy along the stream (moving average over ``window`` images, one seed's rows: the first) at
    ``batch_size``, one panel per model, block boundaries marked; PNG and PDF."""
    chosen = [r for r in rows if is_continual(r) and r.status == "ok" and r.detail and r.batch_size == batch_size]
    if not chosen:
        raise ValueError(f"no ok continual rows at batch size {batch_size} to plot")
    by_model = group_by(chosen, lambda r: r.model)
    variants = sorted({r.variant for r in chosen}, key=variant_order)
    colors = plot_colors(variants)
    fig, axes = axes_row(len(by_model), (6.5 * len(by_model), 3.6))
    handles: dict[str, Any] = {}
    for ax, (model, mrows) in zip(axes, sorted(by_model.items())):
        seed = min(r.seed for r in mrows)
        for row in sorted((r for r in mrows if r.seed == seed), key=lambda r: variant_order(r.variant)):
            size = row.detail["block_size"]
            curve = along_stream(row.detail, max(1, min(window, size)))
            (handles[row.variant],) = ax.plot(np.arange(1, len(curve) + 1), curve, lw=0.9, color=colors[row.variant])
        detail = mrows[0].detail
        size, names = detail["block_size"], detail["corruptions"]
        for k in range(1, len(names)):
            ax.axvline(k * size, color="0.8", lw=0.6)
        ax.set_xticks([(k + 0.5) * size for k in range(len(names))])
        ax.set_xticklabels([n.replace("_", " ") for n in names], rotation=60, ha="right", fontsize=7)
        ax.set_title(f"{model}, batch size {batch_size} (seed {seed})", fontsize=10)
        ax.set_ylabel(f"accuracy, last {min(window, size)} images (%)")
        ax.grid(axis="y", alpha=0.3)
    _legend(axes[-1], handles)
    fig.tight_layout()
    return save(fig, path, formats=("png", "pdf"), tight=True)


def _legend(ax: Any, handles: dict[str, Any]) -> None:
    """One legend entry per method drawn in any panel, in the table order, beside the last panel."""
    ordered = sorted(handles, key=variant_order)
    ax.legend([handles[v] for v in ordered], [method_label(v) for v in ordered], fontsize=8, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))


def write_stream_figures(rows: Sequence[Row], out_dir: str | Path) -> dict[str, list[Path]]:
    """The batch-size figure and one along-the-stream figure per batch size, when the rows support them."""
    continual = [r for r in rows if is_continual(r)]
    if not has_ok(continual):
        return {}
    out = Path(out_dir)
    figures = {"stream_batch_sizes": plot_batch_sizes(continual, out / "stream_batch_sizes")}
    for size in sorted({r.batch_size for r in continual if r.status == "ok" and r.detail}):
        figures[f"stream_along_bs{size}"] = plot_along_stream(continual, out / f"stream_along_bs{size}", size)
    return figures


def stream_report(rows: Sequence[Row]) -> dict[str, Any]:
    """The JSON-able numbers of the stream figures: accuracy by batch size, and per block."""
    continual = [r for r in rows if is_continual(r) and r.status == "ok" and r.detail]
    return {"batch_sizes": batch_size_curves(rows),
            "blocks": [{"model": r.model, "variant": r.variant, "batch_size": r.batch_size, "seed": r.seed,
                        "accuracy": block_accuracies(r.detail)} for r in continual]}
