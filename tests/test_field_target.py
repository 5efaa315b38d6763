"""AQR's default configuration per setting (chosen on the seed-1 draw), the oracle, and the target table."""

from __future__ import annotations

from pathlib import Path

import pytest

from aqr.harness.cells import REALTIME
from aqr.harness.presets import FIELD_AQR_CONFIGS, FIELD_DEFAULTS, FIELD_METHODS
from aqr.harness.report import build_tables, load_rows
from aqr.harness.report.field_tables import row_setting
from aqr.harness.cells import Cell, DataSpec, ModelSpec, freeze_options
from aqr.harness.report.field_target import (RECOMMENDED_SETTINGS, choose_defaults, choose_recommended, is_aqr_config,
                                             is_field_method, recommended_table, spec_variant, target_table,
                                             variant_spec)
from aqr.harness.specs import MethodSpec
from aqr.harness.results import Row
from aqr.methods import RECOMMENDED

SELECTION_DB = Path(__file__).resolve().parents[1] / "docs" / "results" / "field" / "selection.db"
RECOMMEND_DB = SELECTION_DB.with_name("recommend.db")  # the seed-1 draw of the recommended configuration


def row(model: str, variant: str, accuracy: float | None, order: str | None = None, protocol: str = "online",
        status: str = "ok", batch_size: int = 64, seed: int = 1, cost: float = 1.5) -> Row:
    method = variant.partition("[")[0]
    config = {"order": order} if order else {}
    if protocol == REALTIME:
        config["cost"] = cost
    return Row(f"{model}|{variant}|{order}|{protocol}", model, method, variant, "cifar10-c", "continual", 5, batch_size,
               seed, protocol, status, accuracy, 100, 1.0, None, config, {}, 0.0)


def test_aqr_configs_and_field_methods_split_the_preset():
    variants = {f"{m}[{o}]" if sep else m for m, sep, o in (v.partition(":") for v in FIELD_METHODS)}
    assert {v for v in variants if is_aqr_config(v)} == set(FIELD_AQR_CONFIGS)
    assert is_aqr_config("aqr[target=robust]") and is_aqr_config("aqr+lame")
    assert is_field_method("roid") and is_field_method("source")
    assert not is_field_method("moments") and not is_field_method("aqr+tent")


def test_choose_defaults_takes_the_best_mean_over_models_per_setting_and_protocol():
    rows = [row("a", "aqr", 70.0), row("b", "aqr", 60.0),                      # mean 65
            row("a", "aqr+eta", 75.0), row("b", "aqr+eta", 58.0),              # mean 66.5: wins offline
            row("a", "roid", 99.0), row("b", "roid", 99.0),                    # not an AQR configuration
            row("a", "aqr[target=robust]", 90.0),                              # missing on b: cannot compete
            row("a", "aqr", 60.0, protocol=REALTIME), row("b", "aqr", 61.0, protocol=REALTIME),
            row("a", "aqr+eta", 40.0, protocol=REALTIME), row("b", "aqr+eta", 80.0, protocol=REALTIME),
            row("a", "aqr[target=stream]", 50.0, "delta=0.1"), row("b", "aqr[target=stream]", 50.0, "delta=0.1"),
            row("a", "aqr", 50.0, "delta=0.1"), row("b", "aqr", 50.0, "delta=0.1"),   # a tie: variant order
            row("a", "aqr", 99.0, batch_size=16), row("b", "aqr", 99.0, batch_size=16)]
    assert choose_defaults(rows) == {"continual": {"offline": "aqr+eta", "realtime": "aqr"},
                                     "correlated (delta=0.1)": {"offline": "aqr"}}


def test_choose_defaults_ignores_failed_cells():
    rows = [row("a", "aqr", 70.0), row("a", "aqr+eta", None, status="error"), row("a", "aqr", 70.0, protocol=REALTIME)]
    assert choose_defaults(rows) == {"continual": {"offline": "aqr", "realtime": "aqr"}}


def test_target_table_compares_the_default_with_the_best_field_method_and_shows_the_oracle():
    rows = [row("a", "aqr", 74.0, seed=0), row("a", "aqr+eta", 75.2, seed=0), row("a", "cotta", 74.7, seed=0),
            row("a", "moments", 80.0, seed=0), row("a", "aqr", 63.0, protocol=REALTIME, seed=0),
            row("a", "tent", 65.0, protocol=REALTIME, seed=0)]
    table = target_table(rows, {"continual": {"offline": "aqr", "realtime": "aqr"}})
    assert table is not None and table.name == "field_target"
    assert table.labels == ("continual · a · offline", "continual · a · realtime")
    offline, realtime = table.entries
    assert [e.text for e in offline] == ["AQR", "74.0", "CoTTA 74.7", "AQR+ETA 75.2", "-0.7", "no"]
    assert [e.text for e in realtime] == ["AQR", "63.0", "TENT 65.0", "AQR 63.0", "-2.0", "no"]
    met = target_table(rows, {"continual": {"offline": "aqr+eta"}})
    assert [e.text for e in met.entries[0]][-2:] == ["+0.5", "yes"]


