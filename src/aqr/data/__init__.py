"""Datasets: image arrays and npz files (:mod:`~aqr.data.arrays`), CIFAR and CIFAR-C
(:mod:`~aqr.data.cifar`), ImageNet-C (:mod:`~aqr.data.imagenet_c`), and the CIFAR-10-C generator
(:mod:`~aqr.data.cifar_c` with :mod:`~aqr.data.corruptions` and :mod:`~aqr.data.corruption_params`,
which need scipy and Pillow and load only when used). :func:`resolve_data_dir` finds the
benchmark's data folder (``$AQR_DATA_DIR``).

The names below load on first use, so that importing one light submodule (the corruption names,
say) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aqr.data.arrays import ArrayImageDataset, load_npz, load_npz_arrays, to_float
    from aqr.data.cifar import load_cifar, load_cifar_c, load_cifar_pickle
    from aqr.data.imagenet_c import ImageNetCFolder
    from aqr.data.location import DATA_DIR_ENV, DataDirError, resolve_data_dir

_NAMES = {
    "ArrayImageDataset": "aqr.data.arrays", "load_npz": "aqr.data.arrays", "load_npz_arrays": "aqr.data.arrays",
    "to_float": "aqr.data.arrays", "load_cifar": "aqr.data.cifar", "load_cifar_c": "aqr.data.cifar",
    "load_cifar_pickle": "aqr.data.cifar", "ImageNetCFolder": "aqr.data.imagenet_c",
    "DATA_DIR_ENV": "aqr.data.location", "DataDirError": "aqr.data.location", "resolve_data_dir": "aqr.data.location",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    """One of the names above, imported from its module on first access."""
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'aqr.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_NAMES})
