"""Plot helpers: figures on matplotlib's Agg canvas (no pyplot, so no global figure state), saved as files."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def figure(figsize: tuple[float, float], **kwargs: Any) -> Any:
    """A ``matplotlib.figure.Figure`` drawn by the Agg canvas; ``kwargs`` go to ``Figure`` (e.g. ``layout``)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, **kwargs)
    FigureCanvasAgg(fig)
    return fig


def axes_row(ncols: int, figsize: tuple[float, float], **kwargs: Any) -> tuple[Any, list[Any]]:
    """A figure with ``ncols`` axes side by side; ``kwargs`` go to ``Figure.subplots`` (e.g. ``sharey``)."""
    fig = figure(figsize)
    return fig, list(fig.subplots(1, ncols, squeeze=False, **kwargs)[0])


def colors(names: Sequence[str]) -> dict[str, Any]:
    """One colour of matplotlib's ``tab10`` cycle per name, in order."""
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return {name: cmap(i % 10) for i, name in enumerate(names)}


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
