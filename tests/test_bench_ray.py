"""The benchmark grid on Ray (``--executor ray``), on a real local Ray instance of 2 CPUs (no mocks)."""

from __future__ import annotations

import os
import platform
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from aqr.bench.grid import GridSpec  # noqa: E402
from aqr.bench.ray_executor import RayExecutor, RayOptions  # noqa: E402
from aqr.bench.results import ResultsDB  # noqa: E402
from aqr.bench.runner import run_grid  # noqa: E402
from tests.test_bench import _grid_file, _tiny_setup  # noqa: E402


@pytest.fixture(scope="module")
def cluster() -> str:
    """A local Ray instance for this module (2 CPUs, a small object store); yields its address."""
    ray.init(address="local", num_cpus=2, object_store_memory=200 * 1024**2, include_dashboard=False,
             log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture()
def tiny(tmp_path: Path) -> GridSpec:
    return _tiny_setup(tmp_path)[0]


def _rows(db: ResultsDB) -> dict[str, tuple]:
    return {r.key: (r.status, r.accuracy, r.n_images) for r in db.rows()}


def _quiet(message: str) -> None:
    pass


def test_ray_writes_the_rows_the_local_executor_writes(cluster: str, tiny: GridSpec, tmp_path: Path) -> None:
    logged: list[str] = []
    with ResultsDB(tmp_path / "ray.db") as db:
        summary = run_grid(tiny, db, tmp_path / "ray-cache", threads=1, progress=False, log=logged.append,
                           executor="ray", ray=RayOptions(max_retries=1))
        assert summary.ran == 20 and summary.errors == 0, summary.error_messages
        on_ray, prov = _rows(db), [r.provenance for r in db.rows()]
    with ResultsDB(tmp_path / "local.db") as db:
        run_grid(tiny, db, tmp_path / "local-cache", threads=1, progress=False, log=_quiet)
        assert _rows(db) == on_ray                       # same keys, statuses and accuracies
        assert {r.provenance["executor"] for r in db.rows()} == {"local"}
    assert {p["executor"] for p in prov} == {"ray"}
    assert {p["node"] for p in prov} == {platform.node()} and {p["threads"] for p in prov} == {1}
    # statistics once per file (two models), on the cluster, and kept in the driver's cache
    assert sum("calibrating" in m for m in logged) == 2
    assert len(list((tmp_path / "ray-cache" / "stats").glob("*.aqr.safetensors"))) == 2


def _kill_one_cell_worker(killed: list[int], stop: threading.Event) -> None:
    """SIGKILL the first Ray worker process seen running a cell (title ``ray::_cell_task``)."""
    while not stop.is_set() and not killed:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if title.startswith(b"ray::_cell_task"):
                os.kill(int(pid), signal.SIGKILL)
                killed.append(int(pid))
                return
        time.sleep(0.005)


@pytest.mark.parametrize("retries", [1, 0])
def test_a_killed_worker_is_retried_then_recorded(cluster: str, tiny: GridSpec, tmp_path: Path, retries: int) -> None:
    if not Path("/proc").is_dir():
        pytest.skip("finds Ray's worker processes through /proc")
    killed: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(target=_kill_one_cell_worker, args=(killed, stop))
    killer.start()
    try:
        with ResultsDB(tmp_path / "r.db") as db:
            summary = run_grid(tiny, db, tmp_path / "cache", threads=1, progress=False, log=_quiet,
                               executor="ray", ray=RayOptions(max_retries=retries))
            rows = db.rows(tiny.name)
    finally:
        stop.set()
        killer.join()
    assert len(killed) == 1
    assert summary.ran == len(rows) == len({r.key for r in rows}) == len(tiny)   # one row per cell
    errors = [r for r in rows if r.status == "error"]
    if retries:
        assert errors == [] and summary.errors == 0
    else:                                                 # no retry left: the cell is an error row
        assert len(errors) == 1 and "WorkerCrashedError" in errors[0].message
        with ResultsDB(tmp_path / "r.db") as db:           # and a rerun retries it
            again = run_grid(tiny, db, tmp_path / "cache", threads=1, progress=False, log=_quiet,
                             executor="ray", ray=RayOptions())
            assert again.ran == 1 and again.errors == 0 and len(db) == len(tiny)


def test_files_missing_on_a_node_are_named_up_front(cluster: str, tmp_path: Path) -> None:
    present = tmp_path / "x.npy"
    present.write_bytes(b"12345")
    executor = RayExecutor(tmp_path / "cache", RayOptions())
    try:
        executor.check_files({present: 5})
        with pytest.raises(FileNotFoundError, match=f"node {platform.node()} .*cannot read {tmp_path}/gone.npy"):
            executor.check_files({present: 5, tmp_path / "gone.npy": 10})
        with pytest.raises(FileNotFoundError, match="has 5 bytes there, 6 on the driver"):
            executor.check_files({present: 6})
        with pytest.raises(ValueError, match="no node of the Ray cluster offers 64 CPUs"):
            RayExecutor(tmp_path / "cache", RayOptions(cpus_per_cell=64)).check_files({present: 5})
    finally:
        executor.close()


@pytest.mark.slow
def test_cli_on_a_running_cluster_resumes_after_a_sigkilled_driver(cluster: str, tmp_path: Path) -> None:
    grid, _ = _tiny_setup(tmp_path)
    config = _grid_file(grid, tmp_path / "grid.json")
    db_path = tmp_path / "r.db"
    cmd = [sys.executable, "-m", "aqr", "bench", "--config", str(config), "--db", str(db_path), "--cache",
           str(tmp_path / "cache"), "--executor", "ray", "--ray-address", cluster, "--threads", "1", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def count() -> int:
        try:
            con = sqlite3.connect(db_path, timeout=5)
            try:
                return con.execute("SELECT COUNT(*) FROM results").fetchone()[0]
            finally:
                con.close()
        except sqlite3.OperationalError:  # not created yet
            return 0

    deadline = time.time() + 120
    while count() < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, f"run ended before it could be killed: {proc.stderr.read().decode()[-800:]}"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    con = sqlite3.connect(db_path)
    kept = dict(con.execute("SELECT key, created FROM results").fetchall())
    con.close()
    assert 2 <= len(kept) < len(grid)

    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-1500:]
    assert f"{len(kept)} already in" in done.stderr
    with ResultsDB(db_path) as db:
        rows = db.rows(grid.name)
        assert len(rows) == len(grid) and {r.provenance["executor"] for r in rows} == {"ray"}
        assert all(kept[r.key] == r.created for r in rows if r.key in kept)   # not recomputed
