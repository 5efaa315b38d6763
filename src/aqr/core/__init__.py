"""The core of aqr: the quantile map, the normalization layers, source statistics, calibration and
test-time recalibration. ``aqr`` re-exports what users import from here."""
