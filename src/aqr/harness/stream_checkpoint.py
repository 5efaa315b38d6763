"""Checkpoints of a stream cell in progress, so a cell killed at any point resumes where it was.

Every ``every`` images (at the first batch boundary past each multiple) a stream cell writes, atomically,
one file in its cache folder (``<cache>/stream_checkpoints/<cell key>.pt``): the method's
``state_dict()`` (and its optimizer's, where it has one), the protocol's batch counter that seeds
``forward``, the stream position, which images so far were classified right and torch's global random
state. A rerun of the cell loads it and continues from the next batch, giving the per-image predictions
an uninterrupted run gives; the file is removed when the cell completes. It is read with
``torch.load(weights_only=True)`` (tensors, numbers, strings, lists and dicts; nothing is unpickled)
and belongs to one cell key (its config, files' content and code versions): another cell never reads it.

Resuming is exact as far as ``method.state_dict()`` holds the method's whole state between two batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from aqr.util.files import atomic_write

FORMAT = "aqr stream checkpoint"
VERSION = 1
FOLDER = "stream_checkpoints"


class CheckpointError(ValueError):
    """A stream checkpoint that cannot be resumed from (named with its file and what is wrong)."""


@dataclass(frozen=True)
class Resumed:
    """Where a checkpointed stream stands: the next batch to run and the correctness of the images before it."""

    next_batch: int
    correct: np.ndarray


@dataclass(frozen=True)
class StreamCheckpoint:
    """The checkpoint file of one stream cell (``key``: its results-database key), written every ``every`` images."""

    path: Path
    key: str
    every: int

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"checkpoint_every must be an integer >= 1 (images), got {self.every!r}")

    @classmethod
    def in_cache(cls, cache_dir: str | Path, key: str, every: int) -> "StreamCheckpoint":
        """The checkpoint of the cell keyed ``key`` in the cache folder ``cache_dir``."""
        return cls(Path(cache_dir) / FOLDER / f"{key}.pt", key, every)

    def due(self, images_before: int, images_after: int) -> bool:
        """Whether a batch that took the stream from ``images_before`` to ``images_after`` images crossed a
        multiple of ``every``."""
        return images_after // self.every > images_before // self.every

    def save(self, method: torch.nn.Module, next_batch: int, correct: np.ndarray, n_images: int) -> None:
        """Write the state after the batches before ``next_batch`` (the first ``n_images`` of ``correct``)."""
        optimizer = getattr(method, "optimizer", None)
        payload: dict[str, Any] = {
            "format": FORMAT, "version": VERSION, "key": self.key, "next_batch": int(next_batch),
            "n_images": int(n_images), "total": int(len(correct)),
            "correct": torch.from_numpy(np.asarray(correct[:n_images], dtype=np.uint8).copy()),
            "method": method.state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "batches_since_reset": int(getattr(method, "_batches_since_reset", 0)),
            "torch_rng": torch.get_rng_state(),
        }
        odd = _unreadable(payload["method"], "state_dict()") or _unreadable(payload["optimizer"], "optimizer state")
        if odd:
            raise CheckpointError(f"the {type(method).__name__} method's state cannot be checkpointed: {odd} "
                                  "is not a tensor, number, string, list or dict (weights_only=True could not read it)")
        atomic_write(self.path, lambda tmp: torch.save(payload, tmp))

    def resume(self, method: torch.nn.Module, total: int) -> Resumed | None:
        """Load the checkpoint into ``method`` (fresh, built as the cell builds it) and return where the stream
        stands; ``None`` when there is none. :class:`CheckpointError` for a file of another cell, stream or
        format, or a state the method refuses."""
        if not self.path.is_file():
            return None
        try:
            payload = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(f"stream checkpoint {self.path} cannot be read ({type(err).__name__}: {err}); "
                                  "remove it to run the cell from the start") from None
        problem = _check_payload(payload, self.key, total)
        if problem:
            raise CheckpointError(f"stream checkpoint {self.path} {problem}; remove it to run the cell from the start")
        device = next((p.device for p in method.parameters()), torch.device("cpu"))
        try:
            method.load_state_dict(_to_device(payload["method"], device))
            optimizer = getattr(method, "optimizer", None)
            if optimizer is not None and payload["optimizer"] is not None:
                optimizer.load_state_dict(payload["optimizer"])  # moves the state to its parameters' device
        except (RuntimeError, ValueError, KeyError) as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CheckpointError(f"stream checkpoint {self.path} does not fit the cell's method ({first}); "
                                  "remove it to run the cell from the start") from None
        if hasattr(method, "_batches_since_reset"):
            method._batches_since_reset = payload["batches_since_reset"]
        torch.set_rng_state(payload["torch_rng"])
        correct = np.zeros(total, dtype=bool)
        correct[: payload["n_images"]] = payload["correct"].numpy().astype(bool)
        return Resumed(payload["next_batch"], correct)

    def remove(self) -> None:
        """Delete the checkpoint (the cell completed)."""
        self.path.unlink(missing_ok=True)


def _check_payload(payload: Any, key: str, total: int) -> str:
    """What is wrong with a loaded checkpoint for the cell keyed ``key`` over ``total`` images ('' if nothing)."""
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        return "is not an aqr stream checkpoint"
    if payload.get("version") != VERSION:
        return f"has format version {payload.get('version')!r}; this aqr reads version {VERSION}"
    if payload.get("key") != key:
        return f"belongs to the cell {payload.get('key')!r}, not {key!r}"
    if payload.get("total") != total or not 0 <= payload.get("n_images", -1) <= total:
        return f"was written for a stream of {payload.get('total')!r} images; this one has {total}"
    return ""


def _unreadable(state: Any, where: str) -> str:
    """Where in ``state`` a value sits that ``torch.load(weights_only=True)`` would refuse ('' if none)."""
    if state is None or isinstance(state, (torch.Tensor, bool, int, float, str, torch.dtype, torch.device)):
        return ""
    if isinstance(state, dict):
        return next((found for k, v in state.items() if (found := _unreadable(v, f"{where}[{k!r}]"))), "")
    if isinstance(state, (list, tuple)):
        return next((found for k, v in enumerate(state) if (found := _unreadable(v, f"{where}[{k}]"))), "")
    return f"{where} ({type(state).__name__})"


def _to_device(state: Any, device: torch.device) -> Any:
    """``state`` (nested dicts and lists of tensors) with its tensors on ``device``."""
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return type(state)((k, _to_device(v, device)) for k, v in state.items())
    if isinstance(state, list):
        return [_to_device(v, device) for v in state]
    return state
