"""The benchmark grid, the results database and the resumable runner (``aqr bench``)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from aqr import models
from aqr.cli import main as cli_main
from aqr.data.arrays import to_float
from aqr.data.cifar_c import GenerationConfig, generate_cifar_c
from aqr.data.streams import mean_run_length
from aqr.harness.cell_run import run_cell
from aqr.harness.cells import Cell, DataSpec, ModelSpec, eval_indices, parse_range
from aqr.harness.eval_loop import evaluate
from aqr.harness.grid_driver import run_grid
from aqr.harness.grid_files import grid_from_mapping, load_grid
from aqr.harness.inputs import eval_data
from aqr.harness.keys import cell_key
from aqr.harness.presets import PRESETS, default_models, preset
from aqr.harness.provenance import fingerprints
from aqr.harness.results import ResultsDB, ResultsDBError, pack_correct, unpack_correct
from aqr.harness.source_stats import stats_path
from aqr.harness.specs import GridSpec, MethodSpec

CORRUPTIONS = ("gaussian_noise", "contrast")


# ----------------------------------------------------------------------------- grid


def test_parse_range_accepts_slices_and_lists() -> None:
    assert parse_range("2:5") == [2, 3, 4]
    assert parse_range("1,4, 9") == [1, 4, 9]
    assert parse_range([3, 1]) == [3, 1]
    assert parse_range(None) is None
    for bad in ("5:2", "a:b", "1:2:3", "x"):
        with pytest.raises(ValueError):
            parse_range(bad)


DATA = "data"  # the presets only build paths below the data folder: no files needed


def test_method_spec_parses_options() -> None:
    assert MethodSpec.parse("tent") == MethodSpec("tent", {})
    spec = MethodSpec.parse("aqr:tail=gaussian,K=11,gaussian_p=0.001,compile=false")
    assert spec.options == {"tail": "gaussian", "K": 11, "gaussian_p": 0.001, "compile": False}
    assert MethodSpec.parse({"method": "sar", "lr": 0.01}) == MethodSpec("sar", {"lr": 0.01})
    with pytest.raises(ValueError, match="key=value"):
        MethodSpec.parse("aqr:tail")


def test_every_preset_expands_and_main_matches_the_paper() -> None:
    for name in PRESETS:
        grid = preset(name, DATA)
        assert len(list(grid.cells())) == len(grid) > 0
    main = preset("main", DATA)
    assert {m.name for m in main.methods} == {"source", "ttn", "tent", "sar", "moments", "aqr"}
    assert main.severities == (1, 3, 5) and main.batch_sizes == (128, 512) and len(main.corruptions) == 19
    assert [m.name for m in main.models] == ["resnet20", "resnet20_bn", "resnet20_gn", "vit_ln"]
    assert len(main) == 4 * 6 * 19 * 3 * 2 * 3
    tails = preset("tails", DATA)
    assert sorted(c.variant for c in tails.cells() if c.corruption == "fog" and c.severity == 3
                  and c.batch_size == 128 and c.seed == 0) == sorted(
        [f"aqr[tail={t}]" for t in ("standard", "average", "none", "clip", "clip-source", "interval", "gaussian")]
        + ["aqr[tail=average,tail_unit=values]"])
    with pytest.raises(KeyError, match="unknown preset"):
        preset("nope", DATA)
    assert preset("smoke", DATA).models[0].source_data == str(Path(DATA) / "cifar10_test.npz")
    both = default_models(DATA)  # the third-party ResNet-20 with either statistics
    assert both["resnet20_trainstats"].checkpoint == both["resnet20"].checkpoint
    assert both["resnet20_trainstats"].source_data == both["resnet20_bn"].source_data


def test_grid_rejects_bad_values() -> None:
    base = preset("smoke", DATA)
    with pytest.raises(ValueError, match="unknown corruptions"):
        replace(base, corruptions=("rain",))
    with pytest.raises(ValueError, match="severities"):
        replace(base, severities=(0,))
    with pytest.raises(ValueError, match="unknown grid keys"):
        grid_from_mapping({"preset": "smoke", "batchsize": [1]}, DATA)


def test_grid_file_round_trip(tmp_path: Path) -> None:
    spec = {"preset": "smoke", "name": "mine", "methods": ["source", "aqr:tail=clip"], "seeds": [0, 1],
            "corruptions": ["fog"], "n_images": 64}
    (tmp_path / "g.json").write_text(json.dumps(spec))
    yaml = pytest.importorskip("yaml")
    (tmp_path / "g.yaml").write_text(yaml.safe_dump(spec))
    for name in ("g.json", "g.yaml"):
        grid = load_grid(tmp_path / name, DATA)
        assert grid.name == "mine" and grid.seeds == (0, 1) and grid.n_images == 64
        assert [m.name for m in grid.methods] == ["source", "aqr"]
    with pytest.raises(FileNotFoundError):
        load_grid(tmp_path / "missing.yaml")


def _cell(**changes: object) -> Cell:
    cell = next(iter(preset("smoke", DATA).cells()))
    return replace(cell, **changes)


def test_cell_key_changes_with_config_files_and_version() -> None:
    cell = _cell()
    files = {"weights": "a", "source": "b", "eval": "c", "labels": "d"}
    key = cell_key(cell, files, "1.0")
    assert key == cell_key(Cell.from_dict(json.loads(json.dumps(cell.to_dict()))), files, "1.0")
    assert key != cell_key(replace(cell, seed=1), files, "1.0")
    assert key != cell_key(replace(cell, options=(("tail", "clip"),)), files, "1.0")
    assert key != cell_key(cell, {**files, "weights": "z"}, "1.0")
    assert key != cell_key(cell, files, "1.1")


def test_stream_order_enters_the_cell_and_its_key_only_when_set() -> None:
    cell = _cell()
    files = {"weights": "a", "source": "b", "eval": "c", "labels": "d"}
    assert "order" not in cell.to_dict()  # keys of cells recorded before orders existed stay the same
    ordered = replace(cell, order="delta=0.1")
    assert ordered.to_dict()["order"] == "delta=0.1" and Cell.from_dict(ordered.to_dict()) == ordered
    keys = {cell_key(c, files, "1.0") for c in (cell, ordered, replace(cell, order="delta=1"),
                                                 replace(ordered, seed=1), replace(cell, order="iid"))}
    assert len(keys) == 5
    grid = replace(preset("smoke", DATA), orders=("delta=0.10",))
    assert grid.orders == ("delta=0.1",) and {c.order for c in grid.cells()} == {"delta=0.1"}
    assert grid_from_mapping({"preset": "smoke", "order": "mixed"}, DATA).orders == ("mixed",)
    with pytest.raises(ValueError, match="stream order"):
        replace(preset("smoke", DATA), orders=("sorted",))


def test_stream_orders_are_a_grid_dimension() -> None:
    smoke = preset("smoke", DATA)
    assert smoke.orders == (None,)
    grid = replace(smoke, orders=(None, "delta=inf", "delta=0.10"))
    assert grid.orders == (None, "iid", "delta=0.1") and len(grid) == 3 * len(smoke)
    cells = list(grid.cells())
    assert len(cells) == len(grid) and len(set(cells)) == len(cells)
    by_order = {o: [replace(c, order=None) for c in cells if c.order == o] for o in grid.orders}
    assert all(by_order[o] == list(smoke.cells()) for o in grid.orders)  # the same cells in each order
    spec = grid_from_mapping({"preset": "smoke", "orders": ["iid", None, "delta=1"]}, DATA)
    assert spec.orders == ("iid", None, "delta=1")
    for bad, match in (((), "non-empty"), ("iid", "non-empty"), (("iid", "delta=inf"), "distinct")):
        with pytest.raises(ValueError, match=match):
            replace(smoke, orders=bad)
    with pytest.raises(ValueError, match="not both"):
        grid_from_mapping({"preset": "smoke", "order": "iid", "orders": ["iid"]}, DATA)
    with pytest.raises(ValueError, match="list of stream orders"):
        grid_from_mapping({"preset": "smoke", "orders": "iid"}, DATA)


# sha256 of each preset's cell keys in expansion order (one per line), computed before stream orders became a
# grid dimension, with the files and version below: the keys (and so every recorded row) must not move.
KEYS_BEFORE_ORDERS = {
    "main": (8208, "2eaa14d3295e40b015dcecaf4533248811d87a2342904d736e03e2372e24aef0"),
    "tails": (1824, "949e6cec7f64658f736c37eb3cf2034b1b3fa85af952e039e18aaff325401475"),
    "granularity": (456, "8e3c02089c7d91b9f600b6fefa9b1f9b3f9b661ad6fa9fe3d9b297659057c2c0"),
    "vit-blocks": (684, "6a8d8b9b33fcd69f886ff19e1b7bc835a5c8de90d2486d3ba9a65e78a9044544"),
    "smoke": (12, "41f7332363a2f69c9ef46bbab08babc837c9b92b6e894038f42b5111feab8a02"),
    "imagenet": (1026, "9e13b078de27ff70ee214d50c3844c5ca5f80b1252b17dc20bf99772d6556a3a"),
    "stream": (105, "6e771031f2d07249c2ded8440000c5a66d6e89508de34573598ddbf795c1ccc8"),
    # grids that set one order (then GridSpec.order, now orders=(order,))
    "smoke/delta=0.1": (12, "4d52be5762016f13ea8adcee39c7c8a881b96f0070512392e43a2aadb2f6fee9"),
    "stream/mixed": (105, "9d259103822de1c34aa505652004a19a0540f4331e6341836f33567e9ad30e50"),
}


def test_the_keys_of_the_existing_presets_are_unchanged() -> None:
    import hashlib

    files = {"weights": "0" * 64, "source": "1" * 64, "eval": "2" * 64}
    for name, (count, digest) in KEYS_BEFORE_ORDERS.items():
        base, _, order = name.partition("/")
        grid = preset(base, DATA, imagenet_dir="imagenet")
        if order:
            grid = replace(grid, orders=(order,))
        keys = [cell_key(c, files, "1.0") for c in grid.cells()]
        assert (len(keys), hashlib.sha256("\n".join(keys).encode()).hexdigest()) == (count, digest), name


def test_eval_indices_are_a_seeded_subset_of_the_pool() -> None:
    pool = list(range(100, 200))
    a, b = eval_indices(_cell(n_images=30, seed=0), pool), eval_indices(_cell(n_images=30, seed=1), pool)
    assert len(a) == len(set(a)) == 30 and set(a) <= set(pool)
    assert a == eval_indices(_cell(n_images=30, seed=0), pool) and a != b
    assert sorted(eval_indices(_cell(n_images=None), pool)) == pool
    with pytest.raises(ValueError, match="exceeds"):
        eval_indices(_cell(n_images=101), pool)


# ----------------------------------------------------------------------------- database


def test_results_db_stores_and_filters(tmp_path: Path) -> None:
    cell = _cell().to_dict()
    with ResultsDB(tmp_path / "r.db") as db:
        db.add("k1", cell, "ok", 50.0, 10, 1.0, {"aqr": "x"})
        db.add("k2", {**cell, "method": "ttn"}, "error", None, None, 0.1, {}, "boom")
        db.add("k3", {**cell, "method": "tent"}, "n/a", None, None, 0.1, {}, "no BN")
        db.add_membership("exp", ["k1", "k2"])
        assert db.finished() == {"k1", "k3"}            # errors are retried
        assert [r.key for r in db.rows("exp")] == ["k1", "k2"]
        assert [r.method for r in db.rows(status="ok")] == ["source"]
        assert db.rows(key="k1")[0].provenance == {"aqr": "x"}
        with pytest.raises(ValueError, match="unknown columns"):
            db.rows(colour="red")
    with ResultsDB(tmp_path / "r.db") as db:       # reopening keeps everything
        assert len(db) == 3 and db.experiments() == ["exp"]


def test_results_db_keeps_per_image_correctness(tmp_path: Path) -> None:
    cell = _cell().to_dict()
    right = np.random.default_rng(0).random(13) < 0.5
    with ResultsDB(tmp_path / "r.db") as db:
        db.add("k1", cell, "ok", 100.0 * right.mean(), 13, 1.0, {}, correct=pack_correct(right))
        db.add("k2", cell, "ok", 50.0, 10, 1.0, {})
        found = db.correct(["k1", "k2", "nope"])
        assert list(found) == ["k1"] and np.array_equal(found["k1"], right)
        with pytest.raises(ValueError, match="does not hold 20 images"):
            db.add("k3", cell, "ok", 50.0, 20, 1.0, {}, correct=pack_correct(right))
        db.add("k1", cell, "error", None, None, 1.0, {}, "boom")  # a failed rerun keeps the result and its images
        assert np.array_equal(db.correct(["k1"])["k1"], right)
        db.rekey("k1", "k9")  # the images follow their row to its new key
        assert list(db.correct(["k1", "k9"])) == ["k9"] and np.array_equal(db.correct(["k9"])["k9"], right)
        db.rekey("k9", "k1")
        db.add("k1", cell, "ok", 50.0, 10, 1.0, {})  # a result without images drops the old ones
        assert db.correct(["k1"]) == {}
    assert np.array_equal(unpack_correct(pack_correct(right), 13), right)


def test_results_db_refuses_other_files(tmp_path: Path) -> None:
    bad = tmp_path / "notes.db"
    bad.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(ResultsDBError, match="notes.db"):
        ResultsDB(bad)
    other = tmp_path / "other.db"
    with ResultsDB(other):
        pass
    con = sqlite3.connect(other)
    con.execute("UPDATE meta SET value='99' WHERE name='schema_version'")
    con.commit()
    con.close()
    with pytest.raises(ResultsDBError, match="schema version 99"):
        ResultsDB(other)


# ----------------------------------------------------------------------------- runner on tiny data


def _tiny_setup(root: Path, n: int = 96, size: int = 16) -> tuple[GridSpec, dict[str, ModelSpec]]:
    """Two tiny ResNets (BN, GN) saved as aqr checkpoints, a source npz and a 2-corruption CIFAR-C folder."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, n).astype(np.int64)
    # class-dependent brightness so the models have something to learn from
    images = np.clip(rng.normal(60 + 40 * labels[:, None, None, None], 25, (n, size, size, 3)), 0, 255).astype(np.uint8)
    np.savez(root / "clean.npz", x=images, y=labels)
    generate_cifar_c(images, labels, root / "c", GenerationConfig(corruptions=CORRUPTIONS, severities=(3, 5)),
                     progress=False)
    specs = {}
    for norm in ("bn", "gn"):
        model = models.create("resnet20", num_classes=4, norm=norm, width=4, groups=2)
        path = models.save_checkpoint(root / f"tiny_{norm}.pt", model,
                                      {"name": "resnet20", "num_classes": 4, "norm": norm,
                                       "kwargs": {"width": 4, "groups": 2}})
        specs[norm] = ModelSpec(f"tiny_{norm}", str(path), None, str(root / "clean.npz"), "0:48")
    data = DataSpec("tiny-c", str(root / "c"), "48:96")
    grid = GridSpec("tiny", (specs["bn"], specs["gn"]), data,
                    tuple(MethodSpec(m) for m in ("source", "ttn", "tent", "sar", "aqr")),
                    corruptions=CORRUPTIONS, severities=(5,), batch_sizes=(16,), seeds=(0,), n_images=32)
    return grid, specs


