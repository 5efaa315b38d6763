"""Running a fuzz script against aqr's C kernels built under AddressSanitizer and UBSan, in a subprocess
(a crash there fails the test instead of killing pytest)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from aqr.backends import build

HERE = Path(__file__).parent
SANITIZER_FLAGS = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined,float-cast-overflow",
                   "-fno-sanitize-recover=all"]


def sanitizer_runtime() -> str | None:
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


def run_sanitized(script: str, examples: int, passed: str) -> None:
    """Run ``tests/<script> EXAMPLES FLAGS...`` (which builds the kernels with the flags it is given) under
    the sanitizers; skip where the compiler has no sanitizer runtime or cannot build with them, fail on
    any sanitizer report or unless the script printed ``passed``."""
    runtime = sanitizer_runtime()
    if runtime is None:
        pytest.skip("the C compiler has no AddressSanitizer runtime (libasan.so)")
    try:  # built here, so a compiler without -fsanitize support skips instead of failing
        build.build_library(build.compile_command(SANITIZER_FLAGS, simd=False), name="aqr_kernels_sanitized")
        build.build_library(build.compile_command(SANITIZER_FLAGS), name="aqr_kernels_sanitized")
    except OSError as err:
        pytest.skip(f"the C compiler cannot build with sanitizers: {str(err)[-300:]}")
    done = subprocess.run(
        [sys.executable, str(HERE / script), str(examples), *SANITIZER_FLAGS], capture_output=True, text=True,
        timeout=900, cwd=HERE,
        # Python and torch keep memory until exit by design: leaks are not what this looks for
        env={**os.environ, "LD_PRELOAD": runtime, "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
             "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1", "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    report = done.stderr[-4000:]
    assert "Sanitizer" not in done.stderr and "runtime error" not in done.stderr, report
    assert done.returncode == 0 and passed in done.stdout, report
