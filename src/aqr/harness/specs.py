"""Methods with options, and grids of cells: the cross product a benchmark runs.

A :class:`GridSpec` is the cross product models x methods x corruptions x severities x batch sizes x
stream orders x seeds, from a preset (:func:`aqr.harness.presets.preset`), a YAML/JSON file
(:func:`aqr.harness.grid_files.load_grid`) or Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Mapping

from aqr.data.corruption_params import CORRUPTIONS
from aqr.data.streams import StreamOrder
from aqr.harness.cells import CONTINUAL, Cell, DataSpec, ModelSpec, canonical_order, data_corruptions, freeze_options


@dataclass(frozen=True)
class MethodSpec:
    """A method and its options, e.g. ``MethodSpec("aqr", {"tail": "gaussian", "K": 11})``."""

    name: str
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, entry: str | Mapping[str, Any]) -> "MethodSpec":
        """``"tent"``, ``"aqr:tail=clip,K=11"`` or ``{"method": "aqr", "tail": "clip"}``."""
        if isinstance(entry, Mapping):
            entry = dict(entry)
            if "method" not in entry:
                raise ValueError(f"method entry needs a 'method' key, got {entry}")
            name = entry.pop("method")
            return cls(str(name), entry)
        name, _, rest = str(entry).partition(":")
        options: dict[str, Any] = {}
        for part in filter(None, rest.split(",")):
            key, eq, value = part.partition("=")
            if not eq:
                raise ValueError(f"method option must be key=value, got {part!r} in {entry!r}")
            options[key.strip()] = _parse_scalar(value.strip())
        return cls(name.strip(), options)


def _parse_scalar(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


@dataclass(frozen=True)
class GridSpec:
    """A grid of cells: the cross product of its lists."""

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

    def __post_init__(self) -> None:
        if isinstance(self.orders, (str, StreamOrder)) or not self.orders:
            raise ValueError(f"orders must be a non-empty sequence of stream orders (None for none), got {self.orders!r}")
        orders = tuple(canonical_order(o) for o in self.orders)
        if len(set(orders)) != len(orders):
            raise ValueError(f"stream orders must be distinct, got {list(self.orders)}")
        object.__setattr__(self, "orders", orders)
        unknown = [c for c in data_corruptions(self.corruptions) if c not in CORRUPTIONS]
        if unknown:
            raise ValueError(f"unknown corruptions {unknown}; expected names from {', '.join(CORRUPTIONS)} "
                             f"or {CONTINUAL!r}")
        bad = [s for s in self.severities if not 1 <= int(s) <= 5]
        if bad:
            raise ValueError(f"severities must lie in 1..5, got {bad}")
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be positive, got {self.batch_sizes}")
        if self.n_images is not None and self.n_images < 1:
            raise ValueError(f"n_images must be positive, got {self.n_images}")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")

    def cells(self) -> Iterator[Cell]:
        """Every cell, model-major (so a model's statistics and weights are reused back to back)."""
        for model in self.models:
            for corruption in self.corruptions:
                for severity in self.severities:
                    for batch_size in self.batch_sizes:
                        for order in self.orders:
                            for seed in self.seeds:
                                for method in self.methods:
                                    yield Cell(model, self.data, method.name, freeze_options(method.options),
                                               corruption, int(severity), int(batch_size), int(seed),
                                               self.n_images, self.protocol, order)

    def __len__(self) -> int:
        return (len(self.models) * len(self.methods) * len(self.corruptions) * len(self.severities)
                * len(self.batch_sizes) * len(self.orders) * len(self.seeds))

    def override(self, **changes: Any) -> "GridSpec":
        """A copy with some fields replaced (``None`` values are ignored)."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})
