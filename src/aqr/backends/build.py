"""Building and loading aqr's C kernels with the system C compiler, on first use.

A library is its kernels' source files linked with ``_parallel.c`` (the thread team, declared with
what else the kernels share in ``_shared.h``): :func:`load` builds the per-batch kernels
(``_kernels.c``), :func:`load_library` any other set of sources (streaming AQR's kernels,
:mod:`aqr.adapt.stream.native_kernels`). Each library is cached under ``$AQR_CACHE_DIR`` (default
``~/.cache/aqr``), named by a hash of its sources, the shared header, the compiler command and the
flags, beside a build stamp (its size and SHA-256, written after it): a cached library that does not
match its stamp (cut short, or another build copied under its name) is rebuilt before it is loaded, since
loading a damaged library can crash the process. The cache folder is created ``0700``; a folder, library or
stamp another user could have written (not owned by this user, or writable by group or others) is never
loaded from: the library is rebuilt (in a private folder of the process where the folder is not this
user's alone), with one warning. Without a working compiler, or where a library still
does not load or lacks an entry point, :func:`load_kernels` says why, and the fast path runs through torch
instead. Parallel work runs on the OpenMP team torch itself uses (:func:`openmp_entry_points`). Where the
CPU has AVX-512, loading a library times its table lookups both ways and keeps the faster
(:func:`wide_lookup`); both give the same results.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from aqr.backends import layout
from aqr.util.files import atomic_write, sha256_file
from aqr.util.ownership import UntrustedPathError, keep_private, private_folder, untrusted_reason

HERE = Path(__file__).parent
SOURCE = HERE / "_kernels.c"  # the per-batch kernels
PARALLEL = HERE / "_parallel.c"  # the thread team, linked into every library
HEADER = HERE / "_shared.h"  # included by every source: part of each build's hash
_P = ctypes.c_void_p


def cache_dir() -> Path:
    """Where built kernels are kept: ``$AQR_CACHE_DIR``, else ``$XDG_CACHE_HOME/aqr`` or ``~/.cache/aqr``."""
    if os.environ.get("AQR_CACHE_DIR"):
        return Path(os.environ["AQR_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aqr"


def compiler() -> list[str] | None:
    """The C compiler to use (``$CC``, else ``cc``, ``gcc`` or ``clang`` on the path), or ``None``."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    return None if cc is None else cc.split()


def compile_command(extra_flags: Sequence[str] = (), simd: bool = True) -> list[str] | None:
    """The compiler invocation (without output and source), or ``None`` when no C compiler is found.

    ``extra_flags`` come last (a sanitizer build passes ``-fsanitize=...`` and ``-O1``); ``simd``
    adds ``-mavx2 -mfma`` where torch itself runs AVX2 code.
    """
    cc = compiler()
    if cc is None:
        return None
    # -ffp-contract=off: no fused multiply-adds, so the table's float32 arithmetic matches torch's
    flags = ["-O3", "-shared", "-fPIC", "-pthread", "-ffp-contract=off"]
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")()
    if simd and platform.machine().lower() in ("x86_64", "amd64") and capability.startswith("AVX"):
        flags += ["-mavx2", "-mfma"]
    return [*cc, *flags, *extra_flags]


def library_path(command: list[str], name: str = "aqr_kernels", sources: Sequence[Path] = (SOURCE,)) -> Path:
    """Where :func:`build_library` keeps ``sources`` built with ``command``: named by a hash of the
    sources, the thread team, the shared header and the command."""
    text = b"".join(path.read_bytes() for path in (*sources, PARALLEL, HEADER))
    digest = hashlib.sha256(text + " ".join(command).encode()).hexdigest()[:16]
    return cache_dir() / f"{name}_{digest}.so"


def stamp_path(library: Path) -> Path:
    """The build stamp beside a cached library: its size and SHA-256, written once it is in place."""
    return library.with_name(library.name + ".stamp")


def file_stamp(path: Path) -> dict[str, int | str]:
    """What a build stamp records of ``path``."""
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def verified(library: Path) -> bool:
    """Whether ``library`` is the whole file its build stamp records (same size and SHA-256)."""
    try:
        stamp = json.loads(stamp_path(library).read_text())
        return isinstance(stamp, dict) and stamp == file_stamp(library)
    except (OSError, ValueError):
        return False


def private_cache(folder: Path) -> Path:
    """``folder`` made (``0700``) or checked as this user's alone; where it is not, a private folder of this
    process instead (with one warning), so no library another user could have placed there is loaded."""
    try:
        return private_folder(folder)
    except UntrustedPathError as err:
        return _fallback_cache(str(err))


@functools.lru_cache(maxsize=None)
def _fallback_cache(reason: str) -> Path:
    warnings.warn(f"aqr's kernel cache is not used: {reason}; the kernels are built in a private folder of "
                  "this process instead", stacklevel=5)
    return Path(tempfile.mkdtemp(prefix="aqr-kernels-"))


def trusted(library: Path) -> bool:
    """Whether ``library`` and its stamp are this user's alone and match (:func:`verified`); one warning
    names a file that exists but another user could have written."""
    for path in (library, stamp_path(library)):
        try:
            reason = untrusted_reason(path)
        except OSError:
            return False
        if reason is not None:
            if reason not in _WARNED:
                _WARNED.add(reason)
                warnings.warn(f"aqr does not load a kernel library another user could have written ({reason}); "
                              "it builds it again", stacklevel=5)
            return False
    return verified(library)