@pytest.fixture()
def tiny(tmp_path: Path) -> GridSpec:
    return _tiny_setup(tmp_path)[0]


def test_run_grid_fills_the_database_and_resumes(tiny: GridSpec, tmp_path: Path) -> None:
    with ResultsDB(tmp_path / "r.db") as db:
        summary = run_grid(tiny, db, tmp_path / "cache", progress=False, log=lambda m: None)
        assert summary.ran == len(tiny) == 20 and summary.errors == 0, summary.error_messages
        rows = db.rows("tiny")
        assert len(rows) == 20
        by = {(r.model, r.method, r.corruption): r for r in rows}
        assert by[("tiny_gn", "ttn", "gaussian_noise")].status == "n/a"   # TTN needs BatchNorm
        assert by[("tiny_bn", "ttn", "gaussian_noise")].status == "ok"
        ok = [r for r in rows if r.status == "ok"]
        assert all(0.0 <= r.accuracy <= 100.0 and r.n_images == 32 for r in ok)
        per_image = db.correct(r.key for r in ok)
        assert set(per_image) == {r.key for r in ok}
        assert all(100.0 * per_image[r.key].mean() == pytest.approx(r.accuracy) for r in ok)
        prov = ok[0].provenance
        assert prov["torch"] and prov["files"]["eval"] and prov["seed"] == 0 and prov["protocol"] == "episodic"
        # the vector unit the cell's CPU kernels used: another one gives other bits of the same sums
        assert prov["cpu"] == torch.backends.cpu.get_cpu_capability() and prov["device"] == "cpu"
        assert len({stats_path(c, tmp_path / "cache") for c in tiny.cells() if c.method == "aqr"}) == 2
        first_created = {r.key: r.created for r in rows}

        again = run_grid(tiny, db, tmp_path / "cache", progress=False, log=lambda m: None)
        assert again.ran == 0 and again.skipped == 20
        assert {r.key: r.created for r in db.rows("tiny")} == first_created

        # a changed config (another seed) is new work, never a reuse of the seed-0 rows
        reseeded = run_grid(replace(tiny, seeds=(1,)), db, tmp_path / "cache", progress=False, log=lambda m: None)
        assert reseeded.ran == 20 and len(db) == 40


