"""TENT: fully test-time adaptation by entropy minimization (Wang et al., ICLR 2021).

The model normalizes with batch statistics in its BatchNorm layers; only the affine scale and shift
of its BatchNorm/GroupNorm/LayerNorm layers are trained, by SGD with momentum on the mean softmax
entropy of the batch. The copy stays in eval mode (the official code calls ``train()``; the only
difference is dropout/stochastic depth, which we keep off so adaptation is deterministic).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from .base import TTAMethod, softmax_entropy
from .declaration import Needs, method
from .options import OptimizerConfig
from .norm_layers import (contiguous_groupnorm_inputs, norm_affine_parameters, train_norm_affine_parameters,
                          use_batch_statistics)

#: The AQR paper's baseline learning rates (appendix "Hyper-parameter Details").
CNN_LR = 2.5e-4
VIT_LR_PER_SAMPLE = 1e-3 / 64


def infer_arch(model: nn.Module) -> str:
    """``"vit"`` if ``model`` contains an attention module (``nn.MultiheadAttention`` or a class
    whose name ends in ``Attention``, as in timm), else ``"cnn"``."""
    for m in model.modules():
        if isinstance(m, nn.MultiheadAttention) or type(m).__name__.endswith("Attention"):
            return "vit"
    return "cnn"


def default_lr(arch: str, batch_size: int | None = None) -> float:
    """The paper's learning rate: 2.5e-4 for CNNs, 1e-3/64 x batch size for ViTs."""
    if arch == "cnn":
        return CNN_LR
    if arch == "vit":
        if batch_size is None:
            raise ValueError("the ViT learning rate scales with the batch size: pass batch_size= (or lr=)")
        return VIT_LR_PER_SAMPLE * batch_size
    raise ValueError(f"arch must be 'cnn' or 'vit', got {arch!r}")


#: TENT's and SAR's option sets: the paper's learning-rate rule (:func:`default_lr`) on every benchmark.
TENT_DEFAULTS: dict[str, dict[str, Any]] = {"cifar10": {}, "imagenet": {}}


@dataclass(frozen=True)
class TentConfig(OptimizerConfig):
    """TENT options (the optimizer's as in :class:`~aqr.methods.options.OptimizerConfig`; TENT's own
    defaults: SGD with momentum 0.9, no Nesterov, the paper's learning rate).

    Attributes:
        lr: SGD learning rate; ``None`` picks :func:`default_lr` for ``arch``/``batch_size``.
        momentum: SGD momentum (0.9 in TENT and SAR).
        arch: ``"cnn"`` or ``"vit"`` for the default lr; ``None`` infers it (:func:`infer_arch`).
        batch_size: the evaluation batch size, needed only for the ViT default lr.
    """

    optimizer: str = "sgd"
    lr: float | None = None
    nesterov: bool = False
    arch: str | None = None
    batch_size: int | None = None

    lr_rule: ClassVar[bool] = True

    def resolve_lr(self, model: nn.Module) -> float:
        """The learning rate to use on ``model``."""
        if self.lr is not None:
            return self.lr
        arch = self.arch or infer_arch(model)
        if arch == "vit" and self.batch_size is None and self.arch is None:
            found = next(f"{name or 'the model'} ({type(m).__name__})" for name, m in model.named_modules()
                         if isinstance(m, nn.MultiheadAttention) or type(m).__name__.endswith("Attention"))
            raise ValueError(f"the default learning rate of a model with attention layers, as {found}, is the "
                             "transformer one, 1e-3/64 per image, which needs batch_size=; or pass lr= "
                             "(or arch='cnn' for 2.5e-4)")
        return default_lr(arch, self.batch_size)


def configure_for_entropy_minimization(model: nn.Module, batch_statistics: bool = True) -> nn.Module:
    """Eval mode, all gradients off, BatchNorm on batch statistics (see ``use_batch_statistics``); with
    ``batch_statistics=False`` BatchNorm keeps normalizing with its running (source) statistics."""
    model.eval().requires_grad_(False)
    if batch_statistics:
        use_batch_statistics(model)
    contiguous_groupnorm_inputs(model)
    return model


# needs the batch size: the ViT learning rate scales with it
@method("tent", TentConfig, defaults=TENT_DEFAULTS, needs=Needs(batch_size=True))
class Tent(TTAMethod):
    """TENT behind the common protocol (see :mod:`aqr.methods.base`)."""

    def configure_model(self, model: nn.Module) -> nn.Module:
        model = configure_for_entropy_minimization(model)
        self.param_names = train_norm_affine_parameters(model, "TENT")
        return model

    def build_optimizer(self) -> torch.optim.Optimizer:
        params = [p for _, p in norm_affine_parameters(self.model)]
        return self.config.build(params, lr=self.config.resolve_lr(self.model))

    def adapt(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        loss = softmax_entropy(logits).mean(0)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        return logits
