"""Images as arrays: the npz loader, the uint8 NHWC -> float NCHW conversion and a Dataset over arrays.

Every dataset of aqr yields ``(image, label)`` with ``image`` a float32 tensor of shape (3, H, W)
scaled to [0, 1] and ``label`` an int; normalisation is left to the model. Missing or malformed
files raise an error naming the file and what was expected.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

MAX_CLASSES = 100_000  # the most classes a label file or a checkpoint may name (ImageNet-21k has 21,841)


def to_float(images: np.ndarray | torch.Tensor, channels_last: bool = False) -> torch.Tensor:
    """uint8 NHWC images (numpy array or tensor) as float32 NCHW in [0, 1].

    Contiguous (what a DataLoader of CHW images yields) unless ``channels_last``: then the NHWC
    memory order is kept (torch's ``channels_last`` format) and no copy is made before the cast.
    """
    if isinstance(images, np.ndarray):
        array = np.ascontiguousarray(images)
        # read-only arrays (memory maps, PIL's buffers) are copied: torch tensors assume writable memory
        x = torch.from_numpy(array if array.flags.writeable else array.copy())
    else:
        x = images
    if x.dtype != torch.uint8 or x.ndim != 4:
        raise ValueError(f"images must be uint8 (N, H, W, C), got {x.dtype} {tuple(x.shape)}")
    x = x.permute(0, 3, 1, 2)
    if not channels_last:
        x = x.contiguous()
    return x.float().div_(255.0)


class ArrayImageDataset(Dataset):
    """uint8 NHWC images (a numpy array or memmap) and integer labels as a Dataset of [0,1] CHW tensors.

    ``images`` and ``labels`` stay accessible for vectorised use (e.g. ``dataset.images[:512]``).
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        if images.ndim != 4 or images.shape[-1] != 3 or images.dtype != np.uint8:
            raise ValueError(f"images must be uint8 (N, H, W, 3), got {images.dtype} {images.shape}")
        if len(labels) != len(images):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.labels = np.asarray(labels).astype(np.int64)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return to_float(self.images[index][None])[0], int(self.labels[index])


def require_file(path: Path, what: str) -> None:
    """Raise ``FileNotFoundError`` naming ``path`` and what was expected there when it is no file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found (expected {what})")


def check_images(array: np.ndarray, path: Path, key: str) -> None:
    """Raise ``ValueError`` naming ``path`` unless ``array`` is uint8 images (N, H, W, 3)."""
    if array.dtype != np.uint8 or array.ndim != 4 or array.shape[-1] != 3:
        raise ValueError(f"{path}: '{key}' must be uint8 with shape (N, H, W, 3), got {array.dtype} {array.shape}")


def check_labels(labels: np.ndarray, n: int, path: Path, key: str) -> None:
    """Raise ``ValueError`` naming ``path`` unless ``labels`` are ``n`` integers in ``[0, MAX_CLASSES)``."""
    if labels.ndim != 1 or labels.shape[0] != n or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{path}: '{key}' must be integer labels of shape ({n},), got {labels.dtype} {labels.shape}")
    if n and (int(labels.min()) < 0 or int(labels.max()) >= MAX_CLASSES):
        bad = int(labels.min()) if int(labels.min()) < 0 else int(labels.max())
        raise ValueError(f"{path}: '{key}' holds the label {bad}; labels are class indices in [0, {MAX_CLASSES})")


def load_npz_arrays(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read ``x`` (uint8 N,H,W,3) and ``y`` (integer N) from an .npz file, validated; no pickle."""
    path = Path(path)
    require_file(path, "an .npz with 'x' uint8 (N, H, W, 3) and 'y' int64 (N,)")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic not in (b"PK\x03\x04", b"PK\x05\x06"):  # an .npz is a zip archive (an empty one: the second)
        raise ValueError(f"{path}: not an .npz archive (a zip of .npy arrays 'x' and 'y'); "
                         f"it starts with {magic!r}")
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in ("x", "y") if k not in npz.files]
            if missing:
                raise ValueError(f"{path}: missing key(s) {missing}; expected 'x' uint8 (N, H, W, 3) and 'y' int64 (N,)")
            images, labels = npz["x"], npz["y"]
    except (OSError, EOFError, ValueError) as err:
        if str(path) in str(err):
            raise
        raise ValueError(f"{path}: not a readable .npz archive with 'x' and 'y' ({err})") from err
    check_images(images, path, "x")
    check_labels(labels, len(images), path, "y")
    return images, labels.astype(np.int64)


def load_npz(path: str | Path) -> ArrayImageDataset:
    """CIFAR-style .npz (``x`` uint8 NHWC, ``y`` int64) as a dataset."""
    return ArrayImageDataset(*load_npz_arrays(path))
