"""``torch.compile`` once per process for a function, with an eager fallback where compiling fails."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

_COMPILED: dict[Callable[..., object], Callable[..., object]] = {}  # compiled functions, shared by all callers


def compiled(fn: Callable[..., object], enabled: bool = True) -> Callable[..., object]:
    """``torch.compile(fn)`` once per process; ``fn`` itself when disabled or after a failed compile."""
    if not enabled:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return _COMPILED[fn]


def run_compiled(fn: Callable[..., object], enabled: bool, *args: object) -> object:
    """Call the compiled ``fn``; if compiling fails (no C++ compiler...), warn once and run it eagerly."""
    try:
        return compiled(fn, enabled)(*args)
    except Exception as err:
        if not enabled or _COMPILED.get(fn) is fn:
            raise
        warnings.warn(f"torch.compile failed ({type(err).__name__}: {err}); aqr runs {fn.__name__} eagerly", stacklevel=3)
        _COMPILED[fn] = fn
        return fn(*args)
