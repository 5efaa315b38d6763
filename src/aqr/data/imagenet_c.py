"""The ImageNet-C layout ``<root>/<corruption>/<severity>/<wnid>/*.JPEG``: reading it and writing it.

:class:`ImageNetCFolder` reads one corruption and severity. :func:`generate_imagenet_c` writes the
layout from an image folder (e.g. the ImageNet validation set) as ``make_imagenet_c.py`` of
hendrycks/robustness does: each image resized (shorter side 256) and centre-cropped to 224, corrupted
with the ImageNet parameter table, saved as JPEG quality 85. Each image's randomness comes from
:func:`aqr.data.corruptions.image_rng` (seed, corruption, severity, index in the source listing), so
the files do not depend on the worker count. Files are written under a temporary name and renamed,
so an existing file is a complete one: an interrupted run resumes where it stopped, and
``manifest.json`` records the settings and the finished (corruption, severity) folders.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from aqr.data.corruption_params import check_corruption_name
from aqr.data.images import ImageFolder, Preprocess, read_image
from aqr.util.files import atomic_write

MANIFEST = "manifest.json"
JPEG_QUALITY = 85  # make_imagenet_c.py's
IMAGENET_C_PREPROCESS = Preprocess(crop=224, resize=256, interpolation="bilinear")


class ImageNetCFolder(ImageFolder):
    """One corruption and severity of an ImageNet-C folder: ``<root>/<corruption>/<severity>/<wnid>/*.JPEG``.

    Labels are the positions of the wnids in the sorted list of class folders (the standard
    ImageNet class order when all 1000 are present). Images are preprocessed with ``preprocess``
    (default: shorter side to ``resize``, bilinear, centre crop ``crop``).
    """

    def __init__(self, root: str | Path, corruption: str, severity: int, resize: int = 256, crop: int = 224,
                 preprocess: Preprocess | None = None) -> None:
        folder = Path(root) / corruption / str(severity)
        if not folder.is_dir():
            if not (Path(root) / corruption).is_dir():
                check_corruption_name(corruption)
            raise FileNotFoundError(f"{folder}: folder not found (expected <root>/<corruption>/<severity>/<wnid>/*.JPEG)")
        super().__init__(folder, preprocess or Preprocess(crop=crop, resize=resize))


@dataclass(frozen=True)
class FolderGenerationConfig:
    """What :func:`generate_imagenet_c` writes: corruptions x severities of the selected source images."""

    corruptions: tuple[str, ...]
    severities: tuple[int, ...] = (1, 2, 3, 4, 5)
    params: str = "imagenet"
    seed: int = 0
    workers: int = 1
    frost_dir: str | None = None
    preprocess: Preprocess = IMAGENET_C_PREPROCESS
    quality: int = JPEG_QUALITY
    chunk_size: int = 32
    source: dict = field(default_factory=dict)  # provenance of the clean images, stored in the manifest


# Per-process worker state (see aqr.data.cifar_c): set once by the pool initializer.
_WORKER: dict = {}


def _init_worker(params: str, frost_dir: str | None, preprocess: Preprocess, quality: int, seed: int) -> None:
    from aqr.data.corruption_params import get_param_set
    from aqr.data.corruptions import load_frost_overlays

    _WORKER.update(params=params, preprocess=preprocess, quality=quality, seed=seed,
                   frost=load_frost_overlays(frost_dir, get_param_set(params).frost_scale) if frost_dir else None)


def _write_chunk(corruption: str, severity: int, items: list[tuple[int, str, str]]) -> int:
    """Corrupt and save each ``(index, source, target)``; returns how many files were written."""
    from PIL import Image

    from aqr.data.corruptions import corrupt, image_rng

    for index, source, target in items:
        image = read_image(Path(source), _WORKER["preprocess"])
        out = corrupt(image, corruption, severity, image_rng(_WORKER["seed"], corruption, severity, index),
                      params=_WORKER["params"], frost_overlays=_WORKER["frost"])
        atomic_write(target, lambda tmp: Image.fromarray(out).save(tmp, "JPEG", quality=_WORKER["quality"],
                                                                   optimize=True))
    return len(items)


def _settings(config: FolderGenerationConfig) -> dict:
    return {"params": config.params, "seed": int(config.seed), "quality": int(config.quality),
            "preprocess": asdict(config.preprocess), "source": config.source}


def _read_manifest(out: Path) -> dict:
    path = out / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {}


def _save_manifest(out: Path, manifest: dict) -> None:
    atomic_write(out / MANIFEST, lambda tmp: tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n"))


def generate_imagenet_c(source: ImageFolder, out_dir: str | Path, config: FolderGenerationConfig,
                        indices: Sequence[int] | None = None, progress: bool = True,
                        log: Callable[[str], None] | None = None) -> dict[str, float]:
    """Write ``out_dir/<corruption>/<severity>/<class>/<stem>.JPEG`` for the ``indices`` of ``source`` (default all).

    Returns ``{"<corruption>/<severity>": wall seconds}`` for the folders finished in this call;
    folders the manifest lists as finished are skipped. Every class folder of the source is
    created, so labels (sorted folder names) match the source's even when a subset is written.
    Raises ValueError on an unknown corruption or severity, a frost request without ``frost_dir``,
    or an ``out_dir`` written with other settings.
    """
    from aqr.data.corruptions import check_request

    pset, severities = check_request(config.params, config.corruptions, config.severities, config.frost_dir)
    chosen = np.arange(len(source)) if indices is None else np.asarray(indices, dtype=np.int64)
    if len(chosen) == 0:
        raise ValueError("no images to corrupt: the source (after --n-images / --limit) is empty")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = {**_settings(config), "n": int(len(chosen))}
    manifest = _read_manifest(out)
    # What this call creates, removed again if it fails before any folder is finished: a rerun (say,
    # after a bad image was removed from the source) then starts afresh instead of meeting a manifest
    # of other settings and half-written folders.
    created = [path for path in (out / MANIFEST, *(out / c for c in config.corruptions)) if not path.exists()]
    if manifest and manifest.get("settings") != settings:
        raise ValueError(f"{out} holds images made with other settings ({manifest.get('settings')}); "
                         f"choose another --out or remove it (this run: {settings})")
    manifest = {"settings": settings, "classes": list(source.classes), "layout": "<corruption>/<severity>/<class>/<stem>.JPEG",
                "done": manifest.get("done", {})}
    todo = [(c, s) for c in config.corruptions for s in severities if f"{c}/{s}" not in manifest["done"]]
    tasks: list[tuple[str, int, list[tuple[int, str, str]]]] = []
    for c, s in todo:
        folder = out / c / str(s)
        for name in source.classes:
            (folder / name).mkdir(parents=True, exist_ok=True)
        items = []
        for index in chosen:
            path, label = source.samples[index]
            target = folder / source.classes[label] / (path.stem + ".JPEG")
            if not target.is_file():  # written atomically: an existing file is complete
                items.append((int(index), str(path), str(target)))
        tasks.extend((c, s, items[k:k + config.chunk_size]) for k in range(0, len(items), config.chunk_size))
        if not items:
            tasks.append((c, s, []))  # an empty task still marks the folder finished
    timings: dict[str, float] = {}
    if not todo:
        return timings
    remaining = {f"{c}/{s}": 0 for c, s in todo}
    for c, s, _ in tasks:
        remaining[f"{c}/{s}"] += 1
    started = {key: time.perf_counter() for key in remaining}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=sum(len(t[2]) for t in tasks), unit="img", desc="corrupt")
    initargs = (pset.name, config.frost_dir, config.preprocess, int(config.quality), int(config.seed))

    def finished(c: str, s: int, n: int) -> None:
        key = f"{c}/{s}"
        remaining[key] -= 1
        if bar is not None:
            bar.update(n)
        if remaining[key] == 0:
            timings[key] = time.perf_counter() - started[key]
            manifest["done"][key] = {"wall_s": round(timings[key], 2)}
            _save_manifest(out, manifest)
            if log is not None:
                log(f"{key}: {timings[key]:.1f} s")

    _save_manifest(out, manifest)
    try:
        if config.workers <= 1:
            _init_worker(*initargs)
            for c, s, items in tasks:
                finished(c, s, _write_chunk(c, s, items))
        else:
            with ProcessPoolExecutor(config.workers, initializer=_init_worker, initargs=initargs) as pool:
                queue = iter(tasks)
                pending: dict[Future, tuple[str, int]] = {}
                for c, s, items in queue:
                    pending[pool.submit(_write_chunk, c, s, items)] = (c, s)
                    if len(pending) >= 4 * config.workers:
                        break
                while pending:
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        c, s = pending.pop(future)
                        finished(c, s, future.result())
                        nxt = next(queue, None)
                        if nxt is not None:
                            pending[pool.submit(_write_chunk, *nxt)] = nxt[:2]
    except BaseException:
        if not manifest["done"]:
            _remove(created)
        raise
    finally:
        if bar is not None:
            bar.close()
        _WORKER.clear()
    return timings


def _remove(paths: Sequence[Path]) -> None:
    """Delete these files and folders (with what they hold), those that exist."""
    import shutil

    for path in paths:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink(missing_ok=True)

