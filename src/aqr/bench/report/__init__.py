"""The paper's tables and figures, computed from the results database (``aqr report``).

Tables (one neutral :class:`Table`, rendered as Markdown, LaTeX or CSV):

* :func:`per_corruption_table` -- paper Table 1: rows = methods, columns = corruptions + mean, for one
  model at one severity and batch size; each entry is the mean over seeds.
* :func:`summary_table` -- paper Tables 4-6: rows = methods, columns = batch size x severity, entries
  "mean ± std" over corruptions and seeds, for one model or all models pooled.
* :func:`ablation_tables` -- paper Tables 2-3: rows = the variants of one method that differ in one
  option set (``aqr[tail=...]``, ``aqr[K=...]``), columns = batch size, entries over corruptions,
  seeds and severities.

Figures (matplotlib's Agg canvas, no pyplot; PNG and PDF): :func:`plot_severity` (Fig. 4),
:func:`plot_architectures` (Fig. 5) and :func:`plot_tail_deviation` (Fig. 3, from
:func:`percentile_deviations`).

Numbers: only rows with status ``'ok'`` enter a mean; a cell whose rows are all ``'n/a'`` shows
``n/a`` (``error`` when all failed). An entry over fewer values than the fullest of its column (a
failed or missing cell, or a method n/a for some pooled models) says "(k of N)" and cannot be bold.
Standard deviations are sample ones (``ddof=1``) and standard
errors are ``std / sqrt(n)``. Bold marks every entry of a column whose *displayed* (rounded) value
equals the column's best, so displayed ties are all bold, as in the paper.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from aqr.data.corruption_params import CORRUPTIONS
from aqr.bench.results import ResultsDB, Row

BASE_METHODS = ("source", "ttn", "tent", "sar", "aqr")
METHOD_LABELS = {"source": "Source (NA)", "ttn": "TTN", "tent": "TENT", "sar": "SAR", "aqr": "AQR"}
FORMATS = ("md", "latex", "csv")
TAIL_LEVELS = (0, 1, 5, 25, 50, 75, 95, 99, 100)
DIGITS = 1  # decimals shown in tables (the JSON and CSV keep full precision)


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------


def load_rows(db_path: str | Path, experiment: str | None = None, latest: bool = True) -> list[Row]:
    """Every row of the database (or of one experiment), the newest per condition when ``latest``.

    Raises ``FileNotFoundError`` for a missing file (instead of creating an empty database),
    :class:`aqr.bench.results.ResultsDBError` for a file that is not a results database and ``KeyError``
    for an unknown experiment.
    """
    path = Path(db_path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: results database not found (run `aqr bench --db {path}` first)")
    with ResultsDB(path) as db:
        if experiment is not None and experiment not in db.experiments():
            known = ", ".join(db.experiments()) or "none"
            raise KeyError(f"{path} has no experiment {experiment!r} (experiments: {known})")
        rows = db.rows(experiment)
    return latest_rows(rows) if latest else rows


def condition(row: Row) -> tuple:
    """What a row measures, without its code version or file hashes (which are in its key)."""
    return (row.model, row.variant, row.dataset, row.protocol, row.corruption, row.severity,
            row.batch_size, row.seed)


def latest_rows(rows: Iterable[Row]) -> list[Row]:
    """One row per :func:`condition`: the newest, so reruns under a new code version replace old rows."""
    newest: dict[tuple, Row] = {}
    for row in rows:
        kept = newest.get(condition(row))
        if kept is None or row.created >= kept.created:
            newest[condition(row)] = row
    return sorted(newest.values(), key=lambda r: r.created)


# ---------------------------------------------------------------------------------------------
# the neutral table
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One table cell: the numbers behind it and its displayed text (without bold marks)."""

    text: str  # "77.3", "77.3 ± 2.0", "n/a", "error" or "" (no row)
    mean: float | None = None
    std: float | None = None  # sample std of the values the mean is over (None for one value)
    n: int = 0  # how many values the mean is over
    bold: bool = False
    rankable: bool = True  # False for means over incomplete data, which must not win a column


