"""The content key of one input of a cell, by its role: what a cell's key and a CCC stream's cache hash."""

from __future__ import annotations

from pathlib import Path

from aqr.data.corruptions import frost_fingerprint
from aqr.data.images import is_image_source, listing_fingerprint
from aqr.util.files import sha256_cached


def file_fingerprint(role: str, path: Path, owner: str = "cell") -> str:
    """``path``'s content key as the input ``role``: the frost overlays the corruption reads, by content; an image
    folder's or list's listing (paths and sizes); else the file's sha256. ``FileNotFoundError`` naming ``role``
    and ``owner`` where a file is missing."""
    if role == "frost":
        return frost_fingerprint(path)
    if path.is_dir() or (role == "source" and is_image_source(path)):
        return listing_fingerprint(path)
    if not path.is_file():
        raise FileNotFoundError(f"{role} file of {owner} not found: {path}")
    return sha256_cached(path)
