"""The fast path's C kernels on CPU (``_kernels.c``), built with the system C compiler on first use.

Two calls per layer replace the sort, the table and the compiled map of :mod:`aqr.backends.torch_backend`:

* :func:`subset_quantiles`: the quantiles of each channel's sampled positions, read from a
  histogram of ``S / 2`` equal-width buckets. Each inner knot is within one bucket width (and its
  rank within ``S / 256``) of the sorted sample's; a bucket holding more values than that (ties,
  outliers) is sorted, so its knots are exact, and samples of up to 512 values are sorted whole.
  p0 and p100 are the extremes of every value of the channel, as in the exact path.
* :func:`table_map`: builds each channel's lookup table and maps the channel while the table is
  in cache, one 64-bit gather per (slope, intercept) pair where the CPU has AVX2. An eval-mode
  BatchNorm's affine step can be folded into both calls (``pre``).

On ResNet-20 at batch 128 the two take about 45 ms per batch on 2 cores, against about 95 ms for
the compiled torch path (sort in numpy, table and map from inductor). Parallel work runs on the
OpenMP team torch itself uses (:func:`openmp_entry_points`).

The shared library is cached under ``$AQR_CACHE_DIR`` (default ``~/.cache/aqr``), named by a hash
of the source, the compiler command and the flags. Without a working compiler :func:`load_kernels`
says why, and the caller falls back to the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from aqr.core.qmap import quantile_levels

SOURCE = Path(__file__).with_name("_kernels.c")
_P = ctypes.c_void_p
_I = ctypes.c_int64


class NativeKernelError(RuntimeError):
    """A C kernel could not run (its scratch memory could not be allocated)."""


def cache_dir() -> Path:
    """Where built kernels are kept: ``$AQR_CACHE_DIR``, else ``$XDG_CACHE_HOME/aqr`` or ``~/.cache/aqr``."""
    if os.environ.get("AQR_CACHE_DIR"):
        return Path(os.environ["AQR_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "aqr"


def compile_command() -> list[str] | None:
    """The compiler invocation (without output and source), or ``None`` when no C compiler is found."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    # -ffp-contract=off: no fused multiply-adds, so the table's float32 arithmetic matches torch's
    flags = ["-O3", "-shared", "-fPIC", "-pthread", "-ffp-contract=off"]
    capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")()
    if platform.machine().lower() in ("x86_64", "amd64") and capability.startswith("AVX"):
        flags += ["-mavx2", "-mfma"]
    return [*cc.split(), *flags]


def _build(command: list[str]) -> Path:
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(command).encode()).hexdigest()[:16]
    target = cache_dir() / f"aqr_kernels_{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: processes building at once never see a partial file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([*command, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise OSError(f"{' '.join(command)} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


@functools.lru_cache(maxsize=None)
def load_kernels() -> tuple[ctypes.CDLL | None, str]:
    """The loaded kernels (built on first use), or ``None`` and the reason they are unavailable."""
    command = compile_command()
    if command is None:
        return None, "no C compiler found (set CC)"
    try:
        return load(command), ""
    except (OSError, subprocess.SubprocessError) as err:
        return None, str(err)


def load(command: list[str]) -> ctypes.CDLL:
    """Build the kernels with ``command`` (cached) and load them, on torch's OpenMP team if found."""
    lib = ctypes.CDLL(str(_build(command)))
    lib.aqr_subset_quantiles.argtypes = [_P, _I, _I, _I, _P, _P, _P, _I, _I, _P, _P, _I, _I, _P, _P, _P, ctypes.c_int]
    lib.aqr_table_map.argtypes = [_P, _P, _I, _I, _I, _P, _P, _P, _P, _I, ctypes.c_int, _P, _P, _P, _P, _P, _I, ctypes.c_int]
    lib.aqr_recalibrate.argtypes = [_P, _P, _I, _I, _I, _P, _P, _P, _I, _I, _P, _P, _I, _I, _P, ctypes.c_int, _P, _P, _P,
                                    _I, _P, _P, _P, ctypes.c_int]
    lib.aqr_use_openmp.argtypes = [_P, _P, _P]
    team = openmp_entry_points()
    if team is not None:
        lib.aqr_use_openmp(*team)
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


