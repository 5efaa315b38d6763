"""A cell's source statistics: which options shape them, where they are cached, computing them once."""

from __future__ import annotations

import functools
import hashlib
import warnings
from pathlib import Path
from collections.abc import Mapping
from typing import Any

from aqr.adapt import AQRConfig
from aqr.adapt.config import TARGET_KINDS
from aqr.core.calibrate import DEFAULT_MAX_SAMPLES, DEFAULT_NUM_QUANTILES
from aqr.core.points import OUTPUT
from aqr.core.tails import DEFAULT_TAIL_UNIT, TAIL_UNITS
from aqr.harness.cells import Cell
from aqr.harness.inputs import data_loader, load_model, model_preprocess, source_dataset
from aqr.harness.keys import canonical_json, location_free
from aqr.harness.provenance import fingerprints
from aqr.util.threads import torch_threads


# Defaults of the statistics' options: aqr.calibrate's K and max_samples, aqr.AQRConfig's groups.
DEFAULT_K = DEFAULT_NUM_QUANTILES
DEFAULT_GROUPS = AQRConfig.__dataclass_fields__["groups"].default

# Method options that change the source statistics (not the adaptation): they key the stats cache.
STATS_OPTIONS = ("K", "max_samples", "tail_unit")


def stats_options(cell: Cell) -> dict[str, Any]:
    """The options that determine the cell's source statistics (read by methods that need statistics)."""
    opts = cell.option_dict
    out = {"K": int(opts.get("K", DEFAULT_K)), "max_samples": int(opts.get("max_samples", DEFAULT_MAX_SAMPLES)),
           "tail_unit": str(opts.get("tail_unit", DEFAULT_TAIL_UNIT))}
    if float(opts.get("balance", 1.0)) < 1:  # class-conditional knots (only then: other cells keep their files)
        out["groups"] = int(opts.get("groups", DEFAULT_GROUPS))
    target = TARGET_KINDS.get(str(opts.get("target", "batch")))
    if target is not None and target.needs_descriptors:  # the descriptors' source spread (only then: others keep files)
        out["descriptors"] = True
    point = stats_point(cell.method)
    if point not in (None, OUTPUT):  # the values before the affine step (only then: other cells keep their files)
        out["point"] = point
    return out


def stats_point(method: str) -> str | None:
    """Where the method's statistics are read (:mod:`aqr.core.points`), as it declares (``needs.stats``;
    ``None`` for a method that reads none); ``KeyError`` for an unknown method."""
    from aqr.methods import declaration

    return declaration(method).needs.stats


def check_stats_options(options: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` for a statistics option (``K``, ``max_samples``, ``tail_unit``) out of its range."""
    for key, least in (("K", 3), ("max_samples", 2)):
        value = options.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise ValueError(f"{key} must be an integer >= {least}, got {value!r}")
    k, kept = options.get("K", DEFAULT_K), options.get("max_samples", DEFAULT_MAX_SAMPLES)
    if k > kept:
        raise ValueError(f"K={k} must be at most max_samples={kept}, the values kept per channel")
    if "tail_unit" in options and options["tail_unit"] not in TAIL_UNITS:
        raise ValueError(f"tail_unit must be one of {TAIL_UNITS}, got {options['tail_unit']!r}")


def stats_path(cell: Cell, cache_dir: str | Path) -> Path:
    """Where the cell's source statistics are cached: keyed by weights, source data and its options."""
    fp = fingerprints(cell)
    key = {"weights": fp.get("weights"), "source": fp["source"], "indices": cell.model.source_indices,
           "model": location_free(cell)["model"]["model"], **stats_options(cell)}
    if cell.model.image_size or cell.model.resize:  # only when set, so older cache files keep their names
        key["preprocess"] = [cell.model.image_size, cell.model.resize]
    digest = hashlib.sha256(canonical_json(key).encode()).hexdigest()[:20]
    return Path(cache_dir) / "stats" / f"{cell.model.name}-K{key['K']}-{digest}.aqr.safetensors"


def compute_stats(cell: Cell, progress: bool = False, device: str | None = None, loader_workers: int = 0,
                  threads: int | None = None) -> Any:
    """The source statistics a cell needs (:class:`aqr.SourceStats`), computed now on ``device`` with
    ``threads`` torch threads (default: unchanged) and ``loader_workers`` decoding processes."""
    from aqr.core.calibrate import ClassCoverageWarning, calibrate

    opts = stats_options(cell)
    model = load_model(cell.model)
    if device is not None:
        model.to(device)
    source = source_dataset(cell.model, model_preprocess(cell.model, model))
    with torch_threads(threads), warnings.catch_warnings():
        warnings.simplefilter("ignore", ClassCoverageWarning)  # source_dataset warned already, naming the indices
        return calibrate(model, data_loader(source, 500, loader_workers, device), num_quantiles=opts["K"],
                         max_samples=opts["max_samples"], tail_unit=opts["tail_unit"], progress=progress,
                         groups=opts.get("groups"), point=opts.get("point", "output"),
                         descriptors=opts.get("descriptors", False))


def ensure_stats(cell: Cell, cache_dir: str | Path, progress: bool = False, device: str | None = None,
                 loader_workers: int = 0, threads: int | None = None) -> Path:
    """Compute (once) and cache the source statistics a cell needs; returns the stats file.

    The file is written atomically, so concurrent or interrupted runs never leave half a file.
    """
    path = stats_path(cell, cache_dir)
    if path.is_file():
        return path
    return compute_stats(cell, progress, device, loader_workers, threads).save(path)


@functools.lru_cache(maxsize=4)
def load_stats(path: str) -> Any:
    from aqr.core.stats import SourceStats

    return SourceStats.load(path)
