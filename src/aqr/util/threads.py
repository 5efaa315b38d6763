"""Torch's CPU thread count, set for a block of code and restored after it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Within the block torch uses ``n`` CPU threads (unchanged for ``None`` or 0); restored after."""
    import torch

    if n is not None and n < 0:
        raise ValueError(f"the number of threads must be positive, got {n}")
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