@dataclass(frozen=True)
class Table:
    """A rendered-format-neutral table: a header, labelled rows of entries and a note."""

    name: str  # file stem
    title: str
    header: tuple[str, ...]  # header[0] heads the label column
    labels: tuple[str, ...]
    entries: tuple[tuple[Entry, ...], ...]
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form: every entry's text, mean, std, n and bold flag."""
        return {
            "name": self.name, "title": self.title, "header": list(self.header), "note": self.note,
            "rows": [{"label": label, "cells": [_entry_dict(e) for e in row]}
                     for label, row in zip(self.labels, self.entries)],
        }


def _entry_dict(e: Entry) -> dict[str, Any]:
    return {"text": e.text, "mean": e.mean, "std": e.std, "n": e.n, "bold": e.bold}


def summarize(values: Sequence[float], with_std: bool) -> Entry:
    """An entry for ``values``: their mean, sample std and count; text "m" or "m ± s"."""
    arr = np.asarray(values, dtype=float)
    mean = float(arr.mean())
    std = float(arr.std(ddof=1)) if arr.size > 1 else None
    text = f"{mean:.{DIGITS}f}"
    if with_std and std is not None:
        text += f" ± {std:.{DIGITS}f}"
    return Entry(text, mean, std, int(arr.size))


def entry_of(rows: Sequence[Row], with_std: bool) -> Entry:
    """The entry for a table cell's rows: the ok accuracies, else "n/a", "error" or empty."""
    ok = [r.accuracy for r in rows if r.status == "ok" and r.accuracy is not None]
    if ok:
        return summarize(ok, with_std)
    statuses = {r.status for r in rows}
    if "n/a" in statuses:
        return Entry("n/a")
    return Entry("error") if "error" in statuses else Entry("")


def flag_incomplete(entries: Sequence[Sequence[Entry]]) -> list[list[Entry]]:
    """Per column, suffix "(k of N)" to entries over fewer values than the column's fullest; they cannot be bold.

    Methods compared over different corruptions or seeds (a failed or missing cell) are not comparable.
    """
    grid = [list(row) for row in entries]
    for j in range(len(grid[0]) if grid else 0):
        full = max((row[j].n for row in grid), default=0)
        for row in grid:
            e = row[j]
            if e.mean is not None and e.n < full:
                row[j] = replace(e, text=f"{e.text} ({e.n} of {full})", rankable=False)
    return grid


def bold_best(entries: Sequence[Sequence[Entry]]) -> tuple[tuple[Entry, ...], ...]:
    """Mark, per column, every rankable entry whose rounded mean equals the column's best."""
    grid = [list(row) for row in entries]
    for j in range(len(grid[0]) if grid else 0):
        shown = {i: round(row[j].mean, DIGITS) for i, row in enumerate(grid)
                 if row[j].mean is not None and row[j].rankable}
        if not shown:
            continue
        best = max(shown.values())
        for i, value in shown.items():
            if value == best:
                grid[i][j] = replace(grid[i][j], bold=True)
    return tuple(tuple(row) for row in grid)


# ---------------------------------------------------------------------------------------------
# ordering and labels
# ---------------------------------------------------------------------------------------------


