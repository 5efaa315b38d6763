"""aqr.core.hooks.instrumented: what a block installs on a model is gone afterwards, however it ends."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from aqr.core.hooks import instrumented


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))


def test_hooks_forwards_and_modes_are_restored_after_an_error():
    net = _net().train()
    net[2].eval()  # a mixed state must come back as it was
    own = lambda x: x  # noqa: E731 - an instance-level forward the user set
    net[2].forward = own
    seen = []
    with pytest.raises(RuntimeError, match="boom"):
        with instrumented(net) as tools:
            assert not any(m.training for m in net.modules())
            tools.hook("1", lambda _m, _i, out: seen.append(out.shape) or out * 0)
            tools.replace_forward("0", lambda module, forward: lambda x: forward(x) + 1)
            tools.replace_forward("2", lambda module, forward: lambda x: forward(x) * 2)
            y = net(torch.randn(3, 4))
            assert seen == [(3, 4)] and y.shape == (3, 2)
            raise RuntimeError("boom")
    assert [m.training for m in net] == [True, True, False, True] and net.training
    assert "forward" not in net[0].__dict__ and net[2].forward is own
    assert not net[1]._forward_hooks
    x = torch.randn(3, 4)
    net.eval()
    torch.testing.assert_close(net(x), net[3](net[1](net[0](x))))


def test_without_eval_mode_the_flags_are_left_alone():
    net = _net().train()
    with instrumented(net, eval_mode=False) as tools:
        tools.hook("0", lambda _m, _i, out: None)
        assert all(m.training for m in net.modules())
    assert not net[0]._forward_hooks