def test_build_tables_adds_the_target_table_for_field_rows():
    rows = [row("resnet20_trainstats", v, 50.0 + i, seed=0) for i, v in enumerate(["aqr", "roid"])]
    rows.append(row("resnet20_trainstats", "aqr", 40.0, protocol=REALTIME, seed=0))
    assert {"field_target", "field_recommended"} <= {t.name for t in build_tables(rows)}


@pytest.mark.skipif(not SELECTION_DB.is_file(), reason="the selection run's database is not in this checkout")
def test_frozen_defaults_are_the_choice_on_the_committed_selection_draw():
    rows = load_rows(SELECTION_DB)
    assert {r.seed for r in rows} == {1}
    assert choose_defaults(rows) == FIELD_DEFAULTS


# ---- the recommended configuration: one per protocol over every setting and model -----------------------------
ORDERS = {"continual": None, "correlated (delta=0.1)": "delta=0.1", "mixed_domains": "mixed",
          "mixed_domains_correlated (delta=0.1)": "mixed,delta=0.1"}
MODELS = ("resnet20_trainstats", "resnet20_gn", "vit_ln")


def grid_rows(variant: str, accuracy: dict[str, float] | float, protocol: str = "online", cost: float = 1.5,
              **changes) -> list[Row]:
    """One row per setting and model; ``accuracy`` per setting (or one for all)."""
    return [row(m, variant, accuracy if isinstance(accuracy, float) else accuracy[s], ORDERS[s], protocol,
                cost=cost, **changes) for s in RECOMMENDED_SETTINGS for m in MODELS]


def test_rows_of_the_four_settings_are_named_as_the_rule_names_them():
    assert {row_setting(r) for r in grid_rows("aqr", 50.0)} == set(RECOMMENDED_SETTINGS) == set(ORDERS)


def test_choose_recommended_takes_the_best_mean_over_all_settings_and_models():
    # stream wins continual and correlated, robust loses them by a little and wins mixed by a lot: robust's mean
    # is higher. Per setting the rule would pick stream twice; over all cells it picks robust.
    stream = {"continual": 72.0, "correlated (delta=0.1)": 66.0, "mixed_domains": 50.0,
              "mixed_domains_correlated (delta=0.1)": 40.0}
    robust = {"continual": 71.0, "correlated (delta=0.1)": 65.0, "mixed_domains": 55.0,
              "mixed_domains_correlated (delta=0.1)": 45.0}
    rows = [*grid_rows("aqr[target=stream]", stream), *grid_rows("aqr[target=robust]", robust),
            *grid_rows("roid", 99.0),                                        # not an AQR configuration
            *grid_rows("aqr", 99.0, batch_size=16), *grid_rows("aqr+eta", 99.0, seed=0),  # other batch size, draw
            *grid_rows("aqr[target=stream]", stream, REALTIME), *grid_rows("aqr[target=robust]", 40.0, REALTIME)]
    assert choose_recommended(rows) == {"offline": "aqr:target=robust", "realtime": "aqr:target=stream"}
    first_two = RECOMMENDED_SETTINGS[:2]
    assert choose_recommended(rows, settings=first_two)["offline"] == "aqr:target=stream"


def test_choose_recommended_refuses_a_configuration_missing_a_cell():
    complete = grid_rows("aqr[target=stream]", 60.0) + grid_rows("aqr[target=stream]", 60.0, REALTIME)
    better = [r for r in grid_rows("aqr+roid", 90.0) if not (r.model == "vit_ln" and r.config.get("order") == "mixed")]
    failed = grid_rows("aqr+eta", 95.0)
    failed[0] = row(MODELS[0], "aqr+eta", None, status="error")
    assert choose_recommended(complete + better + failed)["offline"] == "aqr:target=stream"
    with pytest.raises(ValueError, match=r"none is eligible: aqr\+roid lacks 1 \(mixed_domains / vit_ln\)") as err:
        choose_recommended(better + grid_rows("aqr", 50.0, REALTIME))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="no AQR configuration has a row"):
        choose_recommended(grid_rows("roid", 50.0) + grid_rows("roid", 50.0, REALTIME))


def test_choose_recommended_refuses_a_cell_with_two_rows():
    rows = grid_rows("aqr", 60.0) + grid_rows("aqr", 60.0, REALTIME, cost=1.4)
    assert choose_recommended(rows) == {"offline": "aqr", "realtime": "aqr"}
    retimed = row(MODELS[0], "aqr", 61.0, protocol=REALTIME, cost=1.5)  # the same cell at another timing round's C
    with pytest.raises(ValueError, match="two ok rows for continual / realtime / resnet20_trainstats / aqr"):
        choose_recommended(rows + [retimed])
    assert choose_recommended(rows + [row(MODELS[0], "aqr", None, protocol=REALTIME, status="error")])["realtime"] == "aqr"


