"""Continual cells: one stream of corruption blocks, evaluated without a reset (the ``stream`` preset).

A continual cell (:func:`aqr.harness.cells.stream_corruptions`) draws ``n_images`` test images from its
pool with its seed, as every cell does, and shows the same images once per corruption, block after
block in the given order. With a stream order (``Cell.order``) the blocks are ordered by
:meth:`aqr.data.streams.StreamOrder.stream` (class-correlated within blocks, or all blocks mixed).
Batches never straddle two blocks, unless the order mixes them; a block's last batch may be smaller.

The result keeps whether each image was classified right, in stream order (:func:`stream_detail`);
:func:`block_accuracies` and :func:`along_stream` read it back for tables and figures.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from aqr.data.arrays import to_float
from aqr.data.streams import StreamOrder, take
from aqr.harness.cells import Cell, block_name, eval_indices, is_gradual, parse_range, stream_schedule
from aqr.harness.stream_checkpoint import StreamCheckpoint


def stream_blocks(cell: Cell) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """``(block name, images uint8 NHWC, labels)`` per block of a continual or gradual cell, images in draw
    order (:func:`aqr.harness.cells.block_name`: a gradual stream's names carry the severity)."""
    from aqr.data import load_cifar_c

    schedule = stream_schedule(cell)
    if schedule is None:
        raise ValueError(f"cell corruption {cell.corruption!r} is not a continual stream")
    pool = parse_range(cell.data.eval_indices)
    if pool is None:
        raise ValueError("DataSpec.eval_indices must be set")
    indices = eval_indices(cell, pool)
    blocks = []
    gradual = is_gradual(cell.corruption)
    for name, severity in schedule:
        ds = load_cifar_c(cell.data.root, name, severity, indices=indices)
        blocks.append((block_name(name, severity, gradual), np.asarray(ds.images), np.asarray(ds.labels)))
    return blocks


def stream_batches(cell: Cell, blocks: Sequence[tuple[str, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The stream's images and labels in order, and where its batches start (never across two blocks,
    unless the cell's order mixes them)."""
    images = [b[1] for b in blocks]
    labels = [b[2] for b in blocks]
    order = StreamOrder.parse(cell.order) if cell.order is not None else None
    if order is None:
        rows = np.concatenate([np.stack([np.full(len(lab), k), np.arange(len(lab))], 1) for k, lab in enumerate(labels)])
    else:
        rows = order.stream(labels, cell.seed)
    stream_images, stream_labels = take(images, rows), take(labels, rows)
    size = cell.batch_size
    if order is not None and order.mixed:
        starts = list(range(0, len(stream_labels), size))
    else:
        edges = np.flatnonzero(np.r_[True, rows[1:, 0] != rows[:-1, 0]]).tolist() + [len(rows)]
        starts = [s for a, b in zip(edges[:-1], edges[1:]) for s in range(a, b, size)]
    return stream_images, stream_labels, starts


def evaluate_stream(method: nn.Module, images: np.ndarray, labels: np.ndarray, starts: Sequence[int],
                    progress: bool = False, desc: str = "", adapted: Sequence[bool] | None = None,
                    checkpoint: StreamCheckpoint | None = None) -> np.ndarray:
    """Whether each image of the stream was classified right, feeding ``method`` the batches that begin at
    ``starts`` in order (from the first image to the last). ``adapted`` (one per batch; realtime protocol):
    the batches the method adapts on; the others get its ``forward_held`` predictions. ``checkpoint``: the
    stream resumes from it where it exists (``method`` fresh) and is saved to it every ``checkpoint.every``
    images; the caller removes it once the result is stored."""
    from tqdm.auto import tqdm

    correct = np.zeros(len(labels), dtype=bool)
    first = 0
    if checkpoint is not None:
        resumed = checkpoint.resume(method, len(labels))
        if resumed is not None:
            first, correct = resumed.next_batch, resumed.correct
    ends = [*starts[1:], len(labels)]
    device = next((p.device for p in method.parameters()), torch.device("cpu"))
    batches = list(zip(starts, ends))
    for k in tqdm(range(first, len(batches)), desc=desc or "batches", leave=False, disable=not progress,
                  unit="batch", initial=first, total=len(batches)):
        start, end = batches[k]
        x = to_float(images[start:end]).to(device)
        logits = method(x) if adapted is None or adapted[k] else method.forward_held(x)
        correct[start:end] = logits.argmax(1).cpu().numpy() == labels[start:end]
        if checkpoint is not None and end < len(labels) and checkpoint.due(start, end):
            checkpoint.save(method, k + 1, correct, end)
    return correct


def stream_detail(correct: np.ndarray, corruptions: Sequence[str], block_size: int) -> dict[str, Any]:
    """A continual cell's per-image results as JSON-able data (correctness packed as bits, base64)."""
    return {"corruptions": list(corruptions), "block_size": int(block_size), "n": int(len(correct)),
            "correct": base64.b64encode(np.packbits(correct.astype(bool))).decode("ascii")}


def correctness(detail: dict[str, Any]) -> np.ndarray:
    """The per-image correctness (bool, stream order) stored by :func:`stream_detail`."""
    bits = np.frombuffer(base64.b64decode(detail["correct"]), dtype=np.uint8)
    return np.unpackbits(bits)[: detail["n"]].astype(bool)


def block_accuracies(detail: dict[str, Any]) -> dict[str, float]:
    """Accuracy (%) of each block of an unmixed stream, by block name (blocks of the same name, as the
    rising and falling severities of a gradual stream, together)."""
    correct = correctness(detail)
    size = detail["block_size"]
    hits: dict[str, list[float]] = {}
    for k, name in enumerate(detail["corruptions"]):
        block = correct[k * size : (k + 1) * size]
        total = hits.setdefault(name, [0.0, 0.0])
        total[0] += float(block.sum())
        total[1] += len(block)
    return {name: 100.0 * right / max(n, 1.0) for name, (right, n) in hits.items()}


def along_stream(detail: dict[str, Any], window: int) -> np.ndarray:
    """Accuracy (%) along the stream: the mean correctness of the ``window`` images ending at each
    position (fewer at the start)."""
    correct = correctness(detail).astype(float)
    totals = np.cumsum(np.r_[0.0, correct])
    ends = np.arange(1, len(correct) + 1)
    begins = np.maximum(0, ends - window)
    return 100.0 * (totals[ends] - totals[begins]) / (ends - begins)
