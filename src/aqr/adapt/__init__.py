"""Test-time recalibration with AQR: the :class:`AQR` wrapper, :func:`recalibrating` and their
:class:`AQRConfig` (``aqr`` re-exports them).

:mod:`~aqr.adapt.config` holds the options (flat, and grouped as ``config.batch`` / ``.stream`` /
``.robust``) and the targets they name, :mod:`~aqr.adapt.layer_maps`
each layer's map, :mod:`~aqr.adapt.model` the wrapper and the context manager, and
:mod:`aqr.adapt.stream` the running states of ``target="stream"`` and ``"robust"``. Built on
:mod:`aqr.core` (the quantile map and the source statistics) and :mod:`aqr.backends` (the per-batch
fast paths); neither imports from here.
"""

from aqr.adapt.config import AQRConfig, BatchOptions, RobustOptions, SmallBatchWarning, StreamOptions
from aqr.adapt.model import AQR, recalibrating

__all__ = ["AQR", "AQRConfig", "BatchOptions", "RobustOptions", "SmallBatchWarning", "StreamOptions", "recalibrating"]
