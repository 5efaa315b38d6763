"""Claims on benchmark cells, so that several runs on one results database divide the cells.

A run claims a cell (a row of the database's ``claims`` table: key, owner, lease expiry) just
before it starts the cell, keeps its leases alive while it runs (a heartbeat thread), and releases
the claim once the result row is stored. Another run skips a cell claimed by someone else until the
lease expires (its owner was killed or hangs) or, in the same process namespace of the same boot of
the same host, the owner's process is gone; then it takes the cell over. Runs in other PID namespaces
(containers sharing a host name) cannot see each other's processes, so between them only the lease
counts. A cell whose row was written after this run started counts as done
for this run whatever its status, so an ``error`` row another run just wrote is not run again at
once (a later run retries it, as it retries any error row).
"""

from __future__ import annotations

import os
import platform
import sqlite3
import threading
import time
import uuid
from pathlib import Path

CLAIMED, DONE, BUSY = "claimed", "done", "busy"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS claims (
    key TEXT PRIMARY KEY,
    owner TEXT NOT NULL,             -- host:pid:random of the claiming run
    host TEXT NOT NULL,              -- where pid means something: host name, boot id and PID namespace
    pid INTEGER NOT NULL,
    expires REAL NOT NULL            -- time.time() after which anyone may take the cell over
);
"""


def _read(path: str) -> str:
    try:
        return os.readlink(path) if os.path.islink(path) else Path(path).read_text().strip()
    except OSError:
        return "?"


def process_namespace() -> str:
    """Where this process's id means something: the host name, this boot's id and the PID namespace
    (``host|boot|pid:[inode]``). Two runs may judge each other's processes only when these are equal."""
    return f"{platform.node()}|{_read('/proc/sys/kernel/random/boot_id')}|{_read('/proc/self/ns/pid')}"


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host (a process we may not signal exists)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Claims:
    """This run's claims on the cells of the results database at ``path`` (which must exist).

    Use as a context manager: on entry a heartbeat thread starts renewing this run's leases every
    ``lease_s / 3`` seconds; on exit it stops and every claim still held is released.
    """

    def __init__(self, path: str | Path, lease_s: float = 120.0, namespace: str | None = None) -> None:
        if lease_s <= 0:
            raise ValueError(f"lease_s must be positive, got {lease_s}")
        self.path = Path(path)
        self.lease_s = float(lease_s)
        # the process namespace (default: process_namespace()); an unknown one ('?' parts) judges no process
        self.host = namespace if namespace is not None else process_namespace()
        self.pid = os.getpid()
        self.owner = f"{self.host}:{self.pid}:{uuid.uuid4().hex[:8]}"
        self.started = time.time()
        self._conn = self._connect()
        self._conn.executescript(_SCHEMA)
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def _connect(self) -> sqlite3.Connection:
        # autocommit; claim() opens its own write transaction (sqlite3 connections are per thread)
        return sqlite3.connect(self.path, timeout=30.0, isolation_level=None)

    # ---- claiming -------------------------------------------------------------------------
    def claim(self, key: str) -> str:
        """Try to take the cell ``key``: :data:`CLAIMED` (run it), :data:`DONE` or :data:`BUSY` (skip it)."""
        now = time.time()
        con = self._conn
        con.execute("BEGIN IMMEDIATE")  # the check and the write are one step for every run
        try:
            row = con.execute("SELECT status, created FROM results WHERE key = ?", (key,)).fetchone()
            if row is not None and (row[0] in ("ok", "n/a") or row[1] >= self.started):
                state = DONE
            else:
                held = con.execute("SELECT owner, host, pid, expires FROM claims WHERE key = ?", (key,)).fetchone()
                if held is not None and held[0] != self.owner and held[3] > now and not self._gone(held[1], held[2]):
                    state = BUSY
                else:
                    con.execute("INSERT OR REPLACE INTO claims VALUES (?, ?, ?, ?, ?)",
                                (key, self.owner, self.host, self.pid, now + self.lease_s))
                    state = CLAIMED
            con.execute("COMMIT")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        return state

    def _gone(self, host: str, pid: int) -> bool:
        # Another process of this namespace that no longer exists holds nothing (a SIGKILLed run's
        # claims need not wait for their leases). A reused pid only means waiting for the lease; a
        # claim from another namespace (or one that could not be read) waits for its lease too.
        return host == self.host and "?" not in host and pid != self.pid and not process_alive(pid)

    def release(self, key: str) -> None:
        """Give the cell back (after its row is stored, or when it will not be run)."""
        self._conn.execute("DELETE FROM claims WHERE key = ? AND owner = ?", (key, self.owner))

    def held(self) -> set[str]:
        """Keys this run holds."""
        return {k for (k,) in self._conn.execute("SELECT key FROM claims WHERE owner = ?", (self.owner,))}

    def renew(self, conn: sqlite3.Connection | None = None) -> None:
        """Push the expiry of every lease of this run ``lease_s`` into the future."""
        (conn or self._conn).execute("UPDATE claims SET expires = ? WHERE owner = ?",
                                     (time.time() + self.lease_s, self.owner))

    # ---- heartbeat --------------------------------------------------------------------------
    def _beat(self) -> None:
        conn = self._connect()
        try:
            while not self._stop.wait(self.lease_s / 3):
                try:
                    self.renew(conn)
                except sqlite3.Error:  # a busy database: the next beat tries again, well inside the lease
                    pass
        finally:
            conn.close()

    def __enter__(self) -> "Claims":
        self._heartbeat = threading.Thread(target=self._beat, name="aqr-claims-heartbeat", daemon=True)
        self._heartbeat.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the heartbeat, release every claim still held, close the connection."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        try:
            self._conn.execute("DELETE FROM claims WHERE owner = ?", (self.owner,))
        finally:
            self._conn.close()
