"""Image files as datasets: a class-folder tree or a list of paths, decoded with a model's preprocessing.

* :class:`Preprocess`: shorter side to ``resize``, then the central ``crop`` x ``crop`` square
  (torchvision's ``Resize(int)`` + ``CenterCrop``, done with Pillow).
* :class:`ImageFolder`: ``root/<class>/.../*.JPEG`` (the ImageFolder layout; class index = position
  of the folder name in sorted order) or a text file with one image path per line, optionally
  followed by an integer label. Items are ``(float32 (3, crop, crop) in [0, 1], label)``.
* :func:`balanced_subset`: a seeded, class-balanced random subset of indices.
* :func:`listing_fingerprint`: a cheap content key of a folder or list (paths and sizes).

Pillow is needed to decode; it is imported only when an image is read.
"""

from __future__ import annotations

import functools
import hashlib
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from aqr.data.arrays import to_float

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png", ".bmp", ".webp")
MAX_SIDE = 4096  # a larger crop or resize only exhausts memory (a 100,000-pixel side is 30 GB a batch)
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "lanczos", "box", "hamming")


@dataclass(frozen=True)
class Preprocess:
    """Shorter side to ``resize`` pixels (``interpolation``), then the central ``crop`` x ``crop`` square."""

    crop: int = 224
    resize: int = 256
    interpolation: str = "bilinear"

    def __post_init__(self) -> None:
        if self.crop < 1 or self.resize < 1:
            raise ValueError(f"image size and resize must be positive, got crop {self.crop}, resize {self.resize}")
        if max(self.crop, self.resize) > MAX_SIDE:
            raise ValueError(f"image size and resize must be at most {MAX_SIDE} pixels, got crop {self.crop}, "
                             f"resize {self.resize}")
        if self.resize < self.crop:
            raise ValueError(f"--resize {self.resize} is smaller than the image size {self.crop}: "
                             "the centre crop would leave the resized image")
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"unknown interpolation {self.interpolation!r}; expected one of {', '.join(INTERPOLATIONS)}")

    def with_overrides(self, image_size: int | None = None, resize: int | None = None) -> "Preprocess":
        """This preprocessing with ``--image-size`` / ``--resize`` applied.

        A new image size alone keeps the resize-to-crop ratio (timm's ``crop_pct``).
        """
        if image_size is None and resize is None:
            return self
        crop = image_size or self.crop
        if resize is None:
            resize = max(crop, int(crop * self.resize / self.crop))
        return replace(self, crop=int(crop), resize=int(resize))

    def apply(self, image: Any) -> np.ndarray:
        """A PIL image (any mode) as uint8 RGB (crop, crop, 3)."""
        from PIL import Image

        image = image.convert("RGB")
        w, h = image.size
        # as torchvision Resize(int): the shorter side becomes `resize`, the other is truncated
        new_w, new_h = (self.resize, int(self.resize * h / w)) if w <= h else (int(self.resize * w / h), self.resize)
        if (new_w, new_h) != (w, h):
            image = image.resize((new_w, new_h), getattr(Image.Resampling, self.interpolation.upper()))
        left = int(round((new_w - self.crop) / 2.0))
        top = int(round((new_h - self.crop) / 2.0))
        return np.asarray(image.crop((left, top, left + self.crop, top + self.crop)))

    def __str__(self) -> str:
        return f"resize {self.resize}, crop {self.crop}, {self.interpolation}"