def test_choose_recommended_breaks_a_tie_by_the_lower_cost():
    offline = grid_rows("aqr+lame", 60.0) + grid_rows("aqr", 60.0)
    cheap_last = grid_rows("aqr+lame", 60.0, REALTIME, cost=1.2) + grid_rows("aqr", 60.0, REALTIME, cost=1.4)
    assert choose_recommended(offline + cheap_last) == {"offline": "aqr+lame", "realtime": "aqr+lame"}
    cheap_first = grid_rows("aqr+lame", 60.0, REALTIME, cost=1.6) + grid_rows("aqr", 60.0, REALTIME, cost=1.4)
    assert choose_recommended(offline + cheap_first) == {"offline": "aqr", "realtime": "aqr"}


def test_variant_spec_is_the_bench_syntax_and_spec_variant_the_cells_label():
    assert variant_spec("aqr") == "aqr" and variant_spec("aqr+roid[target=robust]") == "aqr+roid:target=robust"
    assert variant_spec("aqr[K=11,target=stream]") == "aqr:K=11,target=stream"
    for spec in ("aqr", "aqr:target=stream", "aqr+roid:target=robust", "aqr:target=stream,K=11,compile=false",
                 "aqr:horizon=2.5", "unmixtns:num_components=128"):
        parsed = MethodSpec.parse(spec)
        cell = Cell(ModelSpec("m", "resnet20"), DataSpec(), parsed.name, freeze_options(parsed.options), "continual",
                    5, 64, 1, 500)
        assert spec_variant(spec) == cell.variant
        assert spec_variant(variant_spec(cell.variant)) == cell.variant
    assert {spec_variant(variant_spec(v)) for v in FIELD_AQR_CONFIGS} == set(FIELD_AQR_CONFIGS)


def test_recommended_table_holds_one_configuration_in_every_setting_and_batch_size():
    rows = [row("a", "aqr[target=robust]", 70.0, seed=0), row("a", "roid", 71.0, seed=0),
            row("a", "aqr[target=robust]", 60.0, "delta=0.1", seed=0), row("a", "roid", 50.0, "delta=0.1", seed=0),
            row("a", "aqr[target=stream]", 66.0, "delta=0.1", protocol=REALTIME, seed=0),
            row("a", "tent", 65.0, "delta=0.1", protocol=REALTIME, seed=0),
            row("a", "aqr[target=robust]", 55.0, "mixed", batch_size=16, seed=0),
            row("a", "cotta", 54.0, "mixed", batch_size=16, seed=0)]
    table = recommended_table(rows, {"offline": "aqr:target=robust", "realtime": "aqr:target=stream"})
    assert table is not None and table.name == "field_recommended"
    assert table.labels == ("continual · a · offline · batch 64", "correlated (delta=0.1) · a · offline · batch 64",
                            "correlated (delta=0.1) · a · realtime · batch 64", "mixed_domains · a · offline · batch 16")
    assert [[e.text for e in entry][-2:] for entry in table.entries] == [["-1.0", "no"], ["+10.0", "yes"],
                                                                         ["+1.0", "yes"], ["+1.0", "yes"]]
    assert recommended_table(rows, {"offline": "aqr"}) is not None  # named but absent: rows left blank
    assert recommended_table([r for r in rows if r.protocol != REALTIME], {"offline": "aqr"}) is None  # not field rows


@pytest.mark.skipif(not RECOMMEND_DB.is_file(), reason="the recommendation's draw is not in this checkout")
def test_recommended_is_the_choice_on_the_committed_draw():
    """The rule over all four settings and three models, each candidate with every cell, each cell from a clean
    commit."""
    rows = load_rows(RECOMMEND_DB)
    assert {row_setting(r) for r in rows} == set(RECOMMENDED_SETTINGS) and {r.seed for r in rows} == {1}
    assert not any(r.provenance["git_commit"].endswith("-dirty") for r in rows)
    assert choose_recommended(rows) == dict(RECOMMENDED)


def test_batch1_windowed_cells_sit_in_their_methods_row():
    from aqr.harness.report.field_tables import setting_tables, unwindowed

    assert unwindowed("tent[window=64]") == "tent"
    assert unwindowed("aqr+roid[target=robust,window=64]") == "aqr+roid[target=robust]"
    assert unwindowed("aqr[target=stream]") == "aqr[target=stream]"
    rows = [row("m", "tent", 70.0, protocol="online"), row("m", "tent", 69.0, protocol=REALTIME),
            row("m", "tent[window=64]", 61.5, batch_size=1), row("m", "aqr[target=stream]", 72.0),
            row("m", "aqr[target=stream]", 71.0, protocol=REALTIME),
            row("m", "aqr[target=stream]", 68.5, batch_size=1)]
    (table,) = setting_tables(rows)
    assert "m bs 1" in table.header and "m bs 64" in table.header
    assert not any("window" in label for label in table.labels)
    tent = table.entries[table.labels.index("TENT")]
    assert tent[table.header.index("m bs 1") - 1].text.startswith("61.5")
    assert tent[table.header.index("m bs 64") - 1].text.startswith("70.0")
    assert "window=64" in table.note
