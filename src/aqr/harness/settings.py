"""The field's evaluation settings by name, as the test-time-adaptation benchmark repository names them.

:func:`apply_setting` turns a grid into that setting:

``reset_each_shift``
    one cell per corruption, online: the method adapts through the corruption's images and starts
    afresh for the next (a cell is a fresh method).
``continual``
    one stream of all the grid's corruptions, block after block, online and never reset.
``gradual``
    that stream with each corruption's severity rising 1, 2, ..., 5 and falling back to 1: nine blocks
    per corruption (the cell's severity is the peak), online and never reset.
``mixed_domains``
    the continual stream with all blocks' images mixed in one random order.
``correlated``
    the grid's cells with their images in class-correlated order, Dirichlet concentration ``delta``
    (small: long runs of one class; ``0``: sorted by class label); exactly what ``--order delta=D`` does,
    so the cells and their keys are the same. On continual cells that is the reference's ``correlated``
    setting.
``mixed_domains_correlated``, ``gradual_correlated``, ``reset_each_shift_correlated``
    ``mixed_domains``, ``gradual`` and ``reset_each_shift`` with the images of each cell's stream in
    class-correlated order (``delta`` as for ``correlated``), as the reference combines them: mixed
    domains pools and shuffles every corruption's images and then orders the pooled stream by class;
    the gradual stream and each reset-each-shift cell order every block of one corruption and severity.

The setting is also read back from a cell (:func:`setting_of`), for reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from aqr.harness.cells import (CONTINUAL, CONTINUAL_ORDER, GRADUAL, Cell, canonical_order, is_gradual,
                               stream_corruptions)
from aqr.harness.cells import is_ccc
from aqr.harness.specs import GridSpec

SETTINGS = ("reset_each_shift", "continual", "gradual", "mixed_domains", "correlated", "mixed_domains_correlated",
            "gradual_correlated", "reset_each_shift_correlated", "ccc")
#: The settings that order each stream by class and so need ``delta``.
CORRELATED_SETTINGS = tuple(s for s in SETTINGS if s.endswith("correlated"))


def _single(corruptions: Sequence[str]) -> tuple[str, ...]:
    """The one-corruption names of a grid's corruptions, streams expanded, each once, in order."""
    return tuple(dict.fromkeys(c for name in corruptions for c in (stream_corruptions(name) or (name,))))


def stream_name(kind: str, corruptions: Sequence[str]) -> str:
    """The corruption of a ``kind`` (``"continual"`` or ``"gradual"``) cell streaming ``corruptions``:
    the bare kind for the benchmark's 15 in its order, else ``kind:a+b+...``."""
    names = tuple(corruptions)
    return kind if names == CONTINUAL_ORDER else f"{kind}:{'+'.join(names)}"


def apply_setting(grid: GridSpec, setting: str, delta: float | None = None) -> GridSpec:
    """``grid`` in the named setting (see the module docs); ``delta`` is required by the correlated settings
    (:data:`CORRELATED_SETTINGS`) only.

    The grid's name gets ``-<setting>`` appended (``-delta=D`` for ``correlated``, as ``--order`` does;
    ``-<setting>-delta=D`` for the other correlated settings), so reports keep settings apart. The grid's
    parts take the setting too, each keeping its protocol (a realtime part stays realtime). ``ValueError``
    for an unknown setting or a missing or stray ``delta``.
    """
    if setting not in SETTINGS:
        raise ValueError(f"unknown setting {setting!r}; expected one of {', '.join(SETTINGS)}")
    if setting == "ccc":
        raise ValueError("the ccc setting takes a baseline and a speed: use apply_ccc (--baseline A --speed S)")
    if (setting in CORRELATED_SETTINGS) != (delta is not None):
        raise ValueError(f"--delta D goes with --setting {'|'.join(CORRELATED_SETTINGS)} (and only there): the "
                         "Dirichlet concentration of the class-correlated order")
    parts = tuple(apply_setting(part, setting, delta) for part in grid.parts)
    if setting == "correlated":
        order = canonical_order(f"delta={delta}")
        return grid.override(orders=(order,), name=f"{grid.name}-{order}", parts=parts)
    if setting in CORRELATED_SETTINGS:  # the uncorrelated setting, then its stream ordered by class
        base = apply_setting(grid.override(parts=()), setting.removesuffix("_correlated"))
        mixed = "mixed," if base.orders == ("mixed",) else ""
        order = canonical_order(f"{mixed}delta={delta}")
        return base.override(orders=(order,), name=f"{grid.name}-{setting}-delta={delta:g}", parts=parts)
    corruptions = _single(grid.corruptions)
    online = "online" if grid.protocol == "episodic" else grid.protocol
    changes: dict = {"name": f"{grid.name}-{setting}", "protocol": online, "orders": (None,), "parts": parts}
    if setting == "reset_each_shift":
        changes["corruptions"] = corruptions
    elif setting == "continual":
        changes["corruptions"] = (stream_name(CONTINUAL, corruptions),)
    elif setting == "gradual":
        changes.update(corruptions=(stream_name(GRADUAL, corruptions),), severities=(max(grid.severities),))
    else:  # mixed_domains
        changes.update(corruptions=(stream_name(CONTINUAL, corruptions),), orders=("mixed",))
    return grid.override(**changes)


def apply_ccc(grid: GridSpec, baseline: float, speed: int, images: int) -> GridSpec:
    """``grid`` as CCC streams (:mod:`aqr.harness.ccc`): one cell per model, method, batch size and seed, a stream
    of ``images`` images whose corruptions walk at ``speed`` images a severity step so that the source model
    scores about ``baseline`` %; online (a realtime grid stays realtime), in the drawn order, the grid's
    corruptions and severities replaced (a cell's severity is unused: 5). Named ``<grid>-ccc``."""
    from aqr.harness.ccc import CCCSpec

    name = CCCSpec(float(baseline), speed, images).name
    parts = tuple(apply_ccc(part, baseline, speed, images) for part in grid.parts)
    online = "online" if grid.protocol == "episodic" else grid.protocol
    changed = grid.override(name=f"{grid.name}-ccc", protocol=online, orders=(None,), parts=parts,
                            corruptions=(name,), severities=(5,))
    return replace(changed, n_images=None)  # (the stream's length is in its name; override keeps a None's field)


def setting_of(cell: Cell) -> str:
    """The setting a cell belongs to: ``mixed_domains`` (``_correlated`` with a class-correlated order),
    ``gradual_correlated``, ``gradual``, ``correlated`` (any other stream in class-correlated order, and an
    episodic cell in one), ``continual`` (any other stream), ``reset_each_shift_correlated`` and
    ``reset_each_shift`` (one corruption, online), else ``episodic``."""
    from aqr.data.streams import StreamOrder

    if is_ccc(cell.corruption):
        return "ccc"
    order = StreamOrder.parse(cell.order) if cell.order is not None else None
    correlated = order is not None and not order.iid
    if order is not None and order.mixed:
        return "mixed_domains_correlated" if correlated else "mixed_domains"
    if is_gradual(cell.corruption):
        return "gradual_correlated" if correlated else "gradual"
    if correlated:
        one = stream_corruptions(cell.corruption) is None and cell.protocol != "episodic"
        return "reset_each_shift_correlated" if one else "correlated"
    if stream_corruptions(cell.corruption) is not None:
        return "continual"
    return "episodic" if cell.protocol == "episodic" else "reset_each_shift"
