"""The benchmark grid on Ray (``--executor ray``), on a real local Ray instance of 2 CPUs (no mocks)."""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from aqr.harness.executors import CellSettings  # noqa: E402
from aqr.harness.grid_driver import run_grid  # noqa: E402
from aqr.harness.ray_executor import RayExecutor, RayOptions  # noqa: E402
from aqr.harness.results import ResultsDB  # noqa: E402
from aqr.harness.specs import GridSpec  # noqa: E402
from tests.test_bench import _bench_command, _sigkill_and_resume, _tiny_setup  # noqa: E402


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


def _rows(rows: list) -> dict[str, tuple]:
    return {r.key: (r.status, r.accuracy, r.n_images) for r in rows}


def _quiet(message: str) -> None:
    pass


@contextlib.contextmanager
def _one_cell_worker_killed() -> Iterator[list[int]]:
    """Within the block, a thread SIGKILLs the first Ray worker process seen running a cell (title
    ``ray::_cell_task``); yields the list its pid goes into."""
    if not Path("/proc").is_dir():
        pytest.skip("finds Ray's worker processes through /proc")
    killed: list[int] = []
    stop = threading.Event()

    def kill() -> None:
        while not stop.is_set():
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

    thread = threading.Thread(target=kill)
    thread.start()
    try:
        yield killed
    finally:
        stop.set()
        thread.join()


def test_ray_writes_the_local_rows_though_a_worker_is_killed(cluster: str, tiny: GridSpec, tmp_path: Path) -> None:
    logged: list[str] = []
    with ResultsDB(tmp_path / "ray.db") as db, _one_cell_worker_killed() as killed:
        summary = run_grid(tiny, db, tmp_path / "ray-cache", threads=1, progress=False, log=logged.append,
                           executor="ray", ray=RayOptions(max_retries=1))
        rows = db.rows(tiny.name)
    assert len(killed) == 1                              # Ray reran that cell
    assert summary.ran == len(rows) == len({r.key for r in rows}) == len(tiny) and summary.errors == 0
    with ResultsDB(tmp_path / "local.db") as db:
        run_grid(tiny, db, tmp_path / "local-cache", threads=1, progress=False, log=_quiet)
        assert _rows(db.rows()) == _rows(rows)           # same keys, statuses and accuracies
        assert {(r.provenance["executor"], r.provenance["threads"]) for r in db.rows()} == {("local", 1)}
    prov = [r.provenance for r in rows]
    assert {(p["executor"], p["threads"]) for p in prov} == {("ray", 1)}
    assert {p["node"] for p in prov} == {f"{platform.node()}/{ray.get_runtime_context().get_node_id()[:12]}"}
    # statistics once per file (two models), on the cluster, and kept in the driver's cache
    assert sum("calibrating" in m for m in logged) == 2
    assert len(list((tmp_path / "ray-cache" / "stats").glob("*.aqr.safetensors"))) == 2


def test_a_cell_whose_worker_dies_on_its_last_try_is_an_error_row(cluster: str, tiny: GridSpec, tmp_path: Path) -> None:
    with ResultsDB(tmp_path / "r.db") as db, _one_cell_worker_killed() as killed:
        summary = run_grid(tiny, db, tmp_path / "cache", threads=1, progress=False, log=_quiet,
                           executor="ray", ray=RayOptions(max_retries=0))
        rows = db.rows(tiny.name)
    assert len(killed) == 1 and summary.ran == len(rows) == len(tiny)
    errors = [r for r in rows if r.status == "error"]
    assert len(errors) == 1 and "WorkerCrashedError" in errors[0].message
    with ResultsDB(tmp_path / "r.db") as db:               # a rerun retries it
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
        executor.check_files({tmp_path: -1})                                 # a folder of images
        with pytest.raises(FileNotFoundError, match="empty folder"):
            (tmp_path / "empty").mkdir()
            executor.check_files({tmp_path / "empty": -1})
        with pytest.raises(ValueError, match="needs GPUs per cell"):
            RayExecutor(tmp_path / "cache", RayOptions(), CellSettings(device="cuda"))
        with pytest.raises(ValueError, match="no node of the Ray cluster offers 64 CPUs"):
            RayExecutor(tmp_path / "cache", RayOptions(cpus_per_cell=64)).check_files({present: 5})
    finally:
        executor.close()


@pytest.mark.slow
def test_cli_on_a_running_cluster_resumes_after_a_sigkilled_driver(cluster: str, tmp_path: Path) -> None:
    grid, _ = _tiny_setup(tmp_path)
    grid = replace(grid, methods=grid.methods[:-1])            # 16 cells, no statistics to compute
    cmd = _bench_command(grid, tmp_path, "--executor", "ray", "--ray-address", cluster)
    rows = _sigkill_and_resume(cmd, tmp_path / "r.db", grid, 2)
    assert {r.provenance["executor"] for r in rows} == {"ray"}


def test_an_unreachable_ray_address_is_one_line_and_quick(tiny: GridSpec, tmp_path: Path) -> None:
    """An address where nothing listens: exit 1 with one line well within a minute, no database cells run."""
    import subprocess

    command = _bench_command(tiny, tmp_path, "--executor", "ray", "--ray-address", "127.0.0.1:1")
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - started < 60
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert done.returncode == 1, done.stderr
    assert lines[-1].startswith("aqr bench: error: cannot reach the Ray cluster at 127.0.0.1:1"), lines