@functools.lru_cache(maxsize=64)
def _ranks(samples: int, num_quantiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Type-7 interpolation of ``samples`` sorted values at the K levels, as :func:`aqr.core.qmap.sorted_quantiles`."""
    pos = quantile_levels(num_quantiles) * (samples - 1)
    lo = pos.floor().long().clamp_(0, samples - 1)
    return lo, (pos - lo.to(pos.dtype)).float()


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


Affine = tuple[torch.Tensor, torch.Tensor]  # per-channel (scale, shift), float32 (C,): read scale * x + shift


def _ptr_or_null(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _affine_ptrs(pre: Affine | None) -> tuple[int | None, int | None]:
    return (None, None) if pre is None else (_ptr(pre[0]), _ptr(pre[1]))


def _histogram(samples: int) -> tuple[int, int]:
    """Buckets of the sample's histogram (two values each on average) and :func:`crowded_bucket`."""
    return max(16, samples // 2), crowded_bucket(samples)


def crowded_bucket(samples: int) -> int:
    """Buckets holding more sampled values than this are sorted rather than interpolated.

    ``samples / 256`` bounds the rank error of an interpolated order statistic at 0.4 % of the
    sample (a third of DKW's 95 % bound at 8,192 values); samples of up to 512 values are sorted
    whole, so small layers get exact quantiles, ties included.
    """
    return max(8, samples // 256) if samples > 512 else 0


def subset_quantiles(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    positions: torch.Tensor,
    num_quantiles: int,
    moments: bool = True,
    pre: Affine | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool]:
    """Quantiles ``(C, K)`` of ``x`` (A, C, B; float32, contiguous) at flat ``positions`` (S,) of channel 0.

    Channel ``c`` is read at ``positions + c * B`` (and transformed by ``pre`` first, if given);
    p0 and p100 are the extremes of all of the channel's values, as in the exact path. Also returns
    the sample's mean and std ``(C, 1)`` (``None`` unless ``moments``) and whether every value was
    finite (the knots of a channel that was not are NaN).
    """
    c, s = x.shape[1], positions.shape[0]
    rank_lo, frac = _ranks(s, num_quantiles)
    tq = torch.empty(c, num_quantiles)
    stats = torch.empty(c, 2) if moments else None
    finite = torch.empty(c, dtype=torch.int32)
    status = lib.aqr_subset_quantiles(
        _ptr(x), x.shape[0], c, x.shape[2], _ptr(positions), *_affine_ptrs(pre), s, num_quantiles, _ptr(rank_lo),
        _ptr(frac), *_histogram(s), _ptr(tq), _ptr_or_null(stats), _ptr(finite), torch.get_num_threads(),
    )
    if status != 0:
        raise NativeKernelError(f"aqr_subset_quantiles could not allocate scratch memory for {c} x {s} values")
    mean, std = (None, None) if stats is None else (stats[:, :1], stats[:, 1:])
    return tq, mean, std, bool(finite.all())


TAIL_CODES = {"standard": 0, "average": 0, "none": 1, "clip": 2, "interval": 3, "gaussian": 4}
PARAMETRIC_TAILS = ("interval", "gaussian")  # the tails that read the sample's mean and std
ROWS_LAYOUT_BELOW = 16  # as in _kernels.c: fewer values per (row, channel) count as channels-last


def _per_channel(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.reshape(-1).contiguous().float() for t in tensors]


def _tail_code(tail: str, moments: bool, loc: torch.Tensor | None, scale: torch.Tensor | None,
               z: tuple[float, float] | None) -> int:
    """The kernels' code for ``tail``, after checking that what it reads is given (a NULL would crash)."""
    if tail not in TAIL_CODES:
        raise ValueError(f"unknown tail strategy {tail!r}")
    if tail in PARAMETRIC_TAILS and (not moments or scale is None or (tail == "gaussian" and (loc is None or z is None))):
        raise ValueError(f'tail="{tail}" needs the sample mean and std and the source moments')
    return TAIL_CODES[tail]


def recalibrate(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    positions: torch.Tensor,
    sq: torch.Tensor,
    tail: str,
    cells: int,
    loc: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    z: tuple[float, float] | None = None,
    pre: Affine | None = None,
) -> tuple[torch.Tensor, bool]:
    """:func:`subset_quantiles` then :func:`table_map`, in one pass per channel (channel-major ``x``).

    A channel is mapped right after its quantiles, while its values are still in cache. Returns the
    mapped ``x`` and whether every value was finite; if not, the output's non-finite channels hold
    no values (they are never written).
    """
    a, c, b = x.shape
    if b < ROWS_LAYOUT_BELOW:
        raise ValueError(f"recalibrate takes channel-major layouts ({ROWS_LAYOUT_BELOW}+ values per row and channel), got {b}")
    code = _tail_code(tail, True, loc, scale, z)
    s, k = positions.shape[0], sq.shape[1]
    rank_lo, frac = _ranks(s, k)
    y = torch.empty_like(x)
    tq = torch.empty(c, k)
    moments = torch.empty(c, 2) if tail in PARAMETRIC_TAILS else None
    finite = torch.empty(c, dtype=torch.int32)
    sq = sq.contiguous().float()
    loc, scale = _per_channel(loc, scale)
    zs = None if z is None else torch.tensor(z, dtype=torch.float64)
    status = lib.aqr_recalibrate(
        _ptr(x), _ptr(y), a, c, b, _ptr(positions), *_affine_ptrs(pre), s, k, _ptr(rank_lo), _ptr(frac),
        *_histogram(s), _ptr(sq), code, _ptr_or_null(loc), _ptr_or_null(scale), _ptr_or_null(zs), cells,
        _ptr(tq), _ptr_or_null(moments), _ptr(finite), torch.get_num_threads(),
    )
    if status != 0:
        raise NativeKernelError(f"aqr_recalibrate could not allocate scratch memory for {c} x {s} values")
    return y, bool(finite.all())


def table_map(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    tq: torch.Tensor,
    sq: torch.Tensor,
    tail: str,
    cells: int,
    mean: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
    loc: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    z: tuple[float, float] | None = None,
    pre: Affine | None = None,
) -> torch.Tensor:
    """``x`` (A, C, B, float32, contiguous) mapped with each channel's ``cells``-cell table.

    As :func:`aqr.backends.torch_backend._map_sample` with the knots ``tq``/``sq`` (C, K) and the tail lines of
    :func:`aqr.core.qmap.tail_lines` (``mean``/``std`` of the sample, source ``loc``/``scale`` and the
    probits ``z`` are read by the parametric tails only). With ``pre``, maps ``scale * x + shift``.
    """
    a, c, b = x.shape
    code = _tail_code(tail, mean is not None and std is not None, loc, scale, z)
    y = torch.empty_like(x)
    tq, sq = tq.contiguous().float(), sq.contiguous().float()
    per_channel = _per_channel(mean, std, loc, scale)
    zs = None if z is None else torch.tensor(z, dtype=torch.float64)
    status = lib.aqr_table_map(
        _ptr(x), _ptr(y), a, c, b, *_affine_ptrs(pre), _ptr(tq), _ptr(sq), tq.shape[1], code,
        *map(_ptr_or_null, per_channel), _ptr_or_null(zs), cells, torch.get_num_threads(),
    )
    if status != 0:
        raise NativeKernelError(f"aqr_table_map could not allocate scratch memory for a {cells}-cell table")
    return y