def test_run_cell_matches_a_direct_evaluation(tiny: GridSpec, tmp_path: Path) -> None:
    from aqr.data import load_cifar_c
    from aqr.methods import create

    cell = next(c for c in tiny.cells() if c.method == "source" and c.model.name == "tiny_bn")
    result = run_cell(cell, tmp_path / "cache")
    idx = eval_indices(cell, parse_range(cell.data.eval_indices))
    ds = load_cifar_c(cell.data.root, cell.corruption, cell.severity, idx)
    method = create("source", models.load(cell.model.model))
    acc, n = evaluate(method, ds.images, ds.labels, 16)
    assert result.status == "ok" and result.accuracy == acc and result.n_images == n == 32
    right = (method(to_float(ds.images)).argmax(1) == torch.as_tensor(ds.labels)).numpy()
    assert np.array_equal(unpack_correct(result.correct, 32), right)


def test_a_stream_order_reorders_the_same_images(tiny: GridSpec, tmp_path: Path) -> None:
    cell = next(c for c in replace(tiny, n_images=48).cells() if c.method == "ttn" and c.model.name == "tiny_bn")
    images, labels = eval_data(cell)
    ordered = replace(cell, order="delta=0.01")
    o_images, o_labels = eval_data(ordered)
    assert sorted(map(bytes, o_images)) == sorted(map(bytes, images))  # the same drawn images
    assert mean_run_length(o_labels) > 2 * mean_run_length(labels)
    assert np.array_equal(eval_data(ordered)[1], o_labels)  # seeded
    result = run_cell(ordered, tmp_path / "cache")
    assert result.status == "ok" and result.n_images == 48
    mixed = run_cell(replace(cell, order="mixed"), tmp_path / "cache")
    assert mixed.status == "error" and "mixes corruptions" in mixed.message
    with ResultsDB(tmp_path / "r.db") as db:
        run_grid(replace(tiny, methods=(MethodSpec("rbn"),), orders=("delta=0.1",), protocol="online"), db, tmp_path / "cache",
                 progress=False, log=lambda m: None)
        rows = db.rows("tiny")
        assert {r.status for r in rows} == {"ok", "n/a"}  # rbn needs BatchNorm: n/a on the GN model
        assert all("delta=0.1" in r.provenance["eval"]["order"] for r in rows)


