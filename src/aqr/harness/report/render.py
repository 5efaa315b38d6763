"""Rendering a :class:`~aqr.harness.report.tables.Table` as Markdown, LaTeX or CSV, and writing the files."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from aqr.harness.report.tables import Table

FORMATS = ("md", "latex", "csv")


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
    """One line per row: the label, then mean, std and n of each column at full precision (and the
    interval's low and high when the table's entries have intervals).

    A mean cell holds the entry's text instead when it has no number ("n/a", "error" or "").
    """
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    parts = ["mean", "std", "n"]
    if any(e.low is not None for row in table.entries for e in row):
        parts += ["low", "high"]
    writer.writerow([table.header[0], *(f"{h} {part}" for h in table.header[1:] for part in parts)])
    number = lambda v: repr(v) if v is not None else ""  # noqa: E731
    for label, row in zip(table.labels, table.entries):
        values: list[Any] = [label]
        for e in row:
            values += [repr(e.mean) if e.mean is not None else e.text, number(e.std), e.n]
            if len(parts) > 3:
                values += [number(e.low), number(e.high)]
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
