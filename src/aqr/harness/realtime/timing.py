"""The realtime protocol's timing rounds: measuring a method's cost ``C`` on the running machine.

:func:`measure_cost` runs the method and the plain model on the same batches, round-robin, and takes the
ratio of their total times; :func:`measure_cell_cost` does so on a realtime cell's own stream (building
both with :func:`aqr.harness.cell_run.build_method`); :func:`resolve_costs` completes a costs file
(:mod:`aqr.harness.realtime.costs`) with the costs a grid's realtime cells lack. The rule that turns
``C`` into adapted batches is :mod:`aqr.harness.realtime.rule`.
"""

from __future__ import annotations

import math
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from aqr._version import __version__
from aqr.harness.cells import Cell
from aqr.harness.realtime.costs import CostTable, cost_key, cost_needed, with_cost

# a timing round covers at least this many images: eight periods of the field's slowest periodic update
# (RoTTA's and RBN's, every 64 images), so their share of the cost is not a matter of where the round ends
MIN_TIMED_IMAGES = 512


def _timed(fn: Callable[[], Any], clock: str, device: torch.device) -> float:
    """Seconds ``fn`` takes on ``clock`` (``"cpu"``: this process's CPU time; ``"wall"``: wall time,
    synchronising CUDA before and after)."""
    if clock == "wall" and device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.process_time() if clock == "cpu" else time.perf_counter()
    fn()
    if clock == "wall" and device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.process_time() if clock == "cpu" else time.perf_counter()) - start


def measure_cost(method: torch.nn.Module, plain: torch.nn.Module, batches: Sequence[torch.Tensor],
                 warmup: int = 2, clock: str | None = None) -> dict[str, Any]:
    """The cost of ``method`` relative to ``plain`` (the unadapted model) on ``batches``, measured
    round-robin: the first ``warmup`` batches go through both untimed, then each further batch is timed
    through both, back to back, alternating which goes first; ``"cost"`` is the ratio of the two total
    times, or 1 where it exceeds 1 by no more than the per-batch ratios' median absolute deviation (the
    timing cannot tell the method from the plain forward, so it keeps up with the stream).

    Totals, not the median per-batch ratio: a method that updates every few batches (RoTTA and RBN
    every 64 images, so every fourth batch of 16) is charged its updates, amortized over the batches.

    ``clock``: ``"cpu"`` (process CPU time; the default on CPU, where other jobs inflate wall time) or
    ``"wall"`` (the default on CUDA).
    """
    if len(batches) <= warmup:
        raise ValueError(f"a timing round needs more than the {warmup} warm-up batches, got {len(batches)}")
    device = batches[0].device
    clock = clock or ("wall" if device.type == "cuda" else "cpu")
    if clock not in ("cpu", "wall"):
        raise ValueError(f"clock must be 'cpu' or 'wall', got {clock!r}")
    with torch.no_grad():
        for x in batches[:warmup]:
            method(x)
            plain(x)
        ratios, method_s, plain_s = [], [], []
        for k, x in enumerate(batches[warmup:]):
            if k % 2 == 0:
                tm = _timed(lambda: method(x), clock, device)
                tp = _timed(lambda: plain(x), clock, device)
            else:
                tp = _timed(lambda: plain(x), clock, device)
                tm = _timed(lambda: method(x), clock, device)
            method_s.append(tm)
            plain_s.append(tp)
            ratios.append(tm / max(tp, 1e-9))
    median = statistics.median(ratios)
    spread = statistics.median(abs(r - median) for r in ratios)
    total = sum(method_s) / max(sum(plain_s), 1e-9)
    # a method the timing cannot tell from the plain forward keeps up with the stream: noise of a few
    # percent must not make it skip every other batch
    cost = 1.0 if total <= 1.0 + spread else total
    return {"cost": round(max(cost, 0.01), 2), "rule": "total", "total_ratio": round(total, 4),
            "median_ratio": round(median, 4), "spread": round(spread, 4),
            "ratios": [round(r, 4) for r in ratios],
            "method_s": statistics.median(method_s), "plain_s": statistics.median(plain_s), "clock": clock,
            "device": str(device), "threads": torch.get_num_threads()}


