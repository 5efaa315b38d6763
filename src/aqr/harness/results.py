"""The results database: one SQLite row per benchmark cell, with its provenance.

SQLite in WAL mode, written only by the process that runs the grid, one short transaction per
finished cell. A process killed at any moment (even SIGKILL) leaves a valid file holding every cell
committed before the kill; rerunning the same grid skips them. Rows are keyed by
:func:`aqr.harness.keys.cell_key`, which covers the cell's config, its files' content hashes and the code
version, so a changed config never reuses a stale row. Beside each row, table ``per_image`` keeps
which of the cell's images were classified right (one bit each, in evaluation order), so methods can
be compared image by image on the same images (:mod:`aqr.harness.report.paired`).
"""

from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from aqr.harness.cells import Cell
from aqr.util.files import check_writable_target

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS results (
    key TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    method TEXT NOT NULL,
    variant TEXT NOT NULL,
    dataset TEXT NOT NULL,
    corruption TEXT NOT NULL,
    severity INTEGER NOT NULL,
    batch_size INTEGER NOT NULL,
    seed INTEGER NOT NULL,
    protocol TEXT NOT NULL,
    status TEXT NOT NULL,            -- 'ok', 'n/a' (method not applicable to the model) or 'error'
    accuracy REAL,                   -- top-1, percent
    n_images INTEGER,
    wall_s REAL,
    message TEXT,
    config TEXT NOT NULL,            -- the cell as canonical JSON
    provenance TEXT NOT NULL,        -- versions, git commit, file hashes, host, as JSON
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS experiment_cells (
    experiment TEXT NOT NULL,
    key TEXT NOT NULL,
    PRIMARY KEY (experiment, key)
);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS details (  -- what an ok cell keeps beyond its accuracy (a stream's per-image results)
    key TEXT PRIMARY KEY,
    detail TEXT NOT NULL             -- JSON
);
CREATE TABLE IF NOT EXISTS per_image (
    key TEXT PRIMARY KEY,            -- the row in results
    n INTEGER NOT NULL,              -- images
    correct BLOB NOT NULL            -- bit i: the prediction for the cell's i-th image was right (pack_correct)
);
"""

TABLES = {"results", "experiment_cells", "meta"}

COLUMNS = ("key", "model", "method", "variant", "dataset", "corruption", "severity", "batch_size", "seed",
           "protocol", "status", "accuracy", "n_images", "wall_s", "message", "config", "provenance", "created")


def pack_correct(correct: np.ndarray) -> bytes:
    """Per-image correctness (bool, in evaluation order) as bytes: ``numpy.packbits``, big bit order."""
    return np.packbits(np.asarray(correct, dtype=bool)).tobytes()


def unpack_correct(blob: bytes, n: int) -> np.ndarray:
    """The inverse of :func:`pack_correct` for ``n`` images."""
    return np.unpackbits(np.frombuffer(blob, dtype=np.uint8), count=n).astype(bool)


class ResultsDBError(RuntimeError):
    """The file is not an aqr results database (or one of another schema version)."""


@dataclass(frozen=True)
class Row:
    """One stored result (``config`` and ``provenance`` parsed from JSON)."""

    key: str
    model: str
    method: str
    variant: str
    dataset: str
    corruption: str
    severity: int
    batch_size: int
    seed: int
    protocol: str
    status: str
    accuracy: float | None
    n_images: int | None
    wall_s: float | None
    message: str | None
    config: dict
    provenance: dict
    created: float
    detail: dict | None = None  # e.g. a continual cell's per-image results (aqr.harness.continual.stream_detail)


def _locked(err: sqlite3.OperationalError) -> bool:
    """Whether sqlite gave up waiting for another connection's lock."""
    return "locked" in str(err)


class ResultsDB:
    """Open (creating if needed) a results database at ``path``; use as a context manager.

    A file that is neither empty nor an aqr results database is refused and left as it was, as is
    one whose pages are damaged (SQLite's ``quick_check``). With ``existing``, the file must already be
    a results database (a reader's open: an empty or new file is refused, not given a schema).
    """

    def __init__(self, path: str | Path, existing: bool = False, timeout: float = 30.0) -> None:
        self.timeout = timeout  # how long a write waits for another process's transaction
        self.path = check_writable_target(path)  # never a FIFO or a device opened as a database
        if existing and not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: results database not found")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._conn = sqlite3.connect(self.path, timeout=timeout, isolation_level=None)
            self._check_before_writing(existing)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(_SCHEMA)
            found = self._conn.execute("SELECT value FROM meta WHERE name='schema_version'").fetchone()
        except sqlite3.OperationalError as err:
            if _locked(err):
                raise self._locked_error(err) from err
            raise ResultsDBError(f"{self.path} is not an aqr results database ({err})") from err
        except sqlite3.DatabaseError as err:
            raise ResultsDBError(f"{self.path} is not an aqr results database ({err})") from err
        if found is None:
            self._conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        elif not str(found[0]).strip().isdecimal() or int(found[0]) != SCHEMA_VERSION:
            self._conn.close()
            if not str(found[0]).strip().isdecimal():  # written by hand or by another program
                raise ResultsDBError(f"{self.path} has an unreadable schema version {found[0]!r} in its meta table; "
                                     f"this aqr reads {SCHEMA_VERSION}")
            raise ResultsDBError(f"{self.path} has schema version {found[0]}; this aqr reads {SCHEMA_VERSION}")

    def _check_before_writing(self, existing: bool = False) -> None:
        """Raise :class:`ResultsDBError` (changing nothing) for another program's database or a damaged one,
        and, where ``existing``, for a file that holds no database yet."""
        try:
            tables = {name for (name,) in self._conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            damage = [m for (m,) in self._conn.execute("PRAGMA quick_check")] if tables else ["ok"]
        except sqlite3.DatabaseError as err:
            self._conn.close()
            raise ResultsDBError(f"{self.path} is not an aqr results database, or it is corrupted ({err})") from err
        if existing and not tables:
            self._conn.close()
            raise ResultsDBError(f"{self.path} holds no results database (it is empty); run `aqr bench --db "
                                 f"{self.path}` first")
        if tables and not TABLES <= tables:
            self._conn.close()
            raise ResultsDBError(f"{self.path} is not an aqr results database (it holds the tables "
                                 f"{', '.join(sorted(tables))}); give a new or empty file")
        if damage != ["ok"]:
            self._conn.close()
            raise ResultsDBError(f"{self.path} is corrupted (sqlite quick_check: {'; '.join(damage[:3])})")

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> "ResultsDB":
        return self

    def __exit__(self, kind: object, err: object, tb: object) -> None:
        self.close()
        if isinstance(err, sqlite3.OperationalError) and _locked(err):
            raise self._locked_error(err) from err

    def _locked_error(self, err: sqlite3.OperationalError) -> ResultsDBError:
        """sqlite's "database is locked" names no file: the error that says which one, and why it can be."""
        return ResultsDBError(f"{self.path} stayed locked for {self.timeout:g} s ({err}): another process holds a "
                              "write transaction on it, or the file is on a file system without locks")

    # ---- writing ----------------------------------------------------------------------------
    def add(self, key: str, cell: dict, status: str, accuracy: float | None, n_images: int | None,
            wall_s: float | None, provenance: dict, message: str | None = None, detail: dict | None = None,
            correct: bytes | None = None) -> None:
        """Store one cell's result in its own transaction: it replaces the cell's stored row, except
        that an ``error`` never replaces an ``ok`` result (a failed rerun keeps the result). ``detail``
        (JSON-able) is kept beside an ok row. ``correct``: the cell's per-image correctness
        (:func:`pack_correct` of ``n_images`` values), kept for paired comparisons; it goes and comes
        with the row."""
        if status not in ("ok", "n/a", "error"):
            raise ValueError(f"status must be 'ok', 'n/a' or 'error', got {status!r}")
        if correct is not None and (n_images is None or len(correct) != -(-n_images // 8)):
            raise ValueError(f"per-image correctness of {len(correct)} bytes does not hold {n_images} images")
        values = (key, cell["model"]["name"], cell["method"], Cell.from_dict(cell).variant, cell["data"]["name"],
                  cell["corruption"], cell["severity"], cell["batch_size"], cell["seed"], cell["protocol"],
                  status, accuracy, n_images, wall_s, message,
                  json.dumps(cell, sort_keys=True), json.dumps(provenance, sort_keys=True), time.time())
        update = ", ".join(f"{c} = excluded.{c}" for c in COLUMNS[1:])
        with self._conn:
            self._conn.execute("BEGIN")
            stored = self._conn.execute(
                f"INSERT INTO results ({','.join(COLUMNS)}) VALUES ({','.join('?' * len(COLUMNS))}) "
                f"ON CONFLICT(key) DO UPDATE SET {update} "
                "WHERE NOT (excluded.status = 'error' AND results.status = 'ok')", values).rowcount
            if not stored:  # an error after an ok result: the result, its detail and its images stay
                return
            if detail is not None and status == "ok":
                self._conn.execute("INSERT OR REPLACE INTO details VALUES (?, ?)", (key, json.dumps(detail)))
            if correct is None:
                self._conn.execute("DELETE FROM per_image WHERE key = ?", (key,))
            else:
                self._conn.execute("INSERT OR REPLACE INTO per_image VALUES (?, ?, ?)", (key, n_images, correct))

    def add_membership(self, experiment: str, keys: Iterable[str]) -> None:
        """Record that these cells belong to ``experiment`` (a cell may belong to several)."""
        with self._conn:
            self._conn.execute("BEGIN")
            self._conn.executemany("INSERT OR IGNORE INTO experiment_cells VALUES (?, ?)",
                                   [(experiment, k) for k in keys])

    def rekey(self, old: str, new: str) -> None:
        """Store the row of key ``old`` (its detail, per-image results and experiment memberships) under ``new``
        instead, in one transaction."""
        with self._conn:
            self._conn.execute("BEGIN")
            self._conn.execute("UPDATE OR REPLACE results SET key = ? WHERE key = ?", (new, old))
            self._conn.execute("UPDATE OR REPLACE details SET key = ? WHERE key = ?", (new, old))
            self._conn.execute("UPDATE OR REPLACE per_image SET key = ? WHERE key = ?", (new, old))
            self._conn.execute("UPDATE OR IGNORE experiment_cells SET key = ? WHERE key = ?", (new, old))
            self._conn.execute("DELETE FROM experiment_cells WHERE key = ?", (old,))

    # ---- reading ----------------------------------------------------------------------------
    def finished(self, keys: Iterable[str] | None = None) -> set[str]:
        """Keys with a stored 'ok' or 'n/a' row (errors are retried), optionally among ``keys``."""
        done = {k for (k,) in self._conn.execute("SELECT key FROM results WHERE status IN ('ok', 'n/a')")}
        return done if keys is None else done & set(keys)

    def correct(self, keys: Iterable[str]) -> dict[str, np.ndarray]:
        """Per-image correctness (bool arrays, in each cell's evaluation order) of those ``keys`` that have it."""
        wanted = list(dict.fromkeys(keys))
        found: dict[str, np.ndarray] = {}
        for start in range(0, len(wanted), 500):  # SQLite's limit on bound parameters
            chunk = wanted[start : start + 500]
            sql = f"SELECT key, n, correct FROM per_image WHERE key IN ({','.join('?' * len(chunk))})"
            found.update({key: unpack_correct(blob, n) for key, n, blob in self._conn.execute(sql, chunk)})
        return found

    def experiments(self) -> list[str]:
        return [e for (e,) in self._conn.execute("SELECT DISTINCT experiment FROM experiment_cells ORDER BY experiment")]

    def rows(self, experiment: str | None = None, **where: Any) -> list[Row]:
        """Stored rows, optionally of one experiment and with column equalities (``model="vit_ln"``)."""
        bad = set(where) - set(COLUMNS)
        if bad:
            raise ValueError(f"unknown columns {sorted(bad)}")
        sql = f"SELECT {','.join('r.' + c for c in COLUMNS)}, d.detail FROM results r LEFT JOIN details d ON d.key = r.key"
        args: list[Any] = []
        if experiment is not None:
            sql += " JOIN experiment_cells e ON e.key = r.key AND e.experiment = ?"
            args.append(experiment)
        if where:
            sql += " WHERE " + " AND ".join(f"r.{c} = ?" for c in where)
            args.extend(where.values())
        return [_row(values) for values in self._conn.execute(sql + " ORDER BY r.created", args)]

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows())

    def __len__(self) -> int:
        return self._conn.execute("SELECT COUNT(*) FROM results").fetchone()[0]


def _row(values: tuple) -> Row:
    d = dict(zip((*COLUMNS, "detail"), values))
    d["config"] = json.loads(d["config"])
    d["provenance"] = json.loads(d["provenance"])
    d["detail"] = None if d["detail"] is None else json.loads(d["detail"])
    return Row(**d)
