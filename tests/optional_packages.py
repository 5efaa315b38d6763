"""Skip a test cleanly when an optional package is missing or does not import beside this torch."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


def require(package: str) -> ModuleType:
    """Import ``package`` or skip the test, naming why (e.g. a torchvision built for another torch
    raises RuntimeError on import, and timm imports torchvision)."""
    try:
        return importlib.import_module(package)
    except Exception as err:  # noqa: BLE001 - any import failure means the package is unusable here
        pytest.skip(f"{package} does not import here: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
