"""Methods with options, and grids of cells: the cross product a benchmark runs.

A :class:`GridSpec` is the cross product models x methods x corruptions x severities x batch sizes x
stream orders x seeds, from a preset (:func:`aqr.harness.presets.preset`), a YAML/JSON file
(:func:`aqr.harness.grid_files.load_grid`) or Python; a grid may add the cells of further cross
products (``GridSpec.parts``), as a preset of several settings does.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping, Sequence

from aqr.data.corruption_params import CORRUPTIONS
from aqr.data.streams import StreamOrder
from aqr.harness.cells import (CELL_PROTOCOLS, CONTINUAL, REALTIME, Cell, DataSpec, ModelSpec, canonical_order, data_corruptions, freeze_options,
                               index_count)
from aqr.util.seeds import MAX_SEED


@dataclass(frozen=True)
class MethodSpec:
    """A method and its options, e.g. ``MethodSpec("aqr", {"tail": "gaussian", "K": 11})``."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, entry: str | Mapping[str, Any]) -> "MethodSpec":
        """``"tent"``, ``"aqr:tail=clip,K=11"`` (:func:`aqr.methods.declaration.parse_spec`, the syntax
        :func:`aqr.methods.create` takes too) or ``{"method": "aqr", "tail": "clip"}``."""
        if isinstance(entry, Mapping):
            entry = dict(entry)
            if "method" not in entry:
                raise ValueError(f"method entry needs a 'method' key, got {entry}")
            name = entry.pop("method")
            return cls(str(name), entry)
        from aqr.methods.declaration import parse_spec

        name, options = parse_spec(entry)
        return cls(name, options)

    @property
    def label(self) -> str:
        """The method as the bench's method syntax spells it: ``"aqr:target=stream,K=11"``."""
        return self.name + (":" + ",".join(f"{k}={v}" for k, v in self.options.items()) if self.options else "")


# Options a cell sets itself: the grid's protocol and seed, and the statistics for the methods that need them
CELL_OPTIONS = ("protocol", "seed", "stats")


def check_method(spec: MethodSpec, protocol: str = "episodic", batch_size: int = 1) -> None:
    """Raise ``KeyError`` for an unknown method, ``ValueError`` for an option it does not take or a value
    its config refuses, without a model, data or database: the method's plan (:func:`aqr.methods.plan`) is
    built from the options.

    A method that needs statistics also takes the options that shape them (``K``, ``max_samples``,
    ``tail_unit``; see :mod:`aqr.harness.source_stats`); a cell's method gets its protocol and seed from
    the grid and, where it needs it, ``batch_size`` from the cell (``batch_size`` here).
    """
    from aqr.harness.source_stats import STATS_OPTIONS, check_stats_options
    from aqr.methods import declaration, plan

    found = declaration(spec.name)
    if protocol not in CELL_PROTOCOLS:
        raise ValueError(f"protocol must be one of {CELL_PROTOCOLS}, got {protocol!r}")
    protocol = "online" if protocol == REALTIME else protocol  # a realtime cell's method runs online
    label = spec.label
    set_by_cell = [k for k in CELL_OPTIONS if k in spec.options]
    if set_by_cell:
        raise ValueError(f"method {label!r}: {', '.join(set_by_cell)} {'is' if len(set_by_cell) == 1 else 'are'} "
                         "set by the grid, not by a method option")
    stats_keys = set(STATS_OPTIONS) if found.needs.stats is not None else set()
    taken = sorted((set(found.options) | stats_keys) - set(CELL_OPTIONS))
    unknown = sorted(k for k in spec.options if k not in taken)
    if unknown:
        raise ValueError(f"method {label!r}: unknown options {unknown}; {spec.name} takes {', '.join(taken)}")
    options = {k: v for k, v in spec.options.items() if k not in stats_keys}
    try:
        check_stats_options({k: v for k, v in spec.options.items() if k in stats_keys})
        plan(spec.name, {**options, "protocol": protocol}, batch_size=batch_size)
    except (TypeError, ValueError) as err:
        raise ValueError(f"method {label!r}: {err}") from None


