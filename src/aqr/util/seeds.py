"""The range of seeds aqr takes: what torch's and numpy's generators hold, with room for the small offsets
the methods add (``seed + batch``)."""

from __future__ import annotations

import numbers

MAX_SEED = 2**63 - 1  # torch.manual_seed takes up to 2**64 - 1; beyond, "Overflow when unpacking long long"


def check_seed(seed: object, name: str = "seed") -> int:
    """``seed`` as an int when it is an integer in ``[0, MAX_SEED]``; ``ValueError`` naming ``name`` otherwise
    (a bool, a float such as ``1e23``, a negative or too large integer)."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"{name} must be an integer in [0, 2**63 - 1], got {seed!r}")
    return int(seed)
