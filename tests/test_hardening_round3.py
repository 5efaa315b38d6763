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
