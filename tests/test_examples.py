"""The scripts in examples/ run as a user would run them (this checkout's aqr, a few seconds each on a CPU)
and show what they promise: saved statistics and a saved stream state reproduce the outputs, and AQR
recovers accuracy on the examples' shifted synthetic data."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(script: str, *args: str) -> str:
    path = EXAMPLES / script
    if not path.is_file():
        pytest.skip(f"examples/{script} is not in this checkout")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")  # tiny models: one thread is fastest, and 3-6x faster than two on a busy machine
    done = subprocess.run([sys.executable, str(path), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def test_every_example_is_tested() -> None:
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts == ["compare_methods.py", "service_loop.py", "wrap_your_model.py"]


def test_wrap_your_model(tmp_path: Path) -> None:
    out = _run("wrap_your_model.py", "--out", str(tmp_path))
    for norm in ("bn", "gn"):
        assert f"{norm}: saved and loaded statistics give the same outputs: True" in out, out
        found = re.search(rf"^{norm}: shifted test accuracy ([\d.]+) % without AQR, ([\d.]+) % with AQR$", out, re.M)
        assert found, out
        assert float(found.group(2)) > float(found.group(1)) + 5, out
        assert (tmp_path / f"cnn_{norm}.pt").is_file() and (tmp_path / f"cnn_{norm}.aqr.safetensors").is_file()
    assert re.search(r"^gn: 3 layers recalibrated", out, re.M), out  # two GroupNorms and the LayerNorm


def test_service_loop_resumes_bit_for_bit() -> None:
    out = _run("service_loop.py", "--images", "32")
    assert "served 32 requests at batch 1; state saved after 16" in out, out
    assert "resumed outputs match the uninterrupted run: True" in out, out
    assert "a cold restart (no saved state) differs from it: True" in out, out  # the saved state mattered


def test_compare_methods() -> None:
    out = _run("compare_methods.py", "--methods", "source,ttn,tent,aqr,aqr-stream", "--batch-size", "32")
    scores = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+)\s+([\d.]+)%\s+[\d.]+$", out, re.M)}
    assert list(scores) == ["source", "ttn", "tent", "aqr", "aqr-stream"], out
    assert scores["aqr"] > scores["source"] + 5 and scores["aqr-stream"] > scores["source"] + 5, out
