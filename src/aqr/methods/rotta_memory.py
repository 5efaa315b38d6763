"""A class-balanced memory of recent test items: RoTTA's category-balanced sampling with timeliness and
uncertainty (CSTU; Yuan et al., CVPR 2023).

The memory holds at most ``capacity`` items (any tensors of one shape: images, activations, per-image
statistics), each filed under the class predicted for it. Items arrive one at a time, in stream order:

* a class holding fewer than ``capacity / num_classes`` items is admitted; when the memory is full,
  it takes the place of the worst item of the majority classes (those holding the most items);
* a class already at its share takes the place of its own worst item;
* "worst" is the highest score ``lambda_t / (1 + exp(-age / capacity)) + lambda_u * u / log(num_classes)``,
  ``age`` the number of items offered since the item entered and ``u`` its uncertainty (the entropy
  of its prediction): old and uncertain items go first. A newcomer scores with age 0; it replaces the
  worst item only if that item scores strictly higher, else it is turned away. Ties go to the item
  of the highest class, then the newest, as in RoTTA's code.

So no class ever holds more than ``ceil(capacity / num_classes)`` items (exactly the share when
``num_classes`` divides ``capacity``), and a run of one predicted class can displace other classes
only down to the majority's level. Not thread-safe: its owner serializes access.
"""

from __future__ import annotations

import math

import numpy as np
import torch


