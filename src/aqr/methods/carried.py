"""What a method carries from one batch to the next beyond its modules' tensors, as plain values.

:func:`pack_carried` turns a method's carried attributes (tensors, numbers, strings, ``None``, lists,
tuples and string-keyed dicts of them, numpy arrays, torch generators and the few helper objects
listed in :data:`CARRIED_CLASSES`) into copies that ``torch.load(..., weights_only=True)`` reads back;
:func:`unpack_carried` rebuilds them. No object is unpickled: a helper object is rebuilt only from a class
of that list, its attributes set one by one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .augment import GlobalGenerators, Generators
from .rotta_memory import ClassBalancedMemory

#: the helper objects a method may carry, rebuilt by name from their attributes
CARRIED_CLASSES: dict[str, type] = {cls.__name__: cls for cls in (Generators, GlobalGenerators, ClassBalancedMemory)}
TAG = "__carried__"


def pack_carried(value: Any) -> Any:
    """A copy of ``value`` made of tensors, plain values and containers (tagged dicts for the others)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(pack_carried(v) for v in value)
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value) or TAG in value:
            raise TypeError(f"a carried dict needs string keys other than {TAG!r}, got {list(value)[:4]}")
        return {k: pack_carried(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return {TAG: "numpy", "value": torch.from_numpy(value.copy())}
    if isinstance(value, torch.Generator):
        return {TAG: "generator", "device": str(value.device), "state": value.get_state()}
    name = type(value).__name__
    if CARRIED_CLASSES.get(name) is type(value):
        return {TAG: "object", "class": name, "attributes": pack_carried(vars(value))}
    raise TypeError(f"a method cannot carry a {type(value).__qualname__} in its state_dict (list its class in "
                    "aqr.methods.carried.CARRIED_CLASSES or carry plain values)")


def unpack_carried(packed: Any, current: dict[str, Any]) -> dict[str, Any]:
    """The carried attributes ``packed`` holds, rebuilt; ``ValueError`` if they are not those of ``current``
    (the method's own, by name)."""
    if not isinstance(packed, dict) or list(packed) != list(current):
        names = list(packed) if isinstance(packed, dict) else type(packed).__name__
        raise ValueError(f"the saved state carries {names}; this method carries {list(current)}")
    return {name: _unpack(value) for name, value in packed.items()}


def _unpack(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_unpack(v) for v in value)
    if not isinstance(value, dict):
        return value
    kind = value.get(TAG)
    if kind is None:
        return {k: _unpack(v) for k, v in value.items()}
    if kind == "numpy":
        return value["value"].numpy().copy()
    if kind == "generator":
        generator = torch.Generator(device=value["device"])
        generator.set_state(value["state"])
        return generator
    cls = CARRIED_CLASSES.get(value.get("class")) if kind == "object" else None
    if cls is None:
        raise ValueError(f"the saved state carries an unknown kind of value: {kind!r} {value.get('class')!r}")
    rebuilt = cls.__new__(cls)
    rebuilt.__dict__.update(_unpack(value["attributes"]))
    return rebuilt
