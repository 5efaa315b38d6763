"""Where a row comes from: the content hashes of a cell's files, the code's commit and versions."""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aqr._version import __version__
from aqr.harness.ccc import ccc_files
from aqr.harness.cells import Cell, CellResult, is_ccc, stream_corruptions
from aqr.harness.fingerprints import file_fingerprint
from aqr.harness.inputs import model_file, uses_image_folders


def cell_files(cell: Cell) -> dict[str, Path]:
    """Role -> file or image folder for everything a cell reads (its content key goes into the cell key)."""
    files: dict[str, Path] = {}
    weights = model_file(cell.model)
    if weights is not None:
        files["weights"] = weights
    files["source"] = Path(cell.model.source_data)
    streamed = stream_corruptions(cell.corruption)
    if is_ccc(cell.corruption):  # images made from the clean ones, along walks read from the accuracy table
        files.update(ccc_files(cell))
    elif streamed is not None:  # a continual cell reads every corruption of its stream
        files.update({f"eval:{name}": Path(cell.data.root) / f"{name}.npy" for name in streamed})
        files["labels"] = Path(cell.data.root) / "labels.npy"
    elif uses_image_folders(cell.data):
        files["eval"] = Path(cell.data.root) / cell.corruption / str(cell.severity)
    else:
        files["eval"] = Path(cell.data.root) / f"{cell.corruption}.npy"
        files["labels"] = Path(cell.data.root) / "labels.npy"
    return files


def fingerprints(cell: Cell) -> dict[str, str]:
    """Role -> content key: a file's sha256, or an image folder's or list's listing (paths and sizes)."""
    owner = f"cell {cell.model.name}/{cell.corruption}"
    out = {role: file_fingerprint(role, path, owner) for role, path in cell_files(cell).items()}
    if model_file(cell.model) is None:
        out["weights"] = f"pretrained:{cell.model.model}"
    return out


@functools.lru_cache(maxsize=1)
def git_commit(package: Path | None = None) -> str | None:
    """The checkout's commit, with ``-dirty`` when the files of ``package`` (default: aqr's own folder)
    differ from it; other tracked files, such as a results database committed beside the docs and
    updated by the run itself, do not count."""
    package = package or Path(__file__).resolve().parents[1]  # git finds the checkout from any folder inside it
    try:
        commit = subprocess.run(["git", "-C", str(package), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(package), "status", "--porcelain", "--untracked-files=no", "--", "."],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(cell: Cell, files: dict[str, str], key: str, result: CellResult | None = None,
               executor: str = "local", run: str | None = None) -> dict[str, Any]:
    """Everything needed to trust and reproduce a row: versions, commit, hashes, seed, protocol.

    ``host`` is where the grid's driver ran; ``node``, ``threads``, ``device`` and ``cpu`` (torch's CPU
    capability) where and how the cell ran (from its ``result``), ``executor`` what ran it and ``run`` which driver.
    """
    result = result or CellResult("ok")
    order = "numpy default_rng(seed).permutation(pool)[:n_images]"
    streamed = stream_corruptions(cell.corruption)
    if streamed is not None:
        order += f", the same images for each of {len(streamed)} corruptions in turn ({'+'.join(streamed)}), no reset"
    if cell.order is not None:
        order += f", then stream order {cell.order!r} (aqr.data.streams, seed {cell.seed})"
    return {
        "aqr": __version__, "torch": torch.__version__, "numpy": np.__version__,
        "python": platform.python_version(), "git_commit": git_commit(), "host": platform.node(),
        "machine": platform.machine(), "executor": executor, "run": run, "node": result.node,
        "threads": result.threads, "device": result.device, "cpu": result.cpu, "config_hash": key,
        "files": files, "seed": cell.seed, "protocol": cell.protocol,
        "source": {"data": cell.model.source_data, "indices": cell.model.source_indices},
        "eval": {"data": cell.data.root, "pool": cell.data.eval_indices, "n_images": cell.n_images,
                 "order": order},
    }
