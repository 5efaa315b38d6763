"""aqr's own checkpoint format and loading of third-party state dicts.

An aqr checkpoint is a ``torch.save``d dict holding only tensors, str, int, float, bool, None,
lists and dicts, so it loads with ``weights_only=True``::

    {"format": "aqr-model", "version": 1,
     "config": {"name": str, "num_classes": int, "norm": str | None, "kwargs": dict},
     "state_dict": {...},   # of the NormalizedModel, so keys start with "normalize." / "model."
     "meta": {...}}         # provenance: data sha256, epochs, seed, accuracy, command, versions
"""

from __future__ import annotations

import numbers
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aqr.data.arrays import MAX_CLASSES  # checkpoints and label files share the bound
from aqr.util.files import atomic_write

FORMAT = "aqr-model"
VERSION = 1
MAX_OPTION = 4096  # widths, depths, heads, patch and image sizes of a checkpoint's architecture options
MAX_OPTION_ITEMS = 16


class CheckpointError(ValueError):
    """A checkpoint file could not be read or does not fit the architecture; the message names the file."""


def read_file(path: str | os.PathLike[str]) -> Any:
    """A ``.safetensors`` file as a dict of tensors, any other file with ``torch.load(weights_only=True)``
    on CPU; unreadable files raise :class:`CheckpointError`."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file not found: {path}")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except Exception as err:  # bad header, truncated file
            raise CheckpointError(f"cannot read checkpoint {path}: not a readable safetensors file "
                                  f"({type(err).__name__}: {err})") from err
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # truncated zip, bad pickle, non-allow-listed type, ...
        raise CheckpointError(f"cannot read checkpoint {path}: corrupted, truncated or not a "
                              f"weights-only PyTorch file ({type(err).__name__}: {err})") from err


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to a temporary file beside ``path`` then rename it, so readers never see half a file."""
    return atomic_write(path, lambda tmp: torch.save(obj, tmp))


def is_aqr_checkpoint(obj: Any) -> bool:
    """True when ``obj`` (a loaded file) is in aqr's own format."""
    return isinstance(obj, dict) and obj.get("format") == FORMAT


def plain(value: Any, where: str = "value") -> Any:
    """Return ``value`` as plain weights-only-loadable data: str subclasses (e.g. ``torch.__version__``)
    and paths become str, tuples become lists; dict keys must be str. Other objects raise TypeError.
    """
    if value is None or isinstance(value, (bool, int, float)) and type(value) in (bool, int, float):
        return value
    if isinstance(value, (str, os.PathLike)):
        return os.fspath(value) if not isinstance(value, str) else str(value)
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)):
        return [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"{where}: dict keys must be str")
        return {str(k): plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, numbers.Integral):  # numpy scalars and other number types
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"{where}: {type(value).__name__} cannot be stored in a weights-only checkpoint")


def save_checkpoint(path: str | os.PathLike[str], model: nn.Module, config: dict[str, Any],
                    meta: dict[str, Any] | None = None, half: bool = False) -> Path:
    """Write ``model``'s weights with the ``config`` that rebuilds it; ``half`` stores float tensors as fp16.

    ``config`` must hold ``name`` and may hold ``num_classes``, ``norm`` and ``kwargs`` (all
    passed back to :func:`aqr.models.create`).
    """
    if "name" not in config:
        raise ValueError("checkpoint config needs a 'name'")
    state = {k: (v.detach().half() if half and v.is_floating_point() else v.detach()).cpu().clone()
             for k, v in model.state_dict().items()}
    obj = {"format": FORMAT, "version": VERSION, "config": plain(dict(config), "config"), "state_dict": state,
           "meta": plain(dict(meta or {}), "meta")}
    return atomic_save(obj, path)


def strip_prefix(state_dict: dict[str, torch.Tensor], prefix: str = "module.") -> dict[str, torch.Tensor]:
    """Return ``state_dict`` with ``prefix`` removed from every key that starts with it (DataParallel)."""
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state_dict.items()}


PLAUSIBLE_OPTION = (f"a bool, string, None, number of magnitude <= {MAX_OPTION} "
                    f"or a list of up to {MAX_OPTION_ITEMS} of those")


