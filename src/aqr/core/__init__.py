"""The core of aqr: the quantile map, the normalization layers, source statistics and calibration
(test-time recalibration builds on it in :mod:`aqr.adapt`). ``aqr`` re-exports what users import from
here; nothing here imports from :mod:`aqr.backends` or :mod:`aqr.adapt`."""
