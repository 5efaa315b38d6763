"""Files aqr is pointed at are checked before they are used or changed."""

from __future__ import annotations

import sqlite3

import pytest
import torch

from aqr.harness.cells import Cell, DataSpec, ModelSpec
from aqr.harness.results import ResultsDB, ResultsDBError
from aqr.models import CheckpointError, create, from_checkpoint, save_checkpoint


def test_a_foreign_sqlite_file_is_refused_and_left_unchanged(tmp_path):
    path = tmp_path / "app.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE users (name TEXT)")
        conn.execute("INSERT INTO users VALUES ('ada')")
    before = path.read_bytes()
    with pytest.raises(ResultsDBError, match=f"{path}.*not an aqr results database.*users"):
        ResultsDB(path)
    assert path.read_bytes() == before  # no aqr tables were created in it
    with sqlite3.connect(path) as conn:
        assert [t for (t,) in conn.execute("SELECT name FROM sqlite_master")] == ["users"]


def test_an_empty_file_or_database_becomes_a_results_database(tmp_path):
    empty = tmp_path / "empty.db"
    empty.touch()
    sqlite3.connect(tmp_path / "blank.db").close()
    for path in (empty, tmp_path / "blank.db", tmp_path / "new.db"):
        with ResultsDB(path) as db:
            assert len(db) == 0
        with ResultsDB(path) as db:  # and opens again
            assert len(db) == 0


def test_a_database_with_a_damaged_page_is_refused_when_opened(tmp_path):
    path = tmp_path / "r.db"
    with ResultsDB(path) as db:
        db.add_membership("main", [f"key-{i}" for i in range(2000)])
    data = bytearray(path.read_bytes())
    data[2 * 4096 : 3 * 4096] = b"\xa5" * 4096
    path.write_bytes(bytes(data))
    with pytest.raises(ResultsDBError, match=f"{path}.*(corrupt|malformed)"):
        ResultsDB(path)


def _cell() -> dict:
    return Cell(ModelSpec("m", "resnet20"), DataSpec(), "aqr", (), "fog", 5, 128, 0, 100).to_dict()


def test_an_error_never_overwrites_an_ok_result(tmp_path):
    with ResultsDB(tmp_path / "r.db") as db:
        db.add("k", _cell(), "ok", 81.5, 100, 1.0, {})
        db.add("k", _cell(), "error", None, None, 2.0, {}, "RuntimeError: out of memory")
        (row,) = db.rows()
        assert (row.status, row.accuracy) == ("ok", 81.5)
        assert db.finished() == {"k"}
        db.add("e", _cell(), "error", None, None, 1.0, {}, "first")
        db.add("e", _cell(), "error", None, None, 1.0, {}, "second")  # a newer error replaces an error
        db.add("k", _cell(), "ok", 82.0, 100, 1.0, {})  # and a newer result a result
        rows = {r.key: r for r in db.rows()}
        assert rows["e"].message == "second" and rows["k"].accuracy == 82.0
        db.add("e", _cell(), "ok", 70.0, 100, 1.0, {})  # a result replaces an error
        assert {r.key: r.status for r in db.rows()} == {"k": "ok", "e": "ok"}


def _tiny_checkpoint(tmp_path, **config):
    torch.manual_seed(0)
    model = create("resnet20", num_classes=10, width=4)
    return save_checkpoint(tmp_path / "tiny.pt", model, {"name": "resnet20", "num_classes": 10, "kwargs": {"width": 4},
                                                          **config})


@pytest.mark.parametrize("config, field", [
    ({"num_classes": 4_000_000}, "num_classes"),  # used to allocate about 1 GB before failing
    ({"num_classes": -3}, "num_classes"),
    ({"num_classes": "10"}, "num_classes"),
    ({"kwargs": {"width": 10**6}}, "width"),
    ({"kwargs": {"width": 4.0e9}}, "width"),
    ({"kwargs": {"width": float("nan")}}, "width"),
    ({"kwargs": {"width": [4] * 10_000}}, "width"),
    ({"kwargs": "width=4"}, "kwargs"),
])
def test_absurd_checkpoint_configs_are_refused_before_building(tmp_path, monkeypatch, config, field):
    path = _tiny_checkpoint(tmp_path, **config)
    import aqr.models as models

    monkeypatch.setattr(models, "create", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(CheckpointError, match=f"tiny.pt.*{field}"):
        from_checkpoint(path)


def test_a_config_that_does_not_fit_its_weights_is_refused_before_allocating(tmp_path, monkeypatch):
    """Within the bounds, but 64x wider than its 1.4 MB of weights: found on the meta device."""
    path = _tiny_checkpoint(tmp_path, kwargs={"width": 256})
    import aqr.models as models

    devices = []
    real = models.create

    def spy(*args, **kwargs):
        devices.append(torch.empty(0).device.type)  # the default device the model is built on
        return real(*args, **kwargs)

    monkeypatch.setattr(models, "create", spy)
    with pytest.raises(CheckpointError, match="tiny.pt.*does not fit"):
        from_checkpoint(path)
    assert devices == ["meta"]
    good = _tiny_checkpoint(tmp_path)
    devices.clear()
    assert from_checkpoint(good).model.linear.out_features == 10
    assert devices == ["meta", "cpu"]
