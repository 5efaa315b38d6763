"""The paper's tables from result rows, as one rendering-neutral :class:`Table`.

* :func:`per_corruption_table` -- paper Table 1: rows = methods, columns = corruptions + mean, for one
  model at one severity and batch size; each entry is the mean over seeds.
* :func:`summary_table` -- paper Tables 4-6: rows = methods, columns = batch size x severity, entries
  "mean ± std" over corruptions and seeds, for one model or all models pooled.
* :func:`ablation_tables` -- paper Tables 2-3: rows = the variants of one method that differ in one
  option set (``aqr[tail=...]``, ``aqr[K=...]``), columns = batch size, entries over corruptions,
  seeds and severities.

Numbers: only rows with status ``'ok'`` enter a mean; a cell whose rows are all ``'n/a'`` shows
``n/a`` (``error`` when all failed). An entry over fewer values than the fullest of its column (a
failed or missing cell, or a method n/a for some pooled models) says "(k of N)" and cannot be bold.
Standard deviations are sample ones (``ddof=1``). Bold marks every entry of a column whose
*displayed* (rounded) value equals the column's best, so displayed ties are all bold, as in the paper.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from aqr.data.corruption_params import CORRUPTIONS
from aqr.harness.report.shared import slug
from aqr.harness.results import Row

BASE_METHODS = ("source", "ttn", "tent", "sar", "moments", "aqr")
METHOD_LABELS = {"source": "Source (NA)", "ttn": "TTN", "tent": "TENT", "sar": "SAR", "moments": "Moments",
                 "aqr": "AQR", "bn-ema": "BN-EMA", "rbn": "RBN", "eta": "ETA", "eata": "EATA", "cotta": "CoTTA",
                 "rotta": "RoTTA", "lame": "LAME", "roid": "ROID", "deyo": "DeYO", "aqr+tent": "AQR+TENT",
                 "aqr+eta": "AQR+ETA", "aqr+roid": "AQR+ROID", "aqr+lame": "AQR+LAME", "unmixtns": "UnMix-TNS",
                 "rdumb": "RDumb"}
DIGITS = 1  # decimals shown in tables (the JSON and CSV keep full precision)


@dataclass(frozen=True)
class Entry:
    """One table cell: the numbers behind it and its displayed text (without bold marks)."""

    text: str  # "77.3", "77.3 ± 2.0", "n/a", "error" or "" (no row)
    mean: float | None = None
    std: float | None = None  # sample std of the values the mean is over (None for one value)
    n: int = 0  # how many values the mean is over
    bold: bool = False
    rankable: bool = True  # False for means over incomplete data, which must not win a column
    low: float | None = None  # a confidence interval's bounds, when the entry has one
    high: float | None = None


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
    d = {"text": e.text, "mean": e.mean, "std": e.std, "n": e.n, "bold": e.bold}
    if e.low is not None or e.high is not None:
        d.update(low=e.low, high=e.high)
    return d


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


def _natural(text: str) -> list:
    """Sort key that orders digits numerically (``K=11`` before ``K=101``)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def variant_order(variant: str) -> tuple:
    """Source, TTN, TENT, SAR, moments, AQR first (the paper's order, the control before AQR), then every
    other variant sorted."""
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


def variants_in(rows: Iterable[Row]) -> list[str]:
    """The distinct method variants of ``rows``, in :func:`variant_order`."""
    return sorted({r.variant for r in rows}, key=variant_order)


def has_ok(rows: Iterable[Row]) -> bool:
    """Whether any row holds a result (status ``'ok'``)."""
    return any(r.status == "ok" for r in rows)


def group_by(rows: Iterable[Row], key: Callable[[Row], Any]) -> dict[Any, list[Row]]:
    """``rows`` grouped by ``key(row)``, in first-seen order."""
    groups: dict[Any, list[Row]] = defaultdict(list)
    for row in rows:
        groups[key(row)].append(row)
    return groups


def per_corruption_table(rows: Sequence[Row], model: str, severity: int, batch_size: int) -> Table | None:
    """Paper Table 1: accuracy per method and corruption (mean over seeds) plus their mean; None if no data.

    A row's "mean" is over its corruption means; when it lacks some corruption the text says how
    many it covers and it cannot be bold.
    """
    chosen = [r for r in rows if r.model == model and r.severity == severity and r.batch_size == batch_size]
    if not has_ok(chosen):
        return None
    corruptions = corruption_order(r.corruption for r in chosen)
    cells = group_by(chosen, lambda r: (r.variant, r.corruption))
    variants = variants_in(chosen)
    entries = flag_incomplete([[entry_of(cells.get((v, c), []), with_std=False) for c in corruptions]
                               for v in variants])
    for row in entries:
        row.append(row_mean(row, [e.mean for e in row if e.mean is not None], len(corruptions)))
    seeds = sorted({r.seed for r in chosen if r.status == "ok"})
    errors = [e.std / math.sqrt(e.n) for row in entries for e in row[:-1] if e.std is not None]
    note = f"Accuracy (%), mean over seeds {', '.join(map(str, seeds))}; " + (
        f"largest standard error over seeds: {max(errors):.2f}." if errors else "one seed per entry, no standard error.")
    return Table(f"per_corruption_{slug(model)}_sev{severity}_bs{batch_size}",
                 f"{model}: accuracy per corruption, severity {severity}, batch size {batch_size}",
                 ("Method", *corruptions, "mean"), tuple(method_label(v) for v in variants),
                 bold_best(entries), note)


def row_mean(row: Sequence[Entry], means: Sequence[float], total: int) -> Entry:
    """A table row's mean entry over its columns' ``means`` (of ``total`` columns): marked, and never bold,
    when some column has none."""
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
    if not has_ok(chosen):
        return None
    columns = sorted({(r.batch_size, r.severity) for r in chosen})
    cells = group_by(chosen, lambda r: (r.variant, r.batch_size, r.severity))
    variants = variants_in(chosen)
    entries = flag_incomplete([[entry_of(cells.get((v, b, s), []), with_std=True) for b, s in columns]
                               for v in variants])
    scope = model if model is not None else "all models pooled"
    note = "Accuracy (%), mean ± std across corruptions and seeds"
    if model is None:
        note += (" (and models: " + ", ".join(sorted({r.model for r in chosen}))
                 + "; a method n/a for a model is averaged over the others)")
    return Table(f"summary_{slug(model) if model else 'all'}", f"Summary: {scope}",
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
    families = group_by(chosen, lambda r: (r.method, _option_keys(r.variant)[:1]))
    tables = []
    for (method, keys), family in sorted(families.items()):
        variants = variants_in(family)
        if len(variants) < 2 or not has_ok(family):
            continue
        batch_sizes = sorted({r.batch_size for r in family})
        cells = group_by(family, lambda r: (r.variant, r.batch_size))
        entries = flag_incomplete([[entry_of(cells.get((v, b), []), with_std=True) for b in batch_sizes]
                                   for v in variants])
        severities = sorted({r.severity for r in family if r.status == "ok"})
        note = ("Accuracy (%), mean ± std across corruptions, seeds and severities "
                f"{', '.join(map(str, severities))}.")
        name = f"ablation_{slug(model)}_{slug(method)}_{slug('-'.join(keys))}"
        title = f"{model}: {method_label(method)} by {', '.join(keys)}"
        tables.append(Table(name, title, ("Variant", *(f"bs {b}" for b in batch_sizes)),
                            tuple(method_label(v) for v in variants), bold_best(entries), note))
    return tables


