"""Paired comparisons with bootstrap confidence intervals, and means over seeds.

Every method of a benchmark setting sees the same images in the same order (a cell's images depend
on its seed only), and the results database keeps which images each cell got right
(:meth:`aqr.harness.results.ResultsDB.correct`). So a difference between two methods can be measured
image by image:

* :func:`paired_difference` -- the mean over cells of ``accuracy(a) - accuracy(b)``, with a 95 %
  bootstrap interval over *images*: each replicate redraws the evaluation pool's test images with
  replacement, and every cell, whatever its corruption or seed, reweights its images by how often
  that replicate drew them. Cells that share an image (the corruptions of one seed; seeds whose
  draws overlap) therefore move together, as they should.
* :func:`paired_table` -- per model, rows "A − B" (AQR − moments, AQR − the best baseline, ...; each
  AQR variant the rows hold, e.g. ``aqr[mode=exact]``, gets its own),
  columns batch size x severity; :func:`paired_corruption_table` -- the same per corruption.
* :func:`seed_table` -- per model, each method's mean over corruptions for every seed, as
  "mean ± std over seeds".

Cells in a stream order (``Cell.order``) and image-folder cells over a whole folder are not paired.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from aqr.harness.cells import Cell, eval_indices, parse_range
from aqr.harness.report.shared import slug
from aqr.harness.report.tables import (Entry, Table, bold_best, corruption_order, flag_incomplete, group_by, method_label,
                                     summarize, variants_in)
from aqr.harness.results import Row

REPLICATES = 2000
CONFIDENCE = 0.95
BASELINES = ("source", "ttn", "tent", "sar")  # what AQR is measured against; moments is the control
CONTROL = "moments"


@dataclass(frozen=True)
class PairedCell:
    """One cell's images (test-image ids) and which of them each of two methods got right."""

    images: np.ndarray  # (n,) ids into the evaluation pool
    a: np.ndarray  # (n,) bool
    b: np.ndarray  # (n,) bool


@dataclass(frozen=True)
class Difference:
    """``mean`` of ``accuracy(a) - accuracy(b)`` over ``cells`` cells (points), with its interval."""

    mean: float
    low: float
    high: float
    cells: int

    def text(self) -> str:
        return f"{self.mean:+.2f} [{self.low:+.2f}, {self.high:+.2f}]"


def cell_images(row: Row) -> np.ndarray | None:
    """The pool ids of the images a row's cell evaluated, in evaluation order (see :func:`aqr.harness.cells.eval_indices`);
    None for a cell whose order depends on its data (a stream order) or whose pool is a whole folder."""
    cell = Cell.from_dict(row.config)
    pool = parse_range(cell.data.eval_indices) if cell.data.eval_indices not in (None, "", "all") else None
    if pool is None or getattr(cell, "order", None) is not None:
        return None
    return np.asarray(eval_indices(cell, pool), dtype=np.int64)


def paired_difference(cells: Sequence[PairedCell], replicates: int = REPLICATES, seed: int = 0,
                      confidence: float = CONFIDENCE) -> Difference:
    """Mean over ``cells`` of accuracy(a) - accuracy(b) in points, with a percentile bootstrap interval
    that resamples test images (see the module docs); the same ``seed`` gives the same interval."""
    if not cells:
        raise ValueError("no cells to compare")
    universe, where = np.unique(np.concatenate([c.images for c in cells]), return_inverse=True)
    counts = np.random.default_rng(seed).multinomial(universe.size, np.full(universe.size, 1.0 / universe.size),
                                                     size=replicates).astype(np.float32)
    # cells with the same images (one seed's corruptions) share one gather of the replicate weights
    groups: dict[bytes, list[int]] = defaultdict(list)
    offsets = np.cumsum([0] + [c.images.size for c in cells])
    for i, c in enumerate(cells):
        groups[c.images.tobytes()].append(i)
    replicate_sums = np.zeros(replicates)
    for members in groups.values():
        first = members[0]
        weights = counts[:, where[offsets[first]:offsets[first + 1]]]  # (replicates, n)
        diffs = np.stack([cells[i].a.astype(np.float32) - cells[i].b.astype(np.float32) for i in members], axis=1)
        replicate_sums += ((weights @ diffs) / weights.sum(1, keepdims=True)).sum(1)
    replicate_means = 100.0 * replicate_sums / len(cells)
    mean = 100.0 * float(np.mean([c.a.mean() - c.b.mean() for c in cells]))
    tail = 100.0 * (1.0 - confidence) / 2.0
    low, high = np.percentile(replicate_means, [tail, 100.0 - tail])
    return Difference(mean, float(low), float(high), len(cells))


