"""The table and figure of CCC streams (``--setting ccc``; :mod:`aqr.harness.ccc`).

* :func:`ccc_table`: per stream (model, batch size, CCC stream), each method's accuracy over the whole
  stream, over its first and last tenth, and the drift: (method - Source) over the last tenth minus the
  same over the first tenth (a collapse is a large negative drift), and the cell's wall time. Mean over seeds.
  Rows of the realtime protocol have tables of their own.
* :func:`plot_ccc`: accuracy along each stream (and protocol), a moving average over ``window`` images per method (one
  seed: the first), the pair transitions marked.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from aqr.harness.ccc import CCCSpec
from aqr.harness.cells import is_ccc
from aqr.harness.continual import along_stream, correctness
from aqr.harness.report.field_target import best_field, spec_variant
from aqr.harness.report.figures import finish_figure
from aqr.harness.report.tables import (Entry, Table, bold_best, flag_incomplete, group_by, method_label, summarize,
                                       variant_order, variants_in)
from aqr.harness.results import Row
from aqr.util.plots import axes_row
from aqr.util.plots import colors as plot_colors

WINDOW = 2000  # images in the moving average along a CCC stream
MADE_MARK = " (+images)"  # a wall time that includes making the stream's images


def is_ccc_row(row: Row) -> bool:
    """Whether the row is a CCC stream's."""
    return is_ccc(row.corruption)


def _ok(rows: Sequence[Row]) -> list[Row]:
    return [r for r in rows if is_ccc_row(r) and r.status == "ok" and r.detail]


