"""What a checkpoint may record of the run that made it: nothing of the machine's folders.

A training command or config names the folders of the machine that ran it (temporary and home
folders), which mean nothing elsewhere and should not be published with a checkpoint. Paths are
recorded relative to the working folder when they lie inside it, else by their file name.
"""

from __future__ import annotations

import os
import shlex
from typing import Any

#: the train_config fields that hold paths
PATH_FIELDS = ("data", "test", "out", "work_dir", "init")


def portable_path(path: str | os.PathLike[str] | None, cwd: str | os.PathLike[str] | None = None) -> str | None:
    """``path`` relative to ``cwd`` (default: the working folder) when it lies inside it, else its file name."""
    if path is None:
        return None
    text = os.fspath(path)
    if not os.path.isabs(text):
        return os.path.normpath(text) if not text.startswith("..") else os.path.basename(text.rstrip("/"))
    base = os.path.abspath(cwd if cwd is not None else os.getcwd())
    full = os.path.abspath(text)
    if os.path.commonpath([base, full]) == base and full != base:
        return os.path.relpath(full, base)
    return os.path.basename(full.rstrip("/"))


def portable_command(command: str) -> str:
    """``command`` with every path argument cut to its file name: a recorded command names the
    folders of the machine that ran it, which mean nothing elsewhere."""
    try:
        words = shlex.split(command)
    except ValueError:  # unbalanced quotes: not a command we wrote
        return command
    return shlex.join(os.path.basename(w.rstrip("/")) if "/" in w and not w.startswith("{") else w for w in words)


def portable_train_config(config: dict[str, Any], cwd: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """A train config with its paths made portable (:func:`portable_path`) and its command cut
    (:func:`portable_command`)."""
    out = dict(config)
    for key in PATH_FIELDS:
        if isinstance(out.get(key), str):
            out[key] = portable_path(out[key], cwd)
    if isinstance(out.get("command"), str):
        out["command"] = portable_command(out["command"])
    return out
