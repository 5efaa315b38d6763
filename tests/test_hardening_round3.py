"""Hardening, round 3: a damaged kernel cache, benchmark arguments checked before any work, index
ranges past the data, a damaged results database, options a target does not take, integer images.

Each test reproduces an attack that used to crash, hang or fail late with a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from aqr.backends import build
from tests.cli_lines import one_error_line
from tests.models_tiny import tiny_checkpoint_and_images

# -O0 (last, so it wins over -O3): the same library logic, a quicker build
FAST = ["-O0"]

LOADER = textwrap.dedent("""
    import json, sys, warnings
    from aqr.backends import build
    which = sys.argv[1]
    command = build.compile_command({fast!r})
    if which == "batch":
        loader = lambda _: build.load(command)
    else:
        from aqr.adapt.stream import native_kernels
        loader = lambda _: native_kernels.load(command)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lib = build.warned(*build.try_load(loader))
    print(json.dumps({{"loaded": lib is not None, "warnings": [str(w.message) for w in caught]}}))
""").format(fast=FAST)

needs_compiler = pytest.mark.skipif(build.compile_command() is None, reason="no C compiler")


def _load_in_subprocess(cache: Path, which: str = "batch") -> dict:
    """Load the kernels in a fresh process on the cache ``cache`` (a crash there cannot take pytest down)."""
    env = {**os.environ, "AQR_CACHE_DIR": str(cache)}
    done = subprocess.run([sys.executable, "-c", LOADER, which], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def _library(which: str) -> Path:
    """Where the quick build of the per-batch (``batch``) or stream kernels lies in the current cache."""
    command = build.compile_command(FAST)
    if which == "batch":
        return build.library_path(command)
    from aqr.adapt.stream import native_kernels

    return build.library_path(command, "aqr_stream_kernels", (native_kernels.SOURCE,))


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory) -> Path:
    """A kernel cache holding the quick build of the per-batch kernels and its stamp."""
    cache = tmp_path_factory.mktemp("kernel-cache")
    assert _load_in_subprocess(cache) == {"loaded": True, "warnings": []}
    return cache


def _copy_cache(built: Path, tmp_path: Path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(built, cache)
    monkeypatch.setenv("AQR_CACHE_DIR", str(cache))
    return cache


@needs_compiler
def test_kernels_are_stamped_when_built(built_cache, monkeypatch):
    monkeypatch.setenv("AQR_CACHE_DIR", str(built_cache))
    library = _library("batch")
    stamp = json.loads(build.stamp_path(library).read_text())
    assert stamp["size"] == library.stat().st_size and build.verified(library)


@needs_compiler
def test_a_truncated_cached_library_is_rebuilt_not_loaded(built_cache, tmp_path, monkeypatch):
    cache = _copy_cache(built_cache, tmp_path, monkeypatch)
    library = _library("batch")
    whole = library.read_bytes()
    library.write_bytes(whole[:3000])  # used to kill the process with a bus error in dlopen
    assert not build.verified(library)
    assert _load_in_subprocess(cache) == {"loaded": True, "warnings": []}
    assert build.verified(library) and library.stat().st_size == len(whole)


def _wrong_library(tmp_path: Path) -> Path:
    """A valid shared library of the wrong build: the thread team's entry point and no kernels."""
    source = tmp_path / "wrong.c"
    source.write_text("void aqr_use_openmp(void *a, void *b, void *c) { (void)a; (void)b; (void)c; }\n")
    out = tmp_path / "wrong.so"
    subprocess.run([*build.compiler(), "-shared", "-fPIC", "-o", str(out), str(source)], check=True, timeout=120)
    return out


@needs_compiler
def test_another_builds_library_under_the_name_is_rebuilt(built_cache, tmp_path, monkeypatch):
    cache = _copy_cache(built_cache, tmp_path, monkeypatch)
    library = _library("batch")
    shutil.copyfile(_wrong_library(tmp_path), library)  # used to fail with "undefined symbol", no fallback
    assert _load_in_subprocess(cache) == {"loaded": True, "warnings": []}
    assert build.verified(library)


@needs_compiler
@pytest.mark.parametrize("which", ["batch", "stream"])
def test_a_stamped_library_without_the_kernels_falls_back_with_one_warning(tmp_path, monkeypatch, which):
    cache = tmp_path / "cache"
    monkeypatch.setenv("AQR_CACHE_DIR", str(cache))
    library = _library(which)
    cache.mkdir()
    shutil.copyfile(_wrong_library(tmp_path), library)
    build.stamp_path(library).write_text(json.dumps(build.file_stamp(library)))  # it verifies, and still lacks them
    result = _load_in_subprocess(cache, which)
    assert not result["loaded"]
    assert len(result["warnings"]) == 1, result
    assert "undefined symbol" in result["warnings"][0] and "through torch" in result["warnings"][0]


