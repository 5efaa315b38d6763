"""The realtime protocol's costs file: measured costs ``C`` by (model, method variant, batch size).

:class:`CostTable` reads and writes the file (JSON, format ``"aqr-realtime-costs"``); :func:`cost_key`
names an entry; :func:`with_cost` keys a realtime cell with its cost and :func:`cost_needed` lists the
cells a timing round (:mod:`aqr.harness.realtime.timing`) still has to measure. Nothing here runs a
model, so reading a costs file (``aqr bench --dry-run``) does not import the methods.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aqr.harness.cells import REALTIME, Cell
from aqr.util.files import atomic_write

COSTS_FORMAT = "aqr-realtime-costs"
COSTS_VERSION = 1


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
            if round(cost, 2) <= 0:  # a cell keeps its cost to two decimals: 0.001 would become a cost of 0
                raise ValueError(f"{path}: entry {key!r} has the cost {cost!r}, which rounds to 0.00 (cells keep "
                                 "costs to two decimals); give at least 0.01")
        return cls(dict(data["entries"]))

    def save(self, path: str | Path) -> None:
        """Write the table as JSON, atomically through a temporary file of this writer's own: a reader never
        sees half a file and processes saving at once never take each other's temporary file."""
        text = json.dumps({"format": COSTS_FORMAT, "version": COSTS_VERSION,
                           "entries": dict(sorted(self.entries.items()))}, indent=1) + "\n"
        atomic_write(path, lambda tmp: tmp.write_text(text))

    def cost(self, model: str, variant: str, batch_size: int) -> float | None:
        """The cost of ``variant`` on ``model`` at ``batch_size``; ``None`` when absent or not applicable."""
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
