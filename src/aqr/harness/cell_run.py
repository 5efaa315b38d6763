"""Running one cell: its method built around its model, its images through it, a
:class:`~aqr.harness.cells.CellResult`.

:func:`run_cell` is a pure function of a :class:`aqr.harness.cells.Cell` (plus where the statistics
cache is), so any process on any machine may run it; the grid's driver
(:mod:`aqr.harness.grid_driver`) decides which cells run where.
"""

from __future__ import annotations

import platform
import time
import traceback
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from aqr.core.stats import StatsError
from aqr._version import __version__
from aqr.harness import continual
from aqr.harness.cells import REALTIME, Cell, CellResult, is_ccc, stream_corruptions
from aqr.harness.eval_loop import array_batches, image_correct
from aqr.harness.inputs import (clear_input_caches, data_loader, eval_data, eval_folder, load_model, model_preprocess,
                                source_loader, uses_image_folders)
from aqr.harness.keys import cell_key
from aqr.harness.provenance import fingerprints
from aqr.harness.results import pack_correct
from aqr.harness.source_stats import STATS_OPTIONS, ensure_stats, load_stats
from aqr.harness.stream_checkpoint import StreamCheckpoint
from aqr.util.threads import torch_threads


def build_method(cell: Cell, cache_dir: str | Path, device: str | None = None, loader_workers: int = 0,
                 stats_file: str | Path | None = None) -> nn.Module:
    """The method of a cell around its (cached) model, given what the method declares it needs
    (:func:`aqr.methods.plan`).

    ``stats_file``: the cell's source statistics, if the caller has them (else from ``cache_dir``).
    """
    method_plan = cell_plan(cell)
    model = load_model(cell.model)
    if device is not None:
        model.to(device)
    stats = source = None
    if method_plan.needs.stats is not None:
        path = (Path(stats_file) if stats_file is not None
                else ensure_stats(cell, cache_dir, device=device, loader_workers=loader_workers))
        stats = load_stats(str(path))
        if not stats.computed_with(model):
            # A library user gets a warning; a benchmark cell must not score stale statistics.
            raise StatsError(f"{path} was computed with other weights than {cell.model.model} has now "
                             "(was the checkpoint rewritten during the run?)")
    if method_plan.needs.source:
        source = method_source(cell, method_plan.config, device, loader_workers)
    return method_plan.build(model, stats=stats, source=source)


def cell_plan(cell: Cell) -> Any:
    """The cell's method checked (:class:`aqr.methods.MethodPlan`): its options without the statistics'
    ones, the cell's protocol and seed, and its batch size where the method needs it."""
    from aqr.methods import plan

    options = {k: v for k, v in cell.option_dict.items() if k not in STATS_OPTIONS}
    if isinstance(options.get("layers"), tuple):
        options["layers"] = list(options["layers"])
    return plan(cell.method, {**options, "protocol": cell.method_protocol, "seed": cell.seed},
                batch_size=cell.batch_size)


def method_source(cell: Cell, config: Any, device: str | None = None,
                  loader_workers: int = 0) -> Iterable[tuple[torch.Tensor, Any]]:
    """The source images for a method that needs them (EATA's Fisher information): the clean images the
    cell's statistics are computed from, at most the config's ``source_images`` of them (drawn
    class-balanced with the cell's seed), in batches of its ``fisher_batch_size`` when the cell sets it,
    else of the cell's batch size (the reference computes the Fisher in test-sized batches)."""
    batch_size = cell.option_dict.get("fisher_batch_size")
    if batch_size is None:
        batch_size = cell.batch_size if cell.batch_size > 1 else config.fisher_batch_size
    return source_loader(cell.model, config.source_images, int(batch_size), cell.seed, loader_workers, device)


def needs_stats(cell: Cell) -> bool:
    """Whether the cell's method needs source statistics (``False`` for an unknown method, whose cell fails)."""
    from aqr.methods import METHODS

    found = METHODS.get(cell.method)
    return found is not None and found.needs.stats is not None