def _check_integers(name: str, values: object, low: int, high: int | None = None, one: bool = False) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``values`` is a non-empty list or tuple of integers in
    ``[low, high]`` (``one``: a single value is checked, in a tuple): a grid file's ``2.7``, ``true`` or ``"3"`` is
    refused, not rounded or read as 1."""
    ok = isinstance(values, (tuple, list)) and len(values) > 0
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int) or v < low
           or (high is not None and v > high)] if ok else [values]
    if bad:
        bound = f"in [{low}, {'2**63 - 1' if high == MAX_SEED else high}]" if high is not None else f">= {low}"
        what = "an integer" if one else "a list of integers"
        raise ValueError(f"{name} must be {what} {bound}, got {bad[0]!r}")


@dataclass(frozen=True)
class GridSpec:
    """A grid of cells: the cross product of its lists, then the cells of its ``parts`` (further grids
    over the same data, e.g. another protocol on some of the settings).

    ``costs``: :func:`aqr.harness.realtime.costs.cost_key` -> ``C`` for the cells of the ``"realtime"``
    protocol (see :func:`aqr.harness.realtime.timing.resolve_costs`); a realtime cell without one has
    ``cost=None`` and cannot run.
    """

    name: str
    models: tuple[ModelSpec, ...]
    data: DataSpec
    methods: tuple[MethodSpec, ...]
    corruptions: tuple[str, ...] = CORRUPTIONS
    severities: tuple[int, ...] = (1, 3, 5)
    batch_sizes: tuple[int, ...] = (128, 512)
    seeds: tuple[int, ...] = (0, 1, 2)
    n_images: int | None = 2000
    protocol: str = "episodic"
    orders: tuple[str | None, ...] = (None,)  # stream orders (None: the drawn images' seeded random order)
    parts: tuple["GridSpec", ...] = ()
    costs: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.orders, (str, StreamOrder)) or not self.orders:
            raise ValueError(f"orders must be a non-empty sequence of stream orders (None for none), got {self.orders!r}")
        orders = tuple(canonical_order(o) for o in self.orders)
        if len(set(orders)) != len(orders):
            raise ValueError(f"stream orders must be distinct, got {list(self.orders)}")
        object.__setattr__(self, "orders", orders)
        if self.protocol not in CELL_PROTOCOLS:
            raise ValueError(f"protocol must be one of {CELL_PROTOCOLS}, got {self.protocol!r}")
        unknown = [c for c in data_corruptions(self.corruptions) if c not in CORRUPTIONS]
        if unknown:
            raise ValueError(f"unknown corruptions {unknown}; expected names from {', '.join(CORRUPTIONS)} "
                             f"or {CONTINUAL!r}")
        _check_integers("severities", self.severities, 1, 5)
        _check_integers("batch_sizes", self.batch_sizes, 1)
        _check_integers("seeds", self.seeds, 0, MAX_SEED)
        if self.n_images is not None:
            _check_integers("n_images", (self.n_images,), 1, one=True)
        pool = index_count(self.data.eval_indices)  # known from the text: checked before any data is generated
        if self.n_images is not None and pool is not None and self.n_images > pool:
            raise ValueError(f"n_images={self.n_images} exceeds the {pool} images of eval_indices "
                             f"{self.data.eval_indices!r}")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        if any(part.data != self.data for part in self.parts):
            raise ValueError("a grid's parts must evaluate the same data as the grid")

    @property
    def all_corruptions(self) -> tuple[str, ...]:
        """The corruptions of the grid and its parts, each once."""
        return tuple(dict.fromkeys(c for g in self._grids() for c in g.corruptions))

    @property
    def all_severities(self) -> tuple[int, ...]:
        """The severities of the grid and its parts, each once."""
        return tuple(dict.fromkeys(s for g in self._grids() for s in g.severities))

    def _grids(self) -> Iterator["GridSpec"]:
        yield self
        for part in self.parts:
            yield from part._grids()

    def only_protocols(self, protocols: Sequence[str]) -> "GridSpec":
        """The grid with only the cells of ``protocols`` (``CELL_PROTOCOLS``): its parts of other protocols dropped,
        and where the grid's own protocol is not listed, its first kept part in its place (the name and costs kept).
        ``ValueError`` for an unknown protocol or where no cell is left."""
        unknown = [p for p in protocols if p not in CELL_PROTOCOLS]
        if unknown:
            raise ValueError(f"unknown protocols {unknown}; expected some of {', '.join(CELL_PROTOCOLS)}")
        kept = [replace(g, parts=()) for g in self._grids() if g.protocol in protocols]
        if not kept:
            present = sorted({g.protocol for g in self._grids()})
            raise ValueError(f"grid {self.name!r} has no cells of protocols {list(protocols)} (it has {present})")
        return replace(kept[0], name=self.name, costs=self.costs, parts=tuple(kept[1:]))

    def check_methods(self) -> None:
        """Raise for a method name or option no cell of the grid could run (:func:`check_method`)."""
        for grid in self._grids():
            for method in grid.methods:
                check_method(method, grid.protocol, min(grid.batch_sizes, default=1))

    def cells(self) -> Iterator[Cell]:
        """Every cell, model-major (so a model's statistics and weights are reused back to back), then
        the cells of the parts (each cell once, e.g. when an override made a part repeat the grid);
        realtime cells carry their cost from ``costs`` where it has one."""
        seen: set[Cell] = set()
        for cell in self._own_cells():
            if cell not in seen:
                seen.add(cell)
                yield cell
        for part in self.parts:
            for cell in replace(part, costs=self.costs).cells():
                if cell not in seen:
                    seen.add(cell)
                    yield cell

    def _own_cells(self) -> Iterator[Cell]:
        costs = dict(self.costs)
        for model in self.models:
            for corruption in self.corruptions:
                for severity in self.severities:
                    for batch_size in self.batch_sizes:
                        for order in self.orders:
                            for seed in self.seeds:
                                for method in self.methods:
                                    cell = Cell(model, self.data, method.name, freeze_options(method.options),
                                                corruption, int(severity), int(batch_size), int(seed),
                                                self.n_images, self.protocol, order)
                                    if self.protocol == REALTIME:
                                        cost = costs.get(f"{model.name}|{cell.variant}|{int(batch_size)}")
                                        cell = replace(cell, cost=None if cost is None else round(float(cost), 2))
                                    yield cell

    def __len__(self) -> int:
        own = (len(self.models) * len(self.methods) * len(self.corruptions) * len(self.severities)
               * len(self.batch_sizes) * len(self.orders) * len(self.seeds))
        return sum(1 for _ in self.cells()) if self.parts else own

    def override(self, **changes: Any) -> "GridSpec":
        """A copy with some fields replaced (``None`` values are ignored), in its parts too.

        In a part, ``models`` keeps those of the part's models the new list names (as given there; a part
        left without a model is dropped); the name, ``orders``, ``corruptions`` and ``protocol`` stay the
        part's own (a setting changes them with :func:`aqr.harness.settings.apply_setting`).
        """
        changes = {k: v for k, v in changes.items() if v is not None}
        part_changes = {k: v for k, v in changes.items() if k not in ("name", "parts", "orders", "corruptions",
                                                                      "protocol", "models")}
        parts = []
        for part in changes.get("parts", self.parts):
            if "models" in changes:
                kept = tuple(m for m in changes["models"] if m.name in {pm.name for pm in part.models})
                if not kept:
                    continue
                part = replace(part, models=kept)
            parts.append(part.override(**part_changes))
        return replace(self, **{**changes, "parts": tuple(parts)})
