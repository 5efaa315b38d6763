"""The descriptor structs of aqr's C kernels, built from the layout table each library declares.

An entry point takes at most 8 arguments; the rest travel in a descriptor struct whose fields are
listed once, in C (``AQR_DESCRIPTOR`` in ``_shared.h``). Each library exports ``aqr_layouts``, the
name, kind, offset and size of every field of every descriptor; :func:`read_layouts` builds a
``ctypes.Structure`` per descriptor from that table and checks that ctypes places every field where
the C compiler did (and that the structs are the same size). A library whose table disagrees is
refused (:class:`LayoutError`, an ``OSError``: the kernels then fall back to torch, as for a library
that does not build), so the two sides cannot silently drift apart.
"""

from __future__ import annotations

import ctypes
import keyword
from collections.abc import Mapping

KINDS: dict[str, type] = {"P": ctypes.c_void_p, "I": ctypes.c_int64, "D": ctypes.c_double, "C": ctypes.c_int}
"""A field's kind in a layout table: a pointer, an int64_t, a double or an int."""


class LayoutError(OSError):
    """A library's descriptor layout does not match the structs ctypes builds from it."""


class _Field(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("kind", ctypes.c_char_p), ("offset", ctypes.c_int64),
                ("size", ctypes.c_int64)]


class _Layout(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("size", ctypes.c_int64), ("nfields", ctypes.c_int64),
                ("fields", ctypes.POINTER(_Field))]


class Descriptor(ctypes.Structure):
    """A descriptor struct. ``of(**fields)`` fills one: every field by name, each exactly once (Python's
    own keyword checks refuse a missing or an unknown one, so a field added or renamed on the C side
    cannot be left at zero); ``of`` is generated for each struct from its fields."""

    @staticmethod
    def of(**fields: object) -> Descriptor:  # replaced on each struct read_layouts builds
        raise TypeError("a descriptor struct is built by read_layouts")


def _filler(struct: type[Descriptor], names: list[str]) -> object:
    """``struct``'s ``of``: keyword-only parameters named after its fields, passed on in the struct's order."""
    bad = [n for n in names if not n.isidentifier() or keyword.iskeyword(n) or n == "struct"]
    if bad:
        raise LayoutError(f"aqr_layouts: {struct.__name__} has fields that are not names: {bad}")
    listed = ", ".join(names)
    namespace: dict[str, object] = {"struct": struct}
    exec(f"def {struct.__name__}(*, {listed}):\n    return struct({listed})\n", namespace)  # as dataclasses do
    return staticmethod(namespace[struct.__name__])


def read_layouts(lib: ctypes.CDLL) -> Mapping[str, type[Descriptor]]:
    """The descriptor structs ``lib`` declares, by their C names, each checked against the library's
    offsets and sizes (:class:`LayoutError` where one differs)."""
    entry = lib.aqr_layouts
    entry.argtypes = [ctypes.POINTER(ctypes.c_int64)]
    entry.restype = ctypes.POINTER(_Layout)
    count = ctypes.c_int64()
    table = entry(ctypes.byref(count))
    structs: dict[str, type[Descriptor]] = {}
    for i in range(count.value):
        layout = table[i]
        name = layout.name.decode()
        rows = [layout.fields[j] for j in range(layout.nfields)]
        unknown = sorted({row.kind.decode() for row in rows} - KINDS.keys())
        if unknown:
            raise LayoutError(f"aqr_layouts: {name} has fields of unknown kinds {unknown}")
        fields = [(row.name.decode(), KINDS[row.kind.decode()]) for row in rows]
        if not name.isidentifier() or keyword.iskeyword(name):
            raise LayoutError(f"aqr_layouts: a descriptor named {name!r}")
        struct = type(name, (Descriptor,), {"_fields_": fields})
        struct.of = _filler(struct, [f for f, _ in fields])
        for row, (field, _) in zip(rows, fields):
            placed = getattr(struct, field)
            if (placed.offset, placed.size) != (row.offset, row.size):
                raise LayoutError(f"aqr_layouts: {name}.{field} is at offset {row.offset} ({row.size} bytes) in C, "
                                  f"at {placed.offset} ({placed.size} bytes) in ctypes")
        if ctypes.sizeof(struct) != layout.size:
            raise LayoutError(f"aqr_layouts: {name} is {layout.size} bytes in C, {ctypes.sizeof(struct)} in ctypes")
        structs[name] = struct
    return structs


def declare(lib: ctypes.CDLL, structs: Mapping[str, type[Descriptor]], entry: str, descriptor: str,
            *rest: type) -> None:
    """Set ``lib.<entry>``'s argument types: a pointer to the descriptor ``descriptor``, then ``rest``; it
    returns an int. Refuses an entry point of more than 8 arguments."""
    if descriptor not in structs:
        raise LayoutError(f"aqr_layouts declares no {descriptor} (for {entry})")
    if 1 + len(rest) > 8:
        raise ValueError(f"{entry} would take {1 + len(rest)} arguments: at most 8, the rest in its descriptor")
    function = getattr(lib, entry)
    function.argtypes = [ctypes.POINTER(structs[descriptor]), *rest]
    function.restype = ctypes.c_int
