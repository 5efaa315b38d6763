"""aqr: test-time adaptation by Adaptive Quantile Recalibration."""

__version__ = "0.1.0"
