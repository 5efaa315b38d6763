"""How many kernel launches one layer's map takes on aqr's Triton path (the host's work per forward grows
with them): counted by wrapping the launch of every kernel, in Triton's interpreter on CPU (as
``tests/test_triton.py``). A change that adds a launch per layer fails here and must say why."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton
pytest.importorskip("triton")

from aqr.backends import triton_backend  # noqa: E402
from tests.test_triton import DEVICE, _backend, _layer  # noqa: E402

if triton_backend.kernels is None:  # pragma: no cover
    pytest.skip(f"aqr's Triton kernels do not load here: {triton_backend.UNAVAILABLE}", allow_module_level=True)

kernels = triton_backend.kernels


class Launches:
    """The kernels launched through ``triton_kernels._kernel``, by name, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.names: list[str] = []
        plain = kernels._kernel

        def counted(fn: object, x: torch.Tensor) -> object:
            launch = plain(fn, x)
            names = self.names

            class Counted:
                def __getitem__(self, grid: object) -> object:
                    names.append(getattr(fn, "__name__", getattr(getattr(fn, "fn", None), "__name__", str(fn))))
                    return launch[grid]

            return Counted()

        monkeypatch.setattr(kernels, "_kernel", counted)


# launches per layer map (target knots, then the map): the histogram path's extremes-and-coarse pass, fine
# histogram, knots, table and map; the sorted sample's extremes, targets, table and map
EXPECTED = {"histogram": 5, "sample": 4}


@pytest.mark.parametrize("path", list(EXPECTED))
@pytest.mark.parametrize("kind", ["nchw", "channels_last"])
def test_one_layer_map_takes_its_counted_launches(monkeypatch: pytest.MonkeyPatch, path: str, kind: str) -> None:
    x = _layer(kind).to(DEVICE)
    backend = _backend("standard", x.shape[1])
    if path == "histogram":
        backend.config = kernels.TritonConfig(sort_max=8)  # every layer past the sorted sample's size
    assert backend.histogram(x) == (path == "histogram")
    launches = Launches(monkeypatch)
    y, _ = backend.recalibrate(x)
    assert y.shape == x.shape
    assert len(launches.names) == EXPECTED[path], launches.names
