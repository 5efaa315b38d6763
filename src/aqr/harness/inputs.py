"""What a cell reads: its model, its clean source images, its corrupted evaluation images (generated
when missing), and loaders over them."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Subset

from aqr.data.images import ImageFolder, Preprocess, balanced_subset, is_image_source, listing_fingerprint
from aqr.harness.cells import Cell, DataSpec, ModelSpec, eval_indices, parse_range, stream_positions


def model_file(spec: ModelSpec) -> Path | None:
    """The file holding the model's weights, or None for a pretrained timm/torchvision name."""
    from aqr.models import zoo

    if spec.checkpoint:
        return Path(spec.checkpoint)
    if Path(spec.model).is_file():
        return Path(spec.model)
    entries = zoo()
    if spec.model in entries:
        return entries[spec.model]
    return None


def uses_image_folders(data: DataSpec) -> bool:
    """Whether ``data`` is in the ImageNet-C folder layout (``<root>/<corruption>/<severity>/<class>/``)
    rather than CIFAR-C arrays: decided by what is on disk, or by its clean source when nothing is yet."""
    root = Path(data.root)
    if not root.is_dir() or any(root.glob("*.npy")):
        return not root.is_dir() and bool(data.clean) and is_image_source(data.clean)
    return any(p.is_dir() for p in root.iterdir()) or (bool(data.clean) and is_image_source(data.clean))


@functools.lru_cache(maxsize=4)
def load_model(spec: ModelSpec) -> nn.Module:
    """The cell's model (eval mode, [0, 1] inputs); cached per process."""
    from aqr.models import load

    return load(spec.model, checkpoint=spec.checkpoint)


def source_selection(labels: np.ndarray, indices: str | None, n_images: int | None = None, seed: int = 0,
                     where: str = "") -> np.ndarray:
    """Which source images to calibrate on: the ``indices`` pool (see :func:`aqr.harness.cells.parse_range`;
    ``None``: all; ``"balanced~n"``: ``n`` class-balanced at random, seed 0), then, with ``n_images``, that
    many drawn class-balanced at random (``seed``) from the pool. Warns when only some classes are covered."""
    if indices is not None and indices.strip().startswith("balanced~"):
        count = indices.strip().partition("~")[2]
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"'balanced~n' needs a positive count, got {indices!r}")
        pool = balanced_subset(labels, int(count), 0)
    else:
        parsed = parse_range(indices, len(labels), where)
        pool = np.arange(len(labels)) if parsed is None else np.asarray(parsed, dtype=np.int64)
    if pool.size == 0:
        raise ValueError(f"source indices {indices!r} select no image of {where}")
    if pool.min() < 0 or pool.max() >= len(labels):
        raise ValueError(f"source indices {indices!r} exceed the {len(labels)} images of {where}")
    if n_images is not None:
        pool = balanced_subset(labels, n_images, seed, pool)
    classes, picked = len(np.unique(labels)), len(np.unique(labels[pool]))
    if picked < classes and len(pool) >= 10 * classes:
        # Statistics of a few classes are not the source distribution (a class-sorted file read
        # from the start): AQR would then map every test batch onto those classes.
        warnings.warn(f"source images {indices!r} of {where} cover only {picked} of {classes} classes; is the "
                      f"file sorted by class? Draw a class-balanced random subset with --n-images N "
                      f"(or 'balanced~N', or 'start:stop~n', e.g. '0:{len(labels)}~10000')", stacklevel=3)
    return pool


def load_source(spec: ModelSpec) -> tuple[np.ndarray, np.ndarray]:
    """The clean source images (uint8 NHWC) and labels the statistics are computed on (arrays only)."""
    from aqr.data import load_cifar

    data = load_cifar(spec.source_data)
    idx = source_selection(data.labels, spec.source_indices, where=spec.source_data)
    return np.asarray(data.images[idx]), data.labels[idx]


def model_preprocess(spec: ModelSpec, model: nn.Module) -> Preprocess:
    """How the spec's image files become the model's inputs: the model's preprocessing with the spec's overrides."""
    from aqr.models import preprocessing

    return preprocessing(model).with_overrides(spec.image_size, spec.resize)


def source_dataset(spec: ModelSpec, preprocess: Preprocess, n_images: int | None = None,
                   seed: int = 0) -> Subset:
    """The selected clean source images as a dataset: decoded on access from an image folder or list,
    or from CIFAR arrays (used as stored; ``preprocess`` applies to image files)."""
    if is_image_source(spec.source_data):
        data: Any = ImageFolder(spec.source_data, preprocess)
    else:
        from aqr.data import load_cifar

        data = load_cifar(spec.source_data)
    return Subset(data, source_selection(data.labels, spec.source_indices, n_images, seed,
                                         where=spec.source_data).tolist())


def source_loader(spec: ModelSpec, n_images: int | None, batch_size: int, seed: int = 0, workers: int = 0,
                  device: torch.device | str | None = None) -> DataLoader:
    """Batches of the clean source images the spec's statistics are computed from: all of them, or ``n_images``
    drawn class-balanced at random (``seed``) from that pool, in index order (for a method that needs
    source images, such as EATA's Fisher information)."""
    model = load_model(spec)
    dataset = source_dataset(spec, model_preprocess(spec, model), n_images, seed)
    return data_loader(dataset, batch_size, workers, device)


def data_loader(dataset: Any, batch_size: int, workers: int = 0, device: torch.device | str | None = None) -> DataLoader:
    """Batches of ``dataset`` in order, decoded by ``workers`` processes (pinned memory for a GPU)."""
    pin = torch.device(device).type == "cuda" if device is not None else False
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=workers, pin_memory=pin,
                      persistent_workers=False, prefetch_factor=4 if workers else None)


