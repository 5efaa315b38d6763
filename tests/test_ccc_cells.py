"""``--setting ccc``: CCC cells made from the clean images along walks of a measured accuracy table, run by
the bench, keyed by the table's content, checkpointed and resumed like other stream cells."""

from __future__ import annotations

import base64
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from aqr.data.arrays import load_npz_arrays
from aqr.data.ccc import ccc_corruptions
from aqr.harness import ccc
from aqr.harness.ccc_table import measure_table
from aqr.harness.cell_run import run_cell
from aqr.harness.grid_driver import keyed_cells, run_grid
from aqr.harness.inputs import load_model
from aqr.harness.report import report
from aqr.harness.results import ResultsDB, Row
from aqr.harness.settings import SETTINGS, apply_ccc, apply_setting, setting_of
from aqr.harness.specs import MethodSpec
from aqr.harness.stream_checkpoint import StreamCheckpoint
from tests.cli_lines import one_error_line
from tests.test_bench import _tiny_setup

pytestmark = pytest.mark.usefixtures("one_thread")

BASELINE = 15.0  # CCC's hardest corruptions: noises and contrast, no frost overlays needed


@pytest.fixture()
def ccc_grid(tmp_path: Path):
    grid, _ = _tiny_setup(tmp_path)
    data = replace(grid.data, clean=str(tmp_path / "clean.npz"))
    grid = replace(grid, data=data, models=grid.models[:1], batch_sizes=(8,),
                   methods=(MethodSpec("source"), MethodSpec.parse("tent"), MethodSpec.parse("aqr:target=stream")))
    images, labels = load_npz_arrays(data.clean)
    table = measure_table(load_model(grid.models[0]), images[:48], labels[:48], ccc_corruptions(BASELINE),
                              grid=(0.0, 2.5, 5.0), per_cell=16)
    table.save(ccc.table_path(data, grid.models[0]))
    return apply_ccc(grid, BASELINE, speed=10, images=60)


def test_the_ccc_setting_makes_one_online_stream_cell_per_method(ccc_grid) -> None:
    assert "ccc" in SETTINGS and ccc_grid.name == "tiny-ccc" and ccc_grid.protocol == "online"
    cells = list(ccc_grid.cells())
    assert [c.corruption for c in cells] == ["ccc:baseline=15,speed=10,images=60"] * 3
    assert all(c.n_images is None and c.order is None and setting_of(c) == "ccc" for c in cells)
    assert ccc.CCCSpec.parse(cells[0].corruption) == ccc.CCCSpec(15.0, 10, 60)
    for bad in ("ccc:baseline=15,speed=10", "ccc:baseline=15,speed=ten,images=6", "ccc:baseline=150,speed=1,images=6"):
        with pytest.raises(ValueError, match="CCC"):
            ccc.CCCSpec.parse(bad)
    with pytest.raises(ValueError, match="apply_ccc"):
        apply_setting(ccc_grid, "ccc")


def test_a_ccc_cells_key_holds_its_accuracy_tables_content(ccc_grid) -> None:
    before = [key for key, _, _ in keyed_cells(ccc_grid)]
    path = ccc.table_path(ccc_grid.data, ccc_grid.models[0])
    table = ccc.AccuracyTable.load(path)
    changed = {pair: m + 1.0 for pair, m in table.pairs.items()}
    ccc.AccuracyTable(table.grid, changed, table.about).save(path)
    after = [key for key, _, _ in keyed_cells(ccc_grid)]
    assert len(set(before)) == 3 and not set(before) & set(after)