def test_a_broken_cell_is_recorded_not_fatal(tiny: GridSpec, tmp_path: Path) -> None:
    grid = replace(tiny, methods=(MethodSpec("source"), MethodSpec("sar", {"freeze": "no.such.module"})))
    with ResultsDB(tmp_path / "r.db") as db:
        summary = run_grid(grid, db, tmp_path / "cache", progress=False, log=lambda m: None)
        assert summary.errors == 4 and summary.ran == 8
        errors = db.rows(status="error")
        assert len(errors) == 4 and all(r.message for r in errors)
        assert db.finished() == {r.key for r in db.rows(status="ok")}


def test_missing_data_is_explained(tiny: GridSpec, tmp_path: Path) -> None:
    grid = replace(tiny, data=replace(tiny.data, root=str(tmp_path / "nowhere")))
    with ResultsDB(tmp_path / "r.db") as db, pytest.raises(FileNotFoundError, match="aqr corrupt"):
        run_grid(grid, db, tmp_path / "cache", progress=False, log=lambda m: None)


def test_fingerprints_name_missing_files(tiny: GridSpec) -> None:
    cell = next(iter(tiny.cells()))
    with pytest.raises(FileNotFoundError, match="source file"):
        fingerprints(replace(cell, model=replace(cell.model, source_data="/nope.npz")))


