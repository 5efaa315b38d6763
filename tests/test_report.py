"""``aqr report``: tables, renderers and figures from a small synthetic database."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from aqr import cli
from aqr.harness import report
from aqr.harness.cells import Cell, DataSpec, ModelSpec
from aqr.harness.results import ResultsDB


MODELS = ("resnet20", "vit_ln")
METHODS = ("source", "ttn", "tent", "sar", "aqr")
BASE = {"source": 50.0, "ttn": 60.0, "tent": 61.0, "sar": 62.0, "aqr": 70.0}
TAILS = {"standard": 64.0, "gaussian": 67.0}
CORRUPTIONS = ("gaussian_noise", "defocus_blur", "fog")
SEVERITIES = (3, 5)
BATCH_SIZES = (128, 512)
SEEDS = (0, 1, 2)
# one failed cell: its mean must be over the other two seeds
ERROR_CELL = ("resnet20", "sar", "fog", 5, 512, 2)


def _cell(model: str, method: str, options: dict, corruption: str, severity: int, batch_size: int, seed: int) -> dict:
    cell = Cell(ModelSpec(model, model), DataSpec(), method, tuple(sorted(options.items())), corruption,
                severity, batch_size, seed, 2000)
    return cell.to_dict()


def _accuracy(rng: np.random.Generator, base: float, corruption: str, severity: int) -> float:
    return float(base - 4 * CORRUPTIONS.index(corruption) - 3 * severity + rng.uniform(-1, 1))


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> tuple[Path, dict]:
    """A database with every row kind; returns its path and the true accuracies by condition."""
    path = tmp_path_factory.mktemp("report") / "results.db"
    rng = np.random.default_rng(0)
    truth: dict[tuple, float] = {}
    prov = {"aqr": "0.1.0", "git_commit": "abc123", "torch": torch.__version__, "host": "test"}
    with ResultsDB(path) as d:
        # a stale row for a condition rerun later under a new code version: it must be superseded
        d.add("stale", _cell("resnet20", "aqr", {}, "fog", 3, 128, 0), "ok", 1.0, 2000, 1.0, prov)
        time.sleep(0.01)
        keys = []
        for model in MODELS:
            variants = [(m, {}) for m in METHODS]
            if model == "resnet20":
                variants += [("aqr", {"tail": t}) for t in TAILS]
            for method, options in variants:
                for corruption in CORRUPTIONS:
                    for severity in SEVERITIES:
                        for bs in BATCH_SIZES:
                            for seed in SEEDS:
                                cell = _cell(model, method, options, corruption, severity, bs, seed)
                                variant = f"aqr[tail={options['tail']}]" if options else method
                                key = f"{model}-{variant}-{corruption}-{severity}-{bs}-{seed}"
                                keys.append(key)
                                if model == "vit_ln" and method == "ttn":
                                    d.add(key, cell, "n/a", None, None, 0.0, prov, "TTN needs BatchNorm")
                                elif (model, method, corruption, severity, bs, seed) == ERROR_CELL:
                                    d.add(key, cell, "error", None, None, 0.0, prov, "boom")
                                else:
                                    base = TAILS[options["tail"]] if options else BASE[method]
                                    acc = _accuracy(rng, base, corruption, severity)
                                    truth[(model, variant, corruption, severity, bs, seed)] = acc
                                    d.add(key, cell, "ok", acc, 2000, 1.0, prov)
        d.add_membership("main", keys)
        d.add_membership("other", keys[:5])
    return path, truth


@pytest.fixture(scope="module")
def rows(db):
    return report.load_rows(db[0])


def _values(truth: dict, **fixed) -> list[float]:
    names = ("model", "variant", "corruption", "severity", "batch_size", "seed")
    idx = {names.index(k): v for k, v in fixed.items()}
    return [acc for cond, acc in truth.items() if all(cond[i] == v for i, v in idx.items())]


def _by_label(table: report.Table) -> dict[str, tuple[report.Entry, ...]]:
    return dict(zip(table.labels, table.entries))


# --- loading ------------------------------------------------------------------------------------


def test_newest_row_per_condition_wins(db, rows) -> None:
    all_rows = report.load_rows(db[0], latest=False)
    assert len(all_rows) == len(rows) + 1
    fog = [r for r in rows if (r.model, r.variant, r.corruption, r.severity, r.batch_size, r.seed)
           == ("resnet20", "aqr", "fog", 3, 128, 0)]
    assert len(fog) == 1 and fog[0].accuracy != 1.0
    assert len(report.load_rows(db[0], "other")) == 5


def test_missing_db_and_unknown_experiment_raise(db, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.db"):
        report.load_rows(tmp_path / "nope.db")
    assert not (tmp_path / "nope.db").exists()  # no empty database left behind
    with pytest.raises(KeyError, match="main, other"):
        report.load_rows(db[0], "tails")


# --- tables -------------------------------------------------------------------------------------


def test_per_corruption_table_means_over_seeds(db, rows) -> None:
    truth = db[1]
    table = report.per_corruption_table(rows, "resnet20", 5, 512)
    assert table.header == ("Method", *CORRUPTIONS, "mean")
    assert table.labels[:5] == ("Source (NA)", "TTN", "TENT", "SAR", "AQR")
    assert table.labels[5:] == ("AQR[tail=gaussian]", "AQR[tail=standard]")
    by = _by_label(table)
    for label, variant in (("TENT", "tent"), ("SAR", "sar"), ("AQR[tail=gaussian]", "aqr[tail=gaussian]")):
        means = [np.mean(_values(truth, model="resnet20", variant=variant, corruption=c, severity=5, batch_size=512))
                 for c in CORRUPTIONS]
        assert [e.mean for e in by[label][:3]] == pytest.approx(means, abs=1e-12)
        assert by[label][3].mean == pytest.approx(np.mean(means), abs=1e-12)
    assert by["SAR"][2].n == 2  # the error row is left out of the mean and the entry says so
    assert by["SAR"][2].text == f"{by['SAR'][2].mean:.1f} (2 of 3)" and not by["SAR"][2].rankable
    # AQR is best in every column and is the only bold entry
    assert all(e.bold for e in by["AQR"])
    assert not any(e.bold for label, row in by.items() if label != "AQR" for e in row)


def test_na_method_renders_na(rows) -> None:
    table = report.per_corruption_table(rows, "vit_ln", 3, 128)
    assert [e.text for e in _by_label(table)["TTN"]] == ["n/a"] * 4
    assert "| TTN | n/a | n/a | n/a | n/a |" in report.to_markdown(table)
    assert "n/a" in report.to_latex(table)
    assert report.per_corruption_table(rows, "vit_ln", 1, 128) is None  # no data at severity 1


def test_summary_table_mean_std_match_numpy(db, rows) -> None:
    truth = db[1]
    table = report.summary_table(rows, "resnet20")
    assert table.header[1:] == ("bs 128, sev 3", "bs 128, sev 5", "bs 512, sev 3", "bs 512, sev 5")
    by = _by_label(table)
    for j, (bs, sev) in enumerate([(128, 3), (128, 5), (512, 3), (512, 5)]):
        values = _values(truth, model="resnet20", variant="tent", severity=sev, batch_size=bs)
        entry = by["TENT"][j]
        assert entry.n == len(values) == 9
        assert entry.mean == pytest.approx(np.mean(values), abs=1e-12)
        assert entry.std == pytest.approx(np.std(values, ddof=1), abs=1e-12)
        assert entry.text == f"{np.mean(values):.1f} ± {np.std(values, ddof=1):.1f}"
    assert all(e.bold for e in by["AQR"]) and not any(e.bold for e in by["TENT"])


def test_pooled_summary_averages_applicable_models(db, rows) -> None:
    table = report.summary_table(rows, None)
    ttn = _by_label(table)["TTN"][0]
    assert ttn.n == 9 and ttn.text.endswith("(9 of 18)")  # resnet20 only: TTN is n/a on the ViT
    values = _values(db[1], variant="tent", severity=3, batch_size=128)
    assert _by_label(table)["TENT"][0].mean == pytest.approx(np.mean(values), abs=1e-12)
    assert "vit_ln" in table.note


def test_ablation_table_pools_severities(db, rows) -> None:
    (table,) = report.ablation_tables(rows, "resnet20")
    assert table.labels == ("AQR[tail=gaussian]", "AQR[tail=standard]")
    assert table.header == ("Variant", "bs 128", "bs 512")
    assert "severities 3, 5" in table.note
    values = _values(db[1], model="resnet20", variant="aqr[tail=standard]", batch_size=512)
    entry = table.entries[1][1]
    assert (entry.n, entry.mean, entry.std) == (18, pytest.approx(np.mean(values)), pytest.approx(np.std(values, ddof=1)))
    assert table.entries[0][0].bold and not table.entries[1][0].bold
    assert report.ablation_tables(rows, "vit_ln") == []


def test_incomplete_row_mean_says_so_and_cannot_win(rows) -> None:
    kept = [r for r in rows if not (r.variant == "aqr" and r.corruption == "fog")]
    table = report.per_corruption_table(kept, "resnet20", 3, 128)
    mean = _by_label(table)["AQR"][-1]
    assert mean.text.endswith("(2 of 3)") and not mean.bold
    assert _by_label(table)["AQR[tail=gaussian]"][-1].bold  # the best complete row wins instead


def test_displayed_ties_are_all_bold() -> None:
    entries = [[report.Entry("70.0", 70.04, None, 1)], [report.Entry("70.0", 69.96, None, 1)],
               [report.Entry("n/a")], [report.Entry("69.0", 69.0, None, 1)]]
    assert [row[0].bold for row in report.bold_best(entries)] == [True, True, False, False]


# --- renderers ----------------------------------------------------------------------------------


def test_markdown_bolds_the_best(rows) -> None:
    table = report.summary_table(rows, "resnet20")
    line = next(l for l in report.to_markdown(table).splitlines() if l.startswith("| AQR |"))
    assert line.count("**") == 2 * 4
    assert "**" not in next(l for l in report.to_markdown(table).splitlines() if l.startswith("| SAR |"))


def test_csv_round_trips_numbers(rows) -> None:
    for table in (report.per_corruption_table(rows, "vit_ln", 5, 128), report.summary_table(rows, "resnet20")):
        parsed = list(csv.reader(io.StringIO(report.to_csv(table))))
        assert parsed[0][0] == "Method" and len(parsed[0]) == 1 + 3 * (len(table.header) - 1)
        for line, label, entries in zip(parsed[1:], table.labels, table.entries):
            assert line[0] == label
            for j, e in enumerate(entries):
                mean, std, n = line[1 + 3 * j : 4 + 3 * j]
                assert (float(mean) if e.mean is not None else mean) == (e.mean if e.mean is not None else e.text)
                assert (float(std) if std else None) == e.std
                assert int(n) == e.n


def test_latex_is_balanced_with_one_cell_per_column(rows) -> None:
    for table in report.build_tables(rows):
        tex = report.to_latex(table)
        plain = tex.replace(r"\{", "").replace(r"\}", "")
        depth = 0
        for ch in plain:
            depth += {"{": 1, "}": -1}.get(ch, 0)
            assert depth >= 0
        assert depth == 0
        body = [l for l in tex.splitlines() if l.endswith(r"\\")]
        assert len(body) == 1 + len(table.labels)
        for line in body:
            assert len(re.findall(r"(?<!\\)&", line)) == len(table.header) - 1
        assert "gaussian\\_noise" in tex or "gaussian_noise" not in "".join(table.header)
        assert r"\textbf{" in tex


# --- files, figures and the CLI -------------------------------------------------------------------


def _main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def written(db, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("out")
    return out, report.report(db[0], out, experiment="main")


def test_report_writes_tables_figures_and_index(written) -> None:
    out, result = written
    names = [t["name"] for t in result["tables"]]
    assert names[:3] == ["summary_resnet20", "summary_vit-ln", "summary_all"]
    assert "ablation_resnet20_aqr_tail" in names
    assert sum(n.startswith("per_corruption_") for n in names) == 8
    for name in names:
        for ext in (".md", ".tex", ".csv"):
            assert (out / "tables" / f"{name}{ext}").stat().st_size > 0
    for stem in ("severity", "architectures_sev3"):
        png, pdf = out / "figures" / f"{stem}.png", out / "figures" / f"{stem}.pdf"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
        assert pdf.read_bytes()[:5] == b"%PDF-" and pdf.stat().st_size > 1000
    index = (out / "index.md").read_text()
    assert "![severity](figures/severity.png)" in index and "[tex](tables/summary_all.tex)" in index
    assert "**Summary: resnet20**" in index
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(result))
    assert result["rows"] == {"ok": 395, "n/a": 36, "error": 1} and result["superseded_rows"] == 0


def test_figure_numbers(db, written) -> None:
    truth = db[1]
    result = written[1]
    curve = result["severity_curves"]["cifar10-c"]["tent"]
    assert curve["severity"] == [3, 5]
    # seeds averaged first, then mean and SE across (model, corruption, batch size)
    conds = [np.mean(_values(truth, model=m, variant="tent", corruption=c, severity=5, batch_size=b))
             for m in MODELS for c in CORRUPTIONS for b in BATCH_SIZES]
    assert curve["mean"][1] == pytest.approx(np.mean(conds))
    assert curve["se"][1] == pytest.approx(np.std(conds, ddof=1) / np.sqrt(len(conds)))
    bars = result["architecture_bars"]
    assert bars["severity"] == 3 and bars["bars"]["vit_ln"]["ttn"] == {"status": "n/a"}
    assert bars["bars"]["resnet20"]["aqr"]["n"] == 6


def test_cli_json_matches_library(db, rows) -> None:
    code, out, _ = _main(["report", "--db", str(db[0]), "--experiment", "main", "--json"])
    assert code == 0
    numbers = json.loads(out)
    summary = next(t for t in numbers["tables"] if t["name"] == "summary_resnet20")
    assert summary == json.loads(json.dumps(report.summary_table(rows, "resnet20").to_dict()))


def test_cli_prints_markdown_without_out(db) -> None:
    code, out, _ = _main(["report", "--db", str(db[0])])
    assert code == 0 and out.startswith("**Summary: resnet20**") and "| TTN | n/a |" in out


def test_cli_errors_name_the_problem(db, tmp_path) -> None:
    missing = tmp_path / "missing.db"
    code, out, err = _main(["report", "--db", str(missing)])
    assert code == 2 and str(missing) in err and "not found" in err and "Traceback" not in err
    bad = tmp_path / "bad.db"
    bad.write_text("not a database" * 100)
    code, _, err = _main(["report", "--db", str(bad)])
    assert code == 1 and str(bad) in err  # a file that cannot be used: a runtime error, as a corrupt checkpoint
    code, _, err = _main(["report", "--db", str(db[0]), "--experiment", "nope"])
    assert code == 2 and "'nope'" in err and "main" in err
    code, _, err = _main(["report", "--db", str(db[0]), "--format", "md,docx"])
    assert code == 2 and "docx" in err


def test_pooled_severity_panel_drops_methods_missing_on_some_models(written) -> None:
    curves = written[1]["severity_curves"]
    assert "ttn" not in curves["cifar10-c"]              # n/a on vit_ln: not averaged over resnet20 alone
    assert "aqr[tail=gaussian]" not in curves["cifar10-c"]  # only run on resnet20
    assert "ttn" in curves["cifar10-c / resnet20"] and "ttn" not in curves["cifar10-c / vit_ln"]
    assert set(curves) == {"cifar10-c", "cifar10-c / resnet20", "cifar10-c / vit_ln"}