def build_library(command: list[str], name: str = "aqr_kernels", sources: Sequence[Path] = (SOURCE,)) -> Path:
    """Compile ``sources`` and the thread team with ``command`` into the cache (once per sources and
    command); returns the library.

    ``name`` starts the cached file's name (a sanitizer build is kept apart from the normal one). A
    cached library that does not match its build stamp (:func:`verified`), or that another user could
    have written (:func:`trusted`), is built again; a cache folder that is not this user's alone is not
    used (:func:`private_cache`).
    """
    files = (*sources, PARALLEL)
    target = library_path(command, name, sources)
    target = private_cache(target.parent) / target.name
    if trusted(target):
        return target
    stamp: dict[str, int | str] = {}

    def compile_into(tmp: Path) -> None:
        done = subprocess.run([*command, "-I", str(HERE), "-o", str(tmp), *map(str, files), "-lm"],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise OSError(f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}")
        stamp.update(file_stamp(tmp))

    # built beside the target and renamed: processes building at once never see a partial file; the
    # stamp comes last, so a library without one (a build cut short) is never trusted
    atomic_write(target, compile_into, suffix=".so")
    keep_private(target)  # whatever the umask: a group-writable library would be refused next time
    atomic_write(stamp_path(target), lambda tmp: tmp.write_text(json.dumps(stamp)), suffix=".stamp")
    keep_private(stamp_path(target))
    return target


def try_load(loader: Callable[[list[str]], ctypes.CDLL]) -> tuple[ctypes.CDLL | None, str]:
    """``loader`` run with the default compiler command, or ``None`` and the reason it could not be."""
    command = compile_command()
    if command is None:
        return None, "no C compiler found (set CC)"
    try:
        return loader(command), ""
    except (OSError, subprocess.SubprocessError) as err:
        return None, str(err)
    except AttributeError as err:  # a library that loads without an entry point: not the build its name says
        return None, f"{err}; delete it to rebuild"


@functools.lru_cache(maxsize=None)
def load_kernels() -> tuple[ctypes.CDLL | None, str]:
    """The loaded per-batch kernels (built on first use), or ``None`` and the reason they are unavailable."""
    return try_load(load)


def load_library(command: list[str], name: str, sources: Sequence[Path]) -> ctypes.CDLL:
    """Build ``sources`` with ``command`` (cached as ``name``) and load them, on torch's OpenMP team if found.

    ``lib.structs`` holds the library's descriptor structs (:func:`aqr.backends.layout.read_layouts`:
    a library whose layout table disagrees with ctypes is refused with :class:`~aqr.backends.layout.LayoutError`).
    """
    lib = ctypes.CDLL(str(build_library(command, name, sources)))
    lib.structs = layout.read_layouts(lib)
    lib.aqr_use_openmp.argtypes = [_P, _P, _P]
    team = openmp_entry_points()
    if team is not None:
        lib.aqr_use_openmp(*team)
    lib.aqr_set_lookup.argtypes = [ctypes.c_int]
    lib.aqr_set_lookup.restype = lib.aqr_choose_lookup.restype = ctypes.c_int
    lib.aqr_choose_lookup()  # the faster of the table lookups on this CPU (same results): about 1 ms
    return lib


def wide_lookup(lib: ctypes.CDLL) -> bool:
    """Whether ``lib``'s maps use AVX-512's gathers (chosen where they were faster when it was loaded)."""
    return bool(lib.aqr_set_lookup(-1))


def load(command: list[str], name: str = "aqr_kernels") -> ctypes.CDLL:
    """Build the per-batch kernels with ``command`` (cached as ``name``), load them and declare their entry points."""
    lib = load_library(command, name, (SOURCE,))
    # the batch's arrays (x, then y where there is one), the folded affine step, then the outputs and the threads
    layout.declare(lib, lib.structs, "aqr_subset_quantiles", "aqr_sample", _P, _P, _P, _P, _P, _P, ctypes.c_int)
    layout.declare(lib, lib.structs, "aqr_table_map", "aqr_map", _P, _P, _P, _P, ctypes.c_int)
    layout.declare(lib, lib.structs, "aqr_recalibrate", "aqr_recalibration", _P, _P, _P, _P, ctypes.c_int)
    return lib


def openmp_entry_points() -> tuple[int, int, int] | None:
    """Addresses of ``GOMP_parallel``, ``omp_get_thread_num`` and ``omp_get_num_threads`` in the
    OpenMP runtime this process has loaded (torch's), or ``None`` (then the kernels use pthreads).

    Running on torch's own team matters: its workers spin after every torch op, and threads of
    our own would fight them for the cores (2x slower on a 2-core machine).
    """
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith((".so", ".so.1", ".so.5"))}
    except OSError:
        return None
    for path in sorted(paths):
        if Path(path).name.split(".")[0].split("-")[0] in ("libgomp", "libomp", "libiomp5"):
            try:
                rt = ctypes.CDLL(path)  # already loaded: the same instance
                names = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")
                return tuple(ctypes.cast(getattr(rt, n), ctypes.c_void_p).value for n in names)  # type: ignore[return-value]
            except (OSError, AttributeError):
                continue
    return None


def native_kernels() -> ctypes.CDLL | None:
    """aqr's per-batch C kernels, or ``None`` (warning once with the reason) when they cannot be built."""
    lib, reason = load_kernels()
    return warned(lib, reason)


def warned(lib: ctypes.CDLL | None, reason: str) -> ctypes.CDLL | None:
    """``lib``; where it is ``None``, a warning with ``reason`` first (once per reason: a missing compiler
    is reported once for every library)."""
    if lib is None and reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"aqr's C kernels are unavailable ({reason}); the fast path runs through torch", stacklevel=4)
    return lib


_WARNED: set[str] = set()
