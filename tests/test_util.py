"""aqr.util: the file helpers (one SHA-256, one atomic write) and the plot helpers."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

import pytest

from aqr.util.files import atomic_write, sha256_cached, sha256_file


def test_sha256_file_reads_in_chunks(tmp_path: Path) -> None:
    data = os.urandom(3 * 1024 + 17)
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    assert sha256_file(path, chunk_size=1000) == hashlib.sha256(data).hexdigest()


def test_cached_hash_follows_a_rewritten_file(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"one")
    assert sha256_cached(path) == hashlib.sha256(b"one").hexdigest()
    path.write_bytes(b"three")  # another size: a new version
    assert sha256_cached(path) == hashlib.sha256(b"three").hexdigest()


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "out.txt"
    assert atomic_write(path, lambda tmp: tmp.write_text("first")) == path
    assert path.read_text() == "first"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask

    def fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, fail)
    assert path.read_text() == "first" and sorted(p.name for p in path.parent.iterdir()) == ["out.txt"]