@functools.lru_cache(maxsize=2)
def _load_eval(root: str, corruption: str, severity: int, indices: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    from aqr.data import load_cifar_c

    ds = load_cifar_c(root, corruption, severity, indices=list(indices))
    return np.asarray(ds.images), ds.labels


def eval_data(cell: Cell) -> tuple[np.ndarray, np.ndarray]:
    """The corrupted images (uint8 NHWC) and labels a cell evaluates, in evaluation order (CIFAR-C arrays)."""
    pool = parse_range(cell.data.eval_indices)
    if pool is None:
        raise ValueError("DataSpec.eval_indices must be set")
    images, labels = _load_eval(cell.data.root, cell.corruption, cell.severity, tuple(eval_indices(cell, pool)))
    positions = stream_positions(cell, labels)
    return (images, labels) if positions is None else (images[positions], labels[positions])


def eval_folder(cell: Cell, preprocess: Preprocess) -> Subset:
    """The images a cell evaluates from an ImageNet-C folder, in evaluation order (pool ``"all"``: every image)."""
    from aqr.data.imagenet_c import ImageNetCFolder

    folder = ImageNetCFolder(cell.data.root, cell.corruption, cell.severity, preprocess=preprocess)
    text = cell.data.eval_indices
    pool = (list(range(len(folder))) if text in (None, "", "all")
            else parse_range(text, len(folder), f"{cell.corruption}/{cell.severity}"))
    drawn = eval_indices(cell, pool)
    positions = stream_positions(cell, folder.labels[drawn])
    return Subset(folder, drawn if positions is None else [drawn[i] for i in positions])


def ensure_data(data: DataSpec, corruptions: Sequence[str], progress: bool = True, workers: int = 1,
                severities: Sequence[int] = (1, 2, 3, 4, 5)) -> None:
    """Generate the corruptions missing from ``data.root`` when ``data.clean`` says how; else explain."""
    root = Path(data.root)
    if not corruptions:  # (a grid of CCC streams, made from the clean images)
        return
    if uses_image_folders(data):
        _ensure_folders(data, corruptions, severities, progress, workers)
        return
    missing = [c for c in corruptions if not (root / f"{c}.npy").is_file()]
    if not missing and (root / "labels.npy").is_file():
        return
    if not data.clean:
        raise FileNotFoundError(f"{root}: missing {', '.join(missing) or 'labels.npy'}; generate them with "
                                f"`aqr corrupt --data <clean test .npz> --out {root}`")
    from aqr.data import load_npz_arrays
    from aqr.data.cifar_c import GenerationConfig, generate_cifar_c

    images, labels = load_npz_arrays(data.clean)
    frost = data.frost_dir if "frost" in missing else None
    config = GenerationConfig(corruptions=tuple(missing), workers=workers, frost_dir=frost,
                              source={"path": data.clean})
    generate_cifar_c(images, labels, root, config, progress=progress)


def planned_generation(data: DataSpec, corruptions: Sequence[str],
                       severities: Sequence[int] = (1, 2, 3, 4, 5)) -> str | None:
    """What :func:`ensure_data` would generate into ``data.root`` before the first cell, in one line (how many
    images, about how many MB); ``None`` when nothing is missing or there is nothing to generate from."""
    root = Path(data.root)
    if uses_image_folders(data):
        missing = [f"{c}/{s}" for c in corruptions for s in severities if not (root / c / str(s)).is_dir()]
        if not missing or not data.clean:
            return None
        return (f"the first run generates {len(missing)} missing corruption/severity folder(s) of {data.clean} into "
                f"{root}")
    missing = [c for c in corruptions if not (root / f"{c}.npy").is_file()]
    if (not missing and (root / "labels.npy").is_file()) or not data.clean or not Path(data.clean).is_file():
        return None
    from aqr.data import load_npz_arrays

    images, _ = load_npz_arrays(data.clean)
    count = len(missing) * 5 * len(images)  # every severity of a corruption, as ensure_data generates them
    megabytes = count * int(np.prod(images.shape[1:])) / 1e6
    return (f"the first run generates {count:,} images ({len(missing)} corruption(s) x 5 severities x "
            f"{len(images):,} clean images) into {root}, about {megabytes:,.0f} MB")


def _ensure_folders(data: DataSpec, corruptions: Sequence[str], severities: Sequence[int], progress: bool,
                    workers: int) -> None:
    """ImageNet-C layout: write the missing (corruption, severity) folders from ``data.clean``, or explain."""
    root = Path(data.root)
    missing = [f"{c}/{s}" for c in corruptions for s in severities if not (root / c / str(s)).is_dir()]
    if not data.clean:
        if missing:
            raise FileNotFoundError(f"{root}: missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; "
                                    f"generate them with `aqr corrupt --data <ImageNet val folder> --params imagenet "
                                    f"--out {root}` or point the grid at the released ImageNet-C")
        return
    from aqr.data.imagenet_c import FolderGenerationConfig, generate_imagenet_c

    config = FolderGenerationConfig(corruptions=tuple(corruptions), severities=tuple(severities), workers=workers,
                                    frost_dir=data.frost_dir if "frost" in corruptions else None,
                                    source={"listing": listing_fingerprint(data.clean)})
    generate_imagenet_c(ImageFolder(data.clean), root, config, progress=progress)


def clear_input_caches() -> None:
    """Forget the models and evaluation images cached in this process."""
    load_model.cache_clear()
    _load_eval.cache_clear()
