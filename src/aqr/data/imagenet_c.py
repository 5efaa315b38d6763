"""ImageNet-C: ``<root>/<corruption>/<severity>/<wnid>/*.JPEG``, resized and centre-cropped (needs Pillow)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from aqr.data.arrays import to_float

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png")


def _resize_center_crop(image: Any, resize: int, crop: int) -> np.ndarray:
    """Shorter side to ``resize`` (bilinear), then the central ``crop`` x ``crop`` square, as uint8 HWC."""
    from PIL import Image

    w, h = image.size
    # as torchvision Resize(int): the shorter side becomes `resize`, the other is truncated
    new_w, new_h = (resize, int(resize * h / w)) if w <= h else (int(resize * w / h), resize)
    if (new_w, new_h) != (w, h):
        image = image.resize((new_w, new_h), Image.BILINEAR)
    left = int(round((new_w - crop) / 2.0))
    top = int(round((new_h - crop) / 2.0))
    return np.asarray(image.crop((left, top, left + crop, top + crop)))


class ImageNetCFolder(Dataset):
    """ImageNet-C: ``<root>/<corruption>/<severity>/<wnid>/*.JPEG``.

    Labels are the positions of the wnids in the sorted list of class folders (the standard
    ImageNet class order when all 1000 are present). Each image is resized so its shorter side is
    ``resize`` (bilinear, Pillow), then centre-cropped to ``crop``.
    """

    def __init__(self, root: str | Path, corruption: str, severity: int, resize: int = 256, crop: int = 224) -> None:
        folder = Path(root) / corruption / str(severity)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: folder not found (expected <root>/<corruption>/<severity>/<wnid>/*.JPEG)")
        self.classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
        if not self.classes:
            raise FileNotFoundError(f"{folder}: no class (wnid) sub-folders")
        self.samples: list[tuple[Path, int]] = [
            (p, label)
            for label, wnid in enumerate(self.classes)
            for p in sorted((folder / wnid).iterdir())
            if p.suffix.lower() in IMAGE_EXTENSIONS
        ]
        if not self.samples:
            raise FileNotFoundError(f"{folder}: no images ({', '.join(IMAGE_EXTENSIONS)}) in the class folders")
        self.resize, self.crop = resize, crop

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image, UnidentifiedImageError

        path, label = self.samples[index]
        try:
            with Image.open(path) as im:
                pixels = _resize_center_crop(im.convert("RGB"), self.resize, self.crop)
        except (UnidentifiedImageError, OSError) as err:
            raise ValueError(f"{path}: not a readable image ({err})") from err
        return to_float(pixels[None])[0], label