# ---- the benchmark and the commands: arguments checked before any work ---------------------------

from aqr.harness.cells import DataSpec  # noqa: E402
from aqr.harness.results import ResultsDB, ResultsDBError  # noqa: E402
from aqr.harness.specs import GridSpec, MethodSpec  # noqa: E402

N_IMAGES = 200  # images of the fixture's clean set and of each severity of its CIFAR-C folder


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """A small aqr checkpoint, 200 clean CIFAR-shaped images, a CIFAR-C folder of them (fog) and a grid
    file whose corruptions are generated from the clean images when missing."""
    root = tmp_path_factory.mktemp("round3")
    ckpt, npz, rng = tiny_checkpoint_and_images(root, N_IMAGES)
    cifar_c = root / "cifar-c"
    cifar_c.mkdir()
    np.save(cifar_c / "fog.npy", rng.integers(0, 256, (5 * N_IMAGES, 32, 32, 3), dtype=np.uint8))
    np.save(cifar_c / "labels.npy", np.arange(N_IMAGES) % 10)
    grid = {"name": "round3", "models": [{"name": "tiny", "model": str(ckpt), "source_data": str(npz),
                                         "source_indices": f"0:{N_IMAGES}"}],
            "data": {"root": str(root / "generated"), "clean": str(npz), "eval_indices": f"100:{N_IMAGES}"},
            "corruptions": ["fog"], "severities": [1], "batch_sizes": [50], "seeds": [0], "n_images": 50,
            "methods": ["source"]}
    (root / "grid.json").write_text(json.dumps(grid))
    return {"ckpt": str(ckpt), "npz": str(npz), "cifar_c": str(cifar_c), "grid": str(root / "grid.json"),
            "generated": str(root / "generated"), "root": str(root)}


def _bench(files: dict[str, str], tmp_path: Path, *extra: str) -> list[str]:
    return ["bench", "--config", files["grid"], "--db", str(tmp_path / "r.db"), "--cache", str(tmp_path / "cache"),
            "--no-progress", *extra]


@pytest.mark.parametrize("methods, words", [
    ("nosuch", ["nosuch", "available"]),
    ("source,aqr:nosuch=3", ["nosuch", "aqr takes"]),
    ("aqr:target=streem", ["streem", "target"]),
    ("aqr:K=2", ["K must be"]),
    ("tent:seed=3", ["seed", "set by the grid"]),
    ("aqr:target=stream,balance=0.5", ["balance=0.5", "target='stream'"]),
])
def test_bench_checks_methods_before_the_database_or_any_data(capsys, files, tmp_path, methods, words):
    one_error_line(capsys, _bench(files, tmp_path, "--methods", methods), 2, *words)
    assert not (tmp_path / "r.db").exists() and not Path(files["generated"]).exists()


def test_run_grid_checks_methods_before_generating_data(files, tmp_path):
    from aqr.harness.grid_driver import run_grid
    from aqr.harness.grid_files import load_grid

    grid = load_grid(files["grid"]).override(methods=(MethodSpec("source"), MethodSpec("aqr", {"tail": "bogus"})))
    with ResultsDB(tmp_path / "r.db") as db:
        with pytest.raises(ValueError, match="bogus"):
            run_grid(grid, db, tmp_path / "cache", progress=False, log=lambda m: None)
        assert db.rows() == []
    assert not Path(files["generated"]).exists()


def test_the_check_takes_every_method_a_cell_can_run():
    from aqr.harness.specs import check_method

    check_method(MethodSpec.parse("aqr:tail=clip,K=11,target=robust,balance=0.5"), "online")
    check_method(MethodSpec.parse("roid:defaults=imagenet"))
    check_method(MethodSpec.parse("tent:lr=0.001"), batch_size=64)
    with pytest.raises(ValueError, match="defaults"):
        check_method(MethodSpec.parse("lame:defaults=cifar100"))
    with pytest.raises(ValueError, match="K="):  # the statistics options apply where statistics are used
        check_method(MethodSpec.parse("tent:K=11"))


def test_bench_refuses_more_images_than_the_pool_before_generating(capsys, files, tmp_path):
    one_error_line(capsys, _bench(files, tmp_path, "--n-images", "99999999"), 2, "99999999", f"{N_IMAGES - 100} images")
    assert not (tmp_path / "r.db").exists() and not Path(files["generated"]).exists()


def test_a_grid_knows_its_pool_from_the_text():
    from aqr.harness.cells import MAX_INDEX, index_count

    assert index_count("5000:10000") == 5000 and index_count("0:50000~10000") == 10000
    assert index_count("1,5,9") == 3 and index_count("all") is None and index_count(None) is None
    assert index_count(f"0:{MAX_INDEX + 1}") == MAX_INDEX + 1  # counted, not listed
    with pytest.raises(ValueError, match="exceeds the 5000 images"):
        GridSpec("g", (), DataSpec(eval_indices="5000:10000"), (MethodSpec("source"),), n_images=5001)


