"""aqr's C kernels on hostile input: the issue-14 crash, a property test against the torch backend,
and the same property test under AddressSanitizer and UBSan."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import aqr
from aqr.backends import build
from tests.native_fuzz import fuzz

LIB, WHY = build.load_kernels()
needs_kernels = pytest.mark.skipif(LIB is None, reason=f"aqr's C kernels unavailable: {WHY}")
HERE = Path(__file__).parent
SANITIZER_FLAGS = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined,float-cast-overflow",
                   "-fno-sanitize-recover=all"]


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
def test_native_kernels_equal_the_torch_backend_on_extreme_values():
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


def _sanitizer_runtime() -> str | None:
    """The compiler's AddressSanitizer runtime library, or None when the compiler has none."""
    cc = build.compiler()
    if cc is None:
        return None
    try:
        path = subprocess.run([*cc, "-print-file-name=libasan.so"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.slow
@needs_kernels
def test_fuzz_under_address_and_undefined_behaviour_sanitizers():
    runtime = _sanitizer_runtime()
    if runtime is None:
        pytest.skip("the C compiler has no AddressSanitizer runtime (libasan.so)")
    try:  # built here, so a compiler without -fsanitize support skips instead of failing
        build.build_library(build.compile_command(SANITIZER_FLAGS, simd=False), name="aqr_kernels_sanitized")
        build.build_library(build.compile_command(SANITIZER_FLAGS), name="aqr_kernels_sanitized")
    except OSError as err:
        pytest.skip(f"the C compiler cannot build with sanitizers: {str(err)[-300:]}")
    done = subprocess.run(
        [sys.executable, str(HERE / "native_fuzz.py"), "150", *SANITIZER_FLAGS], capture_output=True, text=True,
        timeout=900, cwd=HERE,
        # Python and torch keep memory until exit by design: leaks are not what this looks for
        env={**os.environ, "LD_PRELOAD": runtime, "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
             "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1", "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    report = done.stderr[-4000:]
    assert "Sanitizer" not in done.stderr and "runtime error" not in done.stderr, report
    assert done.returncode == 0 and "sanitized fuzz passed" in done.stdout, report
