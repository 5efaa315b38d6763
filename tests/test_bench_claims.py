"""Runs sharing a results database divide the cells (claims with leases), and keys without file locations."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

import aqr
from aqr.harness.cells import ModelSpec
from aqr.harness.claims import BUSY, CLAIMED, DONE, Claims
from aqr.harness.grid_driver import keyed_cells, run_grid
from aqr.harness.keys import legacy_cell_key
from aqr.harness.results import ResultsDB
from aqr.harness.specs import GridSpec
from tests.test_bench import _bench_command, _cell, _tiny_setup


def _db(tmp_path: Path) -> Path:
    path = tmp_path / "r.db"
    ResultsDB(path).close()
    return path


def test_a_claimed_cell_is_busy_for_others_until_released(tmp_path: Path) -> None:
    path = _db(tmp_path)
    a, b = Claims(path), Claims(path)
    assert a.claim("k") == CLAIMED and a.claim("k") == CLAIMED     # claiming again is harmless
    assert b.claim("k") == BUSY
    assert a.held() == {"k"} and b.held() == set()
    a.release("k")
    assert b.claim("k") == CLAIMED and a.claim("k") == BUSY
    b.close()                                                      # closing releases what is held
    assert a.claim("k") == CLAIMED
    a.close()


def test_an_expired_lease_is_taken_over_and_a_heartbeat_keeps_it(tmp_path: Path) -> None:
    path = _db(tmp_path)
    silent = Claims(path, lease_s=0.3)                 # no heartbeat: like a run that hangs
    other = Claims(path, lease_s=0.3)
    assert silent.claim("k") == CLAIMED and other.claim("k") == BUSY
    time.sleep(0.4)
    assert other.claim("k") == CLAIMED                 # the lease ran out
    with Claims(path, lease_s=0.3) as alive:           # heartbeat every 0.1 s
        assert alive.claim("j") == CLAIMED
        time.sleep(0.7)
        assert other.claim("j") == BUSY
    assert other.claim("j") == CLAIMED                 # released on exit
    silent.close()
    other.close()


def test_a_dead_process_on_this_host_holds_nothing(tmp_path: Path) -> None:
    path = _db(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    claims = Claims(path, lease_s=3600)
    claims._conn.execute("INSERT INTO claims VALUES ('k', ?, ?, ?, ?)",
                         (f"{claims.host}:{pid}:x", claims.host, pid, time.time() + 3600))
    claims._conn.execute("INSERT INTO claims VALUES ('j', 'far:1:x', 'far', 1, ?)", (time.time() + 3600,))
    assert claims.claim("k") == CLAIMED                # a SIGKILLed run's cells need not wait for the lease
    assert claims.claim("j") == BUSY                   # another host's: only its lease says
    claims.close()


def test_a_run_in_another_pid_namespace_of_the_same_host_keeps_its_claims(tmp_path: Path) -> None:
    """Containers on the host network share a host name but not their process ids: only the lease counts."""
    path = _db(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)                             # no such process here; in the other namespace it may run
    here = Claims(path, lease_s=3600, namespace="box|boot-1|pid:[1]")
    there = "box|boot-1|pid:[2]"                       # same host name and boot, another PID namespace
    here._conn.execute("INSERT INTO claims VALUES ('k', ?, ?, ?, ?)", (f"{there}:{pid}:x", there, pid, time.time() + 3600))
    assert here.claim("k") == BUSY
    mine = "box|boot-1|pid:[1]"                        # the same namespace: a dead process holds nothing
    here._conn.execute("INSERT INTO claims VALUES ('j', ?, ?, ?, ?)", (f"{mine}:{pid}:x", mine, pid, time.time() + 3600))
    assert here.claim("j") == CLAIMED
    unknown = Claims(path, lease_s=3600, namespace="box|?|?")  # namespace unreadable: judge no process
    unknown._conn.execute("INSERT INTO claims VALUES ('u', ?, ?, ?, ?)",
                          (f"box|?|?:{pid}:x", "box|?|?", pid, time.time() + 3600))
    assert unknown.claim("u") == BUSY
    here.close()
    unknown.close()


def test_stored_rows_are_done_and_old_errors_are_retried(tmp_path: Path) -> None:
    path = _db(tmp_path)
    cell = _cell().to_dict()
    with ResultsDB(path) as db:
        db.add("ok", cell, "ok", 50.0, 10, 1.0, {})
        db.add("old-error", cell, "error", None, None, 1.0, {}, "boom")
        time.sleep(0.01)
        claims = Claims(path)
        db.add("new-error", cell, "error", None, None, 1.0, {}, "boom")   # another run's, during this run
    assert claims.claim("ok") == DONE
    assert claims.claim("old-error") == CLAIMED        # errors of earlier runs are retried
    assert claims.claim("new-error") == DONE           # not re-run at once by every run on the database
    claims.close()


@pytest.mark.slow
def test_two_runs_on_one_database_divide_the_cells(tmp_path: Path) -> None:
    grid, _ = _tiny_setup(tmp_path)
    grid = replace(grid, seeds=(0, 1, 2))                       # 60 cells
    db_path = tmp_path / "r.db"
    cmd = _bench_command(grid, tmp_path, "--json")
    with ResultsDB(db_path) as db:                              # statistics first, so both start on cells at once
        run_grid(replace(grid, name="stats", methods=grid.methods[-1:], corruptions=grid.corruptions[:1], seeds=(7,)), db,
                 tmp_path / "cache", threads=1, progress=False, log=lambda m: None)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in runs]
    assert all(p.returncode == 0 for p in runs), [err[-800:] for _, err in outs]
    summaries = [json.loads(out) for out, _ in outs]
    with ResultsDB(db_path) as db:
        rows = db.rows(grid.name)
    assert len(rows) == len(grid) == 60 and len({r.key for r in rows}) == 60
    by_run = Counter(r.provenance["run"] for r in rows)
    assert len(by_run) == 2 and min(by_run.values()) > 0, by_run          # both worked
    assert sorted(s["ran"] for s in summaries) == sorted(by_run.values())  # and no cell ran twice
    assert all(s["ran"] + s["by_others"] == 60 for s in summaries)


def test_keys_do_not_depend_on_where_the_files_live(tmp_path: Path) -> None:
    grid, _ = _tiny_setup(tmp_path)
    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "c", moved / "c")
    for name in ("clean.npz", "tiny_bn.pt", "tiny_gn.pt"):
        shutil.copy(tmp_path / name, moved / name)

    def relocate(spec: ModelSpec) -> ModelSpec:
        return replace(spec, model=str(moved / Path(spec.model).name), source_data=str(moved / "clean.npz"))

    there = replace(grid, models=tuple(relocate(m) for m in grid.models), data=replace(grid.data, root=str(moved / "c")))
    assert [k for k, _, _ in keyed_cells(grid)] == [k for k, _, _ in keyed_cells(there)]
    np_file = moved / "c" / "gaussian_noise.npy"
    np_file.write_bytes(np_file.read_bytes()[:-1] + b"\x01")        # other content: other keys
    assert keyed_cells(grid)[0][0] != keyed_cells(there)[0][0]


def test_rows_under_keys_with_locations_are_adopted(tiny: GridSpec, tmp_path: Path) -> None:
    grid = replace(tiny, methods=tiny.methods[:2])
    with ResultsDB(tmp_path / "r.db") as db:
        assert run_grid(grid, db, tmp_path / "cache", progress=False, log=lambda m: None).ran == 8
        for key, cell, fp in keyed_cells(grid):                     # what an older aqr stored
            db.rekey(key, legacy_cell_key(cell, fp, aqr.__version__))
        assert db.finished({k for k, _, _ in keyed_cells(grid)}) == set()
        again = run_grid(grid, db, tmp_path / "cache", progress=False, log=lambda m: None)
        assert again.ran == 0 and again.skipped == 8 and len(db) == 8 and len(db.rows(grid.name)) == 8


@pytest.fixture()
def tiny(tmp_path: Path) -> GridSpec:
    return _tiny_setup(tmp_path)[0]