@pytest.mark.parametrize("indices, words", [
    ("0:99999999999999999999", ["0:99999999999999999999"]),  # was an OverflowError, exit 1
    ("1,99999999999999999999", ["99999999999999999999"]),
    (f"150:{N_IMAGES + 100}", [f"150:{N_IMAGES + 100}", f"{N_IMAGES} images"]),  # was an IndexError on CIFAR-C
    ("0:1000000000", [f"{N_IMAGES} images"]),  # refused before a list of a billion indices is made
])
def test_indices_past_the_data_are_one_line_usage_errors(capsys, files, indices, words):
    one_error_line(capsys, ["evaluate", files["ckpt"], "--cifar-c", files["cifar_c"], "--corruption", "fog",
                       "--methods", "source", f"--indices={indices}"], 2, *words)
    one_error_line(capsys, ["evaluate", files["ckpt"], "--data", files["npz"], "--methods", "source",
                       f"--indices={indices}"], 2, *words)
    one_error_line(capsys, ["calibrate", files["ckpt"], "--data", files["npz"], f"--indices={indices}",
                       "--out", str(Path(files["root"]) / "s.safetensors"), "--no-progress"], 2, *words)


def test_parse_range_checks_bounds_before_listing():
    from aqr.harness.cells import MAX_INDEX, parse_range

    assert parse_range("2:5", 5) == [2, 3, 4] and parse_range("0:10~3", 10) == sorted(parse_range("0:10~3"))
    with pytest.raises(ValueError, match="exceed the 200 images of data.npz"):
        parse_range(f"0:{MAX_INDEX}", 200, "data.npz")
    with pytest.raises(ValueError, match="beyond any image collection"):
        parse_range(f"0:{MAX_INDEX + 2}")


# ---- a damaged results database --------------------------------------------------------------------

def test_a_non_numeric_schema_version_names_the_file_and_value(capsys, files, tmp_path):
    import sqlite3

    path = tmp_path / "r.db"
    ResultsDB(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value='abc' WHERE name='schema_version'")
    conn.close()
    with pytest.raises(ResultsDBError, match="'abc'") as caught:
        ResultsDB(path)
    assert str(path) in str(caught.value)
    one_error_line(capsys, ["report", "--db", str(path), "--out", str(tmp_path / "out")], 1, "'abc'", str(path))


# ---- aqr.AQR: options its target ignores, integer images ---------------------------------------------

def _bn_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3)).eval()


@pytest.fixture(scope="module")
def net_stats():
    import aqr

    torch.manual_seed(0)
    net = _bn_net()
    return net, aqr.calibrate(net, [torch.rand(16, 3, 12, 12) for _ in range(2)], progress=False)


@pytest.mark.parametrize("target, option", [("stream", {"balance": 0.5}), ("batch", {"groups": 8}),
                                            ("stream", {"own_batch": False}), ("batch", {"class_horizon": 8.0}),
                                            ("stream", {"recent_horizon": 16.0})])
def test_robust_options_on_another_target_are_refused(net_stats, target, option):
    import aqr

    net, stats = net_stats
    (name, value), = option.items()
    with pytest.raises(ValueError, match=rf"{name}={value!r}.*target={target!r}"):
        aqr.AQR(net, stats, target=target, **option)
    aqr.AQR(net, stats, target=target, **{name: aqr.AQRConfig.__dataclass_fields__[name].default})  # the default: fine


@pytest.mark.parametrize("option", [{"estimator": "knot-ema"}, {"horizon": 64.0}, {"tail_window": 32},
                                    {"rebuild_every": 4}, {"stream_grid": 256}])
def test_stream_options_on_the_batch_target_are_refused(net_stats, option):
    import aqr

    net, stats = net_stats
    (name, value), = option.items()
    with pytest.raises(ValueError, match=rf"{name}={value!r}.*target='batch' would ignore"):
        aqr.AQR(net, stats, **option)
    for target in ("stream", "robust"):  # the running targets read them
        aqr.AQR(net, stats, target=target, **option)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64])
def test_integer_images_get_a_clear_error(net_stats, dtype):
    import aqr

    net, stats = net_stats
    x = torch.randint(0, 256, (4, 3, 12, 12), dtype=dtype)
    for adapter in (aqr.AQR(net, stats), aqr.AQR(net, stats, target="stream")):
        with pytest.raises(TypeError, match=rf"{dtype}.*float images.*x\.float\(\) / 255"):
            adapter(x)
    with torch.no_grad():
        assert aqr.AQR(net, stats)(x.float() / 255).shape == (4, 3)
