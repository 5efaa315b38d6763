"""Batch size 1 through the sliding window (ProtocolConfig.window, the reference's TEST.WINDOW_LENGTH)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aqr.methods import ProtocolConfig, create

from .test_methods import conv_net, images

pytestmark = pytest.mark.usefixtures("one_thread")


def one_at_a_time(method, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([method(x[i:i + 1]) for i in range(len(x))])


def test_tent_adapts_once_per_window_and_scores_the_others_from_the_window() -> None:
    net, x = conv_net("bn"), images(n=12)
    windowed = create("tent", net, protocol="online", window=4, lr=0.05, batch_size=4)
    batched = create("tent", net, protocol="online", lr=0.05, batch_size=4)
    out = one_at_a_time(windowed, x)
    # images 1-3: the initial weights on the growing window [x1], [x1, x2], [x1, x2, x3] (BN on its statistics)
    for i in range(3):
        with torch.no_grad():
            assert torch.allclose(out[i], batched.predict_held(x[:i + 1])[i], atol=1e-6)
    # image 4 fills the window: one adaptation step on x1..x4, scored from that step's forward, as at batch 4
    assert torch.allclose(out[3], batched(x[:4])[3], atol=1e-6)
    # images 5-7 replace the oldest slots: [x5, x2, x3, x4], [x5, x6, x3, x4], ... with the weights after one step
    for i, window in ((4, [4, 1, 2, 3]), (5, [4, 5, 2, 3]), (6, [4, 5, 6, 3])):
        with torch.no_grad():
            assert torch.allclose(out[i], batched.predict_held(x[window])[i - 4], atol=1e-6)
    # image 8: the second step, on x5..x8
    assert torch.allclose(out[7], batched(x[4:8])[3], atol=1e-6)
    assert not torch.allclose(out[8], create("tent", net, protocol="online", lr=0.05, batch_size=4).predict_held(
        x[[8, 5, 6, 7]])[0], atol=1e-4)  # the weights moved


def test_a_stateless_method_scores_each_image_from_the_window() -> None:
    net, x = conv_net("bn"), images(n=7)
    out = one_at_a_time(create("ttn", net, window=3), x)
    ttn = create("ttn", net)
    windows = [[0], [0, 1], [0, 1, 2], [3, 1, 2], [3, 4, 2], [3, 4, 5], [6, 4, 5]]
    for i, window in enumerate(windows):
        assert torch.allclose(out[i], ttn(x[window])[window.index(i)], atol=1e-6)


def test_reset_clears_the_window_and_batches_ignore_it() -> None:
    net, x = conv_net("bn"), images(n=8)
    m = create("ttn", net, window=4)
    first = one_at_a_time(m, x[:2])
    m.reset()
    assert torch.equal(one_at_a_time(m, x[:2]), first)
    assert torch.equal(m(x), create("ttn", net)(x))  # a batch of 8: no window
    # episodic: every image starts from the initial weights, the window stays
    episodic = create("tent", net, protocol="episodic", window=2, lr=0.05, batch_size=2)
    out = one_at_a_time(episodic, x[:4])
    fresh = create("tent", net, protocol="episodic", lr=0.05, batch_size=2)
    assert torch.allclose(out[1], fresh(x[:2])[1], atol=1e-6)
    assert torch.allclose(out[3], fresh(x[2:4])[1], atol=1e-6)


def test_window_values_are_checked() -> None:
    for bad in (0, -1, 2.5, True, "64", 10**6):
        with pytest.raises(ValueError, match="window"):
            ProtocolConfig(window=bad)
    assert create("source", conv_net("bn"), window=64).protocol.window == 64


class BatchNorm1dHead(nn.Module):
    """A CNN whose head normalizes pooled features with BatchNorm1d: one image has one value per channel there."""

    def __init__(self) -> None:
        super().__init__()
        self.body = conv_net("bn")
        self.body.fc = nn.Identity()
        self.norm = nn.BatchNorm1d(8)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(self.body(x)))


def test_one_image_through_batch_statistics_of_a_vector_is_refused_naming_the_smallest_batch() -> None:
    net, x = BatchNorm1dHead().eval(), images(n=4)
    for name, extra in (("ttn", {}), ("tent", {"batch_size": 1})):
        m = create(name, net, protocol="online", **extra)
        with pytest.raises(ValueError, match="runs from batch 2, or at batch 1 with a sliding window"):
            m(x[:1])
        assert m(x[:2]).shape == (2, 5)
        windowed = create(name, net, protocol="online", window=64, **extra)
        assert torch.isfinite(one_at_a_time(windowed, x)).all()


def test_a_saved_state_continues_through_the_window_bit_for_bit() -> None:
    net, x = conv_net("bn"), images(n=11)
    whole = create("tent", net, protocol="online", window=4, lr=0.05, batch_size=4)
    expected = one_at_a_time(whole, x)
    first = create("tent", net, protocol="online", window=4, lr=0.05, batch_size=4)
    one_at_a_time(first, x[:6])  # mid-window: slots 0 and 1 replaced since the last step
    resumed = create("tent", net, protocol="online", window=4, lr=0.05, batch_size=4)
    resumed.load_state_dict(first.state_dict())
    assert torch.equal(one_at_a_time(resumed, x[6:]), expected[6:])
