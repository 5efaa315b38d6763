"""aqr's C kernels on hostile input: the issue-14 crash, a property test against the torch backend,
and the same property test under AddressSanitizer and UBSan."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aqr.backends import build
from tests.native_fuzz import fuzz, has_wide_lookup, lookup
from tests.sanitized import run_sanitized

LIB, WHY = build.load_kernels()
needs_kernels = pytest.mark.skipif(LIB is None, reason=f"aqr's C kernels unavailable: {WHY}")
HERE = Path(__file__).parent


def _run(code: str, env: dict[str, str] | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run Python ``code`` in a fresh process (a crash there fails the test instead of killing pytest)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, cwd=HERE)


@needs_kernels
def test_a_channel_spanning_more_than_float_max_does_not_crash():
    """The issue's reproduction: a range of 4e38 overflowed to inf, the bucket became INT_MIN."""
    done = _run("""
import torch, aqr
from torch import nn
torch.manual_seed(0)
m = nn.Sequential(nn.BatchNorm1d(4), nn.Linear(4, 2)).eval()
s = aqr.calibrate(m, [torch.randn(64, 4)])
x = torch.randn(32, 4); x[0], x[1] = 2e38, -2e38
native, torch_path = aqr.AQR(m, s)(x), aqr.AQR(m, s, native=False, compile=False)(x)
assert torch.isfinite(native).all(), native
torch.testing.assert_close(native, torch_path, rtol=1e-5, atol=1e-5)
print("ok")
""")
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("wide", [False, True], ids=["avx2-loads", "avx512-gathers"])
def test_native_kernels_equal_the_torch_backend_on_extreme_values(wide):
    if wide and not has_wide_lookup(LIB):
        pytest.skip("this CPU (or build) has no AVX-512 lookups")
    with lookup(LIB, wide):
        fuzz(LIB, examples=250)


@needs_kernels
def test_rejected_arguments_raise_instead_of_reading_out_of_bounds():
    from aqr.backends import SubsetCache, native

    x = torch.randn(4, 3, 20)
    positions = SubsetCache(100).positions(x)
    with pytest.raises(native.NativeKernelError, match="out of bounds"):
        native.subset_quantiles(LIB, x, positions + 3 * 20, 11)  # positions of channel 1 and beyond the end
    with pytest.raises(native.NativeKernelError, match="out of bounds"):
        native.subset_quantiles(LIB, x, positions[:0], 11)  # no sample at all


@pytest.mark.slow
@needs_kernels
def test_fuzz_under_address_and_undefined_behaviour_sanitizers():
    run_sanitized("native_fuzz.py", 150, "sanitized fuzz passed")
