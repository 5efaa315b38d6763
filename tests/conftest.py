"""Shared fixtures: the data folder of the tests that need real data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aqr.data.location import DATA_DIR_ENV
from aqr.util.threads import torch_threads


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The shared data folder (``$AQR_DATA_DIR``); a test that asks for it is skipped without it."""
    env = os.environ.get(DATA_DIR_ENV)
    if not env:
        pytest.skip(f"needs the shared data folder: set {DATA_DIR_ENV}")
    path = Path(env)
    if not path.is_dir():
        pytest.skip(f"{DATA_DIR_ENV}={env} is not a folder")
    return path


@pytest.fixture()
def one_thread():
    """One torch thread for the test: tiny models run fastest so and do not fight other jobs for the cores.
    A module takes it for all its tests with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    with torch_threads(1):
        yield
