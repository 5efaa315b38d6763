"""How much memory a run may still take, so that a run too large for the machine is refused before it
allocates instead of being killed by the kernel half-way (and taking other jobs with it)."""

from __future__ import annotations

import resource
from pathlib import Path

MEMINFO = Path("/proc/meminfo")
STATUS = Path("/proc/self/status")


def _meminfo_kib(path: Path, field: str) -> int | None:
    """The value of ``field`` (in kiB) in a ``/proc`` file of ``name: value kB`` lines, or ``None``."""
    try:
        for line in path.read_text().splitlines():
            name, _, rest = line.partition(":")
            if name.strip() == field:
                return int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_bytes(meminfo: Path = MEMINFO, status: Path = STATUS) -> int | None:
    """Bytes this process may still allocate: the kernel's MemAvailable, or less where an address-space
    limit (``RLIMIT_AS``) is set; ``None`` where neither can be read (then nothing is refused)."""
    limits = []
    kib = _meminfo_kib(meminfo, "MemAvailable")
    if kib is not None:
        limits.append(kib * 1024)
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        used = _meminfo_kib(status, "VmSize")
        limits.append(max(0, soft - (used or 0) * 1024))
    return min(limits) if limits else None


def human_bytes(n: float) -> str:
    """``n`` bytes as a short text in binary units (``'1.5 GiB'``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop returns


def check_memory(needed: int, what: str, available: int | None = None) -> None:
    """Raise ``MemoryError`` naming both numbers when ``needed`` bytes exceed what is available
    (:func:`available_bytes` unless ``available`` is given)."""
    if available is None:
        available = available_bytes()
    if available is not None and needed > available:
        raise MemoryError(f"{what} needs about {human_bytes(needed)} of memory, but only {human_bytes(available)} "
                          "is available; lower it or free memory first")