def run_cell(cell: Cell, cache_dir: str | Path = "cache", progress: bool = False, device: str | None = None,
             loader_workers: int = 0, *, stats_file: str | Path | None = None,
             threads: int | None = None, checkpoint_every: int | None = None) -> CellResult:
    """Evaluate one cell (on ``device``; image folders decoded by ``loader_workers`` processes; ``threads``
    torch threads, restored after; ``stats_file``: see :func:`build_method`).
    ``checkpoint_every``: a stream cell saves its state every that many images in ``cache_dir`` and a rerun
    resumes from it (:mod:`aqr.harness.stream_checkpoint`); the file is removed when the cell completes.
    Never raises for a failing method: errors come back as ``status="error"``."""
    from aqr.methods import NotApplicable

    t0 = time.perf_counter()
    with torch_threads(threads):
        where = {"node": platform.node(), "threads": torch.get_num_threads(), "device": str(device or "cpu"),
                 "cpu": torch.backends.cpu.get_cpu_capability()}
        try:
            torch.manual_seed(cell.seed)
            method = build_method(cell, cache_dir, device, loader_workers, stats_file)
            desc = f"{cell.spec} {cell.corruption}-{cell.severity}"
            if is_ccc(cell.corruption):
                checkpoint = (None if checkpoint_every is None
                              else stream_checkpoint(cell, cache_dir, checkpoint_every))
                return _run_ccc(cell, method, progress, desc, t0, where, checkpoint)
            if stream_corruptions(cell.corruption) is not None:
                checkpoint = (None if checkpoint_every is None
                              else stream_checkpoint(cell, cache_dir, checkpoint_every))
                return _run_continual(cell, method, progress, desc, t0, where, checkpoint)
            if uses_image_folders(cell.data):
                folder = eval_folder(cell, model_preprocess(cell.model, load_model(cell.model)))
                batches: Iterable[tuple[torch.Tensor, Any]] = data_loader(folder, cell.batch_size, loader_workers,
                                                                          device)
                total = len(batches)  # type: ignore[arg-type]
            else:
                images, labels = eval_data(cell)
                batches, total = array_batches(images, labels, cell.batch_size), -(-len(labels) // cell.batch_size)
            adapted = _realtime_batches(cell, total)
            correct = image_correct(method, batches, progress, desc, total, adapted=adapted)
            detail = None if adapted is None else _realtime_detail(cell, adapted)
            return CellResult("ok", 100.0 * float(correct.mean()), int(correct.size), time.perf_counter() - t0,
                              **where, correct=pack_correct(correct), detail=detail)
        except NotApplicable as err:
            return CellResult("n/a", None, None, time.perf_counter() - t0, str(err), **where)
        except Exception as err:  # recorded, so one broken cell doesn't stop a grid
            msg = f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=6)}"
            return CellResult("error", None, None, time.perf_counter() - t0, msg, **where)


def stream_checkpoint(cell: Cell, cache_dir: str | Path, every: int) -> StreamCheckpoint:
    """The checkpoint file of a stream cell in ``cache_dir``, named by the cell's results-database key."""
    return StreamCheckpoint.in_cache(cache_dir, cell_key(cell, fingerprints(cell), __version__), every)


def _run_continual(cell: Cell, method: nn.Module, progress: bool, desc: str, t0: float,
                   where: dict[str, Any], checkpoint: StreamCheckpoint | None = None) -> CellResult:
    """A continual cell: the whole stream through ``method``, the per-image results kept."""
    if uses_image_folders(cell.data):
        raise ValueError("continual cells read CIFAR-C arrays; image folders are not supported")
    blocks = continual.stream_blocks(cell)
    images, labels, starts = continual.stream_batches(cell, blocks)
    adapted = _realtime_batches(cell, len(starts))
    correct = continual.evaluate_stream(method, images, labels, starts, progress, desc, adapted, checkpoint)
    if checkpoint is not None:
        checkpoint.remove()
    detail = continual.stream_detail(correct, [name for name, _, _ in blocks], len(blocks[0][2]))
    if adapted is not None:
        detail.update(_realtime_detail(cell, adapted))
    return CellResult("ok", 100.0 * float(correct.mean()), len(correct), time.perf_counter() - t0, **where,
                      detail=detail)


def _run_ccc(cell: Cell, method: nn.Module, progress: bool, desc: str, t0: float,
             where: dict[str, Any], checkpoint: StreamCheckpoint | None = None) -> CellResult:
    """A CCC cell: its stream, made on the fly (or read from its cache), through ``method`` in batches of the
    cell's size; the per-image results kept with one block per step of its walks."""
    from aqr.harness import ccc

    images, labels, steps = ccc.stream_of(cell)
    starts = list(range(0, len(labels), cell.batch_size))
    adapted = _realtime_batches(cell, len(starts))
    correct = continual.evaluate_stream(method, images, labels, starts, progress, desc, adapted, checkpoint)  # type: ignore[arg-type]
    if checkpoint is not None:
        checkpoint.remove()
    detail = continual.stream_detail(correct, ccc.step_names(steps), ccc.CCCSpec.parse(cell.corruption).speed)
    detail["images_made"] = images.made  # 0 where the stream's cache held them all: the wall time is the method's
    if adapted is not None:
        detail.update(_realtime_detail(cell, adapted))
    return CellResult("ok", 100.0 * float(correct.mean()), len(correct), time.perf_counter() - t0, **where,
                      detail=detail)


def _realtime_batches(cell: Cell, n_batches: int) -> Any:
    """Which batches a realtime cell's method adapts on (``None`` under the other protocols)."""
    if cell.protocol != REALTIME:
        return None
    if cell.cost is None:
        raise ValueError("a realtime cell needs its method's cost C (a timing round or a costs file; see "
                         "aqr.harness.realtime)")
    from aqr.harness.realtime.rule import adapted_batches

    return adapted_batches(n_batches, cell.cost)


def _realtime_detail(cell: Cell, adapted: Any) -> dict[str, Any]:
    """What a realtime cell records beside its accuracy: its cost and how many batches were adapted on."""
    return {"cost": cell.cost, "batches": int(len(adapted)), "adapted_batches": int(sum(adapted))}


def clear_caches() -> None:
    """Forget the models, statistics and evaluation images cached in this process.

    Needed only when files the cells read were rewritten in place since they were cached (file
    hashes are memoised by size and mtime and refresh themselves).
    """
    clear_input_caches()
    load_stats.cache_clear()
