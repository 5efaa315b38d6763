"""The C kernels' calling convention: no entry point of more than 8 arguments, the rest in descriptor
structs whose layout the Python side builds from the library's own table and checks when it loads."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest
import torch

from aqr.adapt.stream import native_kernels
from aqr.backends import build, layout

SOURCES = [build.SOURCE, build.PARALLEL, native_kernels.SOURCE]
LIB, WHY = build.load_kernels()
STREAM, STREAM_WHY = native_kernels.load_stream_kernels()
needs_kernels = pytest.mark.skipif(LIB is None or STREAM is None, reason=f"C kernels unavailable: {WHY or STREAM_WHY}")
MAX_ARGUMENTS = 8


def exported_functions(path: Path) -> dict[str, int]:
    """Every function a C source defines without ``static`` (so the library exports it), with its
    number of parameters."""
    text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S)
    found = {}
    for match in re.finditer(r"^(?!static\b)[A-Za-z_][\w \t*]*?\b(aqr_\w+)\(([^)]*)\)\s*\{", text, flags=re.M):
        params = match.group(2).strip()
        found[match.group(1)] = 0 if params in ("", "void") else params.count(",") + 1
    return found


def test_no_entry_point_takes_more_than_eight_arguments():
    counts = {name: n for path in SOURCES for name, n in exported_functions(path).items()}
    # the parser sees every entry point (a vacuous parse would pass anything)
    assert {"aqr_recalibrate", "aqr_table_map", "aqr_subset_quantiles", "aqr_stream_scan", "aqr_stream_large",
            "aqr_stream_merge_map", "aqr_stream_bound_commit", "aqr_layouts", "aqr_use_openmp"} <= counts.keys()
    assert len(counts) >= 20, counts
    over = {name: n for name, n in counts.items() if n > MAX_ARGUMENTS}
    assert not over, f"entry points of more than {MAX_ARGUMENTS} arguments: {over}"


@needs_kernels
def test_every_declared_entry_point_has_at_most_eight_argument_types():
    declared = {}
    for lib in (LIB, STREAM):
        for name, value in vars(lib).items():
            if name.startswith("aqr_") and getattr(value, "argtypes", None) is not None:
                declared[name] = len(value.argtypes)
    assert len(declared) >= 17, sorted(declared)
    assert max(declared.values()) <= MAX_ARGUMENTS, declared


@needs_kernels
def test_the_structs_are_built_from_the_librarys_table_and_match_it():
    for lib, names in ((LIB, {"aqr_sample", "aqr_map", "aqr_recalibration"}),
                       (STREAM, {"aqr_stream_scan_args", "aqr_stream_layer", "aqr_stream_large_args"})):
        assert names <= lib.structs.keys()
        for struct in lib.structs.values():
            assert issubclass(struct, layout.Descriptor) and ctypes.sizeof(struct) > 0
    # a field's type comes from the table: the map's tail code is an int, its sizes int64
    assert LIB.structs["aqr_map"].tail.size == ctypes.sizeof(ctypes.c_int)
    assert LIB.structs["aqr_map"].cells.size == 8


@needs_kernels
def test_a_layout_ctypes_would_place_differently_is_refused_and_the_kernels_fall_back(monkeypatch):
    # ints read as int64 on the Python side: every field after the map's tail code moves
    monkeypatch.setitem(layout.KINDS, "C", ctypes.c_int64)
    with pytest.raises(layout.LayoutError, match=r"aqr_map\.\w+ is at offset"):
        layout.read_layouts(LIB)
    lib, reason = build.try_load(build.load)  # what loading the kernels does: the torch fallback, with the reason
    assert lib is None and "aqr_layouts" in reason


@needs_kernels
def test_a_layout_of_an_unknown_kind_is_refused(monkeypatch):
    monkeypatch.delitem(layout.KINDS, "D")
    with pytest.raises(layout.LayoutError, match="unknown kinds"):
        layout.read_layouts(STREAM)


@needs_kernels
def test_a_descriptor_must_be_given_every_field_and_no_other():
    struct = STREAM.structs["aqr_stream_tables_args"]
    fields = dict(C=1, K=3, kn=None, sq=None, G=4, pairs=None, glo=None, ginv=None)
    assert struct.of(**fields).G == 4
    with pytest.raises(TypeError, match=r"aqr_stream_tables_args\(\) missing 1 required keyword-only argument: 'ginv'"):
        struct.of(**{k: v for k, v in fields.items() if k != "ginv"})
    with pytest.raises(TypeError, match=r"aqr_stream_tables_args\(\) got an unexpected keyword argument 'grid'"):
        struct.of(**fields, grid=4)


@needs_kernels
def test_a_null_descriptor_is_refused_by_the_c_side():
    x = torch.zeros(2, 3, 16)
    assert LIB.aqr_recalibrate(None, x.data_ptr(), x.data_ptr(), None, None, 1) == -2
    assert STREAM.aqr_stream_scan(None, 1) == -2
    assert STREAM.aqr_stream_bound_scan(None, None, 1) == -2
