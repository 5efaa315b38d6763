"""Where in a normalization layer AQR reads its values: the layer's output, or before its affine step.

``"output"`` (the paper's point, :class:`aqr.AQR`): what the layer returns, ``weight * x_hat + bias``.
``"pre-affine"`` (the compositions with gradient methods, :mod:`aqr.methods.compose`): ``x_hat`` itself,
the values the layer normalized before its affine step, per channel of the output:

* BatchNorm: ``(x - mean) / sqrt(var + eps)`` with the running statistics in eval mode, or with the
  batch's own when the layer has none or is training (the running statistics are never updated here);
* GroupNorm: each group normalized by its own mean and variance;
* LayerNorm over the last dim (and channels-first subclasses such as timm's ``LayerNorm2d``): each
  token (position) normalized over its channels.

:func:`normalized` computes ``x_hat`` from the layer's input and :func:`affine` applies the layer's
own weight and bias to it, so ``affine(m, normalized(m, x, info), info)`` equals ``m(x)`` for the
layers above (a BatchNorm in training mode aside, whose running statistics stay unchanged).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from aqr.core.layers import LayerError, LayerInfo

OUTPUT = "output"
PRE_AFFINE = "pre-affine"
POINTS: tuple[str, ...] = (OUTPUT, PRE_AFFINE)


def check_point(point: object) -> str:
    """``point`` if it is one of :data:`POINTS`; ``ValueError`` naming them otherwise."""
    if point not in POINTS:
        raise ValueError(f"point must be one of {', '.join(POINTS)}, got {point!r}")
    return point  # type: ignore[return-value]


def normalized(module: nn.Module, x: torch.Tensor, info: LayerInfo) -> torch.Tensor:
    """The layer's input ``x`` normalized as ``module`` normalizes it, without its affine step."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        batch_stats = module.training or module.running_mean is None or module.running_var is None
        mean, var = (None, None) if batch_stats else (module.running_mean, module.running_var)
        return F.batch_norm(x, mean, var, None, None, batch_stats, 0.0, module.eps)
    if isinstance(module, nn.GroupNorm):
        return F.group_norm(x, module.num_groups, None, None, module.eps)
    if isinstance(module, nn.LayerNorm):
        shape = tuple(module.normalized_shape)
        if info.channel_dim == -1:
            return F.layer_norm(x, shape, None, None, module.eps)
        return F.layer_norm(x.movedim(1, -1), shape, None, None, module.eps).movedim(-1, 1)
    raise LayerError(f"layer {info.name!r} is a {type(module).__name__}, not a normalization layer")


def affine(module: nn.Module, x_hat: torch.Tensor, info: LayerInfo) -> torch.Tensor:
    """``weight * x_hat + bias`` per channel with the layer's own parameters (either may be absent)."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    shape = [1] * x_hat.ndim
    shape[info.channel_dim] = info.channels
    if isinstance(weight, torch.Tensor):
        x_hat = x_hat * weight.reshape(shape)
    if isinstance(bias, torch.Tensor):
        x_hat = x_hat + bias.reshape(shape)
    return x_hat