def _natural(text: str) -> list:
    """Sort key that orders digits numerically (``K=11`` before ``K=101``)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def variant_order(variant: str) -> tuple:
    """Source, TTN, TENT, SAR, AQR first (the paper's order), then every other variant sorted."""
    if variant in BASE_METHODS:
        return (0, BASE_METHODS.index(variant), [])
    return (1, 0, _natural(variant))


def method_label(variant: str) -> str:
    """``source`` -> ``Source (NA)``, ``aqr[tail=clip]`` -> ``AQR[tail=clip]``."""
    method, bracket, rest = variant.partition("[")
    if not bracket:
        return METHOD_LABELS.get(method, method)
    return f"{METHOD_LABELS.get(method, method).split(' ')[0]}[{rest}"


def corruption_order(names: Iterable[str]) -> list[str]:
    """Corruptions in the benchmark's order; unknown names after, sorted."""
    names = set(names)
    known = [c for c in CORRUPTIONS if c in names]
    return known + sorted(names - set(known))


def _variants(rows: Iterable[Row]) -> list[str]:
    return sorted({r.variant for r in rows}, key=variant_order)


def _has_ok(rows: Iterable[Row]) -> bool:
    return any(r.status == "ok" for r in rows)


def _group(rows: Iterable[Row], key: Callable[[Row], Any]) -> dict[Any, list[Row]]:
    groups: dict[Any, list[Row]] = defaultdict(list)
    for row in rows:
        groups[key(row)].append(row)
    return groups


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


# ---------------------------------------------------------------------------------------------
# the tables
# ---------------------------------------------------------------------------------------------


def per_corruption_table(rows: Sequence[Row], model: str, severity: int, batch_size: int) -> Table | None:
    """Paper Table 1: accuracy per method and corruption (mean over seeds) plus their mean; None if no data.

    A row's "mean" is over its corruption means; when it lacks some corruption the text says how
    many it covers and it cannot be bold.
    """
    chosen = [r for r in rows if r.model == model and r.severity == severity and r.batch_size == batch_size]
    if not _has_ok(chosen):
        return None
    corruptions = corruption_order(r.corruption for r in chosen)
    cells = _group(chosen, lambda r: (r.variant, r.corruption))
    variants = _variants(chosen)
    entries = flag_incomplete([[entry_of(cells.get((v, c), []), with_std=False) for c in corruptions]
                               for v in variants])
    for row in entries:
        row.append(_row_mean(row, [e.mean for e in row if e.mean is not None], len(corruptions)))
    seeds = sorted({r.seed for r in chosen if r.status == "ok"})
    errors = [e.std / math.sqrt(e.n) for row in entries for e in row[:-1] if e.std is not None]
    note = f"Accuracy (%), mean over seeds {', '.join(map(str, seeds))}; " + (
        f"largest standard error over seeds: {max(errors):.2f}." if errors else "one seed per entry, no standard error.")
    return Table(f"per_corruption_{_slug(model)}_sev{severity}_bs{batch_size}",
                 f"{model}: accuracy per corruption, severity {severity}, batch size {batch_size}",
                 ("Method", *corruptions, "mean"), tuple(method_label(v) for v in variants),
                 bold_best(entries), note)


def _row_mean(row: Sequence[Entry], means: Sequence[float], total: int) -> Entry:
    if not means:
        texts = {e.text for e in row}
        return Entry("n/a" if "n/a" in texts else ("error" if "error" in texts else ""))
    entry = summarize(means, with_std=False)
    if len(means) < total:
        return replace(entry, text=f"{entry.text} ({len(means)} of {total})", rankable=False)
    return entry


def summary_table(rows: Sequence[Row], model: str | None = None) -> Table | None:
    """Paper Tables 4-6: per method, "mean ± std" over corruptions and seeds per (batch size, severity).

    ``model=None`` pools every model; a method that is n/a for some models is then averaged over the
    models it applies to (the note says so). None when there is no ok row.
    """
    chosen = [r for r in rows if model is None or r.model == model]
    if not _has_ok(chosen):
        return None
    columns = sorted({(r.batch_size, r.severity) for r in chosen})
    cells = _group(chosen, lambda r: (r.variant, r.batch_size, r.severity))
    variants = _variants(chosen)
    entries = flag_incomplete([[entry_of(cells.get((v, b, s), []), with_std=True) for b, s in columns]
                               for v in variants])
    scope = model if model is not None else "all models pooled"
    note = "Accuracy (%), mean ± std across corruptions and seeds"
    if model is None:
        note += (" (and models: " + ", ".join(sorted({r.model for r in chosen}))
                 + "; a method n/a for a model is averaged over the others)")
    return Table(f"summary_{_slug(model) if model else 'all'}", f"Summary: {scope}",
                 ("Method", *(f"bs {b}, sev {s}" for b, s in columns)), tuple(method_label(v) for v in variants),
                 bold_best(entries), note + ".")


def _option_keys(variant: str) -> tuple[str, ...]:
    _, _, rest = variant.partition("[")
    return tuple(sorted(part.split("=")[0] for part in rest.rstrip("]").split(",") if part))


def ablation_tables(rows: Sequence[Row], model: str) -> list[Table]:
    """Paper Tables 2-3: variants of one method sharing an option name, per batch size, over severities.

    One table per (method, first option name) with at least two variants, e.g. all
    ``aqr[tail=...]``, including ones that set a further option (``aqr[tail=average,tail_unit=values]``).
    Entries pool corruptions, seeds and severities (listed in the note).
    """
    chosen = [r for r in rows if r.model == model and "[" in r.variant]
    families = _group(chosen, lambda r: (r.method, _option_keys(r.variant)[:1]))
    tables = []
    for (method, keys), family in sorted(families.items()):
        variants = _variants(family)
        if len(variants) < 2 or not _has_ok(family):
            continue
        batch_sizes = sorted({r.batch_size for r in family})
        cells = _group(family, lambda r: (r.variant, r.batch_size))
        entries = flag_incomplete([[entry_of(cells.get((v, b), []), with_std=True) for b in batch_sizes]
                                   for v in variants])
        severities = sorted({r.severity for r in family if r.status == "ok"})
        note = ("Accuracy (%), mean ± std across corruptions, seeds and severities "
                f"{', '.join(map(str, severities))}.")
        name = f"ablation_{_slug(model)}_{_slug(method)}_{_slug('-'.join(keys))}"
        title = f"{model}: {method_label(method)} by {', '.join(keys)}"
        tables.append(Table(name, title, ("Variant", *(f"bs {b}" for b in batch_sizes)),
                            tuple(method_label(v) for v in variants), bold_best(entries), note))
    return tables


def build_tables(rows: Sequence[Row]) -> list[Table]:
    """Every table the rows support: summaries, ablations, then per-corruption tables."""
    models = sorted({r.model for r in rows})
    tables = [summary_table(rows, m) for m in models]
    if len(models) > 1:
        tables.append(summary_table(rows, None))
    for model in models:
        tables.extend(ablation_tables(rows, model))
    for model in models:
        settings = sorted({(r.severity, r.batch_size) for r in rows if r.model == model})
        tables.extend(per_corruption_table(rows, model, s, b) for s, b in settings)
    return [t for t in tables if t is not None]


# ---------------------------------------------------------------------------------------------
# renderers
# ---------------------------------------------------------------------------------------------


def to_markdown(table: Table) -> str:
    """GitHub Markdown: a bold title line, the table, the note; best entries in ``**bold**``."""
    lines = [f"**{table.title}**", "", "| " + " | ".join(table.header) + " |",
             "|" + "---|" + "---:|" * (len(table.header) - 1)]
    for label, row in zip(table.labels, table.entries):
        texts = [f"**{e.text}**" if e.bold else e.text for e in row]
        lines.append("| " + " | ".join([label, *texts]) + " |")
    if table.note:
        lines += ["", table.note]
    return "\n".join(lines) + "\n"


_LATEX_SPECIAL = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}",
                  "±": r"$\pm$"}


