"""The one way aqr instruments a user's model: eval mode and forward hooks, all undone after.

Calibration, :func:`aqr.recalibrating`, the layer-order probe and the tail-deviation figure all run a
model with something attached to some of its layers. :func:`instrumented` gives each of them the same
guarantees, also when several blocks are active on one model at once, from one thread or several,
and whatever order they end in:

* one registry entry per model (a ``WeakKeyDictionary`` guarded by a lock) counts the active
  blocks. The first block that asks for eval mode saves every module's train/eval flag and puts the
  model in eval mode; the last such block to end restores the flags exactly. The last block of any
  kind removes the hooks. Nothing else is ever set on the user's modules (no ``forward`` swaps);
* each hooked module carries one *dispatcher* forward hook, installed once. It runs the hooks of
  the blocks that the *calling thread* has active, in the order they were entered (a hook that
  returns a tensor replaces the output the next one sees). A thread outside every block sees the
  plain model; two threads in blocks with different hooks each see their own.

Caveat: while any block that asked for eval mode is active, the model is in eval mode for every
thread (the flag belongs to the model, not to a thread).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

Hook = Callable[[nn.Module, Any, Any], Any]  # forward hook: (module, inputs, output) -> new output or None


class Instrumentation:
    """What one :func:`instrumented` block installs on a model: forward hooks that run in its thread."""

    def __init__(self, model: nn.Module, entry: _ModelEntry) -> None:
        self.modules: dict[str, nn.Module] = dict(model.named_modules())
        self.hooks: dict[nn.Module, list[Hook]] = {}
        self._entry = entry
        self._stack: list[Instrumentation] | None = None  # the entering thread's active blocks

    def hook(self, name: str, fn: Hook) -> None:
        """Call ``fn(module, inputs, output)`` after module ``name``'s forward in this block's thread;
        a returned tensor replaces the output."""
        module = self.modules[name]
        self.hooks.setdefault(module, []).append(fn)
        self._entry.dispatch(module)


class _ModelEntry:
    """What aqr has set on one model, shared by every block active on it."""

    def __init__(self) -> None:
        self.blocks = 0
        self.eval_blocks = 0
        self.flags: dict[nn.Module, bool] = {}
        self.handles: dict[nn.Module, Any] = {}
        self.local = threading.local()  # .blocks: this thread's active blocks, in entry order

    def thread_blocks(self) -> list[Instrumentation]:
        blocks = getattr(self.local, "blocks", None)
        if blocks is None:
            blocks = self.local.blocks = []
        return blocks

    def dispatch(self, module: nn.Module) -> None:
        """Install ``module``'s dispatcher once (under the registry lock)."""
        with _LOCK:
            if module not in self.handles:
                self.handles[module] = module.register_forward_hook(self._dispatcher)

    def _dispatcher(self, module: nn.Module, inputs: Any, output: Any) -> Any:
        blocks = getattr(self.local, "blocks", None)
        if not blocks:
            return None
        replaced = False
        for block in tuple(blocks):  # a copy: another thread may end one of them meanwhile
            for fn in block.hooks.get(module, ()):
                new = fn(module, inputs, output)
                if new is not None:
                    output, replaced = new, True
        return output if replaced else None


_LOCK = threading.RLock()
_MODELS: weakref.WeakKeyDictionary[nn.Module, _ModelEntry] = weakref.WeakKeyDictionary()


def _enter(model: nn.Module, eval_mode: bool) -> Instrumentation:
    with _LOCK:
        entry = _MODELS.get(model)
        if entry is None:
            entry = _MODELS[model] = _ModelEntry()
        entry.blocks += 1
        if eval_mode:
            if entry.eval_blocks == 0:
                entry.flags = {m: m.training for m in model.modules()}
                model.eval()  # BatchNorm must neither update nor read batch statistics
            entry.eval_blocks += 1
        block = Instrumentation(model, entry)
        block._stack = entry.thread_blocks()
        block._stack.append(block)
        return block


def _exit(model: nn.Module, block: Instrumentation, eval_mode: bool) -> None:
    with _LOCK:
        entry = block._entry
        if block._stack is not None:
            block._stack.remove(block)
        if eval_mode:
            entry.eval_blocks -= 1
            if entry.eval_blocks == 0:
                for module, flag in entry.flags.items():
                    module.training = flag  # exactly as found (no train() overrides run)
                entry.flags = {}
        entry.blocks -= 1
        if entry.blocks == 0:
            for handle in entry.handles.values():
                handle.remove()
            del _MODELS[model]


@contextlib.contextmanager
def instrumented(model: nn.Module, eval_mode: bool = True) -> Iterator[Instrumentation]:
    """Within the block, ``model`` is in eval mode (unless ``eval_mode`` is false) and runs the hooks
    installed through the yielded :class:`Instrumentation` in this thread; afterwards it is as before
    (see the module docstring for several blocks at once)."""
    block = _enter(model, eval_mode)
    try:
        yield block
    finally:
        _exit(model, block, eval_mode)