def test_the_bench_runs_ccc_cells_on_the_fly_and_resumes_one_mid_stream(ccc_grid, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    with ResultsDB(tmp_path / "r.db") as db:
        summary = run_grid(ccc_grid, db, tmp_path / "cache", progress=False, log=lambda m: None)
        assert summary.ran == 3 and summary.errors == 0, summary.error_messages
        rows = {r.variant: r for r in db.rows()}
    assert all(r.n_images == 60 and r.detail["n"] == 60 and r.detail["block_size"] == 10 for r in rows.values())
    # the first cell of the stream made its images, the others read them from the stream's cache
    assert sorted(r.detail["images_made"] for r in rows.values()) == [0, 0, 60]
    cell = next(c for c in ccc_grid.cells() if c.method == "tent")
    folder = ccc.stream_cache(cell)
    assert folder.parent == Path(ccc_grid.data.root) / "ccc_streams" and list(folder.glob("*.npy"))
    assert ccc.stream_cache(replace(cell, seed=cell.seed + 1)) != folder
    assert ccc.stream_cache(replace(cell, method="source", options=())) == folder
    images, labels, steps = ccc.stream_of(cell)
    assert np.array_equal(images[0:60], ccc.stream_of(cell, cache=False)[0][0:60]) and images.made == 0
    assert len(images) == len(labels) == 60 and sum(s.count for s in steps) == 60
    assert rows["tent"].detail["corruptions"] == ccc.step_names(steps)
    assert images[10:20].shape == (10, 16, 16, 3) and np.array_equal(images[10:20], images[10:20])
    # killed after its second checkpoint (an exception in the cell), the cell resumes and scores the same
    saves, original = [0], StreamCheckpoint.save

    def save_then_fail(self, *args, **kwargs):
        original(self, *args, **kwargs)
        saves[0] += 1
        if saves[0] == 2:
            raise RuntimeError("killed")

    monkeypatch.setattr(StreamCheckpoint, "save", save_then_fail)
    failed = run_cell(cell, tmp_path / "cache", checkpoint_every=16)
    assert failed.status == "error" and "killed" in failed.message
    resumed = run_cell(cell, tmp_path / "cache", checkpoint_every=16)
    assert resumed.status == "ok" and resumed.detail == rows["tent"].detail and saves[0] >= 3
    assert not list((tmp_path / "cache" / "stream_checkpoints").glob("*"))
    # the report: a table per stream (whole, first and last tenth, drift against Source) and the figure along it
    result = report(tmp_path / "r.db", tmp_path / "report")
    table = next(t for t in result["tables"] if t["name"].startswith("ccc_tiny_bn_bs8") and t["name"].endswith("_online"))
    assert table["header"] == ["Method", "stream", "first tenth", "last tenth", "drift vs Source", "wall (min)"]
    by_label = {row["label"]: row["cells"] for row in table["rows"]}
    assert by_label["Source (NA)"][3]["mean"] == 0.0 and len(by_label) == 3
    # the wall time of the cell that made the stream's images says so; the others read them
    made = {label: cells[4]["text"].endswith("(+images)") for label, cells in by_label.items()}
    assert sorted(made.values()) == [False, False, True] and all(cells[4]["mean"] > 0 for cells in by_label.values())
    assert by_label["Source (NA)"][0]["mean"] == pytest.approx(rows["source"].accuracy)
    assert not any("ccc:" in str(t["header"]) for t in result["tables"] if not t["name"].startswith("ccc_"))
    assert (tmp_path / "report" / "figures" / "ccc_along_stream.png").is_file()
    assert {r["variant"] for r in result["ccc"]} == {"source", "tent", "aqr[target=stream]"}


def test_a_ccc_cell_without_its_table_says_how_to_measure_it(ccc_grid, tmp_path: Path) -> None:
    ccc.table_path(ccc_grid.data, ccc_grid.models[0]).unlink()
    cell = next(iter(ccc_grid.cells()))
    with pytest.raises(FileNotFoundError, match="python -m aqr.harness.ccc_table --model tiny_bn --baseline 15"):
        ccc.stream_of(cell)


def test_the_cli_asks_for_baseline_and_speed_with_the_ccc_setting(capsys: pytest.CaptureFixture[str]) -> None:
    for extra, status, words in ((["--setting", "ccc", "--baseline", "40"], 2, ("--setting ccc needs --baseline",)),
                                 (["--setting", "continual", "--speed", "10"], 2, ("--baseline and --speed go with",)),
                                 (["--setting", "ccc", "--baseline", "40", "--speed", "0"], 2, ("--speed",))):
        # a data folder that need not exist: the flags are checked before anything is read
        one_error_line(capsys, ["bench", "--preset", "smoke", "--data-dir", "aqr-data", "--dry-run", *extra], status,
                       *words)


class _Interrupted(Exception):
    pass


def test_an_interrupted_accuracy_table_resumes_with_the_same_values(ccc_grid, tmp_path: Path) -> None:
    """Killed after a few forwards, the measurement keeps its finished rows; the rerun measures the rest only and
    gives the uninterrupted table; a checkpoint of other arguments is refused, not mixed in."""
    from torch import nn

    grid = ccc_grid
    images, labels = load_npz_arrays(grid.data.clean)
    model = load_model(grid.models[0])
    corruptions, severities = ccc_corruptions(BASELINE)[:3], (0.0, 5.0)
    whole = measure_table(model, images[:48], labels[:48], corruptions, severities, per_cell=8)

    class Counting(nn.Module):
        def __init__(self, stop_after: int | None) -> None:
            super().__init__()
            self.model, self.calls, self.stop_after = model, 0, stop_after

        def forward(self, x):
            self.calls += 1
            if self.stop_after is not None and self.calls > self.stop_after:
                raise _Interrupted
            return self.model(x)

    checkpoint = tmp_path / "table.json.partial.json"
    per_row = (len(corruptions) - 1) * len(severities)
    with pytest.raises(_Interrupted):
        measure_table(Counting(per_row * 2 + 1), images[:48], labels[:48], corruptions, severities, per_cell=8,
                      checkpoint=checkpoint)
    assert checkpoint.is_file()
    rest = Counting(None)
    resumed = measure_table(rest, images[:48], labels[:48], corruptions, severities, per_cell=8, checkpoint=checkpoint)
    assert rest.calls == per_row * (len(corruptions) * len(severities) - 2)  # two rows were kept
    assert resumed.pairs.keys() == whole.pairs.keys()
    for pair, values in whole.pairs.items():
        np.testing.assert_array_equal(resumed.pairs[pair], values)
    with pytest.raises(ValueError, match="a checkpoint of other arguments"):
        measure_table(model, images[:48], labels[:48], corruptions, severities, per_cell=8, seed=1,
                      checkpoint=checkpoint)


def test_an_accuracy_table_measured_by_a_pool_of_workers_is_the_one_measured_alone(ccc_grid) -> None:
    grid = ccc_grid
    images, labels = load_npz_arrays(grid.data.clean)
    model = load_model(grid.models[0])
    corruptions, severities = ccc_corruptions(BASELINE)[:3], (0.0, 2.5)
    alone = measure_table(model, images[:48], labels[:48], corruptions, severities, per_cell=8)
    pooled = measure_table(model, images[:48], labels[:48], corruptions, severities, per_cell=8, workers=2)
    assert pooled.pairs.keys() == alone.pairs.keys()
    for pair, values in alone.pairs.items():
        np.testing.assert_array_equal(pooled.pairs[pair], values)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        measure_table(model, images[:48], labels[:48], corruptions, severities, per_cell=8, workers=0)


def test_the_table_command_says_what_is_wrong_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from aqr.harness.ccc_table import main

    monkeypatch.delenv("AQR_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["--model", "resnet20_trainstats"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no data folder") and "\n" not in err
    assert main(["--model", "resnet20_trainstats", "--data-dir", str(tmp_path / "nowhere"), "--workers", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err


def test_a_ccc_stream_with_frost_runs_and_keys_its_overlays_by_content(ccc_grid, tmp_path: Path) -> None:
    """Baselines of 20 % and more draw frost too: its overlays (a flat folder of images) enter the key by content."""
    from PIL import Image

    from aqr.data.corruptions import FROST_FILES
    from aqr.harness.provenance import fingerprints
    from tests.test_ccc import _synthetic_table

    frost = tmp_path / "frost"
    frost.mkdir()
    rng = np.random.default_rng(1)
    for name in FROST_FILES:
        Image.fromarray(rng.integers(0, 256, (260, 300, 3), dtype=np.uint8)).save(frost / name)
    names = ccc_corruptions(40.0)
    assert "frost" in names
    cell = next(c for c in ccc_grid.cells() if c.method == "source")
    cell = replace(cell, data=replace(cell.data, frost_dir=str(frost)), corruption=ccc.CCCSpec(40.0, 1, 240).name)
    _synthetic_table(names).save(ccc.table_path(cell.data, cell.model))
    key = fingerprints(cell)["frost"]
    result = run_cell(cell, tmp_path / "cache")
    assert result.status == "ok", result.message
    assert result.n_images == 240 and any("frost" in name for name in result.detail["corruptions"])
    Image.fromarray(rng.integers(0, 256, (260, 300, 3), dtype=np.uint8)).save(frost / FROST_FILES[0])
    assert fingerprints(cell)["frost"] != key
    (frost / FROST_FILES[1]).unlink()
    with pytest.raises(FileNotFoundError, match="frost overlays missing"):
        fingerprints(cell)


def _ccc_row(variant: str, corruption: str, correct: list[int]) -> Row:
    bits = np.asarray(correct, dtype=bool)
    detail = {"correct": base64.b64encode(np.packbits(bits)).decode(), "n": len(bits)}
    return Row(f"{variant}/{corruption}", "m", variant.partition("[")[0], variant, "cifar10-c", corruption, 0, 64, 1,
               "online", "ok", 100.0 * bits.mean(), len(bits), 1.0, None, {}, {}, 0.0, detail)


def test_the_ccc_target_table_sets_the_recommended_configuration_against_the_best_field_method() -> None:
    from aqr.harness.report.ccc_tables import ccc_target_table

    short, long = "ccc:baseline=40,speed=1000,images=100000", "ccc:baseline=40,speed=1000,images=300000"
    tenth = lambda first, middle, last: [1] * first + [0] * (10 - first) + middle + [1] * last + [0] * (10 - last)  # noqa: E731
    rows = [_ccc_row("source", short, tenth(5, [0] * 80, 5)), _ccc_row("eta", short, tenth(6, [1] * 80, 6)),
            _ccc_row("aqr+roid[target=robust]", short, tenth(6, [1] * 70 + [0] * 10, 6)),
            _ccc_row("aqr[target=stream]", short, tenth(9, [1] * 80, 9)),  # an AQR configuration: not a rival
            # the long stream: above every rival, but 3 points behind Source's gap by its last tenth (collapse)
            _ccc_row("source", long, tenth(5, [0] * 80, 5)), _ccc_row("rdumb", long, tenth(5, [0] * 79 + [1], 5)),
            _ccc_row("aqr+roid[target=robust]", long, tenth(8, [1] * 80, 5))]
    table = ccc_target_table(rows, "aqr+roid:target=robust")
    by_label = {label.split(" · ")[2]: [e.text for e in entries] for label, entries in zip(table.labels, table.entries)}
    assert by_label["baseline=40,speed=1000,images=100000"] == ["82.0", "ETA 92.0", "-10.0", "+0.0", "no"]
    assert by_label["baseline=40,speed=1000,images=300000"] == ["93.0", "RDumb 11.0", "+82.0", "-30.0", "no"]
    # a drift upwards on the long stream is no collapse
    rows[-1] = _ccc_row("aqr+roid[target=robust]", long, tenth(5, [1] * 80, 8))
    table = ccc_target_table(rows, "aqr+roid:target=robust")
    assert [e.text for e in table.entries[1]][-2:] == ["+30.0", "yes"] and "300000" in table.labels[1]
    assert ccc_target_table(rows[:1], "aqr+roid:target=robust").entries[0][0].text == "not run"
