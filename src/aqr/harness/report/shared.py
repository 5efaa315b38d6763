"""What the report's modules share: which rows are continual and in which stream order, how orders sort,
and how names and settings are written."""

from __future__ import annotations

import re
from collections.abc import Sequence

from aqr.data.streams import StreamOrder
from aqr.harness.cells import stream_corruptions
from aqr.harness.results import Row


def is_continual(row: Row) -> bool:
    """Whether the row is a continual cell's (one whole stream)."""
    try:
        return stream_corruptions(row.corruption) is not None
    except ValueError:
        return False


def row_order(row: Row) -> str | None:
    """The row's stream order (canonical text, e.g. ``"delta=0.1"``), ``None`` when its cell named none."""
    return row.config.get("order")


def order_key(order: str) -> tuple:
    """Columns' order: unmixed before mixed, each from i.i.d. (``delta = inf``) to the smallest ``delta``."""
    parsed = StreamOrder.parse(order)
    return (parsed.mixed, -parsed.delta)


def slug(text: str) -> str:
    """``text`` as a lowercase file-name part: runs of other characters than letters and digits become ``-``."""
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def setting_label(rows: Sequence[Row]) -> str:
    """The continual setting of ``rows`` in words (streams, severities, block sizes, protocols), for table notes."""
    ok = [r for r in rows if r.status == "ok"]
    blocks = sorted({r.detail["block_size"] for r in ok if r.detail})
    streams = sorted({r.corruption for r in ok})
    return (f"{', '.join(streams)} at severity {', '.join(map(str, sorted({r.severity for r in ok})))}, "
            f"blocks of {', '.join(map(str, blocks))} images, protocol {', '.join(sorted({r.protocol for r in ok}))}")
