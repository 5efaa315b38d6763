"""The benchmark's cell keys are frozen: a refactor must never change which results-database row a cell names.

Two checks, both without the shared data folder:

- every preset's cells, keyed with made-up file fingerprints and a fixed version string, give the keys
  recorded in ``tests/data/cell_keys.json`` (per preset: the cell count, a digest of all keys in grid
  order, the first keys and the legacy keys' digest);
- every row of the committed results database gets its own key back from its stored cell config, file
  hashes and aqr version.

A deliberate change of the keys' meaning (a version constant bumped) rewrites the fixture with
``PYTHONPATH=src python tests/test_cell_keys_frozen.py``; any other change of a key is a bug.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from aqr.harness.cells import Cell, stream_corruptions
from aqr.harness.keys import cell_key, legacy_cell_key
from aqr.harness.presets import PRESETS, preset

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = Path(__file__).parent / "data" / "cell_keys.json"
COMMITTED_DB = ROOT / "docs" / "results" / "reproduction" / "rerun" / "results.db"
VERSION = "0.0.0-frozen"  # any fixed string: the keys must not depend on the installed version here
DATA_DIR = "aqr-data"  # a relative folder that need not exist: file locations drop out of the keys
FIRST = 5  # keys recorded in full per preset, to show which cell moved when the digest differs


def fake_fingerprints(cell: Cell) -> dict[str, str]:
    """Made-up content hashes for the files a cell reads, one per role as the runner names them."""
    files = {"weights": f"weights:{cell.model.name}", "source": f"source:{cell.model.source_data.rsplit('/', 1)[-1]}"}
    streamed = stream_corruptions(cell.corruption)
    if streamed is not None:
        files.update({f"eval:{name}": f"eval:{name}" for name in streamed})
    else:
        files["eval"] = f"eval:{cell.corruption}"
    files["labels"] = f"labels:{cell.data.name}"
    return files


def preset_keys(name: str) -> dict[str, Any]:
    """What the fixture records of one preset."""
    cells = list(preset(name, data_dir=DATA_DIR).cells())
    keys = [cell_key(c, fake_fingerprints(c), VERSION) for c in cells]
    legacy = [legacy_cell_key(c, fake_fingerprints(c), VERSION) for c in cells]
    return {"cells": len(cells), "digest": _digest(keys), "first": keys[:FIRST], "legacy_digest": _digest(legacy)}


def _digest(keys: list[str]) -> str:
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()


def test_fixture_covers_every_preset() -> None:
    assert sorted(json.loads(FIXTURE.read_text())) == sorted(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_keys_are_unchanged(name: str) -> None:
    expected = json.loads(FIXTURE.read_text())[name]
    found = preset_keys(name)
    assert found["cells"] == expected["cells"]
    assert found["first"] == expected["first"]
    assert found["digest"] == expected["digest"], f"a cell key of preset {name!r} changed"
    assert found["legacy_digest"] == expected["legacy_digest"], f"a legacy key of preset {name!r} changed"


def test_committed_rows_get_their_keys_back() -> None:
    if not COMMITTED_DB.is_file():
        pytest.skip(f"{COMMITTED_DB.name} is not in this checkout")
    con = sqlite3.connect(f"file:{COMMITTED_DB}?mode=ro&immutable=1", uri=True)  # never written
    try:
        rows = con.execute("SELECT key, config, provenance FROM results").fetchall()
    finally:
        con.close()
    assert rows
    moved = []
    for key, config, provenance in rows:
        prov = json.loads(provenance)
        if cell_key(Cell.from_dict(json.loads(config)), prov["files"], prov["aqr"]) != key:
            moved.append(key)
    assert not moved, f"{len(moved)} of {len(rows)} committed rows no longer match their key, e.g. {moved[0]}"


if __name__ == "__main__":
    FIXTURE.write_text(json.dumps({name: preset_keys(name) for name in PRESETS}, indent=1) + "\n")
    print(f"wrote {FIXTURE}")
