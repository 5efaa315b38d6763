"""Where the benchmark's data lives: a folder given explicitly, else ``$AQR_DATA_DIR``.

The folder holds ``cifar10_test.npz``, ``cifar10_train_jpeg75.npz``, ``checkpoints/`` and
``frost/`` (the benchmark's presets read them). Nothing defaults to a folder of one machine.

A relative data name the CLI is given (``--data cifar10_test.npz``) is read where it is, else in the data
folder (:func:`resolve_data_file`); ``aqr corrupt`` finds its frost images in ``<data folder>/frost`` when
``--frost-dir`` is not given (:func:`default_frost_dir`).
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


def resolve_data_file(path: str) -> str:
    """``path`` as given when it exists, is absolute or no data folder is set; else, when
    ``$AQR_DATA_DIR/<path>`` exists, that file or folder (a relative name missing here is read from the data folder)."""
    env = os.environ.get(DATA_DIR_ENV)
    given = Path(path)
    if not env or given.is_absolute() or given.exists():
        return path
    candidate = Path(env) / given
    return str(candidate) if candidate.exists() else path


def default_frost_dir() -> str | None:
    """``$AQR_DATA_DIR/frost`` when the data folder is set and holds it, else ``None``."""
    env = os.environ.get(DATA_DIR_ENV)
    if env and (Path(env) / "frost").is_dir():
        return str(Path(env) / "frost")
    return None
