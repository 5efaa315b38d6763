"""The field's settings by name (``--setting``), gradual streams, and the realtime protocol's schedule, costs and keys."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

from aqr.cli.bench import add_grid_arguments, grid_from_args
from aqr.cli.common import UsageError
from aqr.harness import continual
from aqr.harness.cells import REALTIME, Cell, DataSpec, ModelSpec, severity_ramp, stream_schedule
from aqr.harness.keys import cell_key
from aqr.harness.presets import FIELD_BATCH1_METHODS, FIELD_METHODS, FIELD_OFFLINE_METHODS, preset
from aqr.harness.realtime import timing
from aqr.harness.realtime.costs import CostTable, cost_key, with_cost
from aqr.harness.realtime.rule import adapted_batches
from aqr.harness.realtime.timing import measure_cost, resolve_costs
from aqr.harness.settings import SETTINGS, apply_setting, setting_of
from aqr.harness.specs import GridSpec, MethodSpec

DATA_DIR = "aqr-data"  # need not exist: grids and keys are computed without reading files
FILES = {"weights": "w", "source": "s", "eval": "e", "labels": "l"}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_grid_arguments(parser)
    return parser.parse_args(["--data-dir", DATA_DIR, *argv])


# ---- the schedule, on the protocol's own clock (one time unit per arriving batch) -------------------------
@pytest.mark.parametrize("cost, expected", [(1.0, list(range(9))), (0.4, list(range(9))), (1.5, [0, 2, 4, 6, 8]),
                                            (2.0, [0, 2, 4, 6, 8]), (3.0, [0, 3, 6]), (2.5, [0, 3, 6])])
def test_schedule_adapts_when_the_method_is_free(cost: float, expected: list[int]) -> None:
    assert np.flatnonzero(adapted_batches(9, cost)).tolist() == expected


def test_schedule_refuses_a_cost_that_is_not_a_positive_number() -> None:
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive finite"):
            adapted_batches(4, bad)


class _Recorder(nn.Module):
    """Counts which batches reach ``forward`` (adapted on) and which ``forward_held``; predicts class 0."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1))
        self.calls: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append("adapt")
        return torch.zeros(len(x), 10).index_fill_(1, torch.tensor([0]), 1.0)

    def forward_held(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append("held")
        return torch.zeros(len(x), 10).index_fill_(1, torch.tensor([1]), 1.0)


def test_stream_feeds_skipped_batches_to_the_held_state() -> None:
    images = np.zeros((40, 4, 4, 3), np.uint8)
    labels = np.zeros(40, np.int64)
    starts = list(range(0, 40, 8))
    method = _Recorder()
    correct = continual.evaluate_stream(method, images, labels, starts, adapted=adapted_batches(len(starts), 3.0))
    assert method.calls == ["adapt", "held", "held", "adapt", "held"]
    # the held predictions (class 1) are wrong here, the adapted ones (class 0) right: images of batches 0 and 3
    assert correct.tolist() == [True] * 8 + [False] * 16 + [True] * 8 + [False] * 8


# ---- settings ----------------------------------------------------------------------------------------
def test_correlated_setting_gives_the_cells_and_keys_of_the_order_flag() -> None:
    by_setting = grid_from_args(_args("--preset", "stream-noniid", "--setting", "correlated", "--delta", "0.1"))
    by_order = grid_from_args(_args("--preset", "stream-noniid", "--order", "delta=0.1"))
    assert by_setting.name == by_order.name == "stream-noniid-delta=0.1"
    keys = [[cell_key(c, FILES, "v") for c in g.cells()] for g in (by_setting, by_order)]
    assert keys[0] == keys[1] and len(keys[0]) == len(by_order)


def test_a_setting_or_order_reaches_every_part_of_a_grid() -> None:
    """The field preset's realtime and batch-16 parts take the setting too, each keeping its protocol."""
    for argv, order in ((("--setting", "correlated", "--delta", "0.1"), "delta=0.1"),
                        (("--order", "delta=0.1"), "delta=0.1"), (("--setting", "continual"), None),
                        (("--setting", "mixed_domains"), "mixed")):
        grid = grid_from_args(_args("--preset", "field", *argv))
        cells = list(grid.cells())
        assert {c.order for c in cells} == {order}
        assert {(c.protocol, c.batch_size) for c in cells} == {("online", 64), ("online", 16), (REALTIME, 64),
                                                                (REALTIME, 16)}
    by_setting = grid_from_args(_args("--preset", "field", "--setting", "correlated", "--delta", "0.1"))
    by_order = grid_from_args(_args("--preset", "field", "--order", "delta=0.1"))
    assert [cell_key(c, FILES, "v") for c in by_setting.cells()] == [cell_key(c, FILES, "v") for c in by_order.cells()]


@pytest.mark.parametrize("argv, message", [
    (("--setting", "correlated", "--delta", "0.1", "--order", "iid"), "--setting and --order"),
    (("--setting", "correlated"), "needs --delta"),
    (("--setting", "continual", "--delta", "0.1"), "--delta goes with"),
    (("--setting", "gradual_correlated"), "needs --delta"),
    (("--delta", "0.1"), "--delta goes with"),
])
def test_setting_flags_that_do_not_fit_are_usage_errors(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        grid_from_args(_args("--preset", "stream", *argv))


def test_settings_shape_the_stream() -> None:
    main = preset("main", data_dir=DATA_DIR)  # one cell per corruption, episodic
    reset = apply_setting(main, "reset_each_shift")
    assert reset.protocol == "online" and reset.corruptions == main.corruptions and reset.name == "main-reset_each_shift"
    cont = apply_setting(main, "continual")
    assert cont.corruptions == ("continual:" + "+".join(main.corruptions),) and cont.protocol == "online"
    stream = preset("stream", data_dir=DATA_DIR)
    assert apply_setting(stream, "continual").corruptions == ("continual",)
    assert apply_setting(stream, "reset_each_shift").corruptions == tuple(stream_schedule_names(stream))
    mixed = apply_setting(stream, "mixed_domains")
    assert mixed.orders == ("mixed",) and mixed.corruptions == ("continual",)
    gradual = apply_setting(stream, "gradual")
    assert gradual.corruptions == ("gradual",) and gradual.severities == (5,)
    assert {setting_of(c) for c in gradual.cells()} == {"gradual"}
    assert {setting_of(c) for c in mixed.cells()} == {"mixed_domains"}
    assert {setting_of(c) for c in reset.cells()} == {"reset_each_shift"}
    assert {setting_of(c) for c in apply_setting(stream, "correlated", 0.1).cells()} == {"correlated"}
    with pytest.raises(ValueError, match="unknown setting"):
        apply_setting(stream, "sorted")
    assert SETTINGS[:8] == ("reset_each_shift", "continual", "gradual", "mixed_domains", "correlated",
                            "mixed_domains_correlated", "gradual_correlated", "reset_each_shift_correlated")
    assert "ccc" in SETTINGS


def test_correlated_settings_order_each_stream_by_class() -> None:
    """The reference's mixed_domains_correlated, gradual_correlated and reset_each_shift_correlated: the
    uncorrelated setting's cells with a class-correlated order (delta 0: sorted by class)."""
    stream = preset("stream", data_dir=DATA_DIR)
    for setting, delta, order in (("mixed_domains_correlated", 0.1, "mixed,delta=0.1"),
                                  ("gradual_correlated", 0.01, "delta=0.01"),
                                  ("reset_each_shift_correlated", 0.0, "delta=0")):
        plain = apply_setting(stream, setting.removesuffix("_correlated"))
        grid = apply_setting(stream, setting, delta)
        assert grid.orders == (order,) and grid.name == f"stream-{setting}-delta={delta:g}"
        assert (grid.corruptions, grid.severities, grid.protocol) == (plain.corruptions, plain.severities, plain.protocol)
        assert {setting_of(c) for c in grid.cells()} == {setting}
        for bad in (None,):
            with pytest.raises(ValueError, match="--delta"):
                apply_setting(stream, setting, bad)
    with pytest.raises(ValueError, match="--delta"):
        apply_setting(stream, "mixed_domains", 0.1)
    # the field preset's parts take the setting, each keeping its protocol and batch size
    field = grid_from_args(_args("--preset", "field", "--setting", "mixed_domains_correlated", "--delta", "0.1"))
    cells = list(field.cells())
    assert {c.order for c in cells} == {"mixed,delta=0.1"}
    assert {(c.protocol, c.batch_size) for c in cells} == {("online", 64), ("online", 16), (REALTIME, 64),
                                                            (REALTIME, 16)}
    # existing settings keep their cells and keys
    keys = {cell_key(c, FILES, "v") for c in apply_setting(stream, "mixed_domains").cells()}
    assert keys.isdisjoint(cell_key(c, FILES, "v") for c in apply_setting(stream, "mixed_domains_correlated",
                                                                             0.1).cells())


def stream_schedule_names(grid: GridSpec) -> list[str]:
    cell = next(grid.cells())
    return [name for name, _ in stream_schedule(cell)]


def test_gradual_stream_rises_to_the_cell_severity_and_falls_back() -> None:
    assert severity_ramp(5) == (1, 2, 3, 4, 5, 4, 3, 2, 1)
    cell = next(apply_setting(preset("stream", data_dir=DATA_DIR), "gradual").cells())
    schedule = stream_schedule(cell)
    assert len(schedule) == 15 * 9
    assert schedule[:10] == tuple(("gaussian_noise", s) for s in severity_ramp(5)) + (("shot_noise", 1),)
    with pytest.raises(ValueError, match="unknown"):
        stream_schedule(replace(cell, corruption="gradual:fog+smoke"))


def test_gradual_blocks_of_one_name_are_reported_together() -> None:
    detail = continual.stream_detail(np.array([1, 1, 0, 0, 1, 0], bool), ["fog-1", "fog-2", "fog-1"], 2)
    assert continual.block_accuracies(detail) == {"fog-1": 75.0, "fog-2": 0.0}


# ---- costs and keys --------------------------------------------------------------------------------------
def _cell(**changes) -> Cell:
    base = Cell(ModelSpec("m", "resnet20"), DataSpec(), "tent", (), "continual", 5, 64, 0, 100, REALTIME)
    return replace(base, **changes)


def test_cost_enters_the_key_of_realtime_cells_only() -> None:
    online = _cell(protocol="online")
    assert "cost" not in online.to_dict()  # keys of the cells of other protocols are unchanged
    keys = {cell_key(_cell(cost=c), FILES, "v") for c in (1.5, 2.0, 2.01)}
    assert len(keys) == 3
    assert Cell.from_dict(_cell(cost=1.5).to_dict()) == _cell(cost=1.5)
    assert _cell().method_protocol == "online"


def test_cost_table_round_trip_and_bad_files(tmp_path) -> None:
    path = tmp_path / "costs.json"
    assert CostTable.load(path).entries == {}
    table = CostTable({cost_key("m", "tent", 64): {"cost": 2.37, "clock": "cpu"}})
    table.save(path)
    assert CostTable.load(path).cost("m", "tent", 64) == 2.37
    assert with_cost(_cell(), CostTable.load(path).as_mapping()).cost == 2.37
    assert with_cost(_cell(method="sar"), CostTable.load(path).as_mapping()).cost is None
    path.write_text(json.dumps({"format": "aqr-realtime-costs", "entries": {"m|tent|64": {"cost": -1}}}))
    with pytest.raises(ValueError, match="positive 'cost'"):
        CostTable.load(path)
    path.write_text(json.dumps({"format": "aqr-realtime-costs", "entries": {"m|ttn|64": {"not_applicable": "no BN"}}}))
    assert CostTable.load(path).as_mapping() == {} and CostTable.load(path).cost("m", "ttn", 64) is None
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a realtime costs file"):
        CostTable.load(path)


def test_costs_in_the_file_are_used_without_a_timing_round(tmp_path) -> None:
    path = tmp_path / "costs.json"
    CostTable({cost_key("m", "tent", 64): {"cost": 3.0}}).save(path)
    costs = resolve_costs([_cell()], path, tmp_path, log=lambda m: pytest.fail(f"measured: {m}"))
    assert costs == {"m|tent|64": 3.0}
    grid = GridSpec("g", (ModelSpec("m", "resnet20"),), DataSpec(), (MethodSpec("tent"),), corruptions=("continual",),
                    severities=(5,), batch_sizes=(64,), seeds=(0,), n_images=100, protocol=REALTIME,
                    costs=tuple(costs.items()))
    assert [c.cost for c in grid.cells()] == [3.0]


def test_timing_round_reports_its_ratios() -> None:
    plain = nn.Linear(8, 8)
    batches = [torch.randn(16, 8) for _ in range(5)]
    result = measure_cost(plain, plain, batches, warmup=2, clock="cpu")
    assert len(result["ratios"]) == 3 and result["cost"] > 0 and result["clock"] == "cpu"
    with pytest.raises(ValueError, match="warm-up"):
        measure_cost(plain, plain, batches[:2], warmup=2)


class _Periodic(nn.Module):
    """A fake method on a fake clock: each call costs 1 unit, and every ``period``-th call ``update`` units."""

    def __init__(self, spent: list[float], period: int = 0, update: float = 1.0) -> None:
        super().__init__()
        self.spent, self.period, self.update, self.calls = spent, period, update, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.spent[0] = self.update if self.period and self.calls % self.period == 0 else 1.0
        return x


def test_timing_round_charges_a_periodic_update_amortized(monkeypatch) -> None:
    """An update every fourth batch at 9 units: the median batch costs 1, the method 3 per batch on average.
    The median rule charged it nothing (C = 1) and let it adapt on every batch of the realtime stream."""
    spent = [0.0]

    def fake_timed(fn, clock, device):
        fn()
        return spent[0]

    monkeypatch.setattr(timing, "_timed", fake_timed)
    batches = [torch.zeros(16, 8) for _ in range(10)]  # 2 warm-up calls, then 8 timed: two updates
    result = measure_cost(_Periodic(spent, period=4, update=9.0), _Periodic(spent), batches, warmup=2, clock="cpu")
    assert result["median_ratio"] == 1.0 and result["cost"] == 3.0 and result["total_ratio"] == 3.0
    assert measure_cost(_Periodic(spent), _Periodic(spent), batches, warmup=2, clock="cpu")["cost"] == 1.0


def test_field_preset_shape() -> None:
    grid = preset("field", data_dir=DATA_DIR)
    cells = list(grid.cells())
    assert len(cells) == len(grid)
    by = {(c.model.name, c.batch_size, c.order, c.protocol) for c in cells}
    models = {"resnet20_trainstats", "resnet20_gn", "vit_ln"}
    assert {m for m, *_ in by} == models
    settings = (None, "delta=0.1", "mixed", "mixed,delta=0.1")  # continual, correlated and both mixed settings
    for protocol in ("online", REALTIME):
        assert {(m, o) for m, b, o, p in by if p == protocol and b == 64} == {(m, o) for m in models for o in settings}
        assert {o for m, b, o, p in by if p == protocol and b == 16} == set(settings)
    assert {setting_of(c) for c in cells} == {"continual", "correlated", "mixed_domains", "mixed_domains_correlated"}
    assert {m for m, b, *_ in by if b == 16} == {"resnet20_trainstats"}
    assert {c.method for c in cells} == {MethodSpec.parse(m).name for m in FIELD_OFFLINE_METHODS}
    assert {c.method for c in cells if c.protocol == REALTIME} == {MethodSpec.parse(m).name for m in FIELD_METHODS}
    assert {c.model.name for c in cells if c.method == "unmixtns"} == models  # n/a cells on GN and LN, recorded
    assert {(c.protocol, c.batch_size) for c in cells if c.method == "unmixtns"} == {
        ("online", 64), ("online", 16), (REALTIME, 64), (REALTIME, 16)}
    # every method in every setting, protocol and batch size: 3 models at batch 64 and the BN one at 16
    assert len(cells) == len(FIELD_METHODS) * len(settings) * 2 * (len(models) + 1)
    assert all(c.n_images == 500 and c.corruption == "continual" for c in cells)
    keys = [cell_key(c, FILES, "v") for c in cells]
    assert len(set(keys)) == len(keys)
    only_gn = grid.override(models=tuple(m for m in grid.models if m.name == "resnet20_gn"))
    assert {c.model.name for c in only_gn.cells()} == {"resnet20_gn"}
    one_size = grid.override(batch_sizes=(64,))  # the batch-16 parts become the batch-64 cells: each cell once
    assert len(list(one_size.cells())) == len(one_size) == len({c for c in cells if c.batch_size == 64})


def test_field_batch1_preset_is_the_field_column_at_batch_1_through_the_window() -> None:
    grid = preset("field-batch1", data_dir=DATA_DIR)
    cells = list(grid.cells())
    assert grid.name == "field" and len(cells) == len(FIELD_OFFLINE_METHODS)  # recorded beside the field's cells
    assert {(c.model.name, c.batch_size, c.order, c.protocol, c.corruption) for c in cells} == {
        ("resnet20_trainstats", 1, None, "online", "continual")}
    windows = {c.variant: dict(c.options).get("window") for c in cells}
    assert windows["tent[window=64]"] == windows["roid[window=64]"] == windows["aqr[window=64]"] == 64
    assert windows["aqr[target=stream]"] is windows["unmixtns"] is windows["source"] is None  # stream-ready as is
    assert {MethodSpec.parse(m).name for m in FIELD_BATCH1_METHODS} == {MethodSpec.parse(m).name
                                                                       for m in FIELD_OFFLINE_METHODS}
    grid.check_methods()  # every option a method takes (window is a protocol option of every method)


# ---- end to end on a tiny stream ---------------------------------------------------------------------
from tests.test_bench_stream import tiny_stream  # noqa: E402,F401 - the fixture


@pytest.mark.usefixtures("one_thread")
def test_a_gradual_cell_ramps_each_corruption(tiny_stream, tmp_path) -> None:
    from aqr.data.cifar_c import GenerationConfig, generate_cifar_c
    from aqr.data.arrays import load_npz_arrays
    from aqr.harness.cell_run import run_cell

    images, labels = load_npz_arrays(tiny_stream.models[0].source_data)
    generate_cifar_c(images, labels, tmp_path / "ramp", GenerationConfig(corruptions=("gaussian_noise", "contrast"),
                                                                        severities=(1, 2, 3)), progress=False)
    data = replace(tiny_stream.data, root=str(tmp_path / "ramp"))
    grid = apply_setting(replace(tiny_stream, severities=(3,), data=data), "gradual")
    cell = next(c for c in grid.cells() if c.method == "bn-ema" and c.model.name == "tiny_bn")
    assert cell.corruption == "gradual:gaussian_noise+contrast" and cell.severity == 3
    result = run_cell(cell, tmp_path / "cache")
    assert result.status == "ok", result.message
    names = [f"{c}-{s}" for c in ("gaussian_noise", "contrast") for s in (1, 2, 3, 2, 1)]
    assert result.detail["corruptions"] == names and result.n_images == 12 * len(names)
    blocks = continual.stream_blocks(cell)
    assert [b[0] for b in blocks] == names
    assert not np.array_equal(blocks[0][1], blocks[2][1])  # severity 1 and 3 differ
    assert np.array_equal(blocks[0][1], blocks[4][1])      # the ramp comes back to the same images


@pytest.mark.usefixtures("one_thread")
def test_a_realtime_grid_records_cost_and_adapted_batches(tiny_stream, tmp_path) -> None:
    from aqr.harness.grid_driver import run_grid
    from aqr.harness.report import report
    from aqr.harness.results import ResultsDB

    offline = replace(tiny_stream, methods=(MethodSpec("source"), MethodSpec("bn-ema"), MethodSpec("tent")))
    grid = replace(offline, parts=(replace(offline, protocol=REALTIME),))
    costs = tmp_path / "costs.json"
    CostTable({cost_key(m.name, v, 4): {"cost": c} for m in grid.models
               for v, c in (("source", 1.0), ("bn-ema", 1.1), ("tent", 3.0))}).save(costs)
    db_path = tmp_path / "r.db"
    with ResultsDB(db_path) as db:
        summary = run_grid(grid, db, tmp_path / "cache", progress=False, log=lambda m: None, costs_file=costs)
        rows = db.rows()
    assert summary.errors == 0, summary.error_messages
    realtime = {(r.model, r.method): r for r in rows if r.protocol == REALTIME and r.status == "ok"}
    assert realtime
    for (model, method), row in realtime.items():
        batches = row.detail["batches"]  # 2 blocks of 12 images in batches of 4
        assert batches == 6 and row.config["cost"] == {"source": 1.0, "bn-ema": 1.1, "tent": 3.0}[method]
        assert row.detail["adapted_batches"] == {"source": 6, "bn-ema": 3, "tent": 2}[method]
    # source adapts on nothing: realtime and offline predictions are the same
    same = [r for r in rows if r.method == "source" and r.model == "tiny_bn"]
    assert len({r.accuracy for r in same}) == 1 and len(same) == 2
    result = report(db_path, tmp_path / "report")
    table = next(t for t in result["tables"] if t["name"] == "field_continual")
    assert "realtime" in table["header"] and "C" in table["header"]
    assert not any(t["name"].startswith("stream_") and "realtime" in json.dumps(t) for t in result["tables"])


@pytest.mark.usefixtures("one_thread")
def test_timing_round_measures_missing_costs_and_records_what_cannot_run(tiny_stream, tmp_path) -> None:
    grid = replace(tiny_stream, methods=(MethodSpec("ttn"), MethodSpec("tent")), protocol=REALTIME)
    path = tmp_path / "costs.json"
    logged: list[str] = []
    costs = resolve_costs(list(grid.cells()), path, tmp_path / "cache", log=logged.append)
    table = CostTable.load(path)
    assert set(costs) == {"tiny_bn|ttn|4", "tiny_bn|tent|4", "tiny_gn|tent|4"}
    assert "not_applicable" in table.entries["tiny_gn|ttn|4"] and all(c > 0 for c in costs.values())
    assert table.entries["tiny_bn|tent|4"]["rounds"] >= 1
    logged.clear()
    assert resolve_costs(list(grid.cells()), path, tmp_path / "cache", log=logged.append) == costs
    assert logged == []  # nothing measured again


def test_a_method_as_fast_as_the_plain_model_keeps_up_with_the_stream() -> None:
    plain = nn.Linear(8, 8)
    result = measure_cost(plain, plain, [torch.randn(16, 8) for _ in range(11)], warmup=2, clock="cpu")
    assert result["cost"] == 1.0 or result["total_ratio"] > 1.0 + result["spread"]


def test_protocols_keep_only_their_cells_of_every_part() -> None:
    whole = list(grid_from_args(_args("--preset", "field", "--setting", "continual")).cells())
    online = grid_from_args(_args("--preset", "field", "--setting", "continual", "--protocols", "online"))
    realtime = grid_from_args(_args("--preset", "field", "--setting", "continual", "--protocols", "realtime"))
    assert online.name == realtime.name == "field-continual"
    assert list(online.cells()) == [c for c in whole if c.protocol == "online"]
    # the grid's own protocol dropped: a realtime part takes its place, with the costs the grid carries
    assert list(realtime.cells()) == [c for c in whole if c.protocol == REALTIME] and realtime.protocol == REALTIME
    both = grid_from_args(_args("--preset", "field", "--setting", "continual", "--protocols", "online,realtime"))
    assert list(both.cells()) == whole
    ccc = grid_from_args(_args("--preset", "field", "--models", "resnet20_trainstats", "--setting", "ccc",
                               "--baseline", "40", "--speed", "1000", "--protocols", "online"))
    assert {c.protocol for c in ccc.cells()} == {"online"} and len(ccc) == len(FIELD_OFFLINE_METHODS) * 2
    for bad, message in (("sideways", "unknown protocols"), ("episodic", "has no cells of protocols"),
                         ("", "names no protocol"), (" , ", "names no protocol")):
        with pytest.raises(UsageError, match=message):
            grid_from_args(_args("--preset", "field", "--protocols", bad))
