"""Re-saving a checkpoint with the same weights moves its results to the new keys; other weights never."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
import torch

from aqr.harness.cells import Cell, DataSpec, ModelSpec
from aqr.harness.keys import cell_key
from aqr.harness.rekey import rekey_resaved_checkpoint, same_weights
from aqr.harness.results import ResultsDB, pack_correct
from aqr.models import create, save_checkpoint
from aqr.models.checkpoint import atomic_save, read_file
from aqr.util.files import sha256_file

CONFIG = {"name": "resnet20", "num_classes": 10, "kwargs": {"width": 4}}


def _cell(checkpoint: Path, corruption: str) -> Cell:
    return Cell(model=ModelSpec("tiny", "resnet20", str(checkpoint), "clean.npz"), data=DataSpec(), method="source",
                options=(), corruption=corruption, severity=5, batch_size=8, seed=0, n_images=16)


def _db_with_rows(tmp_path: Path, checkpoint: Path) -> tuple[Path, dict[str, Cell]]:
    db = tmp_path / "r.db"
    cells = {}
    with ResultsDB(db) as results:
        for corruption in ("fog", "snow"):
            cell = _cell(checkpoint, corruption)
            files = {"weights": sha256_file(checkpoint), "eval": "e", "labels": "l", "source": "s"}
            key = cell_key(cell, files, "0.1.0")
            results.add(key, cell.to_dict(), "ok", 50.0, 16, 1.0, {"files": files, "aqr": "0.1.0"},
                        detail={"x": 1}, correct=pack_correct(torch.ones(16, dtype=torch.bool).numpy()))
            cells[key] = cell
        other = _cell(tmp_path / "elsewhere.pt", "fog")  # another model's row stays
        files = {"weights": "f" * 64, "eval": "e", "labels": "l", "source": "s"}
        results.add(cell_key(other, files, "0.1.0"), other.to_dict(), "ok", 40.0, 16, 1.0,
                    {"files": files, "aqr": "0.1.0"})
    return db, cells


def _resave(path: Path, meta: dict, tensors_from: Path | None = None) -> None:
    obj = read_file(path)
    if tensors_from is not None:
        obj["state_dict"] = read_file(tensors_from)["state_dict"]
    obj["meta"] = meta
    atomic_save(obj, path)


def test_rows_move_to_the_new_key_when_only_the_metadata_changed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ckpt = save_checkpoint(tmp_path / "m.pt", create("resnet20", num_classes=10, width=4), CONFIG,
                           {"command": "aqr train --out /root/out/m.pt"})
    db, cells = _db_with_rows(tmp_path, ckpt)
    old_sha = sha256_file(ckpt)
    before = tmp_path / "before.pt"
    before.write_bytes(ckpt.read_bytes())
    _resave(ckpt, {"command": "aqr train --out m.pt"})
    assert sha256_file(ckpt) != old_sha and same_weights(before, ckpt)
    assert rekey_resaved_checkpoint(db, old_sha, before, ckpt) == 2
    con = sqlite3.connect(db)
    keys = {k: json.loads(p) for k, p in con.execute("SELECT key, provenance FROM results")}
    new_sha = sha256_file(ckpt)
    for cell in cells.values():
        files = {"weights": new_sha, "eval": "e", "labels": "l", "source": "s"}
        key = cell_key(cell, files, "0.1.0")
        assert keys[key]["files"]["weights"] == new_sha
        assert con.execute("SELECT COUNT(*) FROM per_image WHERE key = ?", (key,)).fetchone()[0] == 1
        assert con.execute("SELECT COUNT(*) FROM details WHERE key = ?", (key,)).fetchone()[0] == 1
    assert not set(cells) & set(keys) and len(keys) == 3  # the old keys are gone; the other model's row stays
    con.close()


def test_other_weights_are_never_rekeyed(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ckpt = save_checkpoint(tmp_path / "m.pt", create("resnet20", num_classes=10, width=4), CONFIG, {})
    torch.manual_seed(1)
    other = save_checkpoint(tmp_path / "o.pt", create("resnet20", num_classes=10, width=4), CONFIG, {})
    db, cells = _db_with_rows(tmp_path, ckpt)
    old_sha = sha256_file(ckpt)
    before = tmp_path / "before.pt"
    before.write_bytes(ckpt.read_bytes())
    _resave(ckpt, {"note": "new"}, tensors_from=other)
    with pytest.raises(ValueError, match="same tensors"):
        rekey_resaved_checkpoint(db, old_sha, before, ckpt)
    con = sqlite3.connect(db)
    assert set(cells) <= {k for (k,) in con.execute("SELECT key FROM results")}
    con.close()
