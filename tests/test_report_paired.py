"""Paired comparisons with bootstrap intervals over images, and means over seeds (aqr.harness.report.paired)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from aqr.harness import report
from aqr.harness.cells import Cell, DataSpec, ModelSpec, eval_indices, parse_range
from aqr.harness.report.paired import PairedCell, best_baseline, paired_difference
from aqr.harness.results import ResultsDB, pack_correct

POOL = "0:400"
N = 200
# per model: each method's chance of a right answer; TTN is n/a on the GN model
SKILL = {"bn": {"source": 0.5, "ttn": 0.6, "moments": 0.7, "aqr": 0.75}, "gn": {"source": 0.55, "moments": 0.6, "aqr": 0.65}}
CORRUPTIONS = ("gaussian_noise", "fog")
SEEDS = (0, 1, 2)


def test_identical_and_opposite_methods() -> None:
    images = np.arange(50)
    right = np.random.default_rng(0).random(50) < 0.5
    same = paired_difference([PairedCell(images, right, right)], replicates=200)
    assert (same.mean, same.low, same.high, same.cells) == (0.0, 0.0, 0.0, 1)
    ones, zeros = np.ones(50, bool), np.zeros(50, bool)
    opposite = paired_difference([PairedCell(images, ones, zeros)] * 3, replicates=200)
    assert opposite.mean == pytest.approx(100.0) and opposite.low == pytest.approx(100.0)
    with pytest.raises(ValueError, match="no cells"):
        paired_difference([])


def test_interval_matches_the_normal_approximation_for_one_cell() -> None:
    rng = np.random.default_rng(1)
    n = 4000
    a, b = rng.random(n) < 0.7, rng.random(n) < 0.6
    diff = paired_difference([PairedCell(np.arange(n), a, b)], replicates=2000)
    d = a.astype(float) - b.astype(float)
    assert diff.mean == pytest.approx(100 * d.mean())
    half = 1.96 * 100 * d.std() / np.sqrt(n)
    assert diff.low < diff.mean < diff.high
    assert (diff.high - diff.low) / 2 == pytest.approx(half, rel=0.1)


def test_cells_sharing_images_move_together() -> None:
    """Two cells on the same images with the same differences are one piece of evidence, not two;
    on disjoint images they are two, and the interval narrows by about sqrt(2)."""
    rng = np.random.default_rng(2)
    n = 2000
    a, b = rng.random(n) < 0.7, rng.random(n) < 0.6
    one = paired_difference([PairedCell(np.arange(n), a, b)])
    shared = paired_difference([PairedCell(np.arange(n), a, b)] * 2)
    disjoint = paired_difference([PairedCell(np.arange(n), a, b), PairedCell(np.arange(n, 2 * n), a, b)])
    width = lambda d: d.high - d.low  # noqa: E731
    assert width(shared) == pytest.approx(width(one), rel=0.1)
    assert width(one) / width(disjoint) == pytest.approx(np.sqrt(2), rel=0.15)


def _cell(model: str, method: str, corruption: str, seed: int, severity: int = 5, batch: int = 128) -> Cell:
    return Cell(ModelSpec(model, model), DataSpec(eval_indices=POOL), method, (), corruption, severity, batch, seed, N)


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> tuple[Path, dict]:
    """Rows with per-image results: each image has a difficulty shared by every method and corruption."""
    path = tmp_path_factory.mktemp("paired") / "r.db"
    hardness = np.random.default_rng(3).random(400)
    truth = {}
    with ResultsDB(path) as d:
        for model, skills in SKILL.items():
            for corruption in CORRUPTIONS:
                for seed in SEEDS:
                    for method in ("source", "ttn", "moments", "aqr"):
                        cell = _cell(model, method, corruption, seed)
                        key = f"{model}-{method}-{corruption}-{seed}"
                        if method not in skills:
                            d.add(key, cell.to_dict(), "n/a", None, None, 0.0, {}, "no BatchNorm")
                            continue
                        images = np.asarray(eval_indices(cell, parse_range(POOL)))
                        noise = np.random.default_rng([seed, CORRUPTIONS.index(corruption)]).random(N) * 0.2
                        right = hardness[images] + noise < skills[method] + 0.1
                        truth[(model, method, corruption, seed)] = right
                        d.add(key, cell.to_dict(), "ok", 100 * right.mean(), N, 1.0, {}, correct=pack_correct(right))
    return path, truth


def test_report_writes_paired_and_seed_tables(db, tmp_path: Path) -> None:
    path, truth = db
    result = report.report(path, tmp_path / "out", figures=False)
    tables = {t["name"]: t for t in result["tables"]}
    paired = tables["paired_bn"]
    rows = {r["label"]: r["cells"][0] for r in paired["rows"]}
    assert set(rows) >= {"AQR − best baseline", "AQR − Moments", "AQR − TTN", "AQR − Source", "Moments − TTN"}
    want = np.mean([truth[("bn", "aqr", c, s)].mean() - truth[("bn", "moments", c, s)].mean()
                    for c in CORRUPTIONS for s in SEEDS]) * 100
    entry = rows["AQR − Moments"]
    assert entry["mean"] == pytest.approx(want) and entry["n"] == len(CORRUPTIONS) * len(SEEDS)
    assert entry["low"] < entry["mean"] < entry["high"]
    assert "(TTN)" in rows["AQR − best baseline"]["text"]  # TTN is the better baseline on the BN model
    assert rows["AQR − best baseline"]["mean"] == pytest.approx(rows["AQR − TTN"]["mean"])
    gn = {r["label"] for r in tables["paired_gn"]["rows"]}
    assert "AQR − TTN" not in gn and "AQR − Source" in gn  # n/a rows pair with nothing
    per_corruption = tables["paired_corruptions_bn_sev5_bs128"]
    assert [r["label"] for r in per_corruption["rows"]] == [*CORRUPTIONS, "mean"]
    assert per_corruption["rows"][-1]["cells"][0]["mean"] == pytest.approx(want)
    seeds = {r["label"]: r["cells"][0] for r in tables["seeds_bn"]["rows"]}
    per_seed = [np.mean([100 * truth[("bn", "aqr", c, s)].mean() for c in CORRUPTIONS]) for s in SEEDS]
    assert seeds["AQR"]["mean"] == pytest.approx(np.mean(per_seed))
    assert seeds["AQR"]["std"] == pytest.approx(np.std(per_seed, ddof=1)) and seeds["AQR"]["n"] == 3
    csv_text = (tmp_path / "out" / "tables" / "paired_bn.csv").read_text()
    assert "low" in csv_text.splitlines()[0]
    again = report.report(path, tmp_path / "again", figures=False)  # the intervals are reproducible
    assert json.dumps(again["tables"]) == json.dumps(result["tables"])


def test_best_baseline_needs_every_cell() -> None:
    from aqr.harness.results import Row

    def row(method: str, acc: float, corruption: str) -> Row:
        return Row("k", "m", method, method, "d", corruption, 5, 128, 0, "episodic", "ok", acc, N, 1.0, None, {}, {}, 0.0)

    complete = [row("ttn", 60.0, c) for c in CORRUPTIONS]
    assert best_baseline(complete + [row("tent", 90.0, "fog")]) == "ttn"  # TENT has one cell of two
    assert best_baseline(complete + [row("source", 70.0, c) for c in CORRUPTIONS]) == "source"
    assert best_baseline([row("aqr", 90.0, "fog")]) is None


def test_every_aqr_variant_is_compared_with_the_control_and_the_baselines(tmp_path: Path) -> None:
    """A rerun in exact mode names its AQR cells aqr[mode=exact]; they are paired like plain AQR."""
    path = tmp_path / "r.db"
    rng = np.random.default_rng(5)
    truth = {}
    with ResultsDB(path) as d:
        for corruption in CORRUPTIONS:
            for method, options, skill in (("ttn", (), 0.6), ("moments", (), 0.7), ("aqr", (("mode", "exact"),), 0.8)):
                cell = Cell(ModelSpec("bn", "bn"), DataSpec(eval_indices=POOL), method, options, corruption, 5, 128, 0, N)
                right = rng.random(N) < skill
                truth[(cell.variant, corruption)] = right
                d.add(f"{cell.variant}-{corruption}", cell.to_dict(), "ok", 100 * right.mean(), N, 1.0, {},
                      correct=pack_correct(right))
    tables = {t["name"]: t for t in report.report(path, tmp_path / "out", figures=False)["tables"]}
    rows = {r["label"]: r["cells"][0] for r in tables["paired_bn"]["rows"]}
    assert {"AQR[mode=exact] − best baseline", "AQR[mode=exact] − Moments", "AQR[mode=exact] − TTN",
            "Moments − TTN"} <= set(rows)
    want = 100 * np.mean([truth[("aqr[mode=exact]", c)].mean() - truth[("moments", c)].mean() for c in CORRUPTIONS])
    assert rows["AQR[mode=exact] − Moments"]["mean"] == pytest.approx(want)
    per_corruption = tables["paired_corruptions_bn_sev5_bs128"]
    assert per_corruption["header"][1:] == ["AQR[mode=exact] − Moments", "AQR[mode=exact] − TTN", "Moments − TTN"]
