"""Tables and figures of the realtime protocol beside the offline results (the ``field`` preset).

* :func:`setting_tables`: per setting (continual, correlated, mixed_domains, ...), each method's accuracy
  over the whole stream per model and batch size: offline (online protocol) and realtime, with the
  method's cost ``C`` and the share of batches it adapted on.
* :func:`plot_costs`: per model, accuracy against each method's relative cost ``C`` (log scale), offline
  (filled) and realtime (hollow), one panel per setting.

They cover the continual cells of databases that hold realtime rows; the other stream tables
(:mod:`aqr.harness.report.stream_tables`) leave realtime rows out, so no table pools the two protocols.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from aqr.data.streams import StreamOrder
from aqr.harness.cells import REALTIME, is_gradual
from aqr.harness.report.figures import finish_figure
from aqr.harness.report.shared import is_continual, row_order, slug
from aqr.harness.report.tables import (Entry, Table, bold_best, entry_of, flag_incomplete, method_label, variant_order,
                                       variants_in)
from aqr.harness.results import Row
from aqr.util.plots import axes_row, require_matplotlib, styles

SETTING_ORDER = ("continual", "correlated", "mixed_domains", "mixed_domains_correlated", "gradual",
                 "gradual_correlated")


def row_setting(row: Row) -> str:
    """The setting of a continual row, by the names of :mod:`aqr.harness.settings` (a correlated one with its delta)."""
    order = row_order(row)
    parsed = StreamOrder.parse(order) if order is not None else None
    correlated = f" (delta={parsed.delta:g})" if parsed is not None and not parsed.iid else ""
    if parsed is not None and parsed.mixed:
        return f"mixed_domains_correlated{correlated}" if correlated else "mixed_domains"
    if is_gradual(row.corruption):
        return f"gradual_correlated{correlated}" if correlated else "gradual"
    return f"correlated{correlated}" if correlated else "continual"


def _setting_rank(setting: str) -> tuple[int, str]:
    base = setting.split(" ")[0]
    return (SETTING_ORDER.index(base) if base in SETTING_ORDER else len(SETTING_ORDER), setting)


def field_rows(rows: Sequence[Row]) -> list[Row]:
    """The continual rows of a database with realtime rows (else none: the stream tables cover them)."""
    continual = [r for r in rows if is_continual(r)]
    return continual if any(r.protocol == REALTIME for r in continual) else []


def method_costs(rows: Sequence[Row]) -> dict[tuple[str, str, int], float]:
    """``(model, variant, batch size)`` -> the cost ``C`` its realtime rows were run with."""
    return {(r.model, r.variant, r.batch_size): float(r.config["cost"]) for r in rows
            if r.protocol == REALTIME and r.config.get("cost") is not None}


def _adapted_share(rows: Sequence[Row]) -> str:
    done = [r.detail for r in rows if r.status == "ok" and r.detail and r.detail.get("batches")]
    if not done:
        return ""
    return f"{100.0 * sum(d['adapted_batches'] for d in done) / sum(d['batches'] for d in done):.0f}%"


def unwindowed(variant: str) -> str:
    """``variant`` without its ``window=N`` option (``tent[window=64]`` -> ``tent``): a batch-1 cell's method run
    through the reference's sliding window (:attr:`aqr.methods.ProtocolConfig.window`) is the same method,
    shown in its row under the batch-1 column."""
    method = variant.partition("[")[0]
    kept = [part for part in _options(variant) if not part.startswith("window=")]
    return f"{method}[{','.join(kept)}]" if kept else method


def _options(variant: str) -> list[str]:
    """The ``key=value`` options of a variant label (``tent[lr=0.1,window=64]`` -> ``["lr=0.1", "window=64"]``)."""
    rest = variant.partition("[")[2]
    return rest.rstrip("]").split(",") if rest else []


def setting_tables(rows: Sequence[Row]) -> list[Table]:
    """One table per setting: per (model, batch size) the offline accuracy, then, where the setting ran under
    the realtime protocol, the realtime accuracy, ``C`` and the share of batches adapted on. A method run
    through a sliding window at batch 1 (``window=N``) is shown in its own row, under the batch-1 column."""
    continual = field_rows(rows)
    windows = sorted({part for r in continual for part in _options(r.variant) if part.startswith("window=")})
    chosen = [replace(r, variant=unwindowed(r.variant)) for r in continual]
    costs = method_costs(chosen)
    tables = []
    for setting in sorted({row_setting(r) for r in chosen}, key=_setting_rank):
        here = [r for r in chosen if row_setting(r) == setting]
        runs = sorted({(r.model, r.batch_size) for r in here})
        header: list[str] = ["Method"]
        columns: list[tuple[str, str, int]] = []
        for model, size in runs:
            header.append(f"{model} bs {size}")
            columns.append(("offline", model, size))
            if any(r.protocol == REALTIME and r.model == model and r.batch_size == size for r in here):
                header += ["realtime", "C", "adapted"]
                columns += [("realtime", model, size), ("C", model, size), ("adapted", model, size)]
        variants = variants_in(here)
        entries: list[list[Entry]] = []
        for v in variants:
            row: list[Entry] = []
            for kind, model, size in columns:
                picked = [r for r in here if r.variant == v and r.model == model and r.batch_size == size]
                realtime = [r for r in picked if r.protocol == REALTIME]
                if kind == "offline":
                    row.append(entry_of([r for r in picked if r.protocol != REALTIME], with_std=False))
                elif kind == "realtime":
                    row.append(entry_of(realtime, with_std=False))
                elif kind == "C":
                    cost = costs.get((model, v, size))
                    row.append(Entry("" if cost is None else f"{cost:.2f}", None, None, 0))
                else:
                    row.append(Entry(_adapted_share(realtime), None, None, 0))
            entries.append(row)
        note = ("Accuracy (%) over the whole stream (15 corruptions at severity 5, online, no reset). Offline: every "
                "batch adapted on; realtime: the stream runs at the plain model's speed, a method of cost C adapts on "
                "the batches it has time for and predicts the others with its last adapted state (C: the method's "
                "time per batch over the plain forward's, measured by a timing round; adapted: share of batches "
                "adapted on).")
        if windows and any(r.batch_size == 1 for r in here):
            note += (" At batch 1 a method that adapts on a batch keeps a sliding window of the last images ("
                     + ", ".join(windows) + ", the reference's batch-1 form): it adapts on the window once it has "
                     "filled anew and scores each image from a forward of the window.")
        tables.append(Table(f"field_{slug(setting)}", f"{setting}: offline and realtime accuracy",
                            tuple(header), tuple(method_label(v) for v in variants),
                            bold_best(flag_incomplete(entries)), note))
    return tables


def cost_points(rows: Sequence[Row]) -> dict[str, dict[str, dict[str, dict[str, list]]]]:
    """model -> setting -> ``"offline"``/``"realtime"`` -> ``{"variant": [...], "cost": [...], "accuracy": [...]}``
    at the model's largest batch size, for methods with a measured cost."""
    chosen = [r for r in field_rows(rows) if r.status == "ok" and r.accuracy is not None]
    costs = method_costs(chosen)
    points: dict[str, dict[str, dict[str, dict[str, list]]]] = {}
    for model in sorted({r.model for r in chosen}):
        size = max(r.batch_size for r in chosen if r.model == model)
        for r in chosen:
            cost = costs.get((model, r.variant, size))
            if r.model != model or r.batch_size != size or cost is None:
                continue
            kind = "realtime" if r.protocol == REALTIME else "offline"
            series = points.setdefault(model, {}).setdefault(row_setting(r), {}).setdefault(
                kind, {"variant": [], "cost": [], "accuracy": []})
            series["variant"].append(r.variant)
            series["cost"].append(cost)
            series["accuracy"].append(r.accuracy)
    return points


