"""Moving results to new keys when a model checkpoint is re-saved with the same weights.

A cell's key holds the sha256 of its weights file. Re-saving a checkpoint with other metadata (say,
provenance cut of machine paths) changes that hash, so its cells would be run again although every
weight is the same. :func:`rekey_resaved_checkpoint` checks that the two files hold bit-identical
tensors, then moves each row keyed with the old file to the key it has with the new one (results,
per-image results, details and experiment lists alike), in one transaction.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import torch

from aqr.harness.cells import Cell
from aqr.harness.keys import cell_key
from aqr.harness.results import ResultsDB
from aqr.models.checkpoint import read_file
from aqr.util.files import sha256_file

#: the tables whose rows are named by a cell's key, besides ``results``
KEYED_TABLES = ("experiment_cells", "details", "per_image")


def same_weights(old: str | Path, new: str | Path) -> bool:
    """Whether two checkpoint files hold the same tensors, bit for bit (names, dtypes, shapes, values)."""
    a, b = (_state(read_file(path)) for path in (old, new))
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a)


def _state(obj: object) -> dict[str, torch.Tensor]:
    state = obj.get("state_dict", obj) if isinstance(obj, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError("not a checkpoint of tensors")
    return state


def rekey_resaved_checkpoint(db_path: str | Path, old_sha256: str, old: str | Path, new: str | Path) -> int:
    """Move the rows of ``db_path`` whose weights hash is ``old_sha256`` (the hash ``old`` had before it was
    rewritten as ``new``; ``old`` must still hold those weights) to their keys with ``new``'s hash. Raises
    ``ValueError`` when the files' tensors differ. Returns the number of rows moved."""
    if not same_weights(old, new):
        raise ValueError(f"{new} does not hold the same tensors as {old}: its results cannot be re-keyed")
    new_sha256 = sha256_file(new)
    ResultsDB(db_path).close()  # refuses a foreign or damaged database
    con = sqlite3.connect(db_path, isolation_level=None)
    moved = 0
    try:
        con.execute("BEGIN IMMEDIATE")
        rows = con.execute("SELECT key, config, provenance FROM results").fetchall()
        for key, config, provenance in rows:
            prov = json.loads(provenance)
            if prov.get("files", {}).get("weights") != old_sha256:
                continue
            cell = Cell.from_dict(json.loads(config))
            if cell_key(cell, prov["files"], prov["aqr"]) != key:
                raise ValueError(f"row {key} does not match its own config; nothing was re-keyed")
            prov["files"]["weights"] = new_sha256
            new_key = cell_key(cell, prov["files"], prov["aqr"])
            con.execute("UPDATE results SET key = ?, provenance = ? WHERE key = ?",
                        (new_key, json.dumps(prov, sort_keys=True), key))
            for table in KEYED_TABLES:
                con.execute(f"UPDATE {table} SET key = ? WHERE key = ?", (new_key, key))
            moved += 1
        con.execute("COMMIT")
    except BaseException:
        con.execute("ROLLBACK")
        raise
    finally:
        con.close()
    return moved
