"""The evaluation loop: a method fed batches in order, scored by top-1 accuracy per image."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from aqr.data.arrays import to_float


def evaluate(method: nn.Module, images: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor,
             batch_size: int, progress: bool = False, desc: str = "") -> tuple[float, int]:
    """Top-1 accuracy (percent) of ``method`` fed ``images`` in order, ``batch_size`` at a time.

    ``images``: uint8 NHWC array or float NCHW tensor in [0, 1]. The last batch may be smaller.
    Returns ``(accuracy, number of images)``.
    """
    return evaluate_batches(method, array_batches(images, labels, batch_size), progress, desc,
                            total=-(-len(labels) // batch_size))


def array_batches(images: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor,
                  batch_size: int) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """``(images, labels)`` batches of arrays in order, images as float NCHW in [0, 1]; the last may be smaller."""
    labels = torch.as_tensor(np.asarray(labels)).long()
    if len(labels) == 0:
        raise ValueError("no images to evaluate")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:  # checked above, read lazily
        for start in range(0, len(labels), batch_size):
            x = images[start : start + batch_size]
            yield (to_float(x) if isinstance(x, np.ndarray) else x), labels[start : start + batch_size]

    return batches()


def evaluate_batches(method: nn.Module, batches: Iterable[tuple[torch.Tensor, Any]], progress: bool = False,
                     desc: str = "", total: int | None = None,
                     device: torch.device | str | None = None) -> tuple[float, int]:
    """Top-1 accuracy (percent) and image count of ``method`` on ``(images, labels)`` batches, in order
    (e.g. a DataLoader). Inputs go to ``device`` (default: where the method's parameters are)."""
    correct = image_correct(method, batches, progress, desc, total, device)
    return 100.0 * float(correct.mean()), int(correct.size)


def image_correct(method: nn.Module, batches: Iterable[tuple[torch.Tensor, Any]], progress: bool = False,
                  desc: str = "", total: int | None = None, device: torch.device | str | None = None,
                  adapted: Sequence[bool] | None = None) -> np.ndarray:
    """Whether ``method``'s top-1 prediction is right, per image, in the order of ``batches`` (bool array).

    ``adapted`` (one per batch; the realtime protocol): the batches the method adapts on; the others get
    its ``forward_held`` predictions. Raises ``ValueError`` when there is no image, and for a label that is
    not one of the model's classes (below 0, or at least its number of logits), which no prediction could match.
    """
    from tqdm.auto import tqdm

    if device is None:
        param = next(method.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
    found = []
    for k, (x, y) in enumerate(tqdm(batches, desc=desc or "batches", leave=False, disable=not progress, unit="batch",
                                    total=total)):
        x = x.to(device, non_blocking=True)
        logits = method(x) if adapted is None or adapted[k] else method.forward_held(x)
        labels = torch.as_tensor(y).long()
        if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= logits.shape[1]):
            bad = int(labels.min()) if int(labels.min()) < 0 else int(labels.max())
            raise ValueError(f"the label {bad} is not one of the model's {logits.shape[1]} classes (0 to "
                             f"{logits.shape[1] - 1}); check the labels, or the model, given")
        found.append((logits.argmax(1).cpu() == labels).numpy())
    if sum(len(f) for f in found) == 0:
        raise ValueError("no images to evaluate")
    return np.concatenate(found).astype(bool)
