"""The model zoo: aqr checkpoints committed under ``zoo/`` at the repository root."""

from __future__ import annotations

import os
from pathlib import Path

ZOO_ENV = "AQR_ZOO"
SUFFIXES: tuple[str, ...] = (".pt",)


def zoo_dir() -> Path:
    """The zoo folder: ``$AQR_ZOO`` when set, else ``zoo/`` at the repository root (beside ``src/``)."""
    env = os.environ.get(ZOO_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "zoo"


def zoo(directory: str | os.PathLike[str] | None = None) -> dict[str, Path]:
    """Map checkpoint name (file stem) -> path for every checkpoint in the zoo folder, sorted by name.

    A missing folder gives an empty dict.
    """
    root = Path(directory) if directory is not None else zoo_dir()
    if not root.is_dir():
        return {}
    return {p.stem: p for p in sorted(root.iterdir()) if p.suffix in SUFFIXES and p.is_file()}
