"""benchmarks/gpu_check.py: its steps in the issue's order, its arguments checked, a clean refusal without CUDA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_the_dry_run_lists_the_steps_in_the_issues_order() -> None:
    done = run("--dry-run", "--out", "x/check.json")
    assert done.returncode == 0, done.stderr
    names = [line.split(":", 1)[0] for line in done.stdout.splitlines()]
    assert names == ["triton-tests", "fp32-batch64", "stream-tests", "stream-targets", "other-rows"]
    assert "x/check_fp32-batch64.json" in done.stdout and "--compiled" in done.stdout


def test_an_unknown_step_is_named() -> None:
    done = run("--only", "triton-tests", "warp-speed", "--dry-run")
    assert done.returncode == 2 and "unknown step(s) warp-speed" in done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_it_refuses_in_one_line(tmp_path: Path) -> None:
    done = run("--out", str(tmp_path / "check.json"))
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0
    assert "needs a CUDA GPU" in done.stderr and not (tmp_path / "check.json").exists()
