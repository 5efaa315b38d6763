"""Continual cells (one whole stream of corruption blocks) and the ``stream`` preset, with their report."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from aqr import models
from aqr.data.arrays import to_float
from aqr.harness import continual
from aqr.harness.cell_run import run_cell
from aqr.harness.cells import CONTINUAL_ORDER, data_corruptions, stream_corruptions
from aqr.harness.grid_driver import run_grid
from aqr.harness.presets import NONIID_METHODS, NONIID_ORDERS, STREAM_METHODS, preset
from aqr.harness.provenance import cell_files
from aqr.harness.report import load_rows, report
from aqr.harness.results import ResultsDB
from aqr.harness.source_stats import stats_options
from aqr.harness.specs import MethodSpec
from aqr.methods import create
from tests.test_bench import _tiny_setup

STREAM = "continual:gaussian_noise+contrast"


pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_stream_preset() -> None:
    grid = preset("stream", "data")
    assert grid.corruptions == ("continual",) and grid.severities == (5,) and grid.protocol == "online"
    assert grid.batch_sizes == (1, 4, 16, 64, 128) and grid.n_images == 2000 and grid.data.eval_indices == "5000:10000"
    assert [m.name for m in grid.methods] == [MethodSpec.parse(m).name for m in STREAM_METHODS]
    assert {m.name for m in grid.models} == {"resnet20", "resnet20_gn", "vit_ln"}
    assert len(list(grid.cells())) == 3 * len(STREAM_METHODS) * 5
    assert CONTINUAL_ORDER[0] == "gaussian_noise" and CONTINUAL_ORDER[-1] == "jpeg_compression"
    assert len(CONTINUAL_ORDER) == 15


def test_the_noniid_stream_preset() -> None:
    grid, stream = preset("stream-noniid", "data"), preset("stream", "data")
    assert (grid.corruptions, grid.severities, grid.protocol, grid.data) == (stream.corruptions, (5,), "online", stream.data)
    assert grid.models == stream.models and grid.seeds == (0,) and grid.n_images == 1000
    assert grid.batch_sizes == (16, 64) and grid.orders == ("iid", "delta=1", "delta=0.1", "delta=0.01", "mixed")
    assert grid.orders == NONIID_ORDERS
    assert [(m.name, dict(m.options)) for m in grid.methods] == [
        ("source", {}), ("ttn", {}), ("bn-ema", {}), ("rbn", {}), ("tent", {}), ("aqr", {}),
        ("aqr", {"target": "stream"}), ("aqr", {"target": "robust"}), ("aqr", {"target": "robust", "balance": 0.5})]
    cells = list(grid.cells())
    assert len(cells) == len(grid) == 3 * len(NONIID_METHODS) * 2 * 5 == 270
    assert len({(c.model.name, c.variant, c.batch_size, c.order) for c in cells}) == 270
    assert {c.order for c in cells if c.variant == "aqr[target=robust]" and c.model.name == "vit_ln"} == set(NONIID_ORDERS)
    # balance < 1 maps onto class-conditional knots: its statistics are calibrated with groups, in their own file
    grouped = [c for c in cells if c.option_dict.get("balance") == 0.5]
    assert grouped and all(stats_options(c).get("groups") == 16 for c in grouped)
    assert all("groups" not in stats_options(c) for c in cells if c not in grouped)


def test_the_noniid_preset_runs_every_method_in_every_order(tiny_stream, tmp_path: Path) -> None:
    """The preset's methods, online, on a continual stream in each of its orders: ok, or n/a where a method
    needs BatchNorm; aqr report then compares the orders."""
    methods = preset("stream-noniid", "data").methods
    grid = replace(tiny_stream, methods=methods, orders=NONIID_ORDERS, n_images=8)
    db_path = tmp_path / "r.db"
    with ResultsDB(db_path) as db:
        summary = run_grid(grid, db, tmp_path / "cache", progress=False, log=lambda m: None)
        assert summary.errors == 0, summary.error_messages
        rows = db.rows()
    assert len(rows) == len(grid) == 2 * len(methods) * len(NONIID_ORDERS)
    not_applicable = {(r.model, r.method) for r in rows if r.status == "n/a"}
    assert not_applicable == {("tiny_gn", m) for m in ("ttn", "bn-ema", "rbn")}
    assert all(r.detail["n"] == 16 for r in rows if r.status == "ok")
    result = report(db_path, tmp_path / "report")
    table = next(t for t in result["tables"] if t["name"] == "orders_tiny-bn_bs4")
    assert [h for h in table["header"][1:]] == list(NONIID_ORDERS)
    by_order = {r.config["order"]: r.accuracy for r in rows if r.model == "tiny_bn" and r.variant == "rbn"}
    rbn = next(row for row in table["rows"] if row["label"] == "RBN")
    assert [c["mean"] for c in rbn["cells"]] == [pytest.approx(by_order[o]) for o in NONIID_ORDERS]
    assert (tmp_path / "report" / "figures" / "stream_orders_bs4.png").is_file()


def test_continual_corruptions_are_parsed_and_checked() -> None:
    assert stream_corruptions("continual") == CONTINUAL_ORDER
    assert stream_corruptions("continual:fog+contrast") == ("fog", "contrast")
    assert stream_corruptions("fog") is None
    with pytest.raises(ValueError, match="rain"):
        stream_corruptions("continual:fog+rain")
    assert data_corruptions(["fog", "continual:contrast+fog"]) == ("fog", "contrast")
    with pytest.raises(ValueError, match="rain"):
        replace(preset("stream", "data"), corruptions=("continual:fog+rain",))


@pytest.fixture()
def tiny_stream(tmp_path: Path):
    grid, _ = _tiny_setup(tmp_path)
    return replace(grid, name="tiny-stream", corruptions=(STREAM,), batch_sizes=(4,), n_images=12,
                   protocol="online", methods=(MethodSpec("source"), MethodSpec("bn-ema")))


def test_a_continual_cell_streams_the_same_images_block_after_block_without_reset(tiny_stream, tmp_path: Path) -> None:
    cell = next(c for c in tiny_stream.cells() if c.method == "bn-ema" and c.model.name == "tiny_bn")
    assert {f"eval:{n}" for n in ("gaussian_noise", "contrast")} <= set(cell_files(cell))
    result = run_cell(cell, tmp_path / "cache")
    assert result.status == "ok" and result.n_images == 24, result.message
    blocks = continual.stream_blocks(cell)
    assert [name for name, _, _ in blocks] == ["gaussian_noise", "contrast"]
    assert np.array_equal(blocks[0][2], blocks[1][2])  # the same drawn images (labels) in both blocks
    # the same stream by hand: one method, never reset, batches of 4 within each block
    method = create("bn-ema", models.load(cell.model.model), protocol="online")
    correct = [method(to_float(images[i : i + 4])).argmax(1).numpy() == labels[i : i + 4]
               for _, images, labels in blocks for i in range(0, len(labels), 4)]
    expected = np.concatenate(correct)
    assert np.array_equal(continual.correctness(result.detail), expected)
    assert result.accuracy == pytest.approx(100 * expected.mean())
    accuracies = continual.block_accuracies(result.detail)
    assert list(accuracies) == ["gaussian_noise", "contrast"]
    assert accuracies["contrast"] == pytest.approx(100 * expected[12:].mean())
    curve = continual.along_stream(result.detail, 5)
    assert curve[-1] == pytest.approx(100 * expected[-5:].mean()) and curve[0] == 100 * expected[0]


def test_batches_stay_inside_blocks(tiny_stream) -> None:
    cell = replace(next(iter(tiny_stream.cells())), batch_size=5)
    images, labels, starts = continual.stream_batches(cell, continual.stream_blocks(cell))
    assert starts == [0, 5, 10, 12, 17, 22] and len(labels) == 24
    mixed = replace(cell, order="mixed")
    assert continual.stream_batches(mixed, continual.stream_blocks(mixed))[2] == [0, 5, 10, 15, 20]


def test_a_stream_grid_resumes_and_reports(tiny_stream, tmp_path: Path) -> None:
    db_path = tmp_path / "r.db"
    with ResultsDB(db_path) as db:
        summary = run_grid(tiny_stream, db, tmp_path / "cache", progress=False, log=lambda m: None)
        assert summary.ran == 4 and summary.errors == 0, summary.error_messages
        assert {(r.model, r.method): r.status for r in db.rows()}[("tiny_gn", "bn-ema")] == "n/a"
        assert all(r.detail and r.detail["n"] == 24 for r in db.rows(status="ok"))
        again = run_grid(tiny_stream, db, tmp_path / "cache", progress=False, log=lambda m: None)
        assert again.ran == 0 and again.skipped == 4
    result = report(db_path, tmp_path / "report")
    names = {t["name"] for t in result["tables"]}
    assert {"stream_tiny-bn_batch_sizes", "stream_tiny-bn_bs4_blocks"} <= names
    assert not any(n.startswith("per_corruption") for n in names)  # a stream is not a corruption column
    assert (tmp_path / "report" / "figures" / "stream_batch_sizes.png").is_file()
    assert (tmp_path / "report" / "figures" / "stream_along_bs4.png").is_file()
    blocks = result["streams"]["blocks"]
    rows = {(r.model, r.method): r for r in load_rows(db_path)}
    source = next(b for b in blocks if b["model"] == "tiny_bn" and b["variant"] == "source")
    assert np.mean(list(source["accuracy"].values())) == pytest.approx(rows[("tiny_bn", "source")].accuracy)
