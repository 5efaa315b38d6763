"""Plot helpers: figures on matplotlib's Agg canvas (no pyplot, so no global figure state), saved as files.

matplotlib is an optional dependency (the ``report`` extra, also in ``demo`` and ``test``): every helper
here, and every module that draws, calls :func:`require_matplotlib` before it imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


INSTALL = "pip install 'aqr[report]'"


class MissingMatplotlib(ImportError):
    """Drawing was asked for where matplotlib is not installed."""


def require_matplotlib(what: str = "drawing figures") -> None:
    """Raise :class:`MissingMatplotlib`, one line naming the extra to install, unless matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401 - imported here once, by the helper that draws next
    except ImportError as err:
        raise MissingMatplotlib(f"{what} needs matplotlib, which is not installed: {INSTALL}") from err


def figure(figsize: tuple[float, float], **kwargs: Any) -> Any:
    """A ``matplotlib.figure.Figure`` drawn by the Agg canvas; ``kwargs`` go to ``Figure`` (e.g. ``layout``)."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, **kwargs)
    FigureCanvasAgg(fig)
    return fig


def axes_row(ncols: int, figsize: tuple[float, float], **kwargs: Any) -> tuple[Any, list[Any]]:
    """A figure with ``ncols`` axes side by side; ``kwargs`` go to ``Figure.subplots`` (e.g. ``sharey``)."""
    fig = figure(figsize)
    return fig, list(fig.subplots(1, ncols, squeeze=False, **kwargs)[0])


@dataclass(frozen=True)
class Style:
    """How one series is drawn: its colour, its marker (lines, scatter points) and its hatch (bars)."""

    color: Any
    marker: str
    hatch: str


# 9 markers and hatches against 20 colours (coprime): neighbours in a list differ in both colour and marker,
# and two names share both only 180 apart
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<")
HATCHES = ("", "//", "..", "xx", "\\\\", "++", "oo", "--", "**")


def styles(names: Sequence[str]) -> dict[str, Style]:
    """A colour and a marker (and a bar hatch) per name, in order, from 20 colours (``tab20``'s dark shades,
    then its light ones) and 9 markers: every name is told apart from every other by colour and marker
    up to 180 names."""
    require_matplotlib()
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    palette = [cmap(i) for i in range(0, 20, 2)] + [cmap(i) for i in range(1, 20, 2)]
    return {name: Style(palette[i % len(palette)], MARKERS[i % len(MARKERS)], HATCHES[i % len(HATCHES)])
            for i, name in enumerate(names)}


def colors(names: Sequence[str]) -> dict[str, Any]:
    """One colour per name, in order: matplotlib's ``tab10`` cycle for up to 10 names, else ``tab20`` (up to 20
    names apart; past that, colours repeat)."""
    require_matplotlib()
    from matplotlib import colormaps

    cmap, size = (colormaps["tab10"], 10) if len(names) <= 10 else (colormaps["tab20"], 20)
    return {name: cmap(i % size) for i, name in enumerate(names)}


def save(fig: Any, path: str | Path, formats: Sequence[str] = ("png",), dpi: int = 150,
         tight: bool = False) -> list[Path]:
    """Save ``fig`` as ``<stem>.<format>`` for each format (a ``.png``/``.pdf`` suffix on ``path`` is replaced).

    ``tight`` crops to the drawn content, which keeps a legend placed outside the axes.
    """
    path = Path(path)
    stem = path.with_suffix("") if path.suffix.lower() in (".png", ".pdf") else path
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = [stem.parent / f"{stem.name}.{fmt}" for fmt in formats]
    for p in paths:
        fig.savefig(p, dpi=dpi, bbox_inches="tight" if tight else None)
    return paths
