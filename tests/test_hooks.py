"""aqr.core.hooks.instrumented: what a block installs on a model is gone afterwards, however it ends,
and acts only in the thread that entered the block."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from aqr.core.hooks import instrumented


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))


def test_hooks_and_modes_are_restored_after_an_error():
    net = _net().train()
    net[2].eval()  # a mixed state must come back as it was
    own = lambda x: x  # noqa: E731 - an instance-level forward the user set
    net[2].forward = own
    seen = []
    with pytest.raises(RuntimeError, match="boom"):
        with instrumented(net) as tools:
            assert not any(m.training for m in net.modules())
            tools.hook("1", lambda _m, _i, out: seen.append(out.shape) or out * 0)
            tools.hook("1", lambda _m, _i, out: out + 1)  # hooks chain: this one sees the zeros
            y = net[1](net[0](torch.randn(3, 4)))
            assert seen == [(3, 4)] and torch.equal(y, torch.ones(3, 4))
            raise RuntimeError("boom")
    assert [m.training for m in net] == [True, True, False, True] and net.training
    assert "forward" not in net[0].__dict__ and net[2].forward is own
    assert not net[1]._forward_hooks


def test_without_eval_mode_the_flags_are_left_alone():
    net = _net().train()
    with instrumented(net, eval_mode=False) as tools:
        tools.hook("0", lambda _m, _i, out: None)
        assert all(m.training for m in net.modules())
    assert not net[0]._forward_hooks


def test_a_block_acts_only_in_its_own_thread_and_ends_in_any_order():
    net = _net().eval()
    x = torch.randn(3, 4)
    plain = net(x)
    outer, inner = instrumented(net), instrumented(net)
    tools = outer.__enter__()
    tools.hook("3", lambda _m, _i, out: out * 0)
    other: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: other.append(net(x)))
    thread.start()
    thread.join()
    torch.testing.assert_close(other[0], plain)  # another thread sees the plain model
    assert torch.equal(net(x), torch.zeros(3, 2))
    inner.__enter__()
    outer.__exit__(None, None, None)  # out of order: the hooks of the ended block stop, the rest stays
    torch.testing.assert_close(net(x), plain)
    assert net[3]._forward_hooks
    inner.__exit__(None, None, None)
    assert not net[3]._forward_hooks
