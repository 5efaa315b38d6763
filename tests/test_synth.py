"""The synthetic experiments (``aqr synth``): quick versions, fixed seeds, the paper's qualitative claims.

Each experiment runs once per session through the CLI (``--quick --json``) and the tests read its JSON.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import numpy as np
import pytest
import torch

from aqr import cli
from aqr.experiments import rates
from aqr.experiments.synthetic_tools import jsonable


@pytest.fixture(scope="module")
def quick(tmp_path_factory) -> dict[str, dict]:
    """The three quick runs' JSON, produced by the CLI once for the whole module."""
    out = tmp_path_factory.mktemp("synth")
    return {name: _run_cli(name, out) for name in ("shapes", "mlp", "rates")}


def _run_cli(name: str, out) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli.main(["synth", name, "--quick", "--json", "--seed", "0", "--out", str(out)])
    assert code == 0
    numbers = json.loads(buf.getvalue(), parse_constant=lambda c: pytest.fail(f"non-strict JSON token {c}"))
    assert (out / f"{name}_quick.png").stat().st_size > 10_000
    assert json.loads((out / f"{name}_quick.json").read_text()) == numbers
    return numbers


# --- CLI output -------------------------------------------------------------------------------


def test_cli_json_has_the_promised_keys(quick):
    assert {"w1_shifted", "w1_ttn", "w1_aqr"} <= quick["shapes"].keys()
    assert {"mse_aqr", "mse_ttn"} <= quick["mlp"].keys()
    assert {"slope_K", "slope_n_source", "slope_n_target", "bound_holds"} <= quick["rates"].keys()
    assert isinstance(quick["rates"]["bound_holds"], bool)


# --- shapes (Fig. 1) --------------------------------------------------------------------------


def test_shapes_aqr_is_closer_to_the_source_than_ttn(quick):
    s = quick["shapes"]
    assert s["w1_aqr"] < 0.25 * s["w1_ttn"]
    assert s["w1_ttn"] < s["w1_shifted"]


# --- one-hidden-layer MLP ---------------------------------------------------------------------


def _cells(mlp: dict, scenario: str) -> dict[tuple[int, int], dict]:
    return {(c["n"], c["num_quantiles"]): c for c in mlp["cells"] if c["scenario"] == scenario}


def test_mlp_aqr_error_decreases_in_n_and_k(quick):
    cells = _cells(quick["mlp"], "mixed")
    ns = sorted({n for n, _ in cells})
    ks = sorted({k for _, k in cells})
    along_n = [cells[n, ks[-1]]["mse_aqr"] for n in ns]
    along_k = [cells[ns[-1], k]["mse_aqr"] for k in ks]
    assert along_n == sorted(along_n, reverse=True)
    assert along_k == sorted(along_k, reverse=True)
    assert along_n[-1] < 0.1 * along_n[0]


def test_mlp_ttn_is_biased_on_non_affine_neurons_only(quick):
    mlp = quick["mlp"]
    cells = _cells(mlp, "mixed")
    ns = sorted({n for n, _ in cells})
    k = max(k for _, k in cells)
    small, large = cells[ns[0], k], cells[ns[-1], k]
    ttn_large = np.array(large["mse_ttn_per_neuron"])
    aqr_large = np.array(large["mse_aqr_per_neuron"])
    is_nonaffine = np.array(mlp["nonaffine"]["mixed"])
    assert is_nonaffine.sum() >= 1 and (~is_nonaffine).sum() >= 1
    # non-affine k_i: TTN keeps a bias that does not shrink with n, AQR goes well below it
    assert np.all(ttn_large[is_nonaffine] > 5 * aqr_large[is_nonaffine])
    assert ttn_large[is_nonaffine].mean() > 0.5 * np.array(small["mse_ttn_per_neuron"])[is_nonaffine].mean()
    # affine k_i: TTN's error is only sampling noise
    assert ttn_large[~is_nonaffine].max() < 0.05 * ttn_large[is_nonaffine].min()


def test_mlp_ttn_matches_aqr_when_all_corruptions_are_affine(quick):
    mlp = quick["mlp"]
    mixed = _cells(mlp, "mixed")
    top = mixed[max(mixed)]["mse_ttn_per_neuron"]
    mixed_bias = min(np.array(top)[np.array(mlp["nonaffine"]["mixed"])])
    aff = _cells(mlp, "affine")
    ns = sorted({n for n, _ in aff})
    k = max(k for _, k in aff)
    ttn = [aff[n, k]["mse_ttn"] for n in ns]
    assert ttn == sorted(ttn, reverse=True)  # TTN -> 0 with n when every k_i is affine
    assert mlp["affine_mse_ttn"] < 0.05 * mixed_bias and mlp["affine_mse_aqr"] < 0.05 * mixed_bias
    assert 0.1 < mlp["affine_mse_ttn"] / mlp["affine_mse_aqr"] < 10


# --- finite-sample rates ----------------------------------------------------------------------


def test_rates_error_decreases_and_bound_holds(quick):
    r = quick["rates"]
    for name in ("K", "K_population", "n_source", "n_target"):
        mean = r["sweeps"][name]["mse_mean"]
        assert mean == sorted(mean, reverse=True), name
        assert r["sweeps"][name]["bound_violations"] == 0
    assert r["bound_holds"] is True
    assert r["slope_K"] < -3.0
    assert -1.6 < r["slope_n_source"] < -0.7 and -1.6 < r["slope_n_target"] < -0.7


def test_rates_uniform_source_breaks_the_k_term_of_the_bound(quick):
    """With L = 0 the theorem's K-term is 0, but the library's map also discretises the target."""
    u = quick["rates"]["uniform_source_population"]
    assert all(b == 0 for b in u["bound"]) and all(m > 0 for m in u["mse_mean"])
    assert quick["rates"]["uniform_bound_holds"] is False


# --- library pieces ---------------------------------------------------------------------------


def test_cosine_density_constants_and_quantile():
    d = rates.CosineDensity(0.6, 2)
    x = torch.linspace(0, 1, 100_001, dtype=torch.float64)
    assert d.f_min == pytest.approx(float(d.pdf(x).min()), abs=1e-9)
    slope = (d.pdf(x[1:]) - d.pdf(x[:-1])) / (x[1:] - x[:-1])
    assert d.lipschitz == pytest.approx(float(slope.abs().max()), rel=1e-4)
    u = torch.rand(10_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    assert float((d.cdf(d.quantile(u)) - u).abs().max()) < 1e-12


def test_theorem_bound_formula():
    d = rates.CosineDensity(0.5, 1)
    eps = math.sqrt(math.log(2 / 0.1) / (2 * 1000))
    want = 3 * (math.pi / (8 * 0.125)) ** 2 * 10**-4 + 3 / 0.25 * eps**2 * 2
    assert rates.theorem_bound(d, 10, 1000, 1000, 0.1) == pytest.approx(want)


def test_population_map_is_exact_for_an_affine_corruption(monkeypatch):
    """Exact knots + affine k: the library's map interpolates an affine k^{-1}, so no K error at all."""
    monkeypatch.setattr(rates, "rates_corruption", lambda h: 3.0 * h - 1.0)
    assert rates.population_mse(rates.CosineDensity(0.6, 2), 5, 4096) < 1e-24


def test_jsonable_is_strict():
    text = json.dumps(jsonable({"a": (1.0, math.inf), "b": np.float64("nan"), "c": np.bool_(True)}))
    assert json.loads(text, parse_constant=lambda c: pytest.fail(c)) == {"a": [1.0, "inf"], "b": "nan", "c": True}
