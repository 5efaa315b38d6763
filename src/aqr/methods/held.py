"""The user's model as given, computed over a method's private copy without a second copy of its weights.

A method that holds no adapted state from one batch to the next predicts a batch it has no time to
adapt on (:meth:`aqr.methods.TTAMethod.forward_held`) with the model the user gave: eval mode, every
BatchNorm layer on its running statistics. Its private copy may no longer compute that: its BatchNorm
layers may normalize with batch statistics (running statistics dropped) or be replaced by layers with
statistics of their own, and its trained parameters may hold the last episodic batch's adaptation.
:func:`source_view` is a structural twin of the copy (:mod:`aqr.core.twin`: its own module tree over
the copy's tensors) in which those layers normalize with the running statistics captured before the
copy was configured (:func:`running_statistics`) and the trained parameters read their initial values.
Nothing of the copy is changed, so threads running the method meanwhile are not disturbed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from aqr.core.twin import structural_twin


class RebuiltCache(dict):
    """A cache of things rebuilt on use: copies, deep copies and pickles of it are empty."""

    def __reduce__(self) -> tuple[type, tuple]:
        return type(self), ()

    def __deepcopy__(self, memo: dict[int, Any]) -> "RebuiltCache":
        return type(self)()


def running_statistics(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{name: (running_mean, running_var)}`` (clones) of every BatchNorm layer of ``model`` that keeps them."""
    return {name: (m.running_mean.detach().clone(), m.running_var.detach().clone())
            for name, m in model.named_modules()
            if isinstance(m, _BatchNorm) and m.running_mean is not None and m.running_var is not None}


def _eval_batch_norm(mean: torch.Tensor, var: torch.Tensor) -> Callable[[nn.Module], Callable[[torch.Tensor], torch.Tensor]]:
    """The forward of a norm layer's twin: eval-mode BatchNorm with ``mean``/``var`` and the layer's affine and eps."""

    def make(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        def forward(x: torch.Tensor) -> torch.Tensor:
            return F.batch_norm(x, mean, var, getattr(module, "weight", None), getattr(module, "bias", None), False,
                                0.0, module.eps)

        return forward

    return make


def source_view(model: nn.Module, statistics: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                initial: Mapping[str, torch.Tensor], device: torch.device) -> nn.Module:
    """A structural twin of the configured copy ``model`` that computes the user's model on ``device``.

    The layer named in ``statistics`` (the BatchNorm layer, or the layer the method put in its place,
    with the same affine parameters and ``eps``) normalizes with them in eval mode; each parameter named (by its state-dict key) in ``initial`` reads that value instead of
    its current one. Everything else is the copy's own, shared.
    """
    modules = dict(model.named_modules())
    forwards = {name: _eval_batch_norm(mean.to(device), var.to(device))
                for name, (mean, var) in statistics.items() if name in modules}
    twin = structural_twin(model, forwards)
    if initial:
        for name, module in twin.named_modules():
            own = module.__dict__["_parameters"]
            keys = {p: f"{name}.{p}" if name else p for p in own}
            if any(key in initial for key in keys.values()):
                module.__dict__["_parameters"] = {
                    p: initial[key].to(device=device, dtype=own[p].dtype) if key in initial else own[p]
                    for p, key in keys.items()}
    return twin