def _grid_file(grid: GridSpec, path: Path) -> Path:
    spec = {"name": grid.name, "models": [m.__dict__ for m in grid.models], "data": grid.data.__dict__,
            "methods": [m.name for m in grid.methods], "corruptions": list(grid.corruptions),
            "severities": list(grid.severities), "batch_sizes": list(grid.batch_sizes), "seeds": list(grid.seeds),
            "n_images": grid.n_images}
    path.write_text(json.dumps(spec))
    return path


def test_cli_dry_run_lists_cells(tiny: GridSpec, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    config = _grid_file(tiny, tmp_path / "grid.json")
    assert cli_main(["bench", "--config", str(config), "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 + len(tiny)
    assert lines[0].split("\t")[5] == "order" and {line.split("\t")[5] for line in lines[1:]} == {"-"}
    assert cli_main(["bench", "--config", str(config), "--order", "delta=1", "--dry-run"]) == 0
    assert {line.split("\t")[5] for line in capsys.readouterr().out.strip().splitlines()[1:]} == {"delta=1"}


def test_cli_order_flag_names_the_order_in_the_grid(tiny: GridSpec, tmp_path: Path) -> None:
    import argparse

    from aqr.cli.bench import add_grid_arguments, grid_from_args

    parser = argparse.ArgumentParser()
    add_grid_arguments(parser)
    config = str(_grid_file(tiny, tmp_path / "grid.json"))
    grid = grid_from_args(parser.parse_args(["--config", config, "--order", "delta=0.10"]))
    assert (grid.name, grid.orders) == ("tiny-delta=0.1", ("delta=0.1",))
    assert grid_from_args(parser.parse_args(["--config", config])).orders == (None,)
    assert cli_main(["bench", "--config", config, "--order", "sideways", "--dry-run"]) == 2


def _bench_command(grid: GridSpec, tmp_path: Path, *extra: str) -> list[str]:
    """The command running ``aqr bench`` on ``grid`` (as a grid file) into ``tmp_path/r.db`` with one thread."""
    config = _grid_file(grid, tmp_path / "grid.json")
    return [sys.executable, "-m", "aqr", "bench", "--config", str(config), "--db", str(tmp_path / "r.db"),
            "--cache", str(tmp_path / "cache"), "--threads", "1", "--no-progress", *extra]


def _sigkill_and_resume(cmd: list[str], db_path: Path, grid: GridSpec, after_rows: int,
                        env: dict[str, str] | None = None) -> list:
    """Run ``cmd`` (an ``aqr bench`` into ``db_path``), SIGKILL it once ``after_rows`` rows are stored,
    check the database kept them intact, rerun ``cmd`` and check it resumed; returns the final rows."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def count() -> int:
        if not db_path.exists():
            return 0
        try:
            con = sqlite3.connect(db_path, timeout=5)
            try:
                return con.execute("SELECT COUNT(*) FROM results").fetchone()[0]
            finally:
                con.close()
        except sqlite3.OperationalError:  # tables not created yet
            return 0

    deadline = time.time() + 120
    while count() < after_rows and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, f"run ended before it could be killed: {proc.stderr.read().decode()[-800:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    con = sqlite3.connect(db_path)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    kept = dict(con.execute("SELECT key, created FROM results").fetchall())
    con.close()
    assert after_rows <= len(kept) < len(grid)

    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-1500:]
    assert f"{len(kept)} already in" in done.stderr
    with ResultsDB(db_path) as db:
        rows = db.rows(grid.name)
    assert len(rows) == len(grid)
    assert all(kept[r.key] == r.created for r in rows if r.key in kept)   # not recomputed
    return rows


@pytest.mark.slow
def test_sigkill_mid_run_loses_only_cells_in_flight(tmp_path: Path) -> None:
    grid, _ = _tiny_setup(tmp_path)
    grid = replace(grid, seeds=(0, 1, 2))                       # 60 cells
    _sigkill_and_resume(_bench_command(grid, tmp_path), tmp_path / "r.db", grid, 5,
                        env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_cli_calibrate_then_evaluate(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    grid, specs = _tiny_setup(tmp_path)
    spec = specs["bn"]
    stats_file = tmp_path / "bn.aqr.safetensors"
    assert cli_main(["calibrate", spec.model, "--data", spec.source_data, "--indices", "0:48", "-K", "11",
                     "--out", str(stats_file), "--no-progress"]) == 0
    from aqr.core.stats import SourceStats

    stats = SourceStats.load(stats_file)
    assert stats.num_quantiles == 11 and len(stats.layer_names) == 19
    capsys.readouterr()
    args = ["evaluate", spec.model, "--stats", str(stats_file), "--cifar-c", grid.data.root,
            "--corruption", "gaussian_noise", "--severity", "5", "--indices", "48:96", "--batch-size", "16",
            "--methods", "source,aqr:tail=clip,mode=exact,tent", "--json"]
    assert cli_main(args) == 0
    accs = json.loads(capsys.readouterr().out)
    assert set(accs) == {"source", "aqr:tail=clip,mode=exact", "tent"}  # spelled as the specs
    assert all(0 <= a <= 100 for a in accs.values())
    # the same numbers as the library path
    from aqr.data import load_cifar_c
    from aqr.methods import create

    ds = load_cifar_c(grid.data.root, "gaussian_noise", 5, list(range(48, 96)))
    direct = evaluate(create("aqr", models.load(spec.model), stats=stats, tail="clip", mode="exact"),
                      ds.images, ds.labels, 16)[0]
    assert accs["aqr:tail=clip,mode=exact"] == direct
    capsys.readouterr()
    assert cli_main(args[:2] + args[4:]) == 2   # checked before any method runs
    err = capsys.readouterr().err
    assert "needs --stats" in err and "source:" not in err


def test_cli_reports_missing_data_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["bench", "--preset", "smoke", "--data-dir", str(tmp_path / "nowhere"),
                     "--cifar-c", str(tmp_path / "c"), "--db", str(tmp_path / "r.db")]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_data_folder_comes_from_the_flag_or_aqr_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delenv("AQR_DATA_DIR", raising=False)
    with pytest.raises(ValueError, match="--data-dir.*AQR_DATA_DIR"):
        preset("smoke")
    assert cli_main(["bench", "--preset", "smoke", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--data-dir" in err and "AQR_DATA_DIR" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setenv("AQR_DATA_DIR", str(tmp_path))
    assert preset("smoke") == preset("smoke", tmp_path)
    # a grid file with its own models needs no data folder
    monkeypatch.delenv("AQR_DATA_DIR")
    own = {"name": "own", "models": [{"name": "m", "model": "m.pt", "source_data": "s.npz"}], "corruptions": ["fog"]}
    grid = grid_from_mapping(own)
    assert [m.name for m in grid.models] == ["m"] and grid.data.clean is None


def test_random_subset_ranges_are_seeded_sorted_and_checked() -> None:
    a = parse_range("100:200~30")
    assert a == parse_range("100:200~30") and a == sorted(a) and len(set(a)) == 30
    assert min(a) >= 100 and max(a) < 200 and a != list(range(100, 130))
    for bad in ("0:10~0", "0:10~11", "5~2", "0:10~x"):
        with pytest.raises(ValueError):
            parse_range(bad)
    assert preset("main", DATA).models[1].source_indices == "0:50000~10000"


def test_class_sorted_source_subset_warns(tmp_path: Path) -> None:
    from aqr.harness.inputs import load_source

    labels = np.repeat(np.arange(4), 50)                      # sorted by class, like the JPEG train set
    images = np.zeros((200, 8, 8, 3), dtype=np.uint8)
    np.savez(tmp_path / "sorted.npz", x=images, y=labels)
    with pytest.warns(UserWarning, match="cover only 1 of 4 classes"):
        load_source(ModelSpec("m", "m", None, str(tmp_path / "sorted.npz"), "0:50"))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, picked = load_source(ModelSpec("m", "m", None, str(tmp_path / "sorted.npz"), "0:200~50"))
    assert len(np.unique(picked)) == 4


def test_statistics_of_other_weights_fail_the_cell(tiny: GridSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import aqr
    from aqr.harness import cell_run

    cell = next(c for c in tiny.cells() if c.method == "aqr" and c.model.name == "tiny_bn")
    assert run_cell(cell, tmp_path / "cache").status == "ok"
    # same architecture, other weights: what a checkpoint rewritten mid-run would look like
    other = models.create("resnet20", num_classes=4, norm="bn", width=4, groups=2)
    images = torch.rand(32, 3, 16, 16)
    stale = aqr.calibrate(other.eval(), [images]).save(tmp_path / "stale.aqr.safetensors")
    monkeypatch.setattr(cell_run, "ensure_stats", lambda cell, cache_dir, **kwargs: stale)
    result = run_cell(cell, tmp_path / "cache")
    assert result.status == "error" and "other weights" in result.message


def test_image_tail_statistics_are_cached_apart(tiny: GridSpec, tmp_path: Path) -> None:
    import aqr

    grid = replace(tiny, methods=(MethodSpec("aqr"), MethodSpec("aqr", {"tail": "average", "tail_unit": "values"})))
    cells = [c for c in grid.cells() if c.model.name == "tiny_bn" and c.corruption == CORRUPTIONS[0]]
    paths = {c.variant: stats_path(c, tmp_path / "cache") for c in cells}
    assert len(set(paths.values())) == 2
    for cell in cells:
        assert run_cell(cell, tmp_path / "cache").status == "ok"
    units = {v: aqr.SourceStats.load(p).tail_unit for v, p in paths.items()}
    assert units == {"aqr": "images", "aqr[tail=average,tail_unit=values]": "values"}


def test_aqr_cell_keys_follow_the_fast_path_version(monkeypatch) -> None:
    """A change of AQR's default fast path must not reuse rows computed before it."""
    from aqr.harness import keys

    files = {"weights": "a", "source": "b", "eval": "c", "labels": "d"}
    aqr_cell = next(c for c in preset("smoke", DATA).cells() if c.method == "aqr")
    other = next(c for c in preset("smoke", DATA).cells() if c.method != "aqr")
    before = cell_key(aqr_cell, files, "1.0"), cell_key(other, files, "1.0")
    monkeypatch.setattr(keys, "AQR_FAST_PATH_VERSION", keys.AQR_FAST_PATH_VERSION + 1)
    assert cell_key(aqr_cell, files, "1.0") != before[0]
    assert cell_key(other, files, "1.0") == before[1]


def test_git_commit_is_dirty_only_for_changes_to_the_package(tmp_path: Path) -> None:
    from aqr.harness.provenance import git_commit

    _git_commit = git_commit.__wrapped__  # uncached (a run asks once)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              check=True, capture_output=True, text=True).stdout.strip()

    (tmp_path / "pkg").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "pkg" / "code.py").write_text("a = 1\n")
    (tmp_path / "docs" / "results.db").write_bytes(b"rows")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "first")
    head = git("rev-parse", "HEAD")
    assert _git_commit(tmp_path / "pkg") == head
    (tmp_path / "docs" / "results.db").write_bytes(b"more rows")  # the run's own database: still clean
    assert _git_commit(tmp_path / "pkg") == head
    (tmp_path / "pkg" / "code.py").write_text("a = 22\n")  # another size: git's stat check sees it within the second
    assert _git_commit(tmp_path / "pkg") == head + "-dirty"


# ----------------------------------------------------------------------------- methods that need source images


def test_bench_gives_eata_the_cells_source_images(tiny: GridSpec, tmp_path: Path) -> None:
    from aqr.harness.cell_run import build_method, cell_plan, method_source
    from aqr.harness.inputs import load_source
    from aqr.methods.eata import fisher_information

    config = _grid_file(tiny, tmp_path / "grid.json")
    db = tmp_path / "r.db"
    assert cli_main(["bench", "--config", str(config), "--methods", "eta,eata,eata:source_images=20",
                     "--corruptions", "gaussian_noise", "--db", str(db), "--cache", str(tmp_path / "cache"),
                     "--no-progress"]) == 0
    with ResultsDB(db) as results:
        rows = results.rows("tiny")
    assert len(rows) == 6 and {r.method for r in rows} == {"eta", "eata"}
    assert all(r.status == "ok" and r.n_images == 32 for r in rows), [r.message for r in rows]

    # the Fisher's images: the model's clean source pool (images 0-47), at most source_images of them,
    # in batches of the cell's size, a seeded draw
    cell = next(c for c in tiny.cells() if c.model.name == "tiny_bn" and c.corruption == "gaussian_noise")
    eata_cell = replace(cell, method="eata", options=(("source_images", 20),))
    batches = list(method_source(eata_cell, cell_plan(eata_cell).config))
    assert [len(b[0]) for b in batches] == [16, 4]
    pool = {tuple(to_float(x[None])[0].flatten().tolist()) for x in load_source(cell.model)[0]}
    drawn = torch.cat([b[0] for b in batches])
    assert all(tuple(x.flatten().tolist()) in pool for x in drawn)
    assert len({tuple(x.flatten().tolist()) for x in drawn}) == 20
    reseeded = torch.cat([b[0] for b in method_source(replace(eata_cell, seed=1), cell_plan(eata_cell).config)])
    assert not torch.equal(drawn, reseeded)

    # ... and the method's Fisher is the one of those batches
    method = build_method(eata_cell, tmp_path / "cache")
    expected = fisher_information(method.model, dict(zip(method.param_names, method.trained)), [b[0] for b in batches])
    assert set(method.fisher) == set(expected)
    assert all(torch.allclose(method.fisher[n], expected[n]) for n in expected)
    assert any(float(v.abs().sum()) > 0 for v in expected.values())
