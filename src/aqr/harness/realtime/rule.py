"""The realtime protocol's rule: which batches of the stream a method costing ``C`` units per batch adapts on.

A batch arrives every time unit; the method takes the batch in front of it whenever it is free and is
then busy for ``C`` units (:mod:`aqr.harness.realtime`). This module depends on nothing of the harness,
so the cell runner (:mod:`aqr.harness.cell_run`) imports it without the timing rounds.
"""

from __future__ import annotations

import math

import numpy as np


def adapted_batches(n_batches: int, cost: float) -> np.ndarray:
    """Which of ``n_batches`` batches (arriving one per time unit) a method costing ``cost`` units per
    adapted batch adapts on: it takes the batch in front of it whenever it is free (bool array).
    ``ValueError`` for a cost that is not a positive finite number."""
    if not math.isfinite(cost) or cost <= 0:
        raise ValueError(f"a realtime cost must be a positive finite number, got {cost!r}")
    adapted = np.zeros(n_batches, dtype=bool)
    free_at = 0.0
    for k in range(n_batches):
        if k >= free_at - 1e-9:  # batch k arrives at time k; the tolerance keeps C = 1 (or 2.0) exact
            adapted[k] = True
            free_at = k + cost
    return adapted
