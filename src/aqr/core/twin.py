"""A structural twin of a model: its own module tree and modes over the model's own weights.

:class:`aqr.AQR` never changes the user's model. It runs a *twin* instead: every module is a shallow
copy whose ``_modules`` dict is new (holding the twin's children), while its ``_parameters``,
``_buffers`` and hook dicts are the *same objects* as the original module's. So the twin

* always computes with the user's current weights and buffers, also after ``load_state_dict`` or
  ``.to(device)`` (which update entries of those dicts), and costs no memory;
* has train/eval flags of its own: it is in eval mode, the user's flags are never touched;
* runs the user's forward hooks and pre-hooks, also those registered later (shared dicts);
* can have a module's ``forward`` replaced on the copy alone (:func:`structural_twin`'s ``forwards``).

A module the model reaches outside its module tree (say, kept in a plain list) is the user's own
in the twin as well; :class:`aqr.AQR` checks that every replaced forward is actually called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

Forward = Callable[..., Any]


def structural_twin(model: nn.Module, forwards: Mapping[str, Callable[[nn.Module], Forward]] | None = None) -> nn.Module:
    """The twin of ``model`` in eval mode; module ``name``'s copy runs ``forwards[name](copy)`` as its forward.

    A module that appears under several names (shared) has one copy, shared the same way.
    """
    copies: dict[int, nn.Module] = {}

    def twin_of(module: nn.Module) -> nn.Module:
        if id(module) in copies:
            return copies[id(module)]
        # a new __dict__ holding the same objects; not copy.copy, which a module may refuse
        # (parametrized modules raise in __getstate__)
        twin = object.__new__(type(module))
        twin.__dict__.update(module.__dict__)
        copies[id(module)] = twin
        twin.__dict__["_modules"] = {name: None if child is None else twin_of(child)
                                    for name, child in module._modules.items()}
        twin.__dict__["training"] = False  # set directly: no user train() override runs
        return twin

    root = twin_of(model)
    for name, make in (forwards or {}).items():
        module = root.get_submodule(name)
        module.__dict__["forward"] = make(module)
    return root
