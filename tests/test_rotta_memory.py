"""The class-balanced memory (aqr.methods.rotta_memory): bounds, RoTTA's replacement rule, reset."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from aqr.methods.rotta_memory import ClassBalancedMemory


def offer(memory: ClassBalancedMemory, classes: list[int], uncertainties: list[float] | None = None,
          first_id: int = 0) -> np.ndarray:
    """Offer items whose payload is their id (first_id, first_id + 1, ...)."""
    n = len(classes)
    ids = torch.arange(first_id, first_id + n, dtype=torch.float32)[:, None]
    u = uncertainties if uncertainties is not None else [0.5] * n
    return memory.add(ids, torch.tensor(classes), torch.tensor(u))


@pytest.mark.parametrize("capacity, num_classes", [(64, 10), (20, 10), (7, 3), (5, 10), (1, 2)])
@pytest.mark.parametrize("skew", [0.0, 0.9])
def test_never_more_than_capacity_nor_a_class_share(capacity: int, num_classes: int, skew: float) -> None:
    rng = np.random.default_rng(capacity + num_classes)
    memory = ClassBalancedMemory(capacity, num_classes)
    share = capacity / num_classes
    for step in range(60):
        n = int(rng.integers(1, 20))
        # skewed streams: most items of one class at a time, as a class-correlated stream gives
        favourite = step % num_classes
        classes = np.where(rng.random(n) < skew, favourite, rng.integers(0, num_classes, n))
        offer(memory, classes.tolist(), rng.random(n).tolist(), first_id=1000 * step)
        counts = memory.class_counts()
        assert len(memory) == counts.sum() <= capacity
        assert counts.max() <= math.ceil(share) == memory.max_per_class
        assert memory.items().shape == (len(memory), 1)
        assert np.array_equal(np.bincount(memory.classes(), minlength=num_classes), counts)
    if capacity % num_classes == 0:
        assert memory.max_per_class == capacity // num_classes
    assert len(memory) == capacity  # a long stream fills it


def test_reset_empties_it() -> None:
    memory = ClassBalancedMemory(8, 4)
    offer(memory, [0, 1, 2, 3, 0, 1])
    assert len(memory) == 6
    memory.reset()
    assert len(memory) == 0 and memory.class_counts().sum() == 0 and len(memory.ages()) == 0
    with pytest.raises(ValueError, match="holds no items"):
        memory.items()
    assert np.array_equal(offer(memory, [2]), [0])  # usable again, from the first slot
    assert memory.ages().tolist() == [1]


def test_a_run_of_one_class_keeps_only_its_share() -> None:
    memory = ClassBalancedMemory(8, 4)  # share 2
    slots = offer(memory, [1] * 5, [0.9, 0.8, 0.7, 0.6, 0.5])
    assert memory.class_counts().tolist() == [0, 2, 0, 0]
    # each newcomer is more certain than the worst held item (older and less certain): it replaces it
    assert (slots >= 0).all() and memory.items().flatten().tolist() == [3.0, 4.0]


def test_an_uncertain_newcomer_is_turned_away() -> None:
    memory = ClassBalancedMemory(4, 2)  # share 2
    offer(memory, [0, 0], [0.1, 0.1])
    assert offer(memory, [0], [0.69], first_id=10).tolist() == [-1]  # log 2 = 0.69: far more uncertain
    assert memory.items().flatten().tolist() == [0.0, 1.0]
    assert memory.ages().tolist() == [3, 2]  # the refused offer still ages the memory


def test_full_memory_makes_room_in_the_majority_class() -> None:
    memory = ClassBalancedMemory(5, 2)  # share 2.5: a class is admitted while it holds 0, 1 or 2
    offer(memory, [0, 0, 0, 0], [0.2, 0.1, 0.3, 0.1])
    # class 0 holds 3 (its share rounded up): the fourth replaced the worst, id 2 (the most uncertain)
    assert memory.class_counts().tolist() == [3, 0]
    assert memory.items().flatten().tolist() == [0.0, 1.0, 3.0]
    offer(memory, [1, 1], [0.3, 0.3], first_id=4)
    assert memory.class_counts().tolist() == [3, 2] and len(memory) == 5
    # full, and class 1 is under its share: the majority class 0 gives up its worst item (id 0, the oldest)
    assert offer(memory, [1], [0.05], first_id=6).tolist() == [0]
    assert memory.class_counts().tolist() == [2, 3]
    assert memory.items().flatten().tolist() == [1.0, 3.0, 4.0, 5.0, 6.0]
    # class 1 is at its share now: a newcomer replaces class 1's worst, class 0 keeps its two
    offer(memory, [1], [0.0], first_id=7)
    assert memory.class_counts().tolist() == [2, 3]
    assert memory.items().flatten().tolist() == [1.0, 3.0, 5.0, 6.0, 7.0]


def test_scores_follow_rottas_formula() -> None:
    memory = ClassBalancedMemory(64, 10, lambda_t=2.0, lambda_u=0.5)
    age, u = np.array([0.0, 64.0]), np.array([0.0, math.log(10)])
    expected = 2.0 / (1 + np.exp(-age / 64)) + 0.5 * u / math.log(10)
    assert np.allclose(memory.score(age, u), expected)


def test_items_are_ordered_by_class_then_arrival_and_copied() -> None:
    memory = ClassBalancedMemory(6, 3)
    x = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    memory.add(x, torch.tensor([2, 0, 2, 1]), torch.zeros(4))
    x.zero_()
    assert memory.items().flatten().tolist() == [11.0, 13.0, 10.0, 12.0]
    assert memory.classes().tolist() == [0, 1, 2, 2]
    assert memory.ages().tolist() == [3, 1, 4, 2]


def test_bad_input_is_refused_and_changes_nothing() -> None:
    for kwargs in ({"capacity": 0, "num_classes": 2}, {"capacity": 4, "num_classes": 1},
                   {"capacity": 2.5, "num_classes": 2}, {"capacity": 4, "num_classes": 2, "lambda_t": -1.0},
                   {"capacity": 4, "num_classes": 2, "lambda_u": float("nan")}):
        with pytest.raises(ValueError):
            ClassBalancedMemory(**kwargs)
    memory = ClassBalancedMemory(4, 2)
    offer(memory, [0])
    bad = [
        (torch.zeros(1, 1), [2], [0.1], "classes"),
        (torch.zeros(1, 1), [-1], [0.1], "classes"),
        (torch.zeros(1, 1), [0], [float("nan")], "uncertainties"),
        (torch.zeros(1, 1), [0], [-0.1], "uncertainties"),
        (torch.zeros(2, 1), [0], [0.1], "items"),
        (torch.zeros(1, 2), [0], [0.1], "like those held"),
        (torch.zeros(1, 1, dtype=torch.float64), [0], [0.1], "like those held"),
        (np.zeros((1, 1)), [0], [0.1], "tensor"),
    ]
    for items, classes, uncertainties, match in bad:
        with pytest.raises(ValueError, match=match):
            memory.add(items, torch.tensor(classes), torch.tensor(uncertainties))
    assert len(memory) == 1 and memory.ages().tolist() == [1]


class PerClassLists:
    """The published rule written the plain way: one list per class, every item's age counted up."""

    def __init__(self, capacity: int, num_classes: int) -> None:
        self.capacity, self.num_classes = capacity, num_classes
        self.lists: list[list[list[float]]] = [[] for _ in range(num_classes)]  # [id, uncertainty, age]

    def score(self, age: float, u: float) -> float:
        return 1 / (1 + math.exp(-age / self.capacity)) + u / math.log(self.num_classes)

    def offer(self, item: int, cls: int, u: float) -> None:
        if self.make_room(cls, self.score(0, u)):
            self.lists[cls].append([item, u, 0])
        for entries in self.lists:
            for entry in entries:
                entry[2] += 1

    def make_room(self, cls: int, new_score: float) -> bool:
        if len(self.lists[cls]) < self.capacity / self.num_classes:
            if sum(map(len, self.lists)) < self.capacity:
                return True
            most = max(map(len, self.lists))
            return self.evict([k for k in range(self.num_classes) if len(self.lists[k]) == most], new_score)
        return self.evict([cls], new_score)

    def evict(self, classes: list[int], new_score: float) -> bool:
        worst = None
        for k in classes:
            for i, (_, u, age) in enumerate(self.lists[k]):
                s = self.score(age, u)
                if worst is None or s >= worst[0]:
                    worst = (s, k, i)
        if worst is None:
            return True
        if worst[0] > new_score:
            self.lists[worst[1]].pop(worst[2])
            return True
        return False