def measure_cell_cost(cell: Cell, cache_dir: str | Path, device: str | None = None, rounds: int = 7,
                      warmup: int = 2, clock: str | None = None, min_images: int = MIN_TIMED_IMAGES
                      ) -> dict[str, Any]:
    """:func:`measure_cost` of a realtime cell's method against the unadapted model, on the first full
    batches of the cell's own stream (its images, in its order): ``warmup`` untimed, then ``rounds`` timed
    or as many as cover ``min_images`` images, whichever is more (as the stream allows)."""
    from aqr.data.arrays import to_float
    from aqr.harness import continual
    from aqr.harness.cell_run import build_method
    from aqr.harness.cells import is_ccc, stream_corruptions
    from aqr.harness.inputs import eval_data

    torch.manual_seed(cell.seed)
    method = build_method(cell, cache_dir, device)
    plain = build_method(replace(cell, method="source", options=(), protocol="online", cost=None), cache_dir, device)
    if stream_corruptions(cell.corruption) is not None:
        images = continual.stream_batches(cell, continual.stream_blocks(cell))[0]
    elif is_ccc(cell.corruption):  # made when sliced
        from aqr.harness.ccc import stream_of

        images = stream_of(cell)[0]  # type: ignore[assignment]
    else:
        images = eval_data(cell)[0]
    # full batches in stream order (across block ends: the cost does not depend on where a block ends)
    size = cell.batch_size
    count = min(len(images) // size, warmup + max(rounds, math.ceil(min_images / size)))
    if count < warmup + 1:
        raise ValueError(f"the cell's {len(images)} images make {count} batches of {size}; a timing round needs "
                         f"at least {warmup + 1}")
    wanted = [(k * size, (k + 1) * size) for k in range(count)]
    target = torch.device(device or "cpu")
    batches = [to_float(images[a:b]).to(target) for a, b in wanted]
    result = measure_cost(method, plain, batches, warmup, clock)
    result.update(model=cell.model.name, method=cell.variant, batch_size=cell.batch_size, rounds=len(batches) - warmup,
                  host=platform.node(), aqr=__version__, torch=torch.__version__,
                  measured=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    return result


def resolve_costs(cells: Sequence[Cell], costs_file: str | Path | None, cache_dir: str | Path,
                  device: str | None = None, threads: int | None = None, rounds: int = 7,
                  log: Callable[[str], None] = print) -> dict[str, float]:
    """Costs for every realtime cell of ``cells``: read from ``costs_file``, the missing ones measured on
    this machine (:func:`measure_cell_cost`, ``threads`` torch threads) and added to the file first,
    so an interrupted or repeated run keys its cells the same."""
    from aqr.methods import NotApplicable
    from aqr.util.threads import torch_threads

    table = CostTable.load(costs_file) if costs_file is not None else CostTable()
    missing = [c for c in cost_needed(with_cost(c, table.as_mapping()) for c in cells)
               if cost_key(c.model.name, c.variant, c.batch_size) not in table.entries]
    for cell in missing:
        log(f"timing round: {cell.model.name} {cell.variant} batch {cell.batch_size}")
        try:
            with torch_threads(threads):
                entry = measure_cell_cost(cell, cache_dir, device, rounds)
        except NotApplicable as err:  # its cells are recorded n/a when they run
            entry = {"not_applicable": str(err), "model": cell.model.name, "method": cell.variant,
                     "batch_size": cell.batch_size}
            log(f"  n/a: {err}")
        else:
            log(f"  C = {entry['cost']:.2f} ({entry['clock']} clock, total time over {entry['rounds']} batches)")
        table.entries[cost_key(cell.model.name, cell.variant, cell.batch_size)] = entry
        if costs_file is not None:
            table.save(costs_file)
    return table.as_mapping()
