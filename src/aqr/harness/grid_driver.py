"""Driving a grid: expand it, skip the cells already in the results database, prepare every
source-statistics file once, run the rest on an executor and record each result as it arrives.

:func:`run_grid` is the only writer of the database. Cells run in this process or local worker
processes (:mod:`aqr.harness.executors`) or on a Ray cluster (:mod:`aqr.harness.ray_executor`); runs
sharing a database divide the cells between them (:mod:`aqr.harness.claims`).
"""

from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from aqr._version import __version__
from aqr.harness.cell_run import needs_stats
from aqr.harness.cells import REALTIME, Cell, CellResult, data_corruptions
from aqr.harness.claims import BUSY, CLAIMED, Claims
from aqr.harness.executors import CellExecutor, CellSettings, LocalExecutor
from aqr.harness.inputs import ensure_data
from aqr.harness.keys import cell_key, legacy_cell_key
from aqr.harness.provenance import cell_files, fingerprints, provenance
from aqr.harness.results import ResultsDB
from aqr.harness.source_stats import stats_path
from aqr.harness.specs import GridSpec

if TYPE_CHECKING:
    from aqr.harness.ray_executor import RayOptions


@dataclass
class GridSummary:
    """What a :func:`run_grid` call did (``by_others``: cells another run on the database finished meanwhile)."""

    total: int = 0
    skipped: int = 0
    ran: int = 0
    errors: int = 0
    not_applicable: int = 0
    by_others: int = 0
    wall_s: float = 0.0
    error_messages: list[str] = field(default_factory=list)


def keyed_cells(grid: GridSpec) -> list[tuple[str, Cell, dict[str, str]]]:
    """Every cell of ``grid`` with its results-database key and its files' content hashes.

    The files must exist (run :func:`aqr.harness.inputs.ensure_data` first for generated corruptions).
    """
    keyed = []
    for cell in grid.cells():
        fp = fingerprints(cell)
        keyed.append((cell_key(cell, fp, __version__), cell, fp))
    return keyed


def adopt_legacy_rows(db: ResultsDB, keyed: Sequence[tuple[str, Cell, dict[str, str]]]) -> int:
    """Rekey the finished rows stored under :func:`aqr.harness.keys.legacy_cell_key` (keys with file
    locations) to today's keys, so a database from before keys were location-free is reused; returns
    how many. A legacy key matches only a row computed under today's versions and files.
    """
    missing = {key: (cell, fp) for key, cell, fp in keyed}
    missing = {k: v for k, v in missing.items() if k not in db.finished(missing)}
    legacy = {legacy_cell_key(cell, fp, __version__): key for key, (cell, fp) in missing.items()}
    found = db.finished(legacy)
    for old in found:
        db.rekey(old, legacy[old])
    return len(found)


def make_executor(executor: str, cache_dir: str | Path, settings: CellSettings, workers: int = 1,
                  ray: RayOptions | None = None, progress: bool = True,
                  log: Callable[[str], None] = print) -> CellExecutor:
    """The executor named ``executor``: ``"local"`` (``workers`` processes) or ``"ray"`` (``ray`` options)."""
    if executor == "local":
        return LocalExecutor(cache_dir, settings, workers=workers, progress=progress, log=log)
    if executor == "ray":
        from aqr.harness.ray_executor import RayExecutor, RayOptions

        return RayExecutor(cache_dir, ray or RayOptions(), settings, progress=progress, log=log)
    raise ValueError(f"unknown executor {executor!r}; expected 'local' or 'ray'")


def run_grid(grid: GridSpec, db: ResultsDB, cache_dir: str | Path = "cache", workers: int = 1,
             threads: int | None = None, progress: bool = True, limit: int | None = None,
             log: Callable[[str], None] = print, device: str | None = None, loader_workers: int = 0,
             executor: str = "local", ray: RayOptions | None = None, lease_s: float = 120.0,
             costs_file: str | Path | None = None, checkpoint_every: int | None = None) -> GridSummary:
    """Run every cell of ``grid`` not already in ``db``; each result is committed as it arrives.

    ``executor="local"`` runs cells in this process, or in ``workers`` processes; ``"ray"`` runs
    each cell as a Ray task (see :class:`aqr.harness.ray_executor.RayOptions`). Either way a cell uses
    ``threads`` torch threads (set inside it), its model runs on ``device`` (default CPU; under Ray,
    CUDA when cells get GPUs), image folders are decoded by ``loader_workers`` processes, and this
    process alone writes the database. Cells are claimed in ``db`` before they start (``lease_s``,
    see :mod:`aqr.harness.claims`), so runs sharing a database divide the cells. ``limit`` stops
    after that many new cells (smoke tests). A method name or option no cell could run raises before
    anything is generated or recorded (:meth:`GridSpec.check_methods`). Realtime cells take their
    methods' costs from ``costs_file``, which a timing round completes first where it lacks one
    (:func:`aqr.harness.realtime.timing.resolve_costs`). ``checkpoint_every``: stream cells save their
    state every that many images in the cache folder where they run, and a rerun of a killed grid resumes
    them mid-stream (:mod:`aqr.harness.stream_checkpoint`).
    """
    for name, value, least in (("workers", workers, 1), ("threads", threads, 1), ("limit", limit, 1),
                               ("loader_workers", loader_workers, 0), ("checkpoint_every", checkpoint_every, 1)):
        if value is not None and (not isinstance(value, int) or value < least):
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
    grid.check_methods()  # before any data is generated or any row written
    t0 = time.perf_counter()
    summary = GridSummary()
    ensure_data(grid.data, data_corruptions(grid.all_corruptions), progress=progress, severities=grid.all_severities)
    if any(cell.protocol == REALTIME and cell.cost is None for cell in grid.cells()):
        from aqr.harness.realtime.timing import resolve_costs

        costs = resolve_costs(list(grid.cells()), costs_file, cache_dir, device, threads, log=log)
        grid = grid.override(costs=tuple(sorted(costs.items())))
    keyed = keyed_cells(grid)
    summary.total = len(keyed)
    db.add_membership(grid.name, [k for k, _, _ in keyed])
    adopted = adopt_legacy_rows(db, keyed)
    if adopted:
        log(f"{adopted} rows stored under keys with file locations now have location-free keys")
    done = db.finished(k for k, _, _ in keyed)
    todo = [item for item in keyed if item[0] not in done]
    summary.skipped = len(keyed) - len(todo)
    if limit is not None:
        todo = todo[:limit]
    log(f"grid {grid.name!r}: {len(keyed)} cells, {summary.skipped} already in {db.path}, {len(todo)} to run")
    if not todo:
        summary.wall_s = time.perf_counter() - t0
        return summary

    settings = CellSettings(threads=threads, device=device, loader_workers=loader_workers,
                            checkpoint_every=checkpoint_every)
    runner = make_executor(executor, cache_dir, settings, workers, ray, progress, log)
    try:
        with Claims(db.path, lease_s) as claims:
            stats = _prepare(runner, todo, cache_dir)
            _drive(runner, claims, todo, stats, db, grid.name, summary, progress)
    finally:
        runner.close()
    summary.wall_s = time.perf_counter() - t0
    return summary


