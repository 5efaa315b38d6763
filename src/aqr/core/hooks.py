"""The one way aqr instruments a user's model: eval mode, forward hooks and replaced forwards, all undone after.

Calibration, recalibration, the layer-order probe and the tail-deviation figure all run a model
with something attached to some of its layers. :func:`instrumented` gives each of them the same
guarantee: whatever was installed through it is removed, and every module's train/eval flag is
restored, however the block ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

Hook = Callable[[nn.Module, Any, Any], Any]  # forward hook: (module, inputs, output) -> new output or None
Forward = Callable[..., Any]


class Instrumentation:
    """What an :func:`instrumented` block installs on a model; :meth:`undo` removes all of it."""

    def __init__(self, model: nn.Module) -> None:
        self.modules: dict[str, nn.Module] = dict(model.named_modules())
        self._handles: list[Any] = []
        self._own_forwards: dict[nn.Module, Forward | None] = {}  # module -> its instance-level forward, if any

    def hook(self, name: str, fn: Hook) -> None:
        """Call ``fn(module, inputs, output)`` after module ``name``'s forward; a returned tensor replaces the output."""
        self._handles.append(self.modules[name].register_forward_hook(fn))

    def replace_forward(self, name: str, make: Callable[[nn.Module, Forward], Forward]) -> None:
        """Run ``make(module, its current forward)`` instead of module ``name``'s forward (its hooks still run)."""
        module = self.modules[name]
        self._own_forwards.setdefault(module, module.__dict__.get("forward"))
        module.forward = make(module, module.forward)  # type: ignore[method-assign]

    def undo(self) -> None:
        """Remove every hook and replaced forward installed through this object."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module, own in self._own_forwards.items():
            if own is None:
                del module.forward
            else:
                module.forward = own  # type: ignore[method-assign]
        self._own_forwards.clear()


@contextlib.contextmanager
def instrumented(model: nn.Module, eval_mode: bool = True) -> Iterator[Instrumentation]:
    """Within the block, ``model`` is in eval mode (unless ``eval_mode`` is false) and carries what is
    installed through the yielded :class:`Instrumentation`; afterwards it is as before."""
    flags = {m: m.training for m in model.modules()} if eval_mode else {}
    tools = Instrumentation(model)
    try:
        if eval_mode:
            model.eval()  # BatchNorm must neither update nor read batch statistics
        yield tools
    finally:
        tools.undo()
        for module, flag in flags.items():
            module.train(flag)
