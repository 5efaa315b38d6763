"""Folders and files only this user can change: what aqr loads code or cached data from.

A library in a kernel cache runs its constructors when it is loaded, and a cached statistics file is
read as it is; either one, planted by another user, would run or feed that user's content. So such a
folder is created ``0700`` and, like each file in it, trusted only when it is owned by this user and not
writable by group or others (:func:`untrusted_reason`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UntrustedPathError(Exception):
    """A folder or file another user could have written (its message says which and why)."""


def untrusted_reason(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` could hold another user's content, or ``None`` where only this user (or root over a
    file of this user's) can have written it: the path itself (a symbolic link too) and what it leads to
    must be owned by this user and not writable by group or others."""
    path = Path(path)
    uid = os.geteuid()
    for status in (os.lstat(path), os.stat(path)):
        if status.st_uid != uid:
            return f"{path} is owned by uid {status.st_uid}, not by this user (uid {uid})"
        if not stat.S_ISLNK(status.st_mode) and status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{path} is writable by group or others (mode {stat.S_IMODE(status.st_mode):o})"
    return None


def private_folder(path: str | os.PathLike[str]) -> Path:
    """``path`` as a folder only this user can change: created with mode ``0700`` where missing (its parents
    as ``mkdir -p`` makes them); an existing one that is not this user's alone raises
    :class:`UntrustedPathError`."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    reason = untrusted_reason(path)
    if reason is not None:
        raise UntrustedPathError(reason)
    if not path.is_dir():
        raise UntrustedPathError(f"{path} is not a folder")
    return path


def keep_private(path: str | os.PathLike[str]) -> Path:
    """Clear the group and others' write bits of ``path`` (a file this user just wrote, whatever the umask)."""
    path = Path(path)
    os.chmod(path, stat.S_IMODE(os.stat(path).st_mode) & ~(stat.S_IWGRP | stat.S_IWOTH))
    return path
