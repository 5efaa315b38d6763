"""Accuracy against the stream order (the ``stream-noniid`` preset): continual cells whose
images come in i.i.d., class-correlated (Dirichlet ``delta``) or mixed order.

* :func:`order_table`: per model and batch size, rows methods, columns the orders (``iid``, then
  ``delta`` from large to small, then mixed ones), each entry the mean over seeds.
* :func:`plot_orders`: per batch size, one panel per model, accuracy against ``delta`` on a log axis,
  one line per method; i.i.d. (``delta = inf``) sits one decade right of the largest ``delta``, and
  each mixed order is a separate marker past a dotted line (its position means nothing).

Only continual cells with an order enter (:func:`ordered_rows`); a cell of one corruption in some
order is a column of the paper's tables as before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aqr.data.streams import StreamOrder
from aqr.harness.report.figures import finish_figure
from aqr.harness.report.shared import is_continual, order_key, row_order, setting_label, slug
from aqr.harness.report.tables import (Table, bold_best, entry_of, flag_incomplete, group_by, method_label,
                                       variant_order, variants_in)
from aqr.harness.results import Row
from aqr.util.plots import axes_row, styles


def ordered_rows(rows: Sequence[Row]) -> list[Row]:
    """The continual rows that name a stream order."""
    return [r for r in rows if is_continual(r) and row_order(r) is not None]


def orders_in(rows: Sequence[Row]) -> list[str]:
    """The distinct stream orders of ``rows`` (rows without one left out), in :func:`~aqr.harness.report.shared.order_key` order."""
    return sorted({o for o in map(row_order, rows) if o is not None}, key=order_key)


def order_table(rows: Sequence[Row], model: str, batch_size: int) -> Table | None:
    """Accuracy (%) over the whole stream per method (rows) and stream order (columns), for one model and
    batch size; None without an ok row."""
    chosen = [r for r in ordered_rows(rows) if r.model == model and r.batch_size == batch_size]
    if not any(r.status == "ok" for r in chosen):
        return None
    orders = orders_in(chosen)
    cells = group_by(chosen, lambda r: (r.variant, row_order(r)))
    variants = variants_in(chosen)
    entries = flag_incomplete([[entry_of(cells.get((v, o), []), with_std=False) for o in orders] for v in variants])
    seeds = sorted({r.seed for r in chosen if r.status == "ok"})
    note = (f"Accuracy (%) over the whole continual stream in each stream order ({setting_label(chosen)}), mean over "
            f"seeds {', '.join(map(str, seeds))}. iid: uniformly random order; delta=D: class-correlated "
            "(Dirichlet concentration D, smaller D: longer runs of one class); mixed: all corruptions shuffled "
            "into one stream.")
    return Table(f"orders_{slug(model)}_bs{batch_size}",
                 f"{model}: continual stream at batch size {batch_size}, accuracy by stream order",
                 ("Method", *orders), tuple(method_label(v) for v in variants), bold_best(entries), note)


def order_tables(rows: Sequence[Row]) -> list[Table]:
    """One :func:`order_table` per model and batch size the ordered rows hold."""
    ordered = ordered_rows(rows)
    settings = sorted({(r.model, r.batch_size) for r in ordered})
    return [t for t in (order_table(ordered, m, b) for m, b in settings) if t is not None]


def order_curves(rows: Sequence[Row]) -> dict[str, dict[int, dict[str, dict[str, list]]]]:
    """model -> batch size -> variant -> the orders and mean accuracies over seeds (ok ordered rows)."""
    ok = [r for r in ordered_rows(rows) if r.status == "ok" and r.accuracy is not None]
    out: dict[str, dict[int, dict[str, dict[str, list]]]] = {}
    for (model, size, variant), group in sorted(group_by(ok, lambda r: (r.model, r.batch_size, r.variant)).items()):
        by_order = group_by(group, row_order)
        orders = sorted(by_order, key=order_key)
        out.setdefault(model, {}).setdefault(size, {})[variant] = {
            "order": orders, "accuracy": [float(np.mean([r.accuracy for r in by_order[o]])) for o in orders]}
    return out


def order_positions(orders: Sequence[str]) -> dict[str, float]:
    """Where each order sits on the figure's log x axis: a finite ``delta`` at its value, i.i.d. one decade
    right of the largest finite one, then each mixed order a further decade right."""
    parsed = {o: StreamOrder.parse(o) for o in orders}
    finite = [p.delta for p in parsed.values() if not p.mixed and not p.iid]
    iid_x = 10.0 ** (math.floor(math.log10(max(finite))) + 1) if finite else 1.0
    positions = {o: p.delta for o, p in parsed.items() if not p.mixed and not p.iid}
    positions.update({o: iid_x for o, p in parsed.items() if not p.mixed and p.iid})
    mixed = sorted((o for o, p in parsed.items() if p.mixed), key=order_key)
    positions.update({o: iid_x * 10.0 ** (k + 1) for k, o in enumerate(mixed)})
    return positions


def plot_orders(rows: Sequence[Row], path: str | Path, batch_size: int) -> list[Path]:
    """Accuracy against the stream order at ``batch_size``, one panel per model, one line per method (see the
    module docs); PNG and PDF."""
    curves = {m: by_size[batch_size] for m, by_size in order_curves(rows).items() if batch_size in by_size}
    if not curves:
        raise ValueError(f"no ok continual rows with a stream order at batch size {batch_size} to plot")
    variants = sorted({v for c in curves.values() for v in c}, key=variant_order)
    style = styles(variants)
    fig, axes = axes_row(len(curves), (4.2 * len(curves), 3.6))
    handles: dict[str, Any] = {}
    for ax, (model, by_variant) in zip(axes, sorted(curves.items())):
        orders = sorted({o for c in by_variant.values() for o in c["order"]}, key=order_key)
        x = order_positions(orders)
        for variant in sorted(by_variant, key=variant_order):
            c = by_variant[variant]
            line = [(x[o], a) for o, a in zip(c["order"], c["accuracy"]) if not StreamOrder.parse(o).mixed]
            apart = [(x[o], a) for o, a in zip(c["order"], c["accuracy"]) if StreamOrder.parse(o).mixed]
            if line:
                (handles[variant],) = ax.plot(*zip(*line), marker=style[variant].marker, ms=4, color=style[variant].color)
            if apart:
                (marker,) = ax.plot(*zip(*apart), marker=style[variant].marker, ms=6, ls="none", mfc="none",
                                    color=style[variant].color)
                handles.setdefault(variant, marker)
        mixed = [o for o in orders if StreamOrder.parse(o).mixed]
        if mixed and len(mixed) < len(orders):
            ax.axvline(np.sqrt(x[mixed[0]] * max(x[o] for o in orders if o not in mixed)), color="0.6", ls=":", lw=0.8)
        ax.set_xscale("log")
        ax.set_xticks([x[o] for o in orders])
        ax.set_xticklabels([_tick(o) for o in orders], fontsize=8)
        ax.minorticks_off()
        ax.set_xlim(min(x.values()) / 3, max(x.values()) * 3)
        ax.set_title(f"{model}, batch size {batch_size}", fontsize=10)
        ax.set_xlabel("stream order (Dirichlet delta, log scale)")
        ax.set_ylabel("accuracy over the stream (%)")
        ax.grid(alpha=0.3)
    return finish_figure(fig, axes, handles, path)


def _tick(order: str) -> str:
    parsed = StreamOrder.parse(order)
    if parsed.mixed:
        return order
    return "iid\n(inf)" if parsed.iid else f"{parsed.delta:g}"


def write_order_figures(rows: Sequence[Row], out_dir: str | Path) -> dict[str, list[Path]]:
    """One :func:`plot_orders` figure per batch size the ordered rows hold (``stream_orders_bs<b>``)."""
    ok = [r for r in ordered_rows(rows) if r.status == "ok"]
    out = Path(out_dir)
    return {f"stream_orders_bs{b}": plot_orders(ok, out / f"stream_orders_bs{b}", b)
            for b in sorted({r.batch_size for r in ok})}