def _pairs(rows: Sequence[Row], correct: Mapping[str, np.ndarray], a: str, b: str) -> dict[tuple, PairedCell]:
    """(corruption, seed) -> the paired cell of variants ``a`` and ``b`` among ``rows`` (ok rows with images)."""
    found: dict[str, dict[tuple, Row]] = {a: {}, b: {}}
    for r in rows:
        if r.variant in found and r.status == "ok" and r.key in correct:
            found[r.variant][(r.corruption, r.seed)] = r
    pairs = {}
    for key, ra in found[a].items():
        rb = found[b].get(key)
        if rb is None:
            continue
        images = cell_images(ra)
        if images is None:  # cells that cannot be paired image by image
            continue
        if not np.array_equal(images, cell_images(rb)) or correct[ra.key].size != images.size:
            raise ValueError(f"{ra.model} {key}: {a} and {b} did not see the same images")
        pairs[key] = PairedCell(images, correct[ra.key], correct[rb.key])
    return pairs


def best_baseline(rows: Sequence[Row]) -> str | None:
    """The baseline (source, TTN, TENT, SAR) with the highest mean accuracy among those with the most
    cells in ``rows`` (one setting of one model), or None."""
    means = {}
    for method in BASELINES:
        ok = [r.accuracy for r in rows if r.variant == method and r.status == "ok" and r.accuracy is not None]
        if ok:
            means[method] = (len(ok), float(np.mean(ok)))
    if not means:
        return None
    most = max(n for n, _ in means.values())
    return max((m for m, (n, _) in means.items() if n == most), key=lambda m: means[m][1])


def aqr_variants(rows: Sequence[Row]) -> list[str]:
    """The AQR variants among ``rows`` (``aqr``, ``aqr[mode=exact]``, ...), in table order."""
    return variants_in(r for r in rows if r.method == "aqr")


def comparisons(rows: Sequence[Row]) -> list[tuple[str, str]]:
    """The ``(a, b)`` variant pairs a model's rows support: each AQR variant against the control and
    each baseline, the control against each baseline, and TENT/SAR against TTN and the unadapted model."""
    present = {r.variant for r in rows if r.status == "ok"}
    wanted = [*((a, b) for a in aqr_variants(rows) for b in (CONTROL, *BASELINES)), *((CONTROL, b) for b in BASELINES),
              ("tent", "ttn"), ("tent", "source"), ("sar", "ttn"), ("sar", "source")]
    return [(a, b) for a, b in wanted if a in present and b in present]


def _short(variant: str) -> str:
    """``Source (NA)`` -> ``Source``; an option list stays: ``AQR[mode=exact]``."""
    label = method_label(variant)
    return label if "[" in label else label.split(" ")[0]


def _label(a: str, b: str) -> str:
    return f"{_short(a)} − {_short(b)}"


def _entry(diff: Difference | None, note: str = "") -> Entry:
    if diff is None:
        return Entry("")
    return Entry(diff.text() + note, diff.mean, None, diff.cells, rankable=False, low=diff.low, high=diff.high)


NOTE = ("Paired differences in accuracy points, mean over corruptions and seeds, with a 95 % bootstrap "
        "interval over test images ({replicates} replicates; each resamples the evaluation pool's images, "
        "shared by every cell). 'best baseline': the best of source, TTN, TENT and SAR at that setting "
        "(among those with every cell), named in brackets.")


def paired_table(rows: Sequence[Row], correct: Mapping[str, np.ndarray], model: str) -> Table | None:
    """Per setting (batch size, severity): each comparison's paired difference with its interval; None
    without a pair."""
    chosen = [r for r in rows if r.model == model]
    pairs = comparisons(chosen)
    if not pairs:
        return None
    settings = sorted({(r.batch_size, r.severity) for r in chosen})
    by_setting = group_by(chosen, lambda r: (r.batch_size, r.severity))
    labels, entries = [], []
    for a in (*aqr_variants(chosen), CONTROL):
        if not any(r.variant == a for r in chosen):
            continue
        row = []
        for setting in settings:
            best = best_baseline(by_setting[setting])
            cells = list(_pairs(by_setting[setting], correct, a, best).values()) if best else []
            row.append(_entry(paired_difference(cells) if cells else None, f" ({method_label(best)})" if best else ""))
        labels.append(f"{_short(a)} − best baseline")
        entries.append(row)
    for a, b in pairs:
        row = []
        for setting in settings:
            cells = list(_pairs(by_setting[setting], correct, a, b).values())
            row.append(_entry(paired_difference(cells) if cells else None))
        labels.append(_label(a, b))
        entries.append(row)
    return Table(f"paired_{slug(model)}", f"{model}: paired differences (points)",
                 ("Comparison", *(f"bs {b}, sev {s}" for b, s in settings)), tuple(labels),
                 tuple(tuple(r) for r in entries), NOTE.format(replicates=REPLICATES))


