"""CIFAR-10/100 loaders: the clean test set (npz or the official python pickles) and CIFAR-C folders."""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Sequence

import numpy as np

from aqr.data.arrays import ArrayImageDataset, check_images, check_labels, load_npz, require_file
from aqr.data.corruption_params import check_corruption_name


class _SafeArray:
    """Stand-in for numpy.ndarray during unpickling: only raw bytes + shape + plain dtype survive."""

    def __init__(self, *args: object) -> None:
        self.array: np.ndarray | None = None

    def __setstate__(self, state: tuple) -> None:
        _version, shape, dtype, fortran, raw = state
        if not isinstance(dtype, _SafeDtype) or not isinstance(raw, (bytes, bytearray)):
            raise pickle.UnpicklingError("unsupported array payload (only plain numeric arrays are allowed)")
        arr = np.frombuffer(bytes(raw), dtype=dtype.dtype)
        self.array = arr.reshape(shape, order="F" if fortran else "C")


class _SafeDtype:
    """Stand-in for numpy.dtype: accepts plain integer/float type codes only."""

    _ALLOWED = {"u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "f4", "f8", "b1"}

    def __init__(self, code: object, align: object = False, copy: object = True) -> None:
        if isinstance(code, bytes):
            code = code.decode("ascii")
        if code not in self._ALLOWED:
            raise pickle.UnpicklingError(f"dtype {code!r} is not allowed")
        self.dtype = np.dtype(code)

    def __setstate__(self, state: tuple) -> None:
        order = state[1]
        if isinstance(order, bytes):
            order = order.decode("ascii")
        if order in ("<", ">"):
            self.dtype = self.dtype.newbyteorder(order)


def _reconstruct(cls: object, shape: object, dtype_code: object) -> _SafeArray:
    return _SafeArray()


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    # protocol-2 pickles written by Python 3 store bytes as _codecs.encode(str, 'latin1')
    if encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"codec {encoding!r} is not allowed")
    return text.encode("latin1")


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only a fixed allow-list of globals, all mapped to inert local stand-ins.

    Builtin containers (dict, list, bytes, str, int) come from pickle opcodes, not globals. The
    numpy names an array pickle refers to are replaced by :class:`_SafeArray` / :class:`_SafeDtype`,
    which only copy bytes into ``np.frombuffer``; nothing in numpy or elsewhere is ever called by
    name, so a crafted file cannot execute code.
    """

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy", "ndarray"): _SafeArray,
        ("numpy", "dtype"): _SafeDtype,
        ("_codecs", "encode"): _latin1_encode,
    }

    def find_class(self, module: str, name: str) -> object:
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed") from None


def _plain(obj: object) -> object:
    """Replace array stand-ins by numpy arrays and bytes keys by str, recursively."""
    if isinstance(obj, _SafeArray):
        return obj.array
    if isinstance(obj, dict):
        return {(k.decode("latin1") if isinstance(k, bytes) else k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


def load_cifar_pickle(path: str | Path) -> ArrayImageDataset:
    """An official CIFAR python batch (``cifar-10-batches-py/test_batch`` or ``cifar-100-python/test``).

    The file is a pickle; it is read with a restricted unpickler that cannot run code (see
    :class:`_RestrictedUnpickler`). Expects key ``data`` (uint8 N x 3072, CHW planes) and
    ``labels`` (CIFAR-10) or ``fine_labels`` (CIFAR-100).
    """
    path = Path(path)
    expected = "a CIFAR python batch: dict with 'data' uint8 (N, 3072) and 'labels' or 'fine_labels'"
    require_file(path, expected)
    try:
        with open(path, "rb") as f:
            raw = _RestrictedUnpickler(io.BufferedReader(f), encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError) as err:
        raise ValueError(f"{path}: cannot read as {expected} ({err})") from err
    batch = _plain(raw)
    if not isinstance(batch, dict) or "data" not in batch:
        raise ValueError(f"{path}: expected {expected}; found keys {sorted(batch) if isinstance(batch, dict) else type(batch).__name__}")
    label_key = "fine_labels" if "fine_labels" in batch else "labels"
    if label_key not in batch:
        raise ValueError(f"{path}: expected {expected}; found keys {sorted(batch)}")
    data = np.asarray(batch["data"])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise ValueError(f"{path}: 'data' must be uint8 (N, 3072), got {data.dtype} {data.shape}")
    labels = np.asarray(batch[label_key], dtype=np.int64)
    check_labels(labels, len(data), path, label_key)
    images = np.ascontiguousarray(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))
    return ArrayImageDataset(images, labels)


def load_cifar(path: str | Path) -> ArrayImageDataset:
    """Clean CIFAR-10/100 test set from an .npz file, an official python batch file, or its folder.

    A folder ``cifar-10-batches-py`` resolves to its ``test_batch``, ``cifar-100-python`` to ``test``.
    """
    path = Path(path)
    if path.is_dir():
        for name in ("test_batch", "test"):
            if (path / name).is_file():
                return load_cifar_pickle(path / name)
        raise FileNotFoundError(f"{path}: no 'test_batch' (CIFAR-10) or 'test' (CIFAR-100) file in this folder")
    if path.suffix == ".npz":
        return load_npz(path)
    return load_cifar_pickle(path)


# ----------------------------------------------------------------------------- CIFAR-10-C / CIFAR-100-C


def _severity_blocks(root: Path, corruption: str) -> list[int]:
    """Severity held by each block of ``<corruption>.npy``: from manifest.json if present, else 1..5."""
    manifest = root / "manifest.json"
    if manifest.is_file():
        info = json.loads(manifest.read_text())
        entry = info.get("corruptions", {}).get(corruption)
        if entry is not None:
            return [int(s) for s in entry["severities"]]
        if "severities" in info:
            return [int(s) for s in info["severities"]]
    return [1, 2, 3, 4, 5]


def load_cifar_c(
    root: str | Path,
    corruption: str,
    severity: int,
    indices: Sequence[int] | np.ndarray | None = None,
) -> ArrayImageDataset:
    """Images of one corruption and severity from a CIFAR-10-C / CIFAR-100-C folder.

    ``<root>/<corruption>.npy`` is uint8 (B*N, H, W, 3): B blocks of the N test images, block b
    holding severity b+1 in the released layout (or the severities listed in ``manifest.json``
    written by :func:`aqr.data.cifar_c.generate_cifar_c`). ``<root>/labels.npy`` has N or B*N labels.
    ``indices`` (test-set indices, e.g. ``range(5000, 10000)``) selects a subset, in that order.
    The array is memory-mapped; only the selected rows are read.
    """
    root = Path(root)
    path = root / f"{corruption}.npy"
    if not path.is_file():
        check_corruption_name(corruption)
    require_file(path, f"uint8 array (5*N, H, W, 3) of corruption '{corruption}' in a CIFAR-C folder")
    label_path = root / "labels.npy"
    require_file(label_path, "integer labels of shape (N,) or (5*N,)")
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
        labels = np.load(label_path, mmap_mode="r", allow_pickle=False)
    except ValueError as err:
        raise ValueError(f"{path.parent}: cannot read {path.name} / labels.npy as plain .npy arrays ({err})") from err
    check_images(array, path, corruption)
    blocks = _severity_blocks(root, corruption)
    if severity not in blocks:
        raise ValueError(f"{path}: severity {severity} not present; blocks hold severities {blocks}")
    if array.shape[0] % len(blocks):
        raise ValueError(f"{path}: {array.shape[0]} rows is not a multiple of {len(blocks)} severity blocks")
    n = array.shape[0] // len(blocks)
    if labels.ndim != 1 or labels.shape[0] not in (n, array.shape[0]) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"{label_path}: expected integer labels of shape ({n},) or ({array.shape[0]},), got {labels.dtype} {labels.shape}"
        )
    idx = np.arange(n) if indices is None else np.asarray(indices, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise IndexError(f"{path}: indices must lie in [0, {n}), got range [{idx.min()}, {idx.max()}]")
    start = blocks.index(severity) * n
    images = np.ascontiguousarray(array[start + idx]) if indices is not None else array[start : start + n]
    label_rows = idx if labels.shape[0] == n else start + idx
    return ArrayImageDataset(images, np.asarray(labels[label_rows]))