def tenths(row: Row) -> tuple[float, float]:
    """Accuracy (%) over the first and the last tenth of a CCC row's stream."""
    correct = correctness(row.detail)
    tenth = max(1, len(correct) // 10)
    return 100.0 * float(correct[:tenth].mean()), 100.0 * float(correct[-tenth:].mean())


def _pair_starts(detail: dict[str, Any]) -> list[tuple[int, str]]:
    """Where each pair of corruptions starts in a CCC stream (image index) and the pair's name."""
    starts, previous = [], None
    for k, name in enumerate(detail["corruptions"]):
        first, second = (part.rsplit("-", 1)[0] for part in name.split("+"))
        if (first, second) != previous:
            starts.append((k * detail["block_size"], f"{first} > {second}"))
            previous = (first, second)
    return starts


def _stream_of(row: Row) -> tuple[str, int, str, str]:
    """What one table or panel holds: a model, a batch size, a CCC stream and a protocol."""
    return row.model, row.batch_size, row.corruption, row.protocol


def ccc_table(rows: Sequence[Row], model: str, batch_size: int, corruption: str, protocol: str = "online") -> Table | None:
    """One CCC stream's table under one protocol (see the module docs); ``None`` without ok rows."""
    chosen = [r for r in _ok(rows) if _stream_of(r) == (model, batch_size, corruption, protocol)]
    if not chosen:
        return None
    source = {r.seed: tenths(r) for r in chosen if r.variant == "source"}
    entries: list[list[Entry]] = []
    variants = variants_in(chosen)
    for v in variants:
        runs = [r for r in chosen if r.variant == v]
        first_last = [tenths(r) for r in runs]
        row = [summarize([r.accuracy for r in runs], with_std=False),
               summarize([f for f, _ in first_last], with_std=False),
               summarize([last for _, last in first_last], with_std=False)]
        drift = [(last - source[r.seed][1]) - (f - source[r.seed][0])
                 for r, (f, last) in zip(runs, first_last) if r.seed in source]
        row.append(summarize(drift, with_std=False) if drift else Entry(""))
        row.append(_wall(runs))
        entries.append(row)
    entries = flag_incomplete(entries)
    best = bold_best([row[:3] for row in entries])
    entries = [[*b, *row[3:]] for b, row in zip(best, entries)]
    note = ("Accuracy (%) over the whole CCC stream, its first and its last tenth, and the drift: (method - Source) "
            "over the last tenth minus the same over the first (negative: falling behind Source); mean over seeds. "
            f"Wall: the cell's time in minutes, mean over seeds, marked {MADE_MARK.strip()} where it includes making "
            "the stream's images (the first cell on a stream; the others read them from its cache).")
    name = corruption.replace(":", "_").replace(",", "_").replace("=", "")
    return Table(f"ccc_{model}_bs{batch_size}_{name}_{protocol}", f"{model}: {corruption}, batch size {batch_size}, "
                 f"{protocol}",
                 ("Method", "stream", "first tenth", "last tenth", "drift vs Source", "wall (min)"),
                 tuple(method_label(v) for v in variants), tuple(tuple(r) for r in entries), note)


# The target's no-collapse part holds on streams this long or longer (issue 57: its long stream): (recommended -
# Source) over the last tenth no more than this many points below the same over the first. A drift upwards is
# no collapse: the two tenths hold other pairs of corruptions, on which the gap to Source differs anyway.
LONG_STREAM = 300_000
COLLAPSE_POINTS = 1.0


def ccc_target_table(rows: Sequence[Row], recommended: str) -> Table | None:
    """Per CCC stream (model, batch size, stream, protocol): the ``recommended`` configuration (a spec, as
    :data:`aqr.methods.RECOMMENDED`'s offline one) against the best method it is compared with over the whole
    stream (Source included; AQR's configurations and its moment-matching control left out), and its drift
    against Source. Met: at or above that method and, on a stream of :data:`LONG_STREAM` images or more, a drift
    of no less than ``-COLLAPSE_POINTS`` (no collapse). ``None`` without CCC rows."""
    chosen = spec_variant(recommended)
    ok = _ok(rows)
    labels, entries = [], []
    for key in sorted({_stream_of(r) for r in ok}):
        here = [r for r in ok if _stream_of(r) == key]
        means = {v: float(np.mean([r.accuracy for r in here if r.variant == v])) for v in variants_in(here)}
        best = best_field(means)
        source = {r.seed: tenths(r) for r in here if r.variant == "source"}
        drifts = [(last - source[r.seed][1]) - (first - source[r.seed][0])
                  for r in here if r.variant == chosen and r.seed in source for first, last in [tenths(r)]]
        long = CCCSpec.parse(key[2]).images >= LONG_STREAM
        row = [Entry(f"{means[chosen]:.1f}", means[chosen], None, 1) if chosen in means else Entry("not run"),
               Entry(f"{method_label(best)} {means[best]:.1f}", means[best], None, 1) if best else Entry("")]
        if chosen in means and best:
            gap = means[chosen] - means[best]
            drift = float(np.mean(drifts)) if drifts else None
            collapsed = long and (drift is None or drift < -COLLAPSE_POINTS)
            row += [Entry(f"{gap:+.1f}", gap, None, 1),
                    Entry("" if drift is None else f"{drift:+.1f}", drift, None, 1),
                    Entry("yes" if gap >= 0 and not collapsed else "no")]
        else:
            row += [Entry(""), Entry(""), Entry("")]
        model, size, corruption, protocol = key
        labels.append(f"{model} · batch {size} · {corruption.removeprefix('ccc:')} · {protocol}")
        entries.append(tuple(row))
    if not entries:
        return None
    note = (f"Accuracy (%) over the whole stream, mean over seeds. Recommended: {method_label(chosen)} "
            "(aqr.methods.RECOMMENDED, offline). Best field method: the best of the methods AQR is compared with "
            "(Source included). Difference: recommended minus that method. Drift: (recommended - Source) over the "
            "last tenth minus the same over the first. Met: at or above the best field method and, on a stream of "
            f"{LONG_STREAM:,} images or more, a drift of no less than -{COLLAPSE_POINTS:g} point (no collapse; the "
            "two tenths hold other pairs of corruptions, so a drift upwards is no collapse).")
    return Table("ccc_target", "CCC: the recommended configuration against the best field method", (
        "Model · batch · stream · protocol", "recommended", "best field method", "difference", "drift vs Source",
        "met"), tuple(labels), tuple(entries), note)


def _wall(runs: Sequence[Row]) -> Entry:
    """The runs' mean wall time in minutes, marked where one of them made the stream's images (not all the method's)."""
    walls = [r.wall_s for r in runs if r.wall_s is not None]
    if not walls:
        return Entry("")
    entry = summarize([w / 60.0 for w in walls], with_std=False)
    made = any(r.detail.get("images_made") != 0 for r in runs)  # rows from before the cache made them all
    return Entry(f"{entry.text}{MADE_MARK if made else ''}", entry.mean, entry.std, entry.n, rankable=False)


def ccc_tables(rows: Sequence[Row]) -> list[Table]:
    """Every CCC stream's table, by model, batch size, stream and protocol."""
    keys = sorted({_stream_of(r) for r in _ok(rows)})
    return [t for t in (ccc_table(rows, *key) for key in keys) if t is not None]


def plot_ccc(rows: Sequence[Row], path: str | Path, window: int = WINDOW) -> list[Path]:
    """Accuracy along each CCC stream (moving average over ``window`` images, at most a tenth of the stream, from
    the first full window on), one panel per stream (model, batch size, stream), one line per method (the first
    seed), pair transitions marked; PNG and PDF."""
    ok = _ok(rows)
    if not ok:
        raise ValueError("no ok CCC rows to plot")
    panels = group_by(sorted(ok, key=_stream_of), _stream_of)
    colors = plot_colors(sorted({r.variant for r in ok}, key=variant_order))
    fig, axes = axes_row(len(panels), (7.0 * len(panels), 3.8))
    handles: dict[str, Any] = {}
    for ax, ((model, size, corruption, protocol), group) in zip(axes, panels.items()):
        seed = min(r.seed for r in group)
        for row in sorted((r for r in group if r.seed == seed), key=lambda r: variant_order(r.variant)):
            shown = min(window, max(1, row.detail["n"] // 10))  # a short stream: a tenth of it
            curve = along_stream(row.detail, shown)[shown - 1 :]  # from the first full window: fewer images swing
            (handles[row.variant],) = ax.plot(np.arange(shown, shown + len(curve)), curve, lw=0.9,
                                              color=colors[row.variant])
        for start, label in _pair_starts(group[0].detail)[1:]:
            ax.axvline(start, color="0.75", lw=0.6)
            ax.text(start, 1.0, label.replace("_", " "), rotation=90, va="top", ha="right", fontsize=6,
                    transform=ax.get_xaxis_transform(), color="0.4")
        ax.set_title(f"{model}, batch size {size}, {protocol}, {corruption.removeprefix('ccc:')} (seed {seed})",
                     fontsize=9)
        ax.set_xlabel("images")
        ax.set_ylabel(f"accuracy, last {min(window, max(1, group[0].detail['n'] // 10))} images (%)")
        ax.grid(axis="y", alpha=0.3)
    return finish_figure(fig, axes, handles, path)


def write_ccc_figures(rows: Sequence[Row], out_dir: str | Path) -> dict[str, list[Path]]:
    """The CCC figure, when the rows hold CCC streams."""
    return {"ccc_along_stream": plot_ccc(rows, Path(out_dir) / "ccc_along_stream")} if _ok(rows) else {}


def ccc_report(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """The JSON-able numbers of the CCC rows: per row, its accuracy and the first and last tenth's."""
    return [{"model": r.model, "variant": r.variant, "batch_size": r.batch_size, "seed": r.seed, "protocol": r.protocol,
             "stream": r.corruption, "accuracy": r.accuracy, "first_tenth": tenths(r)[0], "last_tenth": tenths(r)[1]}
            for r in _ok(rows)]