def plausible_option(value: object) -> bool:
    """Whether ``value`` may be an architecture option (of a checkpoint's config, or ``aqr train --model-kwargs``):
    :data:`PLAUSIBLE_OPTION` says what that is; a larger width or size only exhausts memory."""
    if value is None or isinstance(value, (bool, str)):
        return not isinstance(value, str) or len(value) <= 256
    if isinstance(value, (int, float)):
        return bool(abs(value) <= MAX_OPTION)  # NaN fails the comparison
    if isinstance(value, (list, tuple)):
        return len(value) <= MAX_OPTION_ITEMS and all(plausible_option(v) and not isinstance(v, (list, tuple))
                                                      for v in value)
    return False


def checked_config(config: object, source: str | os.PathLike[str]) -> dict[str, Any]:
    """A checkpoint's ``config`` after checking every value is plausible, before anything is built:
    ``name`` a string, ``num_classes`` an integer in [1, MAX_CLASSES], ``norm`` a string or None, and
    ``kwargs`` a mapping of options that are bools, strings, None, numbers of magnitude at most
    MAX_OPTION or short lists of those. Raises :class:`CheckpointError` naming ``source`` and the field."""

    def fail(field: str, value: object, rule: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {source}: config {field} must be {rule}, got {value!r:.80}")

    if not isinstance(config, dict) or not isinstance(config.get("name"), str):
        raise CheckpointError(f"checkpoint {source} has no valid 'config' with a model 'name'")
    num_classes = config.get("num_classes", 10)
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or not 1 <= num_classes <= MAX_CLASSES:
        raise fail("num_classes", num_classes, f"an integer in [1, {MAX_CLASSES}]")
    norm = config.get("norm")
    if norm is not None and not isinstance(norm, str):
        raise fail("norm", norm, "a string or None")
    kwargs = config.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise fail("kwargs", kwargs, "a mapping of architecture options")
    for key, value in kwargs.items():
        if not plausible_option(value):
            raise fail(f"kwargs[{key!r}]", value, PLAUSIBLE_OPTION)
    return {"name": config["name"], "num_classes": num_classes, "norm": norm, "kwargs": dict(kwargs)}


def check_fit(module: nn.Module, state_dict: dict[str, torch.Tensor], source: str | os.PathLike[str]) -> None:
    """Raise :class:`CheckpointError` naming ``source`` unless ``state_dict`` has exactly ``module``'s keys
    and shapes (``module`` may live on the meta device: nothing is read but shapes)."""
    own = module.state_dict()
    # files from before PyTorch 0.4.1 lack BatchNorm's num_batches_tracked: keep the module's own
    state_dict = {**{k: v for k, v in own.items() if k.endswith("num_batches_tracked")}, **state_dict}
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    wrong = sorted(k for k in set(own) & set(state_dict) if own[k].shape != state_dict[k].shape)
    if missing or unexpected or wrong:
        def few(keys: list[str]) -> str:
            return ", ".join(keys[:5]) + (f" (+{len(keys) - 5} more)" if len(keys) > 5 else "")
        parts = [f"missing keys: {few(missing)}" if missing else "",
                 f"unexpected keys: {few(unexpected)}" if unexpected else "",
                 "shape mismatch: " + few([f"{k} {tuple(state_dict[k].shape)} vs {tuple(own[k].shape)}"
                                           for k in wrong]) if wrong else ""]
        raise CheckpointError(f"checkpoint {source} does not fit {type(module).__name__} (wrong architecture?): "
                              + "; ".join(p for p in parts if p))


def load_weights(module: nn.Module, state_dict: dict[str, torch.Tensor], source: str | os.PathLike[str]) -> None:
    """Strictly load ``state_dict`` into ``module`` (cast to its dtypes); mismatches raise CheckpointError naming ``source``.

    Only BatchNorm ``num_batches_tracked`` counters may be absent (old files); they keep the module's values.
    """
    check_fit(module, state_dict, source)
    own = module.state_dict()
    state_dict = {**{k: v for k, v in own.items() if k.endswith("num_batches_tracked")}, **state_dict}
    cast = {k: v.to(own[k].dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    module.load_state_dict(cast, strict=True)


def third_party_state_dict(obj: Any, source: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Extract a state dict from a loaded file: ``{"state_dict": ...}``, ``{"model": ...}`` or a bare one; strips ``module.``."""
    if isinstance(obj, dict):
        for key in ("state_dict", "model", "model_state_dict"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"checkpoint {source} holds no state dict of tensors")
    return strip_prefix(obj)


def read_state_dict(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """The state dict of tensors in a safetensors or weights-only PyTorch file (see :func:`third_party_state_dict`)."""
    return third_party_state_dict(read_file(path), path)
