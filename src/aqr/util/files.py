"""File helpers: content hashes and writes that readers never see half done."""

from __future__ import annotations

import functools
import hashlib
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path


def sha256_file(path: str | os.PathLike[str], chunk_size: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in chunks (constant memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_size):
            digest.update(block)
    return digest.hexdigest()


def sha256_cached(path: str | os.PathLike[str]) -> str:
    """:func:`sha256_file`, memoised in-process by (path, size, mtime): a rewritten file is hashed again."""
    p = Path(path)
    st = p.stat()
    return _sha256_of_version(str(p.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _sha256_of_version(path: str, size: int, mtime_ns: int) -> str:
    return sha256_file(path, chunk_size=1 << 22)


class WriteTargetError(ValueError):
    """A path given to write to is something else: a folder, a device, a FIFO, a socket, or lies under a file."""


def _kind(mode: int) -> str:
    """What a file of ``mode`` is, in words (``stat.S_IFMT``)."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISREG, "a regular file")):
        if test(mode):
            return name
    return "not a regular file"


def check_writable_target(path: str | os.PathLike[str], *, folder: bool = False, label: str | None = None) -> Path:
    """Return ``path`` when it can be written as a file (with ``folder``: made or filled as a folder) without
    replacing anything else; raise :class:`WriteTargetError` (one line, naming ``label`` and ``path``) when it
    exists and is not a regular file (a folder), or when one of its parents exists and is not a folder.

    Links are followed: a link to a device or a folder is refused like the device or the folder. Missing
    parents are fine (the writers make them). Every writer calls this before it writes (:func:`atomic_write`
    does), and the commands call it before any work.
    """
    target = Path(path)
    name = f"{label} {target}" if label else str(target)
    try:
        mode: int | None = target.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):  # missing, or under a file (found below)
        mode = None
    if mode is not None:
        if folder and not stat.S_ISDIR(mode):
            raise WriteTargetError(f"{name} is {_kind(mode)}, not a folder; give a folder to write into")
        if not folder and stat.S_ISDIR(mode):
            raise WriteTargetError(f"{name} is a folder; give a file name")
        if not folder and not stat.S_ISREG(mode):
            raise WriteTargetError(f"{name} is {_kind(mode)}, not a regular file; refusing to replace it")
        return target
    for parent in target.parents:
        try:
            parent_mode = parent.stat().st_mode
        except OSError:
            continue  # missing (made when written), or itself under a file (found further up)
        if not stat.S_ISDIR(parent_mode):
            raise WriteTargetError(f"{name}: {parent} is {_kind(parent_mode)}, not a folder")
        break  # the nearest existing parent is a folder: the rest above it are folders too
    return target


def current_umask() -> int:
    """The process's umask, read from ``/proc/self/status`` where Linux gives it: setting and restoring
    it (the portable way) would leave it 0 for a moment in every other thread."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o077)  # the portable way, set to the safe side for the moment it is changed
    os.umask(umask)
    return umask


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], object], suffix: str = ".tmp") -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it to ``path``.

    Readers (and processes writing at once) see the old file or the whole new one, never part of
    one; after an error nothing is left behind. ``suffix`` ends the temporary name (``np.savez``
    appends ``.npz`` to names without it). The file gets the usual permissions (umask applied).
    A ``path`` that exists and is not a regular file (a device, a FIFO, a folder) is refused with
    :class:`WriteTargetError` (:func:`check_writable_target`) rather than replaced.
    """
    path = check_writable_target(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        # after the writer (safetensors writes its files private too), not before: mkstemp's file is private
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
