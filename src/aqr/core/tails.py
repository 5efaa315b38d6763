"""The names of the tail strategies and of the Average Sample Tails units, and their check.

Kept apart from the map itself (:mod:`aqr.core.qmap`) so that the command line can offer them
without importing torch.
"""

from __future__ import annotations

from typing import Literal

Tail = Literal["standard", "average", "none", "clip", "clip-source", "interval", "gaussian"]
TAILS: tuple[str, ...] = ("standard", "average", "none", "clip", "clip-source", "interval", "gaussian")
PARAMETRIC_TAILS: tuple[str, ...] = ("interval", "gaussian")  # the tails that read the batch's mean and std

TAIL_UNITS: tuple[str, ...] = ("values", "images")  # what one "batch of 100" of Average Sample Tails holds
DEFAULT_TAIL_UNIT = "images"


def check_tail(tail: object, name: str = "tail") -> None:
    """Raise ``ValueError`` naming ``name`` unless ``tail`` is one of :data:`TAILS`."""
    if tail not in TAILS:
        raise ValueError(f"unknown {name} strategy {tail!r}; expected one of {', '.join(TAILS)}")