def _prepare(runner: CellExecutor, todo: Sequence[tuple[str, Cell, dict[str, str]]],
             cache_dir: str | Path) -> dict[str, Any]:
    """Check the cells' files where they will run and prepare the statistics once per file.

    Returns cell key -> the executor's handle on the cell's statistics (for cells that need them).
    """
    files = {path for _, cell, _ in todo for path in cell_files(cell).values()}
    runner.check_files({path: -1 if path.is_dir() else path.stat().st_size for path in files})
    needed: dict[Path, Cell] = {}
    of_key: dict[str, Path] = {}
    for key, cell, _ in todo:
        if needs_stats(cell):
            of_key[key] = stats_path(cell, cache_dir)
            needed.setdefault(of_key[key], cell)
    handles = runner.prepare_stats(needed)
    return {key: handles[path] for key, path in of_key.items()}


def _drive(runner: CellExecutor, claims: Claims, todo: Sequence[tuple[str, Cell, dict[str, str]]],
           stats: dict[str, Any], db: ResultsDB, name: str, summary: GridSummary, progress: bool) -> None:
    """Claim, submit and record cells until each of ``todo`` has a row (from this run or another)."""
    from tqdm.auto import tqdm

    poll_s = min(5.0, claims.lease_s / 6)
    queue = collections.deque(todo)
    waiting: list[tuple[str, Cell, dict[str, str]]] = []   # claimed by other runs: checked again later
    in_flight: dict[Any, tuple[str, Cell, dict[str, str]]] = {}
    last_check = time.monotonic()
    bar = tqdm(total=len(todo), desc=name, unit="cell", disable=not progress, dynamic_ncols=True)
    try:
        while queue or waiting or in_flight:
            if waiting and time.monotonic() - last_check >= poll_s:
                queue.extend(waiting)
                waiting.clear()
                last_check = time.monotonic()
            while queue and len(in_flight) < runner.capacity():
                item = queue.popleft()
                state = claims.claim(item[0])
                if state == CLAIMED:
                    in_flight[runner.submit(item[1], stats.get(item[0]))] = item
                elif state == BUSY:
                    waiting.append(item)
                else:
                    summary.by_others += 1
                    bar.update(1)
            if in_flight:
                for handle, result in runner.wait(list(in_flight), poll_s):
                    key, cell, fp = in_flight.pop(handle)
                    db.add(key, cell.to_dict(), result.status, result.accuracy, result.n_images, result.wall_s,
                           provenance(cell, fp, key, result, runner.name, claims.owner), result.message,
                           result.detail, result.correct)
                    claims.release(key)
                    _count(summary, cell, result)
                    acc = "n/a" if result.accuracy is None else f"{result.accuracy:.2f}"
                    bar.set_postfix_str(f"{cell.model.name} {cell.spec} {cell.corruption}-{cell.severity} "
                                        f"b{cell.batch_size}: {acc}", refresh=False)
                    bar.update(1)
            elif waiting:
                time.sleep(max(0.0, poll_s - (time.monotonic() - last_check)))
    finally:
        bar.close()


def _count(summary: GridSummary, cell: Cell, result: CellResult) -> None:
    summary.ran += 1
    if result.status == "error":
        summary.errors += 1
        first = (result.message or "").splitlines()[0] if result.message else ""
        summary.error_messages.append(f"{cell.model.name} {cell.spec} {cell.corruption}-{cell.severity} "
                                      f"b{cell.batch_size} s{cell.seed}: {first}")
    elif result.status == "n/a":
        summary.not_applicable += 1


def describe_cells(grid: GridSpec) -> Iterable[str]:
    """One line per cell (for ``--dry-run``)."""
    for cell in grid.cells():
        protocol = cell.protocol + (f" C={cell.cost:g}" if cell.cost is not None else "")
        yield (f"{cell.model.name}\t{cell.spec}\t{cell.corruption}\t{cell.severity}\t{cell.batch_size}\t"
               f"{cell.order or '-'}\t{cell.seed}\t{cell.n_images}\t{protocol}")


def result_json(summary: GridSummary) -> str:
    return json.dumps(summary.__dict__, indent=2)
