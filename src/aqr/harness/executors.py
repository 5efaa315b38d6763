"""Where :func:`aqr.harness.grid_driver.run_grid` runs cells: the interface, and the local executor.

An executor takes cells and hands back their :class:`~aqr.harness.cells.CellResult` as they finish;
the grid's driver decides what to run and alone writes the results database. The local executor
runs cells in the driver's process or in a pool of worker processes on this machine; the Ray
executor (:mod:`aqr.harness.ray_executor`) runs them as tasks on a Ray cluster.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aqr.harness.cell_run import run_cell
from aqr.harness.cells import Cell, CellResult
from aqr.harness.source_stats import ensure_stats, stats_options


@dataclass(frozen=True)
class CellSettings:
    """How each cell runs, whatever runs it: torch threads (``None``: the process's), the device of
    the model (``None``: CPU), the processes decoding image folders and how often (images) a stream cell
    saves a checkpoint it resumes from (``None``: never; :mod:`aqr.harness.stream_checkpoint`)."""

    threads: int | None = None
    device: str | None = None
    loader_workers: int = 0
    checkpoint_every: int | None = None


class CellExecutor(Protocol):
    """What the grid's driver needs from an executor."""

    #: recorded in every row's provenance ("local", "ray")
    name: str

    def capacity(self) -> int:
        """How many cells to keep submitted at once (what runs, plus a queue that keeps it busy)."""

    def check_files(self, sizes: Mapping[Path, int]) -> None:
        """Raise if a file the cells read (with its size here; -1: a folder) is unreadable where cells run."""

    def prepare_stats(self, needed: Mapping[Path, Cell]) -> dict[Path, Any]:
        """Compute each missing statistics file once (``needed``: file -> a cell that needs it);
        returns file -> what :meth:`submit` takes for the cells that need it."""

    def submit(self, cell: Cell, stats: Any | None) -> Hashable:
        """Start a cell; returns a handle."""

    def wait(self, handles: Sequence[Hashable], timeout: float) -> list[tuple[Hashable, CellResult]]:
        """The handles among ``handles`` that finished (at least one, unless ``timeout`` s pass), with results."""

    def close(self) -> None:
        """Stop the workers (cells not finished are lost; their claims expire)."""


def run_cell_task(cell_dict: dict, cache_dir: str, stats_file: str | None, settings: CellSettings) -> CellResult:
    """:func:`aqr.harness.cell_run.run_cell` on a cell sent as plain data (what a worker process receives)."""
    return run_cell(Cell.from_dict(cell_dict), cache_dir, device=settings.device,
                    loader_workers=settings.loader_workers, stats_file=stats_file, threads=settings.threads,
                    checkpoint_every=settings.checkpoint_every)


def exit_with_parent(parent_pid: int, every_s: float = 1.0) -> None:
    """In a worker process: end it as soon as ``parent_pid`` is no longer its parent (the driver was killed),
    instead of computing cells whose results no one will write down."""
    import os
    import threading
    import time

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, name="aqr-exit-with-parent", daemon=True).start()


class LocalExecutor:
    """Cells in this process (``workers`` <= 1) or in ``workers`` spawned processes of this machine."""

    name = "local"

    def __init__(self, cache_dir: str | Path, settings: CellSettings = CellSettings(), workers: int = 1,
                 progress: bool = True, log: Callable[[str], None] = print) -> None:
        self.cache_dir = str(cache_dir)
        self.workers = max(1, int(workers))
        self.settings = settings
        self.progress = progress
        self.log = log
        self._inline: collections.OrderedDict[int, tuple[Cell, Any]] = collections.OrderedDict()
        self._numbers = itertools.count()
        self._pool: ProcessPoolExecutor | None = None
        if self.workers > 1:
            import multiprocessing as mp
            import os

            self._pool = ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"),
                                             initializer=exit_with_parent, initargs=(os.getpid(),))

    def capacity(self) -> int:
        return 1 if self._pool is None else 2 * self.workers

    def check_files(self, sizes: Mapping[Path, int]) -> None:
        """Nothing to do: the driver hashed every file moments ago on this machine."""

    def prepare_stats(self, needed: Mapping[Path, Cell]) -> dict[Path, Any]:
        for path, cell in needed.items():
            if not path.is_file():
                self.log(f"calibrating {cell.model.name} (K={stats_options(cell)['K']}) -> {path}")
                ensure_stats(cell, self.cache_dir, progress=self.progress, device=self.settings.device,
                             loader_workers=self.settings.loader_workers, threads=self.settings.threads)
        return {path: str(path) for path in needed}

    def submit(self, cell: Cell, stats: Any | None) -> Hashable:
        if self._pool is None:  # run when waited for, so the driver records each result at once
            handle = next(self._numbers)
            self._inline[handle] = (cell, stats)
            return handle
        return self._pool.submit(run_cell_task, cell.to_dict(), self.cache_dir, stats, self.settings)

    def wait(self, handles: Sequence[Hashable], timeout: float) -> list[tuple[Hashable, CellResult]]:
        if self._pool is None:
            wanted = set(handles)
            handle = next(h for h in self._inline if h in wanted)
            cell, stats = self._inline.pop(handle)
            s = self.settings
            return [(handle, run_cell(cell, self.cache_dir, self.progress, s.device, s.loader_workers,
                                      stats_file=stats, threads=s.threads, checkpoint_every=s.checkpoint_every))]
        finished, _ = wait([h for h in handles if isinstance(h, Future)], timeout=timeout,
                           return_when=FIRST_COMPLETED)
        return [(fut, fut.result()) for fut in finished]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
