"""Where the benchmark's data lives: a folder given explicitly, else ``$AQR_DATA_DIR``.

The folder holds ``cifar10_test.npz``, ``cifar10_train_jpeg75.npz``, ``checkpoints/`` and
``frost/`` (the benchmark's presets read them). Nothing defaults to a folder of one machine.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "AQR_DATA_DIR"


class DataDirError(ValueError):
    """No data folder was given and ``$AQR_DATA_DIR`` is not set."""


def resolve_data_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """``path`` when given, else ``$AQR_DATA_DIR``; :class:`DataDirError` naming both when neither is set."""
    if path is not None and os.fspath(path) != "":
        return Path(path)
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env)
    raise DataDirError(f"no data folder: pass --data-dir (data_dir= in Python) or set {DATA_DIR_ENV}")
