"""Tables and figures of continual cells (the ``stream`` preset): accuracy against batch size, and
accuracy along the stream.

* :func:`batch_size_table` / :func:`plot_batch_sizes`: per model, each method's accuracy over the
  whole stream at each batch size (mean over seeds).
* :func:`block_table` / :func:`plot_along_stream`: per model and batch size, each method's accuracy
  on each corruption block in stream order (the table), and its moving average over the images of
  the stream (the figure, block boundaries marked).

Rows of different stream orders (``Cell.order``, e.g. the ``stream-noniid`` preset's) are never pooled:
each order has its own tables and figures, named with the order appended (none for rows without an
order). A mixed order has no blocks in stream order, so it has no block table nor along-the-stream
figure; :mod:`aqr.harness.report.orders` compares the orders.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aqr.data.streams import StreamOrder
from aqr.harness.continual import along_stream, block_accuracies
from aqr.harness.report.figures import finish_figure
from aqr.harness.report.orders import order_curves, order_tables, write_order_figures
from aqr.harness.report.shared import is_continual, order_key, row_order, setting_label, slug
from aqr.harness.report.tables import (Table, bold_best, entry_of, flag_incomplete, group_by, has_ok, method_label,
                                       row_mean, summarize, variant_order, variants_in)
from aqr.harness.results import Row
from aqr.util.plots import axes_row, styles

WINDOW = 100  # images in the moving average along the stream (at most a block)


def _mixed(order: str | None) -> bool:
    return order is not None and StreamOrder.parse(order).mixed


def _orders(rows: Sequence[Row]) -> list[str | None]:
    """The stream orders of ``rows``: ``None`` first, then as the order tables list them."""
    found = {row_order(r) for r in rows}
    return ([None] if None in found else []) + sorted((o for o in found if o is not None), key=order_key)


def _named(stem: str, order: str | None) -> str:
    """A table's or figure's name for the rows of one stream order (unchanged for rows without one)."""
    return stem if order is None else f"{stem}_{slug(order)}"


def _titled(title: str, order: str | None) -> str:
    return title if order is None else f"{title}, order {order}"


def _order_field(row: Row) -> dict[str, str]:
    """``{"order": ...}`` for a row with a stream order, else nothing (the JSON of unordered rows is unchanged)."""
    order = row_order(row)
    return {} if order is None else {"order": order}


def batch_size_table(rows: Sequence[Row], model: str, order: str | None = None) -> Table | None:
    """Accuracy (%) over the whole stream per method and batch size, for one model and stream order."""
    chosen = [r for r in rows if r.model == model and is_continual(r) and row_order(r) == order]
    if not has_ok(chosen):
        return None
    sizes = sorted({r.batch_size for r in chosen})
    cells = group_by(chosen, lambda r: (r.variant, r.batch_size))
    variants = variants_in(chosen)
    entries = flag_incomplete([[entry_of(cells.get((v, b), []), with_std=False) for b in sizes] for v in variants])
    note = f"Accuracy (%) over the whole continual stream ({setting_label(chosen)}), mean over seeds."
    return Table(_named(f"stream_{slug(model)}_batch_sizes", order),
                 _titled(f"{model}: continual stream, accuracy by batch size", order),
                 ("Method", *(f"bs {b}" for b in sizes)), tuple(method_label(v) for v in variants),
                 bold_best(entries), note)


def block_table(rows: Sequence[Row], model: str, batch_size: int, order: str | None = None) -> Table | None:
    """Accuracy (%) on each corruption block, in stream order, per method, for one model, batch size and
    stream order; None for a mixed order (its blocks are shuffled together)."""
    if _mixed(order):
        return None
    chosen = [r for r in rows if r.model == model and r.batch_size == batch_size and is_continual(r)
              and row_order(r) == order]
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
        row.append(row_mean(row, [e.mean for e in row if e.mean is not None], len(names)))
    note = f"Accuracy (%) on each block of the stream, in stream order ({setting_label(chosen)}), mean over seeds."
    return Table(_named(f"stream_{slug(model)}_bs{batch_size}_blocks", order),
                 _titled(f"{model}: continual stream at batch size {batch_size}, accuracy per block", order),
                 ("Method", *names, "mean"), tuple(method_label(v) for v in variants), bold_best(entries), note)


def offline_continual(rows: Sequence[Row]) -> list[Row]:
    """The continual rows but the realtime protocol's (which :mod:`aqr.harness.report.field_tables` reports)."""
    return [r for r in rows if is_continual(r) and r.protocol != "realtime"]


def stream_tables(rows: Sequence[Row]) -> list[Table]:
    """Every stream table the rows support: per stream order, by batch size, then per block for each batch
    size; then the stream orders compared (:func:`aqr.harness.report.orders.order_tables`). Realtime rows
    are left out (see :func:`offline_continual`)."""
    continual = offline_continual(rows)
    tables = []
    for order in _orders(continual):
        for model in sorted({r.model for r in continual}):
            tables.append(batch_size_table(continual, model, order))
            for size in sorted({r.batch_size for r in continual if r.model == model}):
                tables.append(block_table(continual, model, size, order))
    return [t for t in tables if t is not None] + order_tables(continual)


def batch_size_curves(rows: Sequence[Row], order: str | None = None) -> dict[str, dict[str, dict[str, list]]]:
    """model -> variant -> batch sizes and mean accuracies over seeds (ok continual rows of one stream order)."""
    out: dict[str, dict[str, dict[str, list]]] = {}
    ok = [r for r in rows if is_continual(r) and r.status == "ok" and row_order(r) == order]
    for (model, variant), group in sorted(group_by(ok, lambda r: (r.model, r.variant)).items()):
        by_size = group_by(group, lambda r: r.batch_size)
        sizes = sorted(by_size)
        out.setdefault(model, {})[variant] = {
            "batch_size": sizes, "accuracy": [float(np.mean([r.accuracy for r in by_size[b]])) for b in sizes]}
    return out