def latex_escape(text: str) -> str:
    """Escape LaTeX's special characters (and write ± as ``$\\pm$``)."""
    return "".join(_LATEX_SPECIAL.get(ch, ch) for ch in text)


def to_latex(table: Table) -> str:
    """A ``table`` float holding a plain ``tabular``; best entries in ``\\textbf{}``."""
    ncols = len(table.header)
    lines = [r"\begin{table}[htbp]", r"\centering",
             r"\caption{" + latex_escape(table.title + (". " + table.note if table.note else "")) + "}",
             r"\label{tab:" + table.name.replace("_", "-") + "}",
             r"\begin{tabular}{l|" + "c" * (ncols - 1) + "}", r"\hline",
             " & ".join(latex_escape(h) for h in table.header) + r" \\", r"\hline"]
    for label, row in zip(table.labels, table.entries):
        texts = [r"\textbf{" + latex_escape(e.text) + "}" if e.bold else latex_escape(e.text) for e in row]
        lines.append(" & ".join([latex_escape(label), *texts]) + r" \\")
    lines += [r"\hline", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines) + "\n"


def to_csv(table: Table) -> str:
    """One line per row: the label, then mean, std and n of each column at full precision.

    A mean cell holds the entry's text instead when it has no number ("n/a", "error" or "").
    """
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([table.header[0], *(f"{h} {part}" for h in table.header[1:] for part in ("mean", "std", "n"))])
    for label, row in zip(table.labels, table.entries):
        values: list[Any] = [label]
        for e in row:
            values += [repr(e.mean) if e.mean is not None else e.text,
                       repr(e.std) if e.std is not None else "", e.n]
        writer.writerow(values)
    return out.getvalue()


