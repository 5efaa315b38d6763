"""File helpers: content hashes and writes that readers never see half done."""

from __future__ import annotations

import functools
import hashlib
import os
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


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], object], suffix: str = ".tmp") -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it to ``path``.

    Readers (and processes writing at once) see the old file or the whole new one, never part of
    one; after an error nothing is left behind. ``suffix`` ends the temporary name (``np.savez``
    appends ``.npz`` to names without it). The file gets the usual permissions (umask applied).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes the file private
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