def plot_batch_sizes(rows: Sequence[Row], path: str | Path, order: str | None = None) -> list[Path]:
    """Accuracy over the stream against batch size (log scale), one panel per model, for one stream order;
    PNG and PDF."""
    curves = batch_size_curves(rows, order)
    if not curves:
        raise ValueError("no ok continual rows to plot")
    variants = sorted({v for m in curves.values() for v in m}, key=variant_order)
    style = styles(variants)
    fig, axes = axes_row(len(curves), (4.0 * len(curves), 3.6))
    handles: dict[str, Any] = {}
    for ax, (model, by_variant) in zip(axes, curves.items()):
        for variant in sorted(by_variant, key=variant_order):
            c = by_variant[variant]
            (handles[variant],) = ax.plot(c["batch_size"], c["accuracy"], marker=style[variant].marker, ms=4,
                                          color=style[variant].color)
        ax.set_xscale("log", base=2)
        sizes = sorted({b for c in by_variant.values() for b in c["batch_size"]})
        ax.set_xticks(sizes)
        ax.set_xticklabels([str(b) for b in sizes])
        ax.set_title(_titled(model, order), fontsize=10)
        ax.set_xlabel("batch size")
        ax.set_ylabel("accuracy over the stream (%)")
        ax.grid(alpha=0.3)
    return finish_figure(fig, axes, handles, path)


def plot_along_stream(rows: Sequence[Row], path: str | Path, batch_size: int, window: int = WINDOW,
                      order: str | None = None) -> list[Path]:
    """Accuracy along the stream (moving average over ``window`` images, one seed's rows: the first) at
    ``batch_size`` in one (unmixed) stream order, one panel per model, block boundaries marked; PNG and PDF."""
    if _mixed(order):
        raise ValueError(f"stream order {order!r} mixes the blocks: there is no block boundary to mark")
    chosen = [r for r in rows if is_continual(r) and r.status == "ok" and r.detail and r.batch_size == batch_size
              and row_order(r) == order]
    if not chosen:
        raise ValueError(f"no ok continual rows at batch size {batch_size} to plot")
    by_model = group_by(chosen, lambda r: r.model)
    variants = sorted({r.variant for r in chosen}, key=variant_order)
    style = styles(variants)
    fig, axes = axes_row(len(by_model), (6.5 * len(by_model), 3.6))
    handles: dict[str, Any] = {}
    for ax, (model, mrows) in zip(axes, sorted(by_model.items())):
        seed = min(r.seed for r in mrows)
        for row in sorted((r for r in mrows if r.seed == seed), key=lambda r: variant_order(r.variant)):
            size = row.detail["block_size"]
            curve = along_stream(row.detail, max(1, min(window, size)))
            s = style[row.variant]
            (handles[row.variant],) = ax.plot(np.arange(1, len(curve) + 1), curve, lw=0.9, color=s.color, marker=s.marker,
                                              ms=4, markevery=max(1, len(curve) // 12))
        detail = mrows[0].detail
        size, names = detail["block_size"], detail["corruptions"]
        for k in range(1, len(names)):
            ax.axvline(k * size, color="0.8", lw=0.6)
        ax.set_xticks([(k + 0.5) * size for k in range(len(names))])
        ax.set_xticklabels([n.replace("_", " ") for n in names], rotation=60, ha="right", fontsize=7)
        ax.set_title(_titled(f"{model}, batch size {batch_size} (seed {seed})", order), fontsize=10)
        ax.set_ylabel(f"accuracy, last {min(window, size)} images (%)")
        ax.grid(axis="y", alpha=0.3)
    return finish_figure(fig, axes, handles, path)


def write_stream_figures(rows: Sequence[Row], out_dir: str | Path) -> dict[str, list[Path]]:
    """Per stream order, the batch-size figure and one along-the-stream figure per batch size (none for a
    mixed order), when the rows support them; then the orders compared, one figure per batch size."""
    continual = offline_continual(rows)
    out = Path(out_dir)
    figures: dict[str, list[Path]] = {}
    for order in _orders(continual):
        ok = [r for r in continual if r.status == "ok" and row_order(r) == order]
        if not ok:
            continue
        name = _named("stream_batch_sizes", order)
        figures[name] = plot_batch_sizes(ok, out / name, order)
        for size in sorted({r.batch_size for r in ok if r.detail}) if not _mixed(order) else ():
            name = _named(f"stream_along_bs{size}", order)
            figures[name] = plot_along_stream(ok, out / name, size, order=order)
    figures.update(write_order_figures(continual, out))
    return figures


def stream_report(rows: Sequence[Row]) -> dict[str, Any]:
    """The JSON-able numbers of the stream figures: accuracy by batch size (rows without a stream order; those
    of each order under ``batch_sizes_by_order``), per block (unmixed orders) and by stream order."""
    rows = offline_continual(rows)
    continual = [r for r in rows if r.status == "ok" and r.detail and not _mixed(row_order(r))]
    orders = [o for o in _orders(rows) if o is not None]
    report: dict[str, Any] = {
        "batch_sizes": batch_size_curves(rows),
        "blocks": [{"model": r.model, "variant": r.variant, "batch_size": r.batch_size, "seed": r.seed,
                    "accuracy": block_accuracies(r.detail), **_order_field(r)} for r in continual]}
    if orders:
        report["batch_sizes_by_order"] = {o: batch_size_curves(rows, o) for o in orders}
        report["orders"] = order_curves(rows)
    return report
