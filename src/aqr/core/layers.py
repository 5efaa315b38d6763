"""Finding the normalization layers AQR recalibrates, and where their channels are.

Supported: ``nn.BatchNorm1d/2d/3d`` (any ``_BatchNorm``, SyncBatchNorm included), ``nn.GroupNorm`` and
``nn.LayerNorm`` over one trailing dim, and their subclasses. The channel of a BN/GN output
``(N, C, ...)`` is dim 1. A LayerNorm's channel is the last dim (tokens ``(N, L, C)``), except for the
"channels-first" subclasses such as timm's ``LayerNorm2d`` (class name ending in ``2d``), which
normalize dim 1 of an ``(N, C, H, W)`` tensor. Other normalization layers (a LayerNorm over several
dims) are skipped with a warning, unless a caller names one explicitly: then :class:`LayerError`.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from aqr.core.hooks import instrumented

NORM_TYPES: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._BatchNorm, nn.GroupNorm, nn.LayerNorm)
LAYER_SELECTIONS = ("all", "top-half", "bottom-half")


class LayerError(ValueError):
    """A layer AQR cannot handle, or a layer selection that does not fit the model."""


class NonFiniteActivationError(ValueError):
    """A normalization layer produced NaN or Inf."""


@dataclass(frozen=True)
class LayerInfo:
    """What AQR records about one normalization layer."""

    name: str
    kind: str  # class name, e.g. "BatchNorm2d"
    channels: int
    channel_dim: int  # 1, or -1 for the last dim


def is_norm(module: nn.Module) -> bool:
    """True for the normalization layers AQR knows how to recalibrate."""
    return isinstance(module, NORM_TYPES)


def num_channels(module: nn.Module) -> int:
    """Number of channels of a supported normalization layer."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return int(module.num_features)
    if isinstance(module, nn.GroupNorm):
        return int(module.num_channels)
    if isinstance(module, nn.LayerNorm):
        return int(module.normalized_shape[-1])
    raise LayerError(f"{type(module).__name__} is not a supported normalization layer")


def layer_info(name: str, module: nn.Module) -> LayerInfo:
    """Describe ``module`` or raise :class:`LayerError` naming it when AQR cannot handle it."""
    if not is_norm(module):
        raise LayerError(
            f"layer {name!r} is a {type(module).__name__}, not a normalization layer "
            "(BatchNorm, GroupNorm or LayerNorm)"
        )
    if isinstance(module, nn.LayerNorm):
        if len(module.normalized_shape) != 1:
            raise LayerError(
                f"layer {name!r}: {unsupported(module)} {tuple(module.normalized_shape)} has no single "
                "channel dim; AQR supports LayerNorm over the last dim only"
            )
        channel_dim = 1 if type(module).__name__.lower().endswith("2d") else -1
    else:
        channel_dim = 1
    return LayerInfo(name, type(module).__name__, num_channels(module), channel_dim)


def unsupported(module: nn.Module) -> str | None:
    """Why AQR cannot recalibrate normalization layer ``module`` (``None``: it can)."""
    if isinstance(module, nn.LayerNorm) and len(module.normalized_shape) != 1:
        return f"{type(module).__name__} over {len(module.normalized_shape)} dims"
    return None


def norm_layers(model: nn.Module) -> list[LayerInfo]:
    """Every normalization layer of ``model`` AQR can recalibrate, in registration order; the others
    are skipped, named in one warning."""
    infos, skipped = [], []
    for name, module in model.named_modules():
        if is_norm(module):
            reason = unsupported(module)
            if reason is None:
                infos.append(layer_info(name, module))
            else:
                skipped.append(f"{name!r} ({reason})")
    if skipped:
        warnings.warn(f"AQR skips {len(skipped)} normalization layer(s) it cannot recalibrate: {', '.join(skipped)}",
                      stacklevel=3)
    return infos


def check_named_layers(model: nn.Module, layers: str | Sequence[str] | None) -> None:
    """Raise :class:`LayerError` naming a layer listed in ``layers`` that AQR cannot recalibrate."""
    if layers is None or isinstance(layers, str):
        return
    modules = dict(model.named_modules())
    for name in layers:
        if name in modules:
            layer_info(name, modules[name])


def check_output(info: LayerInfo, output: object) -> torch.Tensor:
    """Return the layer's output tensor after checking its channel dim has the expected size."""
    if not isinstance(output, torch.Tensor):
        raise LayerError(f"layer {info.name!r} returned a {type(output).__name__}, expected a tensor")
    if output.ndim < 2 or output.shape[info.channel_dim] != info.channels:
        where = "the last dim (-1)" if info.channel_dim == -1 else f"dim {info.channel_dim}"
        found = f"it has {output.shape[info.channel_dim]}" if output.ndim >= 2 else "it has no channel dim"
        raise LayerError(
            f"layer {info.name!r} ({info.kind}) produced shape {tuple(output.shape)}: expected "
            f"{info.channels} channels on {where}, {found}"
        )
    return output


def as_acb(out: torch.Tensor, channel_dim: int) -> torch.Tensor:
    """View a layer output as ``(A, C, B)`` with the channel in the middle (no copy when contiguous)."""
    dim = channel_dim % out.ndim
    a = 1
    for s in out.shape[:dim]:
        a *= s
    return out.reshape(a, out.shape[dim], -1)


def select_layers(
    infos: Sequence[LayerInfo], layers: str | Sequence[str], order: Sequence[str] | None = None
) -> list[LayerInfo]:
    """Pick layers by ``"all"``, ``"top-half"``, ``"bottom-half"`` or an explicit list of names.

    Halves follow ``order`` (the forward execution order); with ``N`` layers the bottom half is the
    first ``N // 2`` and the top half the rest, so a 12-block ViT with a final norm gets blocks 6-11
    plus the final norm as its top half.
    """
    by_name = {i.name: i for i in infos}
    if isinstance(layers, str):
        if layers not in LAYER_SELECTIONS:
            raise LayerError(f"unknown layer selection {layers!r}; use one of {LAYER_SELECTIONS} or a list of names")
        ordered = [by_name[n] for n in (order if order is not None else by_name) if n in by_name]
        if layers == "all":
            return ordered
        half = len(ordered) // 2
        return ordered[half:] if layers == "top-half" else ordered[:half]
    names = list(layers)
    if not names:
        raise LayerError("the explicit layer list is empty")
    missing = [n for n in names if n not in by_name]
    if missing:
        raise LayerError(f"layer {missing[0]!r} is not a normalization layer of this model")
    if len(set(names)) != len(names):
        raise LayerError("the explicit layer list names a layer twice")
    return [by_name[n] for n in names]


def fingerprint(infos: Sequence[LayerInfo]) -> str:
    """A short hash of the model's normalization layers (names, kinds, channel counts)."""
    blob = json.dumps([asdict(i) for i in infos], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def execution_order(model: nn.Module, infos: Sequence[LayerInfo], example: torch.Tensor) -> list[str]:
    """Names of ``infos`` in the order a forward pass on ``example`` first calls them."""
    seen: list[str] = []
    with instrumented(model, eval_mode=False) as tools:
        for info in infos:
            def hook(_m: nn.Module, _i: object, _o: object, name: str = info.name) -> None:
                if name not in seen:
                    seen.append(name)
            tools.hook(info.name, hook)
        with torch.no_grad():
            model(example)
    return seen + [i.name for i in infos if i.name not in seen]