def _cost_axis(ax: Any) -> None:
    """A log x axis of costs labelled in plain numbers (1, 2, 5, 10, ...), without crowded minor labels."""
    require_matplotlib()
    from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator([1, 2, 5, 10, 20, 50, 100]))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot_costs(rows: Sequence[Row], out_dir: str | Path) -> dict[str, list[Path]]:
    """Per model, accuracy against relative cost ``C``: one panel per setting, offline filled, realtime hollow."""
    require_matplotlib("the cost figures")
    from matplotlib.lines import Line2D

    figures: dict[str, list[Path]] = {}
    for model, settings in cost_points(rows).items():
        names = sorted(settings, key=_setting_rank)
        fig, axes = axes_row(len(names), (4.2 * len(names), 3.6))
        variants = sorted({v for s in settings.values() for series in s.values() for v in series["variant"]},
                          key=variant_order)
        style = styles(variants)
        handles: dict[str, Any] = {}
        for ax, setting in zip(axes, names):
            for kind, series in settings[setting].items():
                for v, c, a in zip(series["variant"], series["cost"], series["accuracy"]):
                    face = style[v].color if kind == "offline" else "none"
                    ax.scatter([c], [a], s=36, marker=style[v].marker, facecolors=face, edgecolors=style[v].color,
                               linewidths=1.4)
                    # the legend shows each method's colour filled, whichever protocol was drawn last
                    handles[v] = Line2D([], [], marker=style[v].marker, linestyle="", color=style[v].color,
                                        label=method_label(v))
            _cost_axis(ax)
            ax.set_title(setting, fontsize=9)
            ax.set_xlabel("relative cost C (log)")
            ax.set_ylabel("accuracy (%)")
            ax.grid(alpha=0.3)
        fig.suptitle(f"{model}: accuracy against cost (filled: offline, hollow: realtime)", fontsize=10)
        name = f"field_cost_{slug(model)}"
        figures[name] = finish_figure(fig, axes, handles, Path(out_dir) / name)
    return figures
