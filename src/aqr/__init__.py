"""aqr: test-time adaptation by Adaptive Quantile Recalibration.

>>> stats = aqr.calibrate(model, source_loader)          # once, on source data
>>> stats.save("model.aqr.safetensors")
>>> adapted = aqr.AQR(model, aqr.SourceStats.load("model.aqr.safetensors"))
>>> logits = adapted(test_batch)                         # recalibrated on this batch
"""

__version__ = "0.1.0"

from aqr.core.adapt import AQR, AQRConfig, recalibrating  # noqa: E402
from aqr.core.layers import LayerError, LayerInfo, norm_layers  # noqa: E402
from aqr.core.qmap import TAILS, channel_quantiles, quantile_map  # noqa: E402
from aqr.core.stats import LayerStats, NonFiniteActivationError, SourceStats, StatsError, calibrate, dkw_epsilon  # noqa: E402

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
