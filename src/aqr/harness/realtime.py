"""The realtime protocol: the stream runs at the speed of the plain model and charges each method its time.

After Alfarra et al., "Evaluation of Test-Time Adaptation Under Computational Time Constraints"
(ICML 2024): a batch arrives every time unit (one plain forward pass). A method whose step costs ``C``
units adapts on the batch in front of it when it is free and is busy for ``C`` units; batches that
arrive meanwhile are not adapted on, and are predicted by the state the method holds from its last
adapted batch (:meth:`aqr.methods.TTAMethod.forward_held`; the unadapted model for a method that keeps
no state across batches). So ``C <= 1`` adapts on every batch, ``C = 1.5`` on batches 0, 2, 4, ...
and ``C = 3`` on 0, 3, 6, ... (:func:`adapted_batches`).

``C`` of a (model, method, batch size) comes from a timing round on the running machine
(:func:`measure_cost`: the method and the plain model on the same batches of the cell's stream,
round-robin, the ratio of their total times) or from a costs file (:class:`CostTable`), so a committed run can be
repeated exactly: ``C`` is part of a realtime cell's key (``Cell.cost``, two decimals).
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aqr._version import __version__
from aqr.harness.cells import REALTIME, Cell

COSTS_FORMAT = "aqr-realtime-costs"
COSTS_VERSION = 1
# a timing round covers at least this many images: eight periods of the field's slowest periodic update
# (RoTTA's and RBN's, every 64 images), so their share of the cost is not a matter of where the round ends
MIN_TIMED_IMAGES = 512


def adapted_batches(n_batches: int, cost: float) -> np.ndarray:
    """Which of ``n_batches`` batches (arriving one per time unit) a method costing ``cost`` units per
    adapted batch adapts on: it takes the batch in front of it whenever it is free (bool array)."""
    if not math.isfinite(cost) or cost <= 0:
        raise ValueError(f"a realtime cost must be a positive finite number, got {cost!r}")
    adapted = np.zeros(n_batches, dtype=bool)
    free_at = 0.0
    for k in range(n_batches):
        if k >= free_at - 1e-9:  # batch k arrives at time k; the tolerance keeps C = 1 (or 2.0) exact
            adapted[k] = True
            free_at = k + cost
    return adapted


def cost_key(model: str, variant: str, batch_size: int) -> str:
    """The costs file's name for a method's cost on a model at a batch size."""
    return f"{model}|{variant}|{int(batch_size)}"


@dataclass
class CostTable:
    """Measured costs ``C`` by (model, method variant, batch size), as read from and written to a JSON file.

    ``entries`` maps :func:`cost_key` to a record with at least ``"cost"`` (two decimals), and how it was
    measured (clock, rounds' ratios, device, threads, host, versions); or, for a method that cannot run on
    the model (TTN without BatchNorm), ``"not_applicable"`` with the reason, and no cost.
    """

    entries: dict[str, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path) -> "CostTable":
        """The table in ``path`` (an empty one when the file does not exist); ``ValueError`` for a file
        that is not a costs table or holds a cost that is not a positive number."""
        path = Path(path)
        if not path.is_file():
            return cls()
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not a realtime costs file ({err})") from None
        if not isinstance(data, dict) or data.get("format") != COSTS_FORMAT or not isinstance(data.get("entries"), dict):
            raise ValueError(f"{path}: not a realtime costs file (expected format {COSTS_FORMAT!r} with 'entries')")
        for key, entry in data["entries"].items():
            if isinstance(entry, dict) and isinstance(entry.get("not_applicable"), str) and "cost" not in entry:
                continue  # the method cannot run on that model: its cells are n/a, they need no cost
            cost = entry.get("cost") if isinstance(entry, dict) else None
            if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not math.isfinite(cost) or cost <= 0:
                raise ValueError(f"{path}: entry {key!r} needs a positive 'cost', got {cost!r}")
        return cls(dict(data["entries"]))

    def save(self, path: str | Path) -> None:
        """Write the table as JSON (atomically: a reader never sees half a file)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"format": COSTS_FORMAT, "version": COSTS_VERSION,
                                   "entries": dict(sorted(self.entries.items()))}, indent=1) + "\n")
        tmp.replace(path)

    def cost(self, model: str, variant: str, batch_size: int) -> float | None:
        entry = self.entries.get(cost_key(model, variant, batch_size))
        return None if entry is None or "cost" not in entry else float(entry["cost"])

    def as_mapping(self) -> dict[str, float]:
        """:func:`cost_key` -> cost, what a grid needs to key its realtime cells (not the n/a entries)."""
        return {key: float(entry["cost"]) for key, entry in self.entries.items() if "cost" in entry}


def with_cost(cell: Cell, costs: Mapping[str, float]) -> Cell:
    """A realtime cell with its cost from ``costs`` (unchanged when absent, or when the cell is not realtime)."""
    if cell.protocol != REALTIME or cell.cost is not None:
        return cell
    cost = costs.get(cost_key(cell.model.name, cell.variant, cell.batch_size))
    return cell if cost is None else replace(cell, cost=round(float(cost), 2))


def cost_needed(cells: Iterable[Cell]) -> list[Cell]:
    """One cell per (model, method variant, batch size) among the realtime cells without a cost."""
    found: dict[str, Cell] = {}
    for cell in cells:
        if cell.protocol == REALTIME and cell.cost is None:
            found.setdefault(cost_key(cell.model.name, cell.variant, cell.batch_size), cell)
    return list(found.values())


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
    from aqr.harness.cells import stream_corruptions
    from aqr.harness.inputs import eval_data

    torch.manual_seed(cell.seed)
    method = build_method(cell, cache_dir, device)
    plain = build_method(replace(cell, method="source", options=(), protocol="online", cost=None), cache_dir, device)
    if stream_corruptions(cell.corruption) is not None:
        images = continual.stream_batches(cell, continual.stream_blocks(cell))[0]
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
