"""The paper's tables and figures, computed from the results database (``aqr report``).

:func:`report` writes every table (:mod:`~aqr.harness.report.tables`, rendered by
:mod:`~aqr.harness.report.render` as Markdown, LaTeX and CSV) and figure
(:mod:`~aqr.harness.report.figures`, PNG and PDF) the rows support, the paired comparisons with
bootstrap intervals and means over seeds (:mod:`~aqr.harness.report.paired`, from the per-image results
the database keeps), an ``index.md`` and a ``report.json`` with every number. Rows are read with :func:`load_rows`: for each condition, the
newest row, so reruns under a new code version replace old rows.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from aqr.harness.report.ccc_tables import ccc_report, ccc_tables, ccc_target_table, is_ccc_row, write_ccc_figures
from aqr.harness.report.field_tables import cost_points, plot_costs, row_setting, setting_tables
from aqr.harness.report.field_target import choose_defaults, recommended_table, target_table
from aqr.harness.report.figures import (architecture_bars, closest_severity, mean_se, plot_architectures,
                                        plot_severity, severity_curves)
from aqr.harness.report.orders import order_curves, order_table, order_tables, plot_orders, write_order_figures
from aqr.harness.report.paired import (paired_corruption_table, paired_difference, paired_table, paired_tables,
                                       seed_table)
from aqr.harness.report.render import FORMATS, latex_escape, to_csv, to_latex, to_markdown, write_tables
from aqr.harness.report.shared import is_continual, row_order
from aqr.harness.report.stream_tables import stream_report, stream_tables, write_stream_figures
from aqr.harness.report.tables import (BASE_METHODS, METHOD_LABELS, Entry, Table, ablation_tables, bold_best,
                                       corruption_order, entry_of, flag_incomplete, has_ok, method_label,
                                       per_corruption_table, summarize, summary_table, variant_order)
from aqr.harness.presets import FIELD_DEFAULTS, MODEL_NOTES
from aqr.harness.results import ResultsDB, Row
from aqr.util.plots import require_matplotlib

__all__ = ["choose_defaults", "cost_points", "plot_costs", "setting_tables", "target_table", "BASE_METHODS", "FORMATS", "METHOD_LABELS", "Entry", "Table", "ablation_tables", "architecture_bars",
           "bold_best", "build_tables", "condition", "corruption_order", "entry_of", "flag_incomplete",
           "index_markdown", "latest_rows", "latex_escape", "load_rows", "mean_se", "method_label",
           "order_curves", "order_table", "order_tables", "paired_corruption_table", "paired_difference", "paired_table", "paired_tables", "per_corruption_table",
           "plot_architectures", "plot_orders", "plot_severity", "provenance_summary", "report", "report_dict",
           "is_continual", "row_order", "seed_table",
           "severity_curves", "stream_report", "stream_tables", "summarize", "summary_lines", "summary_table", "to_csv", "to_latex",
           "to_markdown", "variant_order", "write_figures", "write_order_figures", "write_stream_figures",
           "write_tables"]


def load_rows(db_path: str | Path, experiment: str | None = None, latest: bool = True) -> list[Row]:
    """Every row of the database (or of one experiment), the newest per condition when ``latest``.

    Raises ``FileNotFoundError`` for a missing file (instead of creating an empty database),
    :class:`aqr.harness.results.ResultsDBError` for a file that is not a results database and ``KeyError``
    for an unknown experiment.
    """
    path = Path(db_path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: results database not found (run `aqr bench --db {path}` first)")
    with ResultsDB(path, existing=True) as db:
        if experiment is not None and experiment not in db.experiments():
            known = ", ".join(db.experiments()) or "none"
            raise KeyError(f"{path} has no experiment {experiment!r} (experiments: {known})")
        rows = db.rows(experiment)
    return latest_rows(rows) if latest else rows


def condition(row: Row) -> tuple:
    """What a row measures, without its code version or file hashes (which are in its key): rows of two
    stream orders are two conditions."""
    return (row.model, row.variant, row.dataset, row.protocol, row.corruption, row.severity,
            row.batch_size, row.seed, row_order(row))


def latest_rows(rows: Iterable[Row]) -> list[Row]:
    """One row per :func:`condition`: the newest, so reruns under a new code version replace old rows."""
    newest: dict[tuple, Row] = {}
    for row in rows:
        kept = newest.get(condition(row))
        if kept is None or row.created >= kept.created:
            newest[condition(row)] = row
    return sorted(newest.values(), key=lambda r: r.created)


def provenance_summary(rows: Iterable[Row]) -> dict[str, list[str]]:
    """The distinct code versions, commits, torch versions and hosts behind the rows."""
    found: dict[str, set[str]] = defaultdict(set)
    for row in rows:
        for key in ("aqr", "git_commit", "torch", "host"):
            found[key].add(str(row.provenance.get(key)))
    return {k: sorted(v) for k, v in found.items()}


def build_tables(rows: Sequence[Row]) -> list[Table]:
    """Every table the rows support: summaries, ablations, per-corruption tables, then the continual
    cells' tables (:mod:`aqr.harness.report.stream_tables`), the realtime protocol's beside them
    (:mod:`aqr.harness.report.field_tables`) and the field preset's target table, AQR's default configurations
    (:data:`aqr.harness.presets.FIELD_DEFAULTS`) against the best field method
    (:mod:`aqr.harness.report.field_target`), and the recommended configuration's
    (:data:`aqr.methods.RECOMMENDED`) beside it."""
    from aqr.methods import RECOMMENDED

    rows_all = rows
    streams = stream_tables(rows) + ccc_tables(rows) + [ccc_target_table(rows, RECOMMENDED["offline"])]
    rows = [r for r in rows if not is_continual(r) and not is_ccc_row(r)]
    models = sorted({r.model for r in rows})
    tables = [summary_table(rows, m) for m in models]
    if len(models) > 1:
        tables.append(summary_table(rows, None))
    for model in models:
        tables.extend(ablation_tables(rows, model))
    for model in models:
        settings = sorted({(r.severity, r.batch_size) for r in rows if r.model == model})
        tables.extend(per_corruption_table(rows, model, s, b) for s, b in settings)
    tables += [*streams, *setting_tables(rows_all), target_table(rows_all, FIELD_DEFAULTS),
               recommended_table(rows_all, RECOMMENDED)]
    return [t for t in tables if t is not None]


def write_figures(rows: Sequence[Row], out_dir: str | Path) -> dict[str, list[Path]]:
    """Fig. 4 and Fig. 5 (at severity 3, or the closest present) when the rows support them, then the
    continual cells' figures (:mod:`aqr.harness.report.stream_tables`)."""
    out = Path(out_dir)
    figures: dict[str, list[Path]] = write_stream_figures(rows, out)
    figures.update(write_ccc_figures(rows, out))
    figures.update(plot_costs(rows, out))
    rows = [r for r in rows if not is_continual(r) and not is_ccc_row(r)]
    if not has_ok(rows):
        return figures
    figures["severity"] = plot_severity(rows, out / "severity")
    severity = closest_severity(rows)
    figures["architectures"] = plot_architectures(rows, out / f"architectures_sev{severity}", severity)
    return figures


