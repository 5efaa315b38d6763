"""aqr: test-time adaptation by Adaptive Quantile Recalibration.

>>> stats = aqr.calibrate(model, source_loader)          # once, on source data
>>> stats.save("model.aqr.safetensors")
>>> adapted = aqr.AQR(model, aqr.SourceStats.load("model.aqr.safetensors"))
>>> logits = adapted(test_batch)                         # recalibrated on this batch

The core and the recalibration (``aqr.adapt``) are imported here; the rest loads on first use
(``aqr.models``, ``aqr.methods``, ``aqr.data``, ``aqr.bench``, ``aqr.experiments``, ``aqr.cli``,
``aqr.backends``, ``aqr.core``, ``aqr.util``), so ``import aqr`` stays light.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from aqr._version import __version__  # noqa: E402

from aqr.adapt import AQR, AQRConfig, recalibrating  # noqa: E402
from aqr.core.calibrate import calibrate, dkw_epsilon  # noqa: E402
from aqr.core.layers import LayerError, LayerInfo, NonFiniteActivationError, norm_layers  # noqa: E402
from aqr.core.qmap import TAILS, channel_quantiles, quantile_map  # noqa: E402
from aqr.core.stats import LayerStats, SourceStats, StatsError  # noqa: E402

SUBMODULES = ("adapt", "backends", "bench", "cli", "core", "data", "experiments", "methods", "models", "util")

__all__ = [
    "AQR",
    "AQRConfig",
    "LayerError",
    "LayerInfo",
    "LayerStats",
    "NonFiniteActivationError",
    "SourceStats",
    "StatsError",
    "TAILS",
    "calibrate",
    "channel_quantiles",
    "dkw_epsilon",
    "norm_layers",
    "quantile_map",
    "recalibrating",
]


def __getattr__(name: str) -> ModuleType:
    """``aqr.models``, ``aqr.methods``, ...: the subpackage, imported on first access."""
    if name in SUBMODULES:
        return importlib.import_module(f"aqr.{name}")
    raise AttributeError(f"module 'aqr' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *SUBMODULES})