class ClassBalancedMemory:
    """At most ``capacity`` recent items, balanced over ``num_classes`` predicted classes (see module docs).

    ``lambda_t`` and ``lambda_u`` weigh an item's age and uncertainty when choosing whom to replace
    (RoTTA: 1 and 1). :meth:`add` offers items, :meth:`items` returns what is held, :meth:`reset`
    empties it. A caller that keeps several payloads per item (e.g. statistics of every layer) may
    offer ``items=None`` and store them itself at the slots :meth:`add` returns (:meth:`slots` lists
    the occupied ones).
    """

    def __init__(self, capacity: int, num_classes: int, lambda_t: float = 1.0, lambda_u: float = 1.0) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ValueError(f"capacity must be a positive integer, got {capacity!r}")
        if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 2:
            raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
        for name, value in (("lambda_t", lambda_t), ("lambda_u", lambda_u)):
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
        self.capacity = int(capacity)
        self.num_classes = int(num_classes)
        self.lambda_t = float(lambda_t)
        self.lambda_u = float(lambda_u)
        self.reset()

    # ---- state -------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every item (the state right after construction)."""
        self._class = np.full(self.capacity, -1, dtype=np.int64)  # -1: free slot
        self._born = np.zeros(self.capacity, dtype=np.int64)  # the clock when the item entered
        self._uncertainty = np.zeros(self.capacity, dtype=np.float64)
        self._counts = np.zeros(self.num_classes, dtype=np.int64)
        self._clock = 0  # items offered so far
        self._payload: torch.Tensor | None = None

    @property
    def per_class(self) -> float:
        """A class's share, ``capacity / num_classes``: a class is admitted while it holds fewer."""
        return self.capacity / self.num_classes

    @property
    def max_per_class(self) -> int:
        """The most items one class can hold: ``ceil(capacity / num_classes)``."""
        return math.ceil(self.per_class)

    def __len__(self) -> int:
        return int(self._counts.sum())

    def class_counts(self) -> np.ndarray:
        """Items held per class, shape ``(num_classes,)``."""
        return self._counts.copy()

    def _held(self) -> np.ndarray:
        slots = np.flatnonzero(self._class >= 0)
        return slots[np.lexsort((self._born[slots], self._class[slots]))]

    def slots(self) -> np.ndarray:
        """The occupied slots (in ``[0, capacity)``), ordered by class then arrival: the order of :meth:`items`."""
        return self._held()

    def items(self) -> torch.Tensor:
        """The items held, shape ``(len(self), *item_shape)``, ordered by class then arrival."""
        if self._payload is None:
            raise ValueError("the memory holds no items: add some first (offered with items=None, they are the "
                             "caller's to keep at slots())")
        return self._payload[torch.as_tensor(self._held(), device=self._payload.device)]

    def classes(self) -> np.ndarray:
        """The class of every item, in :meth:`items` order."""
        return self._class[self._held()].copy()

    def ages(self) -> np.ndarray:
        """The age of every item (items offered since it entered), in :meth:`items` order."""
        return self._clock - self._born[self._held()]

    def uncertainties(self) -> np.ndarray:
        """The uncertainty of every item, in :meth:`items` order."""
        return self._uncertainty[self._held()].copy()

    # ---- updates -----------------------------------------------------------------------
    def score(self, age: np.ndarray | float, uncertainty: np.ndarray | float) -> np.ndarray:
        """Replacement score (higher goes first): timeliness plus normalized uncertainty."""
        age = np.asarray(age, dtype=np.float64)
        return (self.lambda_t / (1.0 + np.exp(-age / self.capacity))
                + self.lambda_u * np.asarray(uncertainty, dtype=np.float64) / math.log(self.num_classes))

    def add(self, items: torch.Tensor | None, classes: torch.Tensor | np.ndarray,
            uncertainties: torch.Tensor | np.ndarray) -> np.ndarray:
        """Offer ``n`` items one by one, in order, with their predicted classes and uncertainties (e.g.
        prediction entropies); returns each item's slot, or -1 if turned away.

        ``items`` (shape ``(n, *item_shape)``) are copied in; ``None`` stores nothing (the caller keeps
        the payloads at the returned slots). Raises ``ValueError`` (and changes nothing) for classes
        outside ``[0, num_classes)``, negative or non-finite uncertainties, or items of another shape,
        dtype or device than those held (or none where items are held, or the reverse).
        """
        if items is not None and not isinstance(items, torch.Tensor):
            raise ValueError(f"items must be a tensor or None, got {type(items).__name__}")
        classes = np.asarray(torch.as_tensor(classes).detach().cpu(), dtype=np.int64).reshape(-1)
        uncertainties = np.asarray(torch.as_tensor(uncertainties).detach().cpu(), dtype=np.float64).reshape(-1)
        n = len(classes) if items is None else len(items)
        if not (n == len(classes) == len(uncertainties)):
            raise ValueError(f"{n} items but {len(classes)} classes and {len(uncertainties)} uncertainties")
        if classes.size and (classes.min() < 0 or classes.max() >= self.num_classes):
            raise ValueError(f"classes must lie in [0, {self.num_classes}), got [{classes.min()}, {classes.max()}]")
        if not np.all(np.isfinite(uncertainties) & (uncertainties >= 0)):
            raise ValueError("uncertainties must be finite and >= 0")
        self._check_payload(items)
        slots = np.full(len(classes), -1, dtype=np.int64)
        for i, (cls, uncertainty) in enumerate(zip(classes, uncertainties)):
            slot = self._admit(int(cls), float(uncertainty))
            if slot >= 0:
                self._class[slot], self._born[slot], self._uncertainty[slot] = cls, self._clock, uncertainty
                self._counts[cls] += 1
                if items is not None:
                    self._payload[slot] = items[i].detach()
                slots[i] = slot
            self._clock += 1
        return slots

    def _check_payload(self, items: torch.Tensor | None) -> None:
        if (items is None) != (self._payload is None) and self._clock > 0:
            raise ValueError("offer items every time or never: this memory " +
                             ("holds items" if self._payload is not None else "was offered items=None"))
        if items is None:
            return
        if self._payload is None:
            if len(items):
                self._payload = torch.zeros((self.capacity, *items.shape[1:]), dtype=items.dtype, device=items.device)
            return
        held = self._payload
        if items.shape[1:] != held.shape[1:] or items.dtype != held.dtype or items.device != held.device:
            raise ValueError(f"items must be {held.dtype} {tuple(held.shape[1:])} on {held.device} like those held, "
                             f"got {items.dtype} {tuple(items.shape[1:])} on {items.device}")

    def _admit(self, cls: int, uncertainty: float) -> int:
        """The slot for a newcomer of class ``cls`` (freed by evicting if needed), or -1 to turn it away."""
        if self._counts[cls] < self.per_class:
            if len(self) < self.capacity:
                return int(np.flatnonzero(self._class < 0)[0])
            majority = np.flatnonzero(self._counts == self._counts.max())
            candidates = np.flatnonzero(np.isin(self._class, majority))
        else:
            candidates = np.flatnonzero(self._class == cls)
        # RoTTA scans by class, then by arrival, and takes the last of equal scores
        candidates = candidates[np.lexsort((self._born[candidates], self._class[candidates]))]
        scores = self.score(self._clock - self._born[candidates], self._uncertainty[candidates])
        worst = len(scores) - 1 - int(np.argmax(scores[::-1]))
        if scores[worst] <= self.score(0, uncertainty):
            return -1
        slot = int(candidates[worst])
        self._counts[self._class[slot]] -= 1
        self._class[slot] = -1
        return slot
