"""Stream orders (aqr.data.streams): i.i.d., class-correlated by Dirichlet sampling as RoTTA builds it, mixed."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from aqr.data.streams import (MAX_SLOTS, StreamOrder, check_delta, dirichlet_order, mean_run_length, run_lengths,
                              take)

CLASSES = 10


def balanced_labels(per_class: int = 200, seed: int = 0) -> np.ndarray:
    labels = np.repeat(np.arange(CLASSES), per_class)
    return labels[np.random.default_rng(seed).permutation(len(labels))]


def window_count_pvalue(ordered: list[np.ndarray], window: int) -> float:
    """Chi-square p-value of per-window class counts against the hypergeometric law of i.i.d. order."""
    counts = []
    for labels in ordered:
        w = labels[: len(labels) // window * window].reshape(-1, window)
        counts.extend((w == c).sum(1) for c in range(CLASSES))
    counts = np.concatenate(counts)
    n = len(ordered[0])
    law = stats.hypergeom(n, n // CLASSES, window)
    top = 5  # bins 0..4 and ">= 5", each expected well above 5 observations
    observed = np.array([np.sum(counts == k) for k in range(top)] + [np.sum(counts >= top)])
    expected = np.array([law.pmf(k) for k in range(top)] + [law.sf(top - 1)]) * len(counts)
    return float(stats.chisquare(observed, expected).pvalue)


def test_iid_windows_match_iid_sampling_and_correlated_windows_do_not() -> None:
    labels = balanced_labels()
    iid = [labels[dirichlet_order(labels, math.inf, seed)] for seed in range(5)]
    correlated = [labels[dirichlet_order(labels, 1.0, seed)] for seed in range(5)]
    assert window_count_pvalue(iid, window=20) > 1e-3
    assert window_count_pvalue(correlated, window=20) < 1e-9  # the test can tell the difference


def test_mean_run_length_grows_as_delta_shrinks() -> None:
    labels = balanced_labels()
    n, per_class = len(labels), len(labels) // CLASSES
    mean_runs = {delta: np.mean([mean_run_length(labels[dirichlet_order(labels, delta, seed)]) for seed in range(5)])
                 for delta in (math.inf, 1.0, 0.1, 0.01)}
    # i.i.d.: neighbours share a class with probability (per_class - 1) / (n - 1)
    expected_runs = 1 + (n - 1) * (1 - (per_class - 1) / (n - 1))
    assert mean_runs[math.inf] == pytest.approx(n / expected_runs, abs=0.03)
    assert mean_runs[math.inf] < mean_runs[1.0] < mean_runs[0.1] < mean_runs[0.01]
    assert mean_runs[0.1] > 10 * mean_runs[math.inf]


def assert_rotta_slots(labels: np.ndarray, delta: float, seed: int, classes: int, slots: int) -> None:
    """Each block is cut into ``slots`` slots; class c's images are split over them with Dirichlet
    proportions (floor of the cumulative shares); inside a slot each class's part is one run, and a
    class's images keep their order."""
    order = dirichlet_order(labels, delta, seed)
    assert np.array_equal(np.sort(order), np.arange(len(labels)))
    proportions = np.random.default_rng(seed).dirichlet(np.full(slots, delta), size=classes)
    parts = np.zeros((slots, classes), dtype=int)  # parts[slot, class]
    for c in range(classes):
        size = np.sum(labels == c)
        cuts = np.r_[0, (np.cumsum(proportions[c])[:-1] * size).astype(int), size]
        parts[:, c] = np.diff(cuts)
    start = 0
    for slot in range(slots):
        stop = start + parts[slot].sum()
        piece = order[start:stop]
        got = labels[piece]
        assert np.array_equal(np.bincount(got, minlength=classes), parts[slot])
        assert len(run_lengths(got)) == np.count_nonzero(parts[slot])  # one contiguous run per class
        for c in np.unique(got):
            assert np.all(np.diff(piece[got == c]) > 0)
        start = stop
    assert start == len(labels)


@pytest.mark.parametrize("delta", [0.01, 0.1, 1.0, 10.0])
def test_dirichlet_order_is_rottas_slot_construction(delta: float) -> None:
    assert_rotta_slots(balanced_labels(per_class=37, seed=3), delta, seed=11, classes=CLASSES, slots=CLASSES)


def test_slots_are_capped_like_rottas() -> None:
    labels = np.random.default_rng(0).permutation(np.arange(1500) % 150)
    assert MAX_SLOTS == 100
    assert_rotta_slots(labels, 0.5, seed=1, classes=150, slots=MAX_SLOTS)


def test_orders_are_seeded() -> None:
    labels = balanced_labels()
    for delta in (math.inf, 0.1):
        assert np.array_equal(dirichlet_order(labels, delta, 4), dirichlet_order(labels, delta, 4))
        assert not np.array_equal(dirichlet_order(labels, delta, 4), dirichlet_order(labels, delta, 5))
    order = StreamOrder(0.1)
    assert np.array_equal(order.positions(labels, 7), order.positions(labels, 7))