def paired_corruption_table(rows: Sequence[Row], correct: Mapping[str, np.ndarray], model: str, severity: int,
                            batch_size: int) -> Table | None:
    """Per corruption (over seeds): each AQR variant − moments and − the best baseline of the setting,
    and moments − the best baseline; None without AQR or moments and a partner."""
    chosen = [r for r in rows if r.model == model and r.severity == severity and r.batch_size == batch_size]
    best = best_baseline(chosen)
    wanted = [*((a, b) for a in aqr_variants(chosen) for b in (CONTROL, best)), (CONTROL, best)]
    pairs = [(a, b) for a, b in wanted if b is not None]
    pairs = [p for p in pairs if p in comparisons(chosen)]
    if not pairs:
        return None
    found = {p: _pairs(chosen, correct, *p) for p in pairs}
    corruptions = corruption_order({c for cells in found.values() for c, _ in cells})
    entries = []
    for corruption in corruptions:
        row = []
        for p in pairs:
            cells = [cell for (c, _), cell in found[p].items() if c == corruption]
            row.append(_entry(paired_difference(cells) if cells else None))
        entries.append(tuple(row))
    entries.append(tuple(_entry(paired_difference(list(found[p].values()))) for p in pairs))
    return Table(f"paired_corruptions_{slug(model)}_sev{severity}_bs{batch_size}",
                 f"{model}: paired differences per corruption (points), severity {severity}, batch size {batch_size}",
                 ("Corruption", *(_label(*p) for p in pairs)), (*corruptions, "mean"), tuple(entries),
                 NOTE.format(replicates=REPLICATES).split(" 'best baseline'")[0] + " Per corruption: over seeds.")


def seed_table(rows: Sequence[Row], model: str) -> Table | None:
    """Per method and setting: the mean over corruptions for each seed, as "mean ± std over seeds";
    None when the model has no setting with two seeds."""
    chosen = [r for r in rows if r.model == model and r.status == "ok"]
    settings = sorted({(r.batch_size, r.severity) for r in chosen})
    if not any(len({r.seed for r in chosen if (r.batch_size, r.severity) == s}) > 1 for s in settings):
        return None
    corruptions = {s: {r.corruption for r in chosen if (r.batch_size, r.severity) == s} for s in settings}
    variants = variants_in(chosen)
    entries = []
    for v in variants:
        row = []
        for s in settings:
            by_seed = group_by([r for r in chosen if r.variant == v and (r.batch_size, r.severity) == s],
                               lambda r: r.seed)
            means = [float(np.mean([r.accuracy for r in rs])) for rs in by_seed.values()
                     if {r.corruption for r in rs} == corruptions[s]]  # a seed counts once it has every corruption
            row.append(summarize(means, with_std=True) if means else Entry(""))
        entries.append(row)
    return Table(f"seeds_{slug(model)}", f"{model}: accuracy, mean ± std over seeds",
                 ("Method", *(f"bs {b}, sev {s}" for b, s in settings)), tuple(method_label(v) for v in variants),
                 bold_best(flag_incomplete(entries)),
                 "Accuracy (%): per seed the mean over the setting's corruptions, then mean ± sample std over "
                 "the seeds that have every corruption (n = seeds).")


def paired_tables(rows: Sequence[Row], correct: Mapping[str, np.ndarray]) -> list[Table]:
    """Every seed, paired and per-corruption paired table the rows (and their per-image results) support."""
    models = sorted({r.model for r in rows})
    tables = [seed_table(rows, m) for m in models]
    if correct:
        tables += [paired_table(rows, correct, m) for m in models]
        for m in models:
            settings = sorted({(r.severity, r.batch_size) for r in rows if r.model == m})
            tables += [paired_corruption_table(rows, correct, m, s, b) for s, b in settings]
    return [t for t in tables if t is not None]