RENDERERS: dict[str, tuple[str, Callable[[Table], str]]] = {
    "md": (".md", to_markdown), "latex": (".tex", to_latex), "csv": (".csv", to_csv),
}


def write_tables(tables: Sequence[Table], out_dir: str | Path, formats: Sequence[str] = FORMATS) -> list[Path]:
    """Write each table in each format as ``<out_dir>/<name>.<ext>``; returns the paths."""
    unknown = set(formats) - set(RENDERERS)
    if unknown:
        raise ValueError(f"unknown table formats {sorted(unknown)}; choose from {', '.join(RENDERERS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for table in tables:
        for fmt in formats:
            suffix, render = RENDERERS[fmt]
            path = out / f"{table.name}{suffix}"
            path.write_text(render(table))
            paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------------
# figure data
# ---------------------------------------------------------------------------------------------


def mean_se(values: Sequence[float]) -> tuple[float, float, int]:
    """Mean, standard error (sample std / sqrt n; 0 for one value) and count."""
    arr = np.asarray(values, dtype=float)
    se = float(arr.std(ddof=1) / math.sqrt(arr.size)) if arr.size > 1 else 0.0
    return float(arr.mean()), se, int(arr.size)


def _seed_means(rows: Iterable[Row], key: Callable[[Row], Any]) -> list[float]:
    """Mean accuracy over seeds of each experimental condition (``key``) among the ok rows."""
    groups = _group((r for r in rows if r.status == "ok" and r.accuracy is not None), key)
    return [float(np.mean([r.accuracy for r in g])) for g in groups.values()]


def severity_curves(rows: Sequence[Row]) -> dict[str, dict[str, dict[str, list]]]:
    """Fig. 4 numbers: panel -> variant -> severity, mean, se, n over (model, corruption, batch size).

    Panel ``<dataset>`` pools the models, keeping only the methods that ran on every one of them
    (a method that is n/a on some models would otherwise be averaged over easier ones); with
    several models, panels ``<dataset> / <model>`` follow with every method. Seeds are averaged
    within a condition first, so the standard error is across conditions.
    """
    out: dict[str, dict[str, dict[str, list]]] = {}
    for dataset, drows in sorted(_group(rows, lambda r: r.dataset).items()):
        models = sorted({r.model for r in drows})
        ok_models = {v: {r.model for r in drows if r.variant == v and r.status == "ok"} for v in _variants(drows)}
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
    for variant in _variants(rows):
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
        for variant in _variants(mrows):
            vrows = [r for r in mrows if r.variant == variant]
            values = _seed_means(vrows, lambda r: (r.corruption, r.batch_size))
            if values:
                bars[variant] = dict(zip(("mean", "se", "n"), mean_se(values)))
            elif any(r.status == "n/a" for r in vrows):
                bars[variant] = {"status": "n/a"}
        out[model] = bars
    return out


def _closest_severity(rows: Sequence[Row], wanted: int = 3) -> int | None:
    severities = {r.severity for r in rows if r.status == "ok"}
    return min(severities, key=lambda s: (abs(s - wanted), s)) if severities else None


# ---------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------


def _figure(ncols: int, figsize: tuple[float, float]):
    """A figure and its axes on the Agg canvas, without pyplot (no global figure state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def _save(fig, path: str | Path) -> list[Path]:
    """Save as ``<stem>.png`` and ``<stem>.pdf`` (a .png/.pdf suffix on ``path`` is replaced)."""
    path = Path(path)
    stem = path.with_suffix("") if path.suffix.lower() in (".png", ".pdf") else path
    stem.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    paths = [stem.parent / f"{stem.name}.png", stem.parent / f"{stem.name}.pdf"]
    fig.savefig(paths[0], dpi=150, bbox_inches="tight")  # "tight" keeps a legend placed outside
    fig.savefig(paths[1], bbox_inches="tight")
    return paths


def _colors(variants: Sequence[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {v: cmap(i % 10) for i, v in enumerate(variants)}


def plot_severity(rows: Sequence[Row], path: str | Path) -> list[Path]:
    """Fig. 4: accuracy vs severity per method (panels as in :func:`severity_curves`), SE error bars; PNG and PDF."""
    curves = severity_curves(rows)
    if not curves:
        raise ValueError("no ok rows to plot")
    fig, axes = _figure(len(curves), (4.0 * len(curves), 3.6))
    colors = _colors(sorted({v for by_variant in curves.values() for v in by_variant}, key=variant_order))
    handles: dict[str, Any] = {}
    for ax, (panel, by_variant) in zip(axes, curves.items()):
        for i, (variant, c) in enumerate(by_variant.items()):
            dodge = 0.03 * (i - (len(by_variant) - 1) / 2)  # keep error bars of close methods apart
            line = ax.errorbar(np.add(c["severity"], dodge), c["mean"], yerr=c["se"], label=method_label(variant),
                               marker="o", ms=4, capsize=3, color=colors[variant])
            handles.setdefault(variant, line)
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("severity")
        ax.set_xticks(sorted({s for c in by_variant.values() for s in c["severity"]}))
        ax.set_ylabel("accuracy (%)")
        ax.grid(alpha=0.3)
    ordered = sorted(handles, key=variant_order)
    axes[-1].legend([handles[v] for v in ordered], [method_label(v) for v in ordered], fontsize=8,
                    loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def plot_architectures(rows: Sequence[Row], path: str | Path, severity: int = 3) -> list[Path]:
    """Fig. 5: grouped bars, one group per model, one bar per method, SE error bars; PNG and PDF."""
    bars = architecture_bars(rows, severity)
    if not any("mean" in b for m in bars.values() for b in m.values()):
        raise ValueError(f"no ok rows at severity {severity} to plot")
    variants = sorted({v for m in bars.values() for v in m}, key=variant_order)
    colors = _colors(variants)
    width = 0.8 / len(variants)
    fig, (ax,) = _figure(1, (max(5.0, 0.35 * len(bars) * len(variants) + 1.5), 3.8))
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
            ax.bar(x, bar["mean"], width, yerr=bar["se"], capsize=2, color=colors[variant], label=label)
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels(list(bars))
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"severity {severity}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(fig, path)


def plot_tail_deviation(deviations: Mapping[int, Sequence[float]], path: str | Path,
                        title: str | None = None) -> list[Path]:
    """Fig. 3: one box per percentile level of the batch-minus-reference deviations; PNG and PDF."""
    levels = sorted(deviations)
    fig, (ax,) = _figure(1, (6.0, 3.6))
    ax.boxplot([np.asarray(deviations[k], dtype=float) for k in levels])
    ax.set_xticks(range(1, len(levels) + 1))
    ax.set_xticklabels([f"p{k}" for k in levels])
    ax.axhline(0.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("percentile level")
    ax.set_ylabel("deviation from reference (reference std)")
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def write_figures(rows: Sequence[Row], out_dir: str | Path) -> dict[str, list[Path]]:
    """Fig. 4 and Fig. 5 (at severity 3, or the closest present) when the rows support them."""
    out = Path(out_dir)
    figures: dict[str, list[Path]] = {}
    if not _has_ok(rows):
        return figures
    figures["severity"] = plot_severity(rows, out / "severity")
    severity = _closest_severity(rows)
    figures["architectures"] = plot_architectures(rows, out / f"architectures_sev{severity}", severity)
    return figures


# ---------------------------------------------------------------------------------------------
# Fig. 3: tail percentiles of small batches
# ---------------------------------------------------------------------------------------------


def tail_layer(model: Any, layer: str | None = None) -> Any:
    """The :class:`aqr.core.layers.LayerInfo` of ``layer``, or of the model's first normalization layer."""
    from aqr.core.layers import LayerError, norm_layers

    infos = norm_layers(model)
    if not infos:
        raise LayerError(f"{type(model).__name__} has no BatchNorm, GroupNorm or LayerNorm layer")
    if layer is None:
        return infos[0]
    for info in infos:
        if info.name == layer:
            return info
    raise LayerError(f"{layer!r} is not a normalization layer of this model; "
                     f"choose from {', '.join(i.name for i in infos)}")


def _as_batch(images: Any, index: Sequence[int] | slice) -> Any:
    """Float NCHW [0, 1] batch from a float NCHW tensor or a uint8 NHWC array."""
    import torch

    if isinstance(images, torch.Tensor):
        return images[index].float()
    batch = np.ascontiguousarray(np.asarray(images[index]))
    if batch.dtype != np.uint8 or batch.ndim != 4 or batch.shape[-1] != 3:
        raise ValueError(f"images must be a float NCHW tensor or uint8 NHWC array, got {batch.dtype} {batch.shape}")
    return torch.from_numpy(batch).permute(0, 3, 1, 2).float().div_(255.0)


def percentile_deviations(model: Any, images: Any, layer: str | None = None, n_batches: int = 20,
                          batch_size: int = 128, reference: int = 10000,
                          levels: Sequence[int] = TAIL_LEVELS, seed: int = 0) -> dict[int, np.ndarray]:
    """Fig. 3: per level, the deviation of small-batch percentiles from reference percentiles.

    The reference percentiles of the normalization layer's output (``layer``, default the model's
    first one) come from the first ``reference`` images via :func:`aqr.calibrate` (p0/p100 exact,
    inner levels from a 10^6-value sample per channel, within 0.14 percentile points by DKW). Each of
    ``n_batches`` batches draws ``batch_size`` distinct images at random (``seed``) from all of
    ``images``. A deviation is ``(batch percentile - reference percentile) / reference std`` per
    channel, so channels and layers are comparable, averaged over the channels whose reference std
    is positive. Returns ``{level: array of n_batches deviations}``.
    """
    import torch

    from aqr.core.hooks import instrumented
    from aqr.core.layers import check_output
    from aqr.core.qmap import channel_quantiles
    from aqr.core.calibrate import calibrate

    levels = [int(k) for k in levels]
    if any(not 0 <= k <= 100 for k in levels):
        raise ValueError(f"levels must be percentiles in 0..100, got {levels}")
    n = len(images)
    if reference > n or batch_size > n:
        raise ValueError(f"{n} images cannot give {reference} reference images and batches of {batch_size}")
    info = tail_layer(model, layer)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    chunks = (_as_batch(images, slice(i, min(i + 256, reference))) for i in range(0, reference, 256))
    ref = calibrate(model, chunks, layers=[info.name], num_quantiles=101, tail="standard",
                    max_samples=1_000_000, seed=seed, compile=False).layers[info.name]
    ref_q, ref_std = ref.quantiles.double(), ref.std.double()
    live = ref_std > 0  # a dead channel has no scale to express a deviation in
    rng = np.random.default_rng(seed)
    captured: list[torch.Tensor] = []
    deviations = np.empty((n_batches, len(levels)))
    with instrumented(model) as tools, torch.no_grad():
        tools.hook(info.name, lambda _m, _i, out: captured.append(check_output(info, out).detach()))
        for b in range(n_batches):
            captured.clear()
            model(_as_batch(images, np.sort(rng.choice(n, batch_size, replace=False))).to(device))
            q = channel_quantiles(captured[-1], 101, dim=info.channel_dim).double().cpu()
            dev = (q[:, levels] - ref_q[:, levels]) / ref_std[:, None]
            deviations[b] = dev[live].mean(dim=0).numpy()
    return {k: deviations[:, i] for i, k in enumerate(levels)}


# ---------------------------------------------------------------------------------------------
# the whole report
# ---------------------------------------------------------------------------------------------


def provenance_summary(rows: Iterable[Row]) -> dict[str, list[str]]:
    """The distinct code versions, commits, torch versions and hosts behind the rows."""
    found: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        for key in ("aqr", "git_commit", "torch", "host"):
            found[key].add(str(row.provenance.get(key)))
    return {k: sorted(v) for k, v in found.items()}


def report_dict(rows: Sequence[Row], tables: Sequence[Table], superseded: int = 0) -> dict[str, Any]:
    """The JSON-able numbers of a report: row counts, provenance, tables and figure data."""
    severity = _closest_severity(rows)
    return {
        "rows": dict(Counter(r.status for r in rows)),
        "superseded_rows": superseded,
        "models": sorted({r.model for r in rows}),
        "provenance": provenance_summary(rows),
        "tables": [t.to_dict() for t in tables],
        "severity_curves": severity_curves(rows),
        "architecture_bars": {"severity": severity,
                              "bars": architecture_bars(rows, severity) if severity is not None else {}},
    }


def report(db_path: str | Path, out_dir: str | Path, experiment: str | None = None,
           formats: Sequence[str] = FORMATS, figures: bool = True) -> dict[str, Any]:
    """Write every table and figure the database supports, an ``index.md`` and ``report.json``.

    Layout: ``tables/<name>.{md,tex,csv}``, ``figures/<name>.{png,pdf}``. Returns the JSON dict
    (also written to ``report.json``), with the written files under ``"files"``.
    """
    all_rows = load_rows(db_path, experiment, latest=False)
    rows = latest_rows(all_rows)
    tables = build_tables(rows)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table_files = write_tables(tables, out / "tables", formats)
    figure_files = write_figures(rows, out / "figures") if figures else {}
    result = {"db": str(db_path), "experiment": experiment,
              **report_dict(rows, tables, superseded=len(all_rows) - len(rows))}
    index = out / "index.md"
    index.write_text(index_markdown(result, tables, figure_files, table_files, out))
    files = [index, out / "report.json", *table_files, *(p for ps in figure_files.values() for p in ps)]
    result["files"] = [str(p) for p in files]
    (out / "report.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def index_markdown(result: Mapping[str, Any], tables: Sequence[Table], figure_files: Mapping[str, Sequence[Path]],
                   table_files: Sequence[Path], out_dir: Path) -> str:
    """``index.md``: what the report covers, its figures (PNG) and every table in Markdown."""
    counts = result["rows"]
    lines = [f"# aqr report: {result['experiment'] or 'all experiments'}", "",
             f"Database `{result['db']}`: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
             + f" rows ({result['superseded_rows']} older duplicates superseded).", ""]
    for key, values in result["provenance"].items():
        lines.append(f"- {key}: {', '.join(values)}")
    if figure_files:
        lines += ["", "## Figures", ""]
        for name, paths in figure_files.items():
            lines.append(f"![{name}]({paths[0].relative_to(out_dir).as_posix()})")
    lines += ["", "## Tables", ""]
    for table in tables:
        others = [p for p in table_files if p.stem == table.name and p.suffix != ".md"]
        links = " ".join(f"[{p.suffix[1:]}]({p.relative_to(out_dir).as_posix()})" for p in others)
        lines += [to_markdown(table).rstrip("\n") + (f" {links}" if links else ""), ""]
    return "\n".join(lines)