def test_edge_cases_and_bad_input() -> None:
    assert len(dirichlet_order(np.zeros(0, dtype=int), 0.1, 0)) == 0
    assert np.array_equal(dirichlet_order(np.zeros(5, dtype=int), 0.1, 0), np.arange(5))
    for bad in (-1, -1e-9, float("nan"), "x", None):
        with pytest.raises(ValueError, match="delta"):
            check_delta(bad)
    assert check_delta(0) == 0.0
    with pytest.raises(ValueError, match="integers"):
        dirichlet_order(np.array([0.5, 1.0]), 0.1, 0)
    with pytest.raises(ValueError, match="non-negative"):
        dirichlet_order(np.array([0, -1]), 0.1, 0)
    with pytest.raises(ValueError, match="num_classes"):
        dirichlet_order(np.array([0, 5]), 0.1, 0, num_classes=3)
    with pytest.raises(ValueError, match="one-dimensional"):
        dirichlet_order(np.zeros((2, 2), dtype=int), 0.1, 0)


def test_delta_zero_sorts_by_class_keeping_each_class_in_the_order_given() -> None:
    labels = np.array([2, 0, 1, 0, 2, 1, 0])
    order = dirichlet_order(labels, 0, 0)
    assert order.tolist() == [1, 3, 6, 2, 5, 0, 4]  # class 0 at 1, 3, 6; class 1 at 2, 5; class 2 at 0, 4
    assert np.array_equal(order, dirichlet_order(labels, 0, 123))  # no random numbers
    blocks = [balanced_labels(), balanced_labels()]
    rows = StreamOrder.parse("mixed,delta=0").stream(blocks, 0)
    stream_labels = take(blocks, rows)
    assert np.all(np.diff(stream_labels) >= 0)  # the pooled stream sorted by class ...
    first = rows[stream_labels == 0]
    assert len(set(first[:, 0].tolist())) == 2  # ... each class's run mixing both corruptions
    assert not np.array_equal(first, first[np.lexsort((first[:, 1], first[:, 0]))])  # in shuffled order


def test_stream_order_text_round_trips() -> None:
    for text, order in [("iid", StreamOrder()), ("delta=0.1", StreamOrder(0.1)), ("mixed", StreamOrder(mixed=True)),
                        ("mixed,delta=0.01", StreamOrder(0.01, True))]:
        assert StreamOrder.parse(text) == order and str(order) == text
    assert StreamOrder.parse("delta=inf") == StreamOrder() and StreamOrder.parse(" delta=1e-1 ") == StreamOrder(0.1)
    assert StreamOrder.parse("delta=0.1,mixed") == StreamOrder(0.1, True)
    assert StreamOrder.parse("delta=0") == StreamOrder(0.0) and str(StreamOrder(0.0)) == "delta=0"
    for bad in ("sorted", "delta", "delta=-2", "mixed=yes"):
        with pytest.raises(ValueError):
            StreamOrder.parse(bad)
    with pytest.raises(ValueError, match="mixed"):
        StreamOrder(mixed=True).positions(balanced_labels(), 0)


def blocks_of(sizes: tuple[int, ...]) -> list[np.ndarray]:
    return [balanced_labels(size // CLASSES, seed=k) for k, size in enumerate(sizes)]


@pytest.mark.parametrize("text", ["iid", "delta=0.1"])
def test_continual_stream_keeps_blocks_in_order(text: str) -> None:
    blocks = blocks_of((200, 300, 100))
    order = StreamOrder.parse(text)
    stream = order.stream(blocks, seed=2)
    assert stream.shape == (600, 2)
    assert np.array_equal(stream[:, 0], np.repeat([0, 1, 2], [200, 300, 100]))
    for k, b in enumerate(blocks):
        assert np.array_equal(np.sort(stream[stream[:, 0] == k, 1]), np.arange(len(b)))
    # a block's order does not depend on the other blocks
    other = order.stream([blocks[0], blocks_of((500,))[0], blocks[2]], seed=2)
    assert np.array_equal(other[:200], stream[:200])
    assert np.array_equal(other[-100:], stream[-100:])
    assert np.array_equal(take(blocks, stream), np.concatenate([b[stream[stream[:, 0] == k, 1]]
                                                                for k, b in enumerate(blocks)]))


def test_mixed_stream_interleaves_corruptions() -> None:
    blocks = blocks_of((400, 400, 400, 400))
    stream = StreamOrder(mixed=True).stream(blocks, seed=0)
    pairs = {tuple(p) for p in stream}
    assert len(pairs) == 1600 and pairs == {(k, i) for k in range(4) for i in range(400)}
    assert mean_run_length(stream[:, 0]) < 1.5  # i.i.d. over 4 equal blocks: about 4/3
    correlated = StreamOrder(0.01, mixed=True).stream(blocks, seed=0)
    labels = take(blocks, correlated)
    assert mean_run_length(labels) > 20 * mean_run_length(take(blocks, stream))
    assert mean_run_length(correlated[:, 0]) < 1.5  # still mixed over corruptions


def test_take_checks_its_indices() -> None:
    blocks = [np.arange(3), np.arange(2)]
    with pytest.raises(IndexError, match="blocks"):
        take(blocks, np.array([[2, 0]]))
    with pytest.raises(IndexError, match="positions"):
        take(blocks, np.array([[1, 2]]))
    with pytest.raises(IndexError, match="positions"):
        take(blocks, np.array([[0, -1]]))
    with pytest.raises(ValueError, match="rows"):
        take(blocks, np.array([0, 1]))
