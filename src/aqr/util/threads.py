"""Torch's CPU thread count, set for a block of code and restored after it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


MAX_THREADS = 1024  # more torch threads than any machine's cores; 100,000 kills the process inside libgomp


def check_threads(n: object) -> None:
    """Raise ``ValueError`` unless ``n`` is ``None`` or an integer in ``[0, MAX_THREADS]`` (0: torch's default)."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_THREADS):
        raise ValueError(f"the number of threads must be an integer in [1, {MAX_THREADS}] (0: torch's default), "
                         f"got {n!r}")


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Within the block torch uses ``n`` CPU threads (unchanged for ``None`` or 0); restored after."""
    import torch

    check_threads(n)
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
