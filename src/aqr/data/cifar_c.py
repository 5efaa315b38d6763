"""Generate a CIFAR-10-C-style corrupted test set in the released on-disk layout.

Layout written to ``out_dir``:

* ``<corruption>.npy``: uint8 (len(severities) * N, H, W, 3), one block of the N images per
  requested severity, in the order requested. With severities 1..5 (the default) this is exactly
  the released CIFAR-10-C layout: row = (severity - 1) * N + index.
* ``labels.npy``: the labels repeated once per block (uint8 when they fit, as released).
* ``manifest.json``: the severities of the blocks, N, seed, parameter set, source file hash and
  per-corruption generation time. :func:`aqr.data.load_cifar_c` reads it to map a severity to its
  block when not all five severities were generated; without it, five blocks are assumed.

Each image's randomness comes from :func:`aqr.data.corruptions.image_rng` (seed, corruption, severity,
index), so the arrays do not depend on the worker count or chunking. A corruption whose file exists
with the expected shape and a matching manifest entry is skipped (resumable); files are written to
a temporary name and renamed, so a crash never leaves a truncated ``<corruption>.npy``.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from aqr.data.corruption_params import CORRUPTIONS, get_param_set
from aqr.data.corruptions import check_request, corrupt, image_rng, load_frost_overlays
from aqr.util.files import atomic_write

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class GenerationConfig:
    """What to generate; see :func:`generate_cifar_c`."""

    corruptions: tuple[str, ...] = CORRUPTIONS
    severities: tuple[int, ...] = (1, 2, 3, 4, 5)
    params: str = "cifar"
    seed: int = 0
    workers: int = 1
    frost_dir: str | None = None
    chunk_size: int = 500
    source: dict = field(default_factory=dict)  # provenance of the clean images, stored in the manifest


# Per-process worker state, set by _init_worker: the pool initializer is the only way to hand the
# images to each worker once rather than pickling them into every task. Cleared after each run.
_WORKER: dict = {}


def _init_worker(images: np.ndarray, params: str, frost_dir: str | None) -> None:
    _WORKER["images"] = images
    _WORKER["params"] = params
    _WORKER["frost"] = (
        load_frost_overlays(frost_dir, get_param_set(params).frost_scale) if frost_dir is not None else None
    )


def _corrupt_chunk(name: str, severity: int, start: int, stop: int, seed: int) -> tuple[int, np.ndarray, float]:
    t0 = time.process_time()
    images = _WORKER["images"]
    out = np.empty((stop - start,) + images.shape[1:], dtype=np.uint8)
    for k, index in enumerate(range(start, stop)):
        out[k] = corrupt(
            images[index],
            name,
            severity,
            image_rng(seed, name, severity, index),
            params=_WORKER["params"],
            frost_overlays=_WORKER["frost"],
        )
    return start, out, time.process_time() - t0


def _read_manifest(out_dir: Path) -> dict:
    path = out_dir / MANIFEST
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


def _save_npy(path: Path, array: np.ndarray) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)

    atomic_write(path, write)


def _save_manifest(out_dir: Path, manifest: dict) -> None:
    def write(tmp: Path) -> None:
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")

    atomic_write(out_dir / MANIFEST, write)


def _is_complete(out_dir: Path, name: str, entry: dict | None, expected_shape: tuple[int, ...], key: dict) -> bool:
    path = out_dir / f"{name}.npy"
    if entry is None or not path.is_file():
        return False
    if any(entry.get(k) != v for k, v in key.items()):
        return False
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError):
        return False
    return arr.shape == expected_shape and arr.dtype == np.uint8


def generate_cifar_c(
    images: np.ndarray,
    labels: np.ndarray,
    out_dir: str | Path,
    config: GenerationConfig = GenerationConfig(),
    progress: bool = True,
) -> dict[str, float]:
    """Corrupt ``images`` (uint8 N x H x W x 3) and write the released layout to ``out_dir``.

    Returns {corruption: wall-clock seconds} for the corruptions generated in this call (skipped,
    already complete ones are absent). Raises ValueError on a bad image array, an unknown
    corruption or severity, or a frost request without ``frost_dir``.
    """
    images = np.ascontiguousarray(images)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be uint8 (N, H, W, 3), got {images.dtype} {images.shape}")
    if len(images) == 0:
        raise ValueError("no images to corrupt: the source (after --limit) is empty")
    labels = np.asarray(labels)
    if labels.shape != (len(images),):
        raise ValueError(f"labels must have shape ({len(images)},), got {labels.shape}")
    pset, severities = check_request(config.params, config.corruptions, config.severities, config.frost_dir)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n = len(images)
    block_shape = (len(severities) * n,) + images.shape[1:]
    key = {"severities": list(severities), "n": n, "seed": int(config.seed), "params": pset.name}
    manifest = _read_manifest(out)
    entries: dict = manifest.get("corruptions", {})
    if any(manifest.get(k) not in (None, v) for k, v in key.items()) or manifest.get("source") not in (
        None,
        config.source,
    ):
        entries = {}  # a different run wrote this folder: regenerate everything it lists
    manifest = {**key, "source": config.source, "layout": "row = block * n + index; block b holds severities[b]"}
    manifest["corruptions"] = entries

    label_blocks = np.tile(labels, len(severities))
    if labels.size and labels.min() >= 0 and labels.max() < 256:
        label_blocks = label_blocks.astype(np.uint8)
    _save_npy(out / "labels.npy", label_blocks)

    todo = [c for c in config.corruptions if not _is_complete(out, c, entries.get(c), block_shape, key)]
    timings: dict[str, float] = {}
    bar = None
    if progress and todo:
        from tqdm import tqdm

        bar = tqdm(total=len(todo) * len(severities) * n, unit="img", desc="corrupt")

    pool = None
    if config.workers > 1 and todo:
        pool = ProcessPoolExecutor(
            max_workers=config.workers,
            initializer=_init_worker,
            initargs=(images, pset.name, config.frost_dir),
        )
    else:
        _init_worker(images, pset.name, config.frost_dir)
    try:
        for name in todo:
            t0 = time.perf_counter()
            result = np.empty(block_shape, dtype=np.uint8)
            tasks = [
                (name, s, start, min(start + config.chunk_size, n), int(config.seed))
                for s in severities
                for start in range(0, n, config.chunk_size)
            ]
            if pool is not None:
                futures = [pool.submit(_corrupt_chunk, *t) for t in tasks]
                outputs = (f.result() for f in futures)
            else:
                outputs = (_corrupt_chunk(*t) for t in tasks)
            cpu = 0.0
            for (tname, s, start, stop, _), (_, chunk, cpu_s) in zip(tasks, outputs):
                block = severities.index(s)
                result[block * n + start : block * n + stop] = chunk
                cpu += cpu_s
                if bar is not None:
                    bar.update(stop - start)
            _save_npy(out / f"{name}.npy", result)
            timings[name] = time.perf_counter() - t0
            entries[name] = {**key, "wall_s": round(timings[name], 2), "cpu_s": round(cpu, 2)}
            _save_manifest(out, manifest)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        if bar is not None:
            bar.close()
        _WORKER.clear()
    _save_manifest(out, manifest)
    return timings


def parse_list(text: str, allowed: Sequence[str] | None = None) -> list[str]:
    """Split a comma-separated list; 'all' gives ``allowed``. Raises ValueError on unknown names."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if allowed is not None:
        if items == ["all"]:
            return list(allowed)
        unknown = [t for t in items if t not in allowed]
        if unknown:
            raise ValueError(f"unknown name(s) {', '.join(unknown)}; expected 'all' or some of {', '.join(allowed)}")
    return items
