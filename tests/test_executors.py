"""The local executor's worker processes end with the driver that started them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

DRIVER = textwrap.dedent("""
    import os, sys, time
    from aqr.harness.executors import LocalExecutor

    if __name__ == "__main__":
        executor = LocalExecutor(sys.argv[1], workers=2, progress=False)
        print(executor._pool.submit(os.getpid).result(), flush=True)
        executor._pool.submit(time.sleep, 120)  # a long cell in flight when the driver dies
        time.sleep(120)
""")


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left for a parent to reap counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in state


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_end_when_the_driver_is_killed(tmp_path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    driver = subprocess.Popen([sys.executable, str(script), str(tmp_path / "cache")], stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        worker = int(driver.stdout.readline())
        assert _alive(worker)
        driver.send_signal(signal.SIGKILL)  # no chance to shut its pool down
        driver.wait(10)
        deadline = time.monotonic() + 20
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(worker), "a worker outlived its driver"
    finally:
        driver.kill()
