"""A cell's key in the results database, and the versions that enter it.

The key covers the cell's config without file locations, the content hashes of its files and the code
version, so a changed config, regenerated data or retrained weights never reuse an old row, while the
same data mounted at another path does.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

from aqr.harness.cells import Cell


# Bump when the meaning of a cell's result changes (evaluation loop, image selection, metrics), so
# rows computed under the old rules are never reused for a new run.
PROTOCOL_VERSION = 1

# Part of AQR cells' keys only: bump when AQR's default source statistics change.
# 1: Average Sample Tails over 100 activation values; 2: over 100 images (tail_unit="images").
AQR_STATS_VERSION = 2

# Part of AQR cells' keys only: bump when the default fast path changes its results.
# 1: p0/p100 and inner knots from the sample (numpy sort); 2: p0/p100 from every value, inner knots
# from the sample's histogram (aqr.backends.native); 3: the tie rule in fast mode (marked table cells
# map exactly) and ranges in float64; 4: the sample grows with the batch (samples_per_row=64 beyond
# target_samples; unchanged up to 128 images of 32 x 32).
AQR_FAST_PATH_VERSION = 4

# Part of the keys of the methods named only: bump a method's entry when a change of its defaults changes its
# results, so its rows computed with the old defaults are never reused for a cell that no longer means them.
# aqr+roid: 2: BatchNorm on the source statistics (use_batch_statistics=False; 1: on the batch's).
METHOD_DEFAULTS_VERSIONS = {"aqr+roid": 2}

# Part of the keys of cells with a stream order only: bump when aqr.data.streams orders images differently.
STREAM_ORDER_VERSION = 1


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def location_free(cell: Cell) -> dict[str, Any]:
    """The cell as a dict without where its files live: each path is replaced by the role it plays.

    The files enter a key by their content hashes, so nodes (or users) that mount the same data at
    different paths compute the same keys. Generation inputs (``clean``, ``frost_dir``) drop out:
    the generated files' hashes stand for them.
    """
    d = cell.to_dict()
    model, data = d["model"], d["data"]
    if model["checkpoint"] is not None:
        model["checkpoint"] = "<weights file>"
    elif Path(model["model"]).is_file():  # an aqr checkpoint given by path (else a zoo or hub name)
        model["model"] = "<weights file>"
    model["source_data"] = "<source file>"
    data.update(root="<data folder>", clean=None, frost_dir=None)
    return d


def cell_key(cell: Cell, fingerprints: Mapping[str, str], version: str) -> str:
    """Stable id of a cell's result: its config, the content hashes of its files and the code version.

    ``fingerprints`` maps each of the cell's files (checkpoint, source data, evaluation data) to its
    sha256, so regenerated data or retrained weights never reuse old rows; where the files live
    does not count (:func:`location_free`).
    """
    return _key(location_free(cell), cell.method, fingerprints, version)


def legacy_cell_key(cell: Cell, fingerprints: Mapping[str, str], version: str) -> str:
    """The key aqr gave a cell before keys were location-free (file paths included), for old databases."""
    return _key(cell.to_dict(), cell.method, fingerprints, version)


def _key(config: Mapping[str, Any], method: str, fingerprints: Mapping[str, str], version: str) -> str:
    payload = {
        "cell": config,
        "files": dict(sorted(fingerprints.items())),
        "aqr": version,
        "protocol_version": PROTOCOL_VERSION,
    }
    if config.get("order") is not None:
        payload["stream_order_version"] = STREAM_ORDER_VERSION
    if method in METHOD_DEFAULTS_VERSIONS:
        payload["method_defaults_version"] = METHOD_DEFAULTS_VERSIONS[method]
    reads_stats, maps = _aqr_parts(method)
    if reads_stats:
        payload["aqr_stats_version"] = AQR_STATS_VERSION
    if maps:
        payload["aqr_fast_path_version"] = AQR_FAST_PATH_VERSION
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:32]


def _aqr_parts(method: str) -> tuple[bool, bool]:
    """Whether the method reads AQR's source statistics (aqr, moments, the compositions) and whether it maps
    with AQR's quantile map (aqr and the compositions), as it declares; an unknown name has neither."""
    from aqr.methods import METHODS

    found = METHODS.get(method)
    if found is None:
        return False, False
    return found.needs.stats is not None, found.maps_quantiles
