"""benchmarks/noniid_stream.py's pieces that do not need data: the method list and accuracy by position."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "noniid_stream.py"
spec = importlib.util.spec_from_file_location("noniid_stream", SCRIPT)
noniid = importlib.util.module_from_spec(spec)
spec.loader.exec_module(noniid)


def test_accuracy_by_position_counts_images_of_the_same_corruption_before() -> None:
    blocks = np.repeat([0, 1], 600)  # two blocks of 600 images
    correct = np.zeros(1200, dtype=bool)
    correct[np.r_[0:64, 600:664]] = True  # right only on each block's first 64 images
    got = noniid.by_position(correct, blocks)
    assert got == {"0-63": 100.0, "64-127": 0.0, "128-255": 0.0, "256-511": 0.0, "512+": 0.0}
    mixed = np.tile([0, 1], 100)  # interleaved: image 2i is block 0's i-th image
    assert noniid.by_position(np.arange(200) < 128, mixed) == {"0-63": 100.0, "64-127": 0.0}


def test_method_list_keeps_options_with_their_method() -> None:
    assert noniid.method_list("source,aqr:target=robust,groups=10,tent") == ["source", "aqr:target=robust,groups=10", "tent"]
