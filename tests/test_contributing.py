"""CONTRIBUTING.md's worked example, followed from a test file: a method added in one file (here, this one)
is created by name, checked by the bench's dry check and run in a bench cell, with nothing else changed."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from torch import nn

from aqr import methods
from aqr.harness.results import ResultsDB
from aqr.harness.specs import MethodSpec, check_method
from aqr.methods import TTAMethod, method
from aqr.methods.options import check_number

from .test_bench import _tiny_setup


@dataclass(frozen=True)
class TemperatureConfig:
    """Options of the toy method: the logits are divided by ``temperature``."""

    temperature: float = 2.0

    def __post_init__(self) -> None:
        check_number("temperature", self.temperature, 0.0, low_open=True)


@pytest.fixture()
def toy_method():
    """The worked example's method, registered for one test and removed after it."""

    @method("temperature", TemperatureConfig, stateless=True)
    class Temperature(TTAMethod):
        """The source model with its logits divided by a temperature (no adaptation)."""

        def predict(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return self.model(x) / self.config.temperature

    try:
        yield Temperature
    finally:
        methods.REGISTRY.unregister("temperature")


def test_a_method_added_in_one_file_is_created_by_name(toy_method: type) -> None:
    assert "temperature" in methods.available()
    assert methods.plan("temperature", {"temperature": 4.0}).config == TemperatureConfig(4.0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    x = torch.randn(5, 3, 2, 2)
    out = methods.create("temperature", net, temperature=4.0)(x)
    assert torch.allclose(out, net(x) / 4.0)
    with pytest.raises(TypeError, match="did you mean 'temperature'"):
        methods.create("temperature", net, temprature=4.0)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        methods.plan("temperature", {"temperature": 0.0})
    with pytest.raises(ValueError, match="registered already"):
        method("temperature", TemperatureConfig)(toy_method)


def test_the_bench_runs_the_added_method(toy_method: type, tmp_path: Path) -> None:
    from aqr.harness.grid_driver import run_grid

    check_method(MethodSpec.parse("temperature:temperature=3.0"))
    with pytest.raises(ValueError, match="unknown options"):
        check_method(MethodSpec.parse("temperature:t=3.0"))
    tiny = _tiny_setup(tmp_path)[0]
    grid = replace(tiny, methods=(MethodSpec("source"), MethodSpec.parse("temperature:temperature=3.0")))
    with ResultsDB(tmp_path / "r.db") as db:
        summary = run_grid(grid, db, tmp_path / "cache", progress=False, log=lambda m: None)
        assert summary.errors == 0, summary.error_messages
        rows = {(r.model, r.method, r.corruption): r for r in db.rows()}
    # dividing the logits by a positive number changes no prediction: the toy scores as Source, cell by cell
    toy = {k[0::2]: r.accuracy for k, r in rows.items() if k[1] == "temperature"}
    source = {k[0::2]: r.accuracy for k, r in rows.items() if k[1] == "source"}
    assert toy and toy == source