def report_dict(rows: Sequence[Row], tables: Sequence[Table], superseded: int = 0) -> dict[str, Any]:
    """The JSON-able numbers of a report: row counts, provenance, tables and figure data."""
    paper = [r for r in rows if not is_continual(r) and not is_ccc_row(r)]  # the paper's; streams have their own
    severity = closest_severity(paper)
    return {
        "rows": dict(Counter(r.status for r in rows)),
        "superseded_rows": superseded,
        "models": sorted({r.model for r in rows}),
        "provenance": provenance_summary(rows),
        "tables": [t.to_dict() for t in tables],
        "severity_curves": severity_curves(paper),
        "architecture_bars": {"severity": severity,
                              "bars": architecture_bars(paper, severity) if severity is not None else {}},
        "streams": stream_report(rows),
        "costs": cost_points(rows),
        "ccc": ccc_report(rows),
    }


def report(db_path: str | Path, out_dir: str | Path, experiment: str | None = None,
           formats: Sequence[str] = FORMATS, figures: bool = True) -> dict[str, Any]:
    """Write every table and figure the database supports, an ``index.md`` and ``report.json``.

    Layout: ``tables/<name>.{md,tex,csv}``, ``figures/<name>.{png,pdf}``. Returns the JSON dict
    (also written to ``report.json``), with the written files under ``"files"``. With ``figures``,
    matplotlib must be installed (checked before anything is written).
    """
    if figures:
        require_matplotlib("aqr report's figures (or --no-figures)")
    all_rows = load_rows(db_path, experiment, latest=False)
    rows = latest_rows(all_rows)
    with ResultsDB(db_path, existing=True) as db:
        correct = db.correct(r.key for r in rows)
    tables = build_tables(rows)
    summaries = sum(t.name.startswith("summary_") for t in tables)  # the paired tables follow the summaries
    paired = paired_tables([r for r in rows if not is_continual(r)], correct)  # continual cells have their own
    tables = tables[:summaries] + paired + tables[summaries:]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table_files = write_tables(tables, out / "tables", formats)
    figure_files = write_figures(rows, out / "figures") if figures else {}
    result = {"db": str(db_path), "experiment": experiment,
              **report_dict(rows, tables, superseded=len(all_rows) - len(rows))}
    index = out / "index.md"
    index.write_text(index_markdown(result, tables, figure_files, table_files, out, summary_lines(rows)))
    files = [index, out / "report.json", *table_files, *(p for ps in figure_files.values() for p in ps)]
    result["files"] = [str(p) for p in files]
    (out / "report.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def summary_lines(rows: Sequence[Row]) -> list[str]:
    """The report's summary in Markdown: per run (model, setting, protocol, batch size) the method with the best
    mean accuracy over the run's cells beside Source's, then what each model name stands for."""
    ok = [r for r in rows if r.status == "ok" and r.accuracy is not None]
    runs: dict[tuple[str, str, str, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in ok:
        runs[(r.model, summary_setting(r), r.protocol, r.batch_size)][r.variant].append(float(r.accuracy))  # type: ignore[arg-type]
    if not runs:
        return []
    lines = ["## Summary", "", "The best method of each run (mean accuracy over the run's cells, %) beside the "
             "unadapted model; the tables below have every method.", "",
             "| model | setting | protocol | batch | best method | accuracy | Source | methods |", "|---|---|---|---:|---|---:|---:|---:|"]
    for (model, setting, protocol, size), by_variant in sorted(runs.items()):
        means = {v: sum(a) / len(a) for v, a in by_variant.items()}
        best = max(sorted(means, key=variant_order), key=lambda v: means[v])
        source = f"{means['source']:.2f}" if "source" in means else ""
        lines.append(f"| {model} | {setting} | {protocol} | {size} | {method_label(best)} | {means[best]:.2f} | "
                     f"{source} | {len(means)} |")
    notes = [f"- `{m}`: {MODEL_NOTES[m]}." for m in sorted({r.model for r in rows}) if m in MODEL_NOTES]
    if notes:
        lines += ["", "Models:", "", *notes]
    return lines + [""]


def summary_setting(row: Row) -> str:
    """The setting a row's run goes under in the summary: a CCC stream its own (its speed and length make another
    stream), a continual setting by name, else "per corruption"."""
    if is_ccc_row(row):
        return row.corruption
    return row_setting(row) if is_continual(row) else "per corruption"


def index_markdown(result: Mapping[str, Any], tables: Sequence[Table], figure_files: Mapping[str, Sequence[Path]],
                   table_files: Sequence[Path], out_dir: Path, summary: Sequence[str] = ()) -> str:
    """``index.md``: what the report covers, its summary (:func:`summary_lines`), its figures (PNG) and every
    table in Markdown."""
    counts = result["rows"]
    lines = [f"# aqr report: {result['experiment'] or 'all experiments'}", "",
             f"Database `{result['db']}`: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
             + f" rows ({result['superseded_rows']} older duplicates superseded).", ""]
    for key, values in result["provenance"].items():
        lines.append(f"- {key}: {', '.join(values)}")
    if summary:
        lines += ["", *summary]
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
