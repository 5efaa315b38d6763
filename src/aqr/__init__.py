"""aqr: test-time adaptation by Adaptive Quantile Recalibration.

>>> stats = aqr.calibrate(model, source_loader)          # once, on source data
>>> stats.save("model.aqr.safetensors")
>>> adapted = aqr.AQR(model, aqr.SourceStats.load("model.aqr.safetensors"))
>>> logits = adapted(test_batch)                         # recalibrated on this batch

Every name and subpackage loads on first use (``aqr.AQR`` imports :mod:`aqr.adapt`, ``aqr.models``
the model zoo, ...), so ``import aqr`` costs nothing until it is used and ``aqr --help`` does not
wait for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from aqr._version import __version__

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from aqr.adapt import AQR, AQRConfig, SmallBatchWarning, recalibrating
    from aqr.core.calibrate import calibrate, dkw_epsilon
    from aqr.core.layers import LayerError, LayerInfo, NonFiniteActivationError, norm_layers
    from aqr.core.qmap import TAILS, channel_quantiles, quantile_map
    from aqr.core.stats import LayerStats, SourceStats, StatsError
    from aqr.deploy import export

SUBMODULES = ("adapt", "backends", "cli", "core", "data", "deploy", "experiments", "harness", "methods", "models",
              "util")

# public name -> the module that defines it
_NAMES = {
    "AQR": "aqr.adapt",
    "AQRConfig": "aqr.adapt",
    "recalibrating": "aqr.adapt",
    "SmallBatchWarning": "aqr.adapt",
    "calibrate": "aqr.core.calibrate",
    "dkw_epsilon": "aqr.core.calibrate",
    "LayerError": "aqr.core.layers",
    "LayerInfo": "aqr.core.layers",
    "NonFiniteActivationError": "aqr.core.layers",
    "norm_layers": "aqr.core.layers",
    "TAILS": "aqr.core.qmap",
    "channel_quantiles": "aqr.core.qmap",
    "quantile_map": "aqr.core.qmap",
    "LayerStats": "aqr.core.stats",
    "SourceStats": "aqr.core.stats",
    "StatsError": "aqr.core.stats",
    "export": "aqr.deploy",
}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    """A public name or a subpackage (``aqr.models``, ``aqr.methods``, ...), imported on first access."""
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if name in SUBMODULES:
        return importlib.import_module(f"aqr.{name}")
    raise AttributeError(f"module 'aqr' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_NAMES, *SUBMODULES})
