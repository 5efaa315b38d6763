"""Normalization-layer helpers shared by the methods: finding BatchNorm layers and putting them on
batch statistics (TTN, TENT, SAR), replacing them by layers with statistics of their own (bn-ema,
RBN), and choosing the affine parameters that TENT and SAR train."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from aqr.core.layers import NORM_TYPES

from .base import NotApplicable


def batchnorm_layers(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """All BatchNorm layers (1d/2d/3d/sync) of ``model`` with their qualified names."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, _BatchNorm)]


def replace_batchnorms(model: nn.Module, make: Callable[[_BatchNorm], nn.Module], method: str) -> list[nn.Module]:
    """Replace every BatchNorm layer of ``model`` in place (meant for a private copy) by ``make(layer)``;
    returns the new layers. The model itself must not be a BatchNorm layer (``method`` names the refusal)."""
    layers = []
    for name, bn in batchnorm_layers(model):
        if not name:
            raise NotApplicable(f"{method} wraps a model containing BatchNorm layers, not a bare BatchNorm layer")
        parent, _, child = name.rpartition(".")
        layer = make(bn)
        setattr(model.get_submodule(parent), child, layer)
        layers.append(layer)
    return layers


class MovingStatsBatchNorm(nn.Module):
    """Stands in for a BatchNorm layer with running statistics and normalizes with statistics of its own.

    ``mean``/``var`` start as the layer's running statistics, which ``source_mean``/``source_var``
    keep; subclasses move them (each with its ``momentum``). Shares the layer's affine parameters and
    ``eps``. ``method`` names the method in the refusal of a layer without running statistics.
    """

    def __init__(self, bn: _BatchNorm, momentum: float, method: str) -> None:
        super().__init__()
        if bn.running_mean is None or bn.running_var is None:
            raise NotApplicable(f"{method} needs BatchNorm layers with running statistics (track_running_stats=True)")
        self.num_features = bn.num_features
        self.eps = bn.eps
        self.momentum = momentum
        self.weight = bn.weight
        self.bias = bn.bias
        for name in ("source_mean", "mean"):
            self.register_buffer(name, bn.running_mean.detach().clone())
        for name in ("source_var", "var"):
            self.register_buffer(name, bn.running_var.detach().clone())

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` normalized with ``mean``/``var``, then scaled and shifted by the affine parameters."""
        return F.batch_norm(x, self.mean, self.var, self.weight, self.bias, False, 0.0, self.eps)

    def reset(self) -> None:
        """Statistics back to the source's."""
        self.mean.copy_(self.source_mean)
        self.var.copy_(self.source_var)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}, momentum={self.momentum}"


def use_batch_statistics(model: nn.Module) -> int:
    """Make every BatchNorm layer of ``model`` normalize with the statistics of the current batch.

    In any mode, each BN layer then uses the batch mean and the biased batch variance with its own
    ``eps`` (exactly ``F.batch_norm(training=True)``), and has no running statistics to read or
    update (``track_running_stats=False``, ``running_mean = running_var = None``). Modifies
    ``model`` in place; meant for a private copy. Returns how many layers were changed.
    """
    layers = batchnorm_layers(model)
    for _, m in layers:
        m.track_running_stats = False
        m.running_mean = None
        m.running_var = None
        m.num_batches_tracked = None
    return len(layers)


def norm_affine_parameters(model: nn.Module, skip: frozenset[str] = frozenset()) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` for the affine weight/bias of every BN/GN/LN layer not named in ``skip``.

    Subclasses count (e.g. timm's LayerNorm2d); layers built without affine parameters contribute
    nothing. Order is ``named_modules`` order.
    """
    found = []
    for name, m in model.named_modules():
        if name in skip or not isinstance(m, NORM_TYPES):
            continue
        for pname in ("weight", "bias"):
            p = getattr(m, pname, None)
            if isinstance(p, nn.Parameter):
                found.append((f"{name}.{pname}" if name else pname, p))
    return found


def train_norm_affine_parameters(model: nn.Module, method: str,
                                 skip: frozenset[str] = frozenset()) -> list[str]:
    """Turn on the gradients of the parameters :func:`norm_affine_parameters` finds (layers named in
    ``skip`` left out) and return their names; :class:`NotApplicable` (naming ``method``) if there are none."""
    trained = norm_affine_parameters(model, skip=skip)
    if not trained:
        outside = " outside its frozen modules" if skip else ""
        raise NotApplicable(f"{method} needs BatchNorm/GroupNorm/LayerNorm layers with affine parameters{outside}")
    for _, p in trained:
        p.requires_grad_(True)
    return [name for name, _ in trained]


def _contiguous_input(module: nn.Module, args: tuple) -> tuple | None:
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and not x.requires_grad and not x.is_contiguous():
        return (x.contiguous(), *args[1:])
    return None


def contiguous_groupnorm_inputs(model: nn.Module) -> int:
    """Give every GroupNorm layer a contiguous input when that input needs no gradient.

    Works around a PyTorch CPU crash (seen with torch 2.13): the GroupNorm backward pass segfaults
    when its input is channels_last (e.g. images permuted from NHWC) and only its affine parameters
    need gradients, which is exactly TENT's and SAR's situation at the first GroupNorm layer.
    The copy costs one activation per affected layer. Returns how many layers got the hook.
    """
    layers = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    for m in layers:
        m.register_forward_pre_hook(_contiguous_input)
    return len(layers)