def read_image(path: Path, preprocess: Preprocess) -> np.ndarray:
    """Decode ``path`` and preprocess it to uint8 HWC; unreadable files raise ValueError naming the file."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            return preprocess.apply(im)
    except (UnidentifiedImageError, OSError, SyntaxError) as err:
        raise ValueError(f"{path}: not a readable image ({err})") from err


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def scan_class_folders(root: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    """Classes (sorted sub-folder names) and ``(path, label)`` of every image below them, in sorted order."""
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: folder not found (expected <folder>/<class>/*.JPEG)")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise FileNotFoundError(f"{root}: no class sub-folders (expected <folder>/<class>/*.JPEG, "
                                "or a text file listing image paths)")
    samples: list[tuple[Path, int]] = []
    for label, name in enumerate(classes):
        for folder, dirs, files in os.walk(root / name, followlinks=True):
            dirs.sort()
            samples.extend((Path(folder) / f, label) for f in sorted(files) if _is_image(f))
    if not samples:
        raise FileNotFoundError(f"{root}: no images ({', '.join(IMAGE_EXTENSIONS)}) in its class folders")
    return classes, samples


def read_image_list(path: Path) -> tuple[list[str], list[tuple[Path, int]]]:
    """Parse a list file: one image path a line (relative to the file's folder), optionally ``<path> <label>``.

    Without labels, an image's class is its parent folder's name (sorted names give the indices).
    Blank lines and lines starting with ``#`` are skipped.
    """
    entries: list[tuple[Path, int | None]] = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:  # an image or archive given where a list was expected
        raise ValueError(f"{path}: not a list of images (a text file, one image a line): byte {err.start} is "
                         "not UTF-8") from None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.rsplit(None, 1)
        label: int | None = None
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            line, label = parts[0], int(parts[1])
            if label < 0:
                raise ValueError(f"{path}:{number}: negative label {label}")
        image = Path(line)
        entries.append((image if image.is_absolute() else path.parent / image, label))
    if not entries:
        raise ValueError(f"{path}: lists no image paths")
    labelled = {label is not None for _, label in entries}
    if len(labelled) > 1:
        raise ValueError(f"{path}: some lines have a label and some do not; give all or none")
    if labelled == {True}:
        top = max(label for _, label in entries)
        return [str(k) for k in range(top + 1)], [(p, int(label)) for p, label in entries]
    classes = sorted({p.parent.name for p, _ in entries})
    index = {name: k for k, name in enumerate(classes)}
    return classes, [(p, index[p.parent.name]) for p, _ in entries]


class ImageFolder(Dataset):
    """Images of a class-folder tree or a list file, decoded and preprocessed on access.

    ``samples`` holds ``(path, label)``, ``classes`` the class names, ``labels`` the labels as an
    int64 array (for class-balanced subsets without decoding anything).
    """

    def __init__(self, source: str | os.PathLike[str], preprocess: Preprocess = Preprocess()) -> None:
        self.source = Path(source)
        if self.source.is_file():
            self.classes, self.samples = read_image_list(self.source)
        else:
            self.classes, self.samples = scan_class_folders(self.source)
        self.labels = np.fromiter((label for _, label in self.samples), dtype=np.int64, count=len(self.samples))
        self.preprocess = preprocess

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        return to_float(read_image(path, self.preprocess)[None])[0], label


def is_image_source(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names an image folder or a list of image paths (not an .npz or CIFAR pickle folder)."""
    p = Path(path)
    if p.is_file():
        return p.suffix.lower() in (".txt", ".lst", ".list")
    return p.is_dir() and not any((p / name).is_file() for name in ("test_batch", "test"))


def balanced_subset(labels: np.ndarray, n: int, seed: int = 0, pool: Sequence[int] | None = None) -> np.ndarray:
    """``n`` indices of ``pool`` (default: all), drawn at random so every class gets ``n // classes`` or one more.

    Classes with too few images give all they have; the rest is spread over the others. The result
    is sorted; with ``n >= len(pool)`` it is the whole pool.
    """
    pool_idx = np.arange(len(labels)) if pool is None else np.asarray(pool, dtype=np.int64)
    if n < 1:
        raise ValueError(f"the number of images must be positive, got {n}")
    if n >= len(pool_idx):
        return pool_idx
    rng = np.random.default_rng(seed)
    shuffled = pool_idx[rng.permutation(len(pool_idx))]
    classes, inverse = np.unique(labels[shuffled], return_inverse=True)
    # rank of each image within its class (in shuffled order); take rank 0 of every class, then 1, ...
    order = np.argsort(inverse, kind="stable")
    starts = np.searchsorted(inverse[order], np.arange(len(classes)))
    rank = np.empty(len(shuffled), dtype=np.int64)
    rank[order] = np.arange(len(shuffled)) - starts[inverse[order]]
    class_order = rng.permutation(len(classes))  # which classes get the remainder
    keys = rank * len(classes) + class_order[inverse]
    return np.sort(shuffled[np.argsort(keys, kind="stable")[:n]])


@functools.lru_cache(maxsize=256)
def _listing_fingerprint(path: str, mtime: float) -> str:
    dataset = ImageFolder(path)
    digest = hashlib.sha256()
    root = dataset.source if dataset.source.is_dir() else dataset.source.parent
    for image, label in dataset.samples:
        rel = os.path.relpath(image, root)
        digest.update(f"{rel}\t{image.stat().st_size}\t{label}\n".encode())
    return "listing:" + digest.hexdigest()


def listing_fingerprint(path: str | os.PathLike[str]) -> str:
    """A key of an image folder or list: every image's relative path, size and label (no decoding).

    Memoised per process (a folder of 1.28M images takes seconds to list); a changed list file or
    top folder is listed again.
    """
    p = Path(path)
    return _listing_fingerprint(str(p.resolve()), p.stat().st_mtime)