@pytest.mark.parametrize("capacity, num_classes", [(64, 10), (12, 4), (5, 3)])
def test_same_items_as_the_rule_written_plainly(capacity: int, num_classes: int) -> None:
    rng = np.random.default_rng(7)
    memory, plain = ClassBalancedMemory(capacity, num_classes), PerClassLists(capacity, num_classes)
    classes = np.repeat(rng.integers(0, num_classes, 100), rng.integers(1, 15, 100))[:800]  # runs of one class
    uncertainties = np.round(rng.random(len(classes)), 2)  # rounded: ties happen and follow the same rule
    offer(memory, classes.tolist(), uncertainties.tolist())
    for i, (c, u) in enumerate(zip(classes, uncertainties)):
        plain.offer(i, int(c), float(u))
    expected = [entry[0] for entries in plain.lists for entry in entries]
    assert memory.items().flatten().long().tolist() == expected
    assert memory.ages().tolist() == [entry[2] for entries in plain.lists for entry in entries]


def test_callers_may_keep_the_payloads_at_the_slots() -> None:
    memory, shadow = ClassBalancedMemory(6, 3), ClassBalancedMemory(6, 3)
    rng = np.random.default_rng(3)
    own = torch.zeros(6, 2)  # e.g. one buffer per layer, of any shape
    for step in range(10):
        classes, u = torch.as_tensor(rng.integers(0, 3, 5)), torch.as_tensor(rng.random(5))
        payload = torch.arange(5 * step, 5 * step + 5, dtype=torch.float32)[:, None]
        slots = memory.add(None, classes, u)
        assert np.array_equal(slots, shadow.add(payload, classes, u))  # the same decisions
        kept = slots >= 0
        own[torch.as_tensor(slots[kept])] = payload[torch.as_tensor(kept)].expand(-1, 2)
    assert torch.equal(own[torch.as_tensor(memory.slots())][:, :1], shadow.items())
    with pytest.raises(ValueError, match="holds no items"):
        memory.items()
    with pytest.raises(ValueError, match="every time or never"):
        memory.add(torch.zeros(1, 1), [0], [0.1])
    with pytest.raises(ValueError, match="every time or never"):
        shadow.add(None, [0], [0.1])
