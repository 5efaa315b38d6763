"""``aqr report`` on continual cells in several stream orders (the ``stream-noniid`` preset): accuracy against
the order, per model, batch size and method, from synthetic rows."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from aqr.harness import report
from aqr.harness.cells import Cell, DataSpec, ModelSpec
from aqr.harness.continual import stream_detail
from aqr.harness.presets import NONIID_ORDERS
from aqr.harness.report.orders import order_key, order_positions
from aqr.harness.results import ResultsDB, Row

MODELS = ("resnet20", "vit_ln")
VARIANTS = (("source", {}), ("ttn", {}), ("aqr", {}), ("aqr", {"target": "stream"}))
BATCH_SIZES = (16, 64)
SEEDS = (0, 1)
STREAM = "continual:gaussian_noise+fog"
BLOCK = 40


def _variant(method: str, options: dict) -> str:
    return method + ("".join(f"[{k}={v}]" for k, v in options.items()))


def _synthetic(rng: np.random.Generator) -> tuple[list[tuple[dict, str, float | None, dict | None]], dict]:
    """(cell dict, status, accuracy, detail) per cell and the accuracies by (model, variant, bs, order, seed)."""
    cells, truth = [], {}
    for model in MODELS:
        for method, options in VARIANTS:
            for bs in BATCH_SIZES:
                for order in NONIID_ORDERS:
                    for seed in SEEDS:
                        cell = Cell(ModelSpec(model, model), DataSpec(), method, tuple(sorted(options.items())), STREAM,
                                    5, bs, seed, BLOCK, "online", order).to_dict()
                        if model == "vit_ln" and method == "ttn":
                            cells.append((cell, "n/a", None, None))
                            continue
                        correct = rng.random(2 * BLOCK) < rng.uniform(0.2, 0.9)
                        accuracy = 100.0 * float(correct.mean())
                        truth[(model, _variant(method, options), bs, order, seed)] = accuracy
                        cells.append((cell, "ok", accuracy, stream_detail(correct, ["gaussian_noise", "fog"], BLOCK)))
    return cells, truth


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> tuple[Path, dict]:
    """A results database of continual cells in every order of the stream-noniid preset, and the accuracies."""
    path = tmp_path_factory.mktemp("orders") / "results.db"
    cells, truth = _synthetic(np.random.default_rng(0))
    with ResultsDB(path) as db:
        for i, (cell, status, accuracy, detail) in enumerate(cells):
            db.add(f"k{i}", cell, status, accuracy, None if accuracy is None else 2 * BLOCK, 1.0, {"aqr": "0"},
                   "n/a" if status == "n/a" else None, detail=detail)
        db.add_membership("stream-noniid", [f"k{i}" for i in range(len(cells))])
    return path, truth


def test_rows_of_different_orders_are_different_conditions(synthetic) -> None:
    path, truth = synthetic
    rows = report.load_rows(path)
    assert len(rows) == len(MODELS) * len(VARIANTS) * len(BATCH_SIZES) * len(NONIID_ORDERS) * len(SEEDS)
    assert {report.row_order(r) for r in rows} == set(NONIID_ORDERS)


def test_the_order_table_holds_each_methods_mean_over_seeds_per_order(synthetic) -> None:
    path, truth = synthetic
    rows = report.load_rows(path)
    table = report.order_table(rows, "resnet20", 64)
    assert table.name == "orders_resnet20_bs64"
    assert table.header == ("Method", "iid", "delta=1", "delta=0.1", "delta=0.01", "mixed")
    assert table.labels == ("Source (NA)", "TTN", "AQR", "AQR[target=stream]")
    for label, (method, options) in zip(table.labels, VARIANTS):
        row = dict(zip(table.header[1:], table.entries[table.labels.index(label)]))
        for order in NONIID_ORDERS:
            expected = np.mean([truth[("resnet20", _variant(method, options), 64, order, s)] for s in SEEDS])
            assert row[order].mean == pytest.approx(expected) and row[order].n == len(SEEDS)
    for column in range(len(NONIID_ORDERS)):  # the best of each column is bold
        means = [row[column].mean for row in table.entries]
        assert [row[column].bold for row in table.entries] == [round(m, 1) == round(max(means), 1) for m in means]
    vit = report.order_table(rows, "vit_ln", 16)
    assert [e.text for e in vit.entries[vit.labels.index("TTN")]] == ["n/a"] * len(NONIID_ORDERS)
    assert report.order_table(rows, "resnet20", 128) is None


def test_the_report_writes_the_order_tables_and_figures(synthetic, tmp_path: Path) -> None:
    path, truth = synthetic
    result = report.report(path, tmp_path / "out")
    names = {t["name"] for t in result["tables"]}
    assert {f"orders_{m.replace('_', '-')}_bs{b}" for m in MODELS for b in BATCH_SIZES} <= names
    # the stream tables keep each order apart (named after it); a mixed stream has no blocks to tabulate
    assert "stream_resnet20_batch_sizes" not in names  # every row has an order
    assert {"stream_resnet20_batch_sizes_delta-0-1", "stream_resnet20_bs16_blocks_delta-0-01",
            "stream_resnet20_batch_sizes_mixed"} <= names
    assert not any(n.startswith("stream_") and "blocks_mixed" in n for n in names)
    figures = tmp_path / "out" / "figures"
    for b in BATCH_SIZES:
        assert (figures / f"stream_orders_bs{b}.png").stat().st_size > 0
        assert (figures / f"stream_orders_bs{b}.pdf").is_file()
        assert (figures / f"stream_along_bs{b}_iid.png").is_file()
        assert not (figures / f"stream_along_bs{b}_mixed.png").exists()
    curves = result["streams"]["orders"]["resnet20"][16]
    assert curves["aqr[target=stream]"]["order"] == list(NONIID_ORDERS)
    assert curves["aqr[target=stream]"]["accuracy"][2] == pytest.approx(
        np.mean([truth[("resnet20", "aqr[target=stream]", 16, "delta=0.1", s)] for s in SEEDS]))
    index = (tmp_path / "out" / "index.md").read_text()
    assert "resnet20: continual stream at batch size 64, accuracy by stream order" in index
    assert "figures/stream_orders_bs64.png" in index
    blocks = [b for b in result["streams"]["blocks"] if b["model"] == "resnet20" and b["variant"] == "source"]
    assert {b["order"] for b in blocks} == set(NONIID_ORDERS) - {"mixed"}


def test_rows_without_an_order_keep_their_stream_tables(synthetic) -> None:
    path, _ = synthetic
    rows = report.load_rows(path)
    unordered = [Row(**{**r.__dict__, "key": r.key + "-none", "config": {k: v for k, v in r.config.items() if k != "order"}})
                 for r in rows if report.row_order(r) == "iid"]
    names = [t.name for t in report.stream_tables(unordered + rows)]
    assert "stream_resnet20_batch_sizes" in names and "stream_resnet20_bs16_blocks" in names
    table = next(t for t in report.stream_tables(unordered) if t.name == "stream_resnet20_batch_sizes")
    assert not any(t.name.startswith("orders_") for t in report.stream_tables(unordered))
    ordered = next(t for t in report.stream_tables(rows) if t.name == "stream_resnet20_batch_sizes_iid")
    assert table.entries == ordered.entries  # the same rows, only named after their order


def test_orders_sit_on_a_log_axis_with_iid_right_of_every_delta_and_mixed_apart() -> None:
    orders = sorted(["mixed", "delta=0.01", "iid", "delta=1", "delta=0.1", "mixed,delta=0.1"], key=order_key)
    assert orders == ["iid", "delta=1", "delta=0.1", "delta=0.01", "mixed", "mixed,delta=0.1"]
    x = order_positions(orders)
    assert (x["delta=0.01"], x["delta=0.1"], x["delta=1"]) == (0.01, 0.1, 1.0)
    assert x["iid"] == 10.0 and x["mixed"] == 100.0 and x["mixed,delta=0.1"] == 1000.0
    assert order_positions(["iid", "delta=0.5"])["iid"] == 1.0 and order_positions(["iid"]) == {"iid": 1.0}
    assert all(math.isfinite(v) and v > 0 for v in x.values())


@pytest.mark.parametrize("count", [3, 10, 13, 20])
def test_a_figures_lines_get_colours_apart_up_to_twenty(count: int) -> None:
    pytest.importorskip("matplotlib")
    from aqr.util.plots import colors

    names = [f"method {i}" for i in range(count)]
    given = colors(names)
    assert list(given) == names and len({tuple(c) for c in given.values()}) == count
