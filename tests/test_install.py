"""A plain (non-editable) ``pip install`` of the repository works outside it: the zoo, the C kernels'
source and py.typed travel as package data, and the metadata carries the MIT license and its file."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import importlib.resources, sys, torch
import aqr
assert "site-packages" in aqr.__file__ and aqr.__file__.startswith(sys.prefix), aqr.__file__  # the venv's own copy
for package, name in (("aqr.backends", "_kernels.c"), ("aqr.backends", "_parallel.c"), ("aqr.backends", "_shared.h"),
                      ("aqr.adapt.stream", "_stream_kernels.c")):
    assert importlib.resources.files(package).joinpath(name).is_file(), name
assert importlib.resources.files("aqr").joinpath("py.typed").is_file()  # PEP 561
import importlib.metadata
dist = importlib.metadata.distribution("aqr")
assert dist.metadata["License-Expression"] == "MIT", dict(dist.metadata)
license_files = [f for f in dist.files if f.name == "LICENSE"]  # the wheel's dist-info carries the file
assert license_files and "MIT License" in license_files[0].read_text(), dist.files
model = aqr.models.load("resnet20_gn")
stats = aqr.calibrate(model, [torch.rand(16, 3, 32, 32)], compile=False)
out = aqr.AQR(model, stats, compile=False)(torch.rand(8, 3, 32, 32))
assert out.shape == (8, 10) and bool(torch.isfinite(out).all())
out = aqr.AQR(model, stats, compile=False, target="stream")(torch.rand(8, 3, 32, 32))  # the stream kernels build
assert out.shape == (8, 10) and bool(torch.isfinite(out).all())
from aqr.adapt.stream.native_kernels import load_stream_kernels
from aqr.backends.build import load_kernels
for lib, why in (load_kernels(), load_stream_kernels()):  # the installed sources build (where there is a compiler)
    assert lib is not None or "no C compiler" in why, why
print("ok", sorted(aqr.models.zoo()))
"""


@pytest.mark.slow
def test_a_plain_install_loads_a_zoo_model_from_outside_the_repository(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "AQR_ZOO", "VIRTUAL_ENV")}
    env["AQR_CACHE_DIR"] = str(tmp_path / "kernels")

    def run(args: list[str]) -> subprocess.CompletedProcess:
        done = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return done

    # the dependencies are this interpreter's (torch, numpy, safetensors, tqdm: copying torch into the venv
    # took most of the test's minute); a path line in a .pth file adds the directory without running its
    # own .pth files, so an editable aqr installed there stays out of sight
    deps = Path(torch.__file__).resolve().parents[1]
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "_test_dependencies.pth").write_text(f"{deps}\n")
    run([*pip, "--no-deps", str(REPO)])
    assert run([python, "-c", SCRIPT]).stdout.split() == ["ok", "['resnet20_bn',", "'resnet20_gn',", "'vit_ln']"]
