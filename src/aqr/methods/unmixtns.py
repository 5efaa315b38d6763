"""UnMix-TNS: un-mixing test-time normalization statistics (Tomar et al., ICLR 2024).

The standalone form of the paper's code (github.com/devavratTomar/unmixtns, ``unmixtns.py``, on top of the
test-time-adaptation benchmark code): the frozen source model whose BatchNorm layers are replaced by
UnMix-TNS layers. No weights change and no gradient is taken. Each layer keeps ``K`` *components*, running
per-channel means ``m_k`` and variances ``v_k`` (``k = 1..K``), and for every test batch, per image ``i``
with instance (spatial) mean ``mu_i`` and biased variance ``s_i``:

1. **Assignment.** ``p_ik = softmax_k(cos(mu_i, m_k) / tau)``, ``tau = 0.07``: how much image ``i`` looks
   like component ``k`` (cosine similarity of the channel-mean vectors).
2. **Mixing.** Each component is mixed with the image by its assignment,
   ``M_ik = (1 - p_ik) m_k + p_ik mu_i`` and ``V_ik = (1 - p_ik) v_k + p_ik s_i``; the image is normalized with
   the moments of the equal-weight mixture of the ``K``: ``mean_i = (1/K) sum_k M_ik`` and
   ``var_i = (1/K) sum_k V_ik + (1/K) sum_k M_ik^2 - mean_i^2``, then scaled and shifted by the layer's
   affine parameters. Every image gets statistics of its own, close to the mixture of all components,
   pulled towards itself through the components it resembles: a run of one class cannot drag every
   image's statistics with it.
3. **Update** (after the batch is normalized): ``m_k += a * mean_i p_ik (mu_i - m_k)`` and
   ``v_k += a * mean_i p_ik (s_i - v_k)``, the mean over the batch's images.

**Initialization.** The components start around the layer's running (source) statistics ``m, v``:
``m_k = m + sqrt(alpha K / (K - 1) * v) * z_k`` with ``z_k`` standard normal, ``v_k = (1 - alpha) v``,
``alpha = 0.5``, so that the mixture of the ``K`` has the source's mean and variance in expectation
(``K = 1``: the source statistics). The ``z_k`` are drawn per layer, in the order of the model's
modules, from a generator seeded by the protocol's ``seed`` (the reference draws them from torch's
global generator after seeding it with its ``RNG_SEED``: the same numbers for the same seed).

**Momentum.** ``a = 1 - (1 - m_bn)^(b / batch_size_max)`` for a batch of ``b`` images, ``m_bn`` the
BatchNorm layer's own momentum (0.1 for PyTorch's default; ``momentum=`` overrides it) and
``batch_size_max`` 64 (the reference's ``UNMIXTNS.BATCH_SIZE_MAX``; 16 in its ImageNet-C runs): at
batch 64 the components move by the layer's momentum, at batch 1 by 1/64 of it in log terms.

Presets (``defaults=``): ``"cifar10"`` (K = 16, ``batch_size_max`` 64, the reference's CIFAR-10-C runs)
and ``"imagenet"`` (K = 16, ``batch_size_max`` 16, its ImageNet-C runs at batch 16). Its scripts use K = 128
for mixed-domain streams: ``num_components=128``.

BatchNorm2d (and 3d) layers become UnMix-TNS layers; BatchNorm1d layers keep their source statistics, as
in the reference; a model without BatchNorm is :class:`NotApplicable` (GroupNorm and LayerNorm models).

Differences from the reference code: the momentum follows the size of the batch at hand, where the
reference uses its configured test batch size (they differ on a stream's last, shorter batch); images
with NaN or Inf values are normalized like the others (their own outputs are not finite) but never
move a component; the components are reset to their initial draw by ``reset()``, as the reference's
reset reloads them. Calls are serialized (as every method's), so threads sharing one instance see the
components of some sequential order of their batches.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from aqr.core.twin import structural_twin

from .base import NotApplicable, TTAMethod
from .declaration import method
from .norm_layers import replace_batchnorms
from .options import check_number, check_positive

UNMIXTNS_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "cifar10": MappingProxyType({"num_components": 16, "batch_size_max": 64}),
    "imagenet": MappingProxyType({"num_components": 16, "batch_size_max": 16}),
})


@dataclass(frozen=True)
class UnMixTNSConfig:
    """UnMix-TNS options (defaults: the reference's CIFAR-10-C settings).

    Attributes:
        defaults: the option set the unset options came from, ``"cifar10"`` or ``"imagenet"``.
        num_components: ``K``, the statistics components per layer (16; 128 in the reference's mixed runs).
        temperature: ``tau`` of the assignment softmax over cosine similarities (0.07).
        init_spread: ``alpha``, the share of the source variance spread between the components' means at
            initialization (0.5).
        momentum: the components' momentum at ``batch_size_max`` images; ``None``: each BatchNorm layer's own
            (0.1 where the layer has none).
        batch_size_max: the batch size at which a batch moves the components by ``momentum``.
    """

    defaults: str = "cifar10"
    num_components: int = 16
    temperature: float = 0.07
    init_spread: float = 0.5
    momentum: float | None = None
    batch_size_max: int = 64

    def __post_init__(self) -> None:
        check_positive("num_components", self.num_components, integer=True)
        check_number("temperature", self.temperature, 0.0, low_open=True)
        check_number("init_spread", self.init_spread, 0.0, 1.0)
        if self.momentum is not None:
            check_number("momentum", self.momentum, 0.0, 1.0, low_open=True)
        check_positive("batch_size_max", self.batch_size_max, integer=True)

    def batch_momentum(self, layer_momentum: float, batch: int) -> float:
        """``1 - (1 - m)^(batch / batch_size_max)``: how far a batch of ``batch`` images moves the components."""
        return 1.0 - (1.0 - layer_momentum) ** (batch / self.batch_size_max)


def initial_components(mean: torch.Tensor, var: torch.Tensor, num_components: int, init_spread: float,
                       generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(K, C)`` component means and variances a layer starts from (see the module docs), drawing
    ``K x C`` standard normal numbers from ``generator`` (none when ``K = 1``)."""
    means = mean.detach().repeat(num_components, 1)
    variances = var.detach().repeat(num_components, 1)
    if num_components == 1:
        return means, variances
    noise = torch.randn(means.shape, generator=generator, dtype=means.dtype, device="cpu").to(means.device)
    means = means + math.sqrt(init_spread * num_components / (num_components - 1)) * variances.sqrt() * noise
    return means, (1.0 - init_spread) * variances


def mixed_statistics(inst_mean: torch.Tensor, inst_var: torch.Tensor, means: torch.Tensor, variances: torch.Tensor,
                     temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 1-2 of the module docs for ``(B, C)`` instance moments and ``(K, C)`` components: returns the
    ``(B, K)`` assignments and each image's ``(B, C)`` mean and variance."""
    with torch.no_grad():
        similarity = F.normalize(inst_mean, dim=1) @ F.normalize(means, dim=1).T
        probs = torch.softmax(similarity / temperature, dim=1)
    p = probs.unsqueeze(-1)  # (B, K, 1)
    mean_mix = (1.0 - p) * means.unsqueeze(0) + p * inst_mean.unsqueeze(1)  # (B, K, C)
    var_mix = (1.0 - p) * variances.unsqueeze(0) + p * inst_var.unsqueeze(1)
    mean = mean_mix.mean(1)
    var = var_mix.mean(1) + (mean_mix ** 2).mean(1) - mean ** 2
    return probs, mean, var


def component_step(inst_mean: torch.Tensor, inst_var: torch.Tensor, probs: torch.Tensor, means: torch.Tensor,
                   variances: torch.Tensor, momentum: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3: the components after one batch, ``x_k + momentum * mean_i p_ik (y_i - x_k)``; images whose moments
    are not all finite are left out (they count in the batch size, as every image does in the reference's mean)."""
    finite = (torch.isfinite(inst_mean).all(1) & torch.isfinite(inst_var).all(1)).to(probs.dtype)  # (B,)
    weight = (torch.nan_to_num(probs) * finite.unsqueeze(1)).unsqueeze(-1)  # (B, K, 1)
    batch = inst_mean.shape[0]

    def step(observed: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
        diff = torch.where(finite.unsqueeze(1).unsqueeze(2) > 0, observed.unsqueeze(1) - current.unsqueeze(0),
                           torch.zeros((), dtype=current.dtype, device=current.device))
        return current + momentum * (weight * diff).sum(0) / batch

    return step(inst_mean, means), step(inst_var, variances)


class UnMixTNSBatchNorm(nn.Module):
    """A BatchNorm layer (2d or 3d) replaced by UnMix-TNS (see the module docs): instance-wise statistics mixed
    with ``K`` running components, which each batch then moves. Shares the layer's affine
    parameters and ``eps``; ``initial_means``/``initial_vars`` keep the components' first draw."""

    def __init__(self, bn: _BatchNorm, config: UnMixTNSConfig, generator: torch.Generator) -> None:
        super().__init__()
        if bn.running_mean is None or bn.running_var is None:
            raise NotApplicable("unmixtns needs BatchNorm layers with running statistics (track_running_stats=True)")
        self.num_features = bn.num_features
        self.eps = bn.eps
        self.weight = bn.weight
        self.bias = bn.bias
        self.temperature = config.temperature
        self.layer_momentum = config.momentum if config.momentum is not None else (bn.momentum or 0.1)
        self.config = config
        means, variances = initial_components(bn.running_mean, bn.running_var, config.num_components,
                                              config.init_spread, generator)
        self.register_buffer("initial_means", means.clone())
        self.register_buffer("initial_vars", variances.clone())
        self.register_buffer("means", means)
        self.register_buffer("vars", variances)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalize(x, update=True)

    def normalize(self, x: torch.Tensor, update: bool) -> torch.Tensor:
        """``x`` normalized per image with its mixed statistics; with ``update`` the batch then moves the components."""
        if x.ndim < 3:
            raise ValueError(f"an UnMix-TNS layer normalizes (N, C, ...) maps with spatial positions, got shape "
                             f"{tuple(x.shape)}")
        dims = list(range(2, x.ndim))
        inst_var, inst_mean = torch.var_mean(x, dim=dims, correction=0)  # (B, C)
        probs, mean, var = mixed_statistics(inst_mean, inst_var, self.means, self.vars, self.temperature)
        if update and x.shape[0] > 0:
            with torch.no_grad():
                momentum = self.config.batch_momentum(self.layer_momentum, x.shape[0])
                means, variances = component_step(inst_mean.detach(), inst_var.detach(), probs, self.means, self.vars,
                                                  momentum)
                self.means.copy_(means)
                self.vars.copy_(variances)
        shape = (*mean.shape, *([1] * len(dims)))
        out = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        extra = [1] * len(dims)
        if self.weight is not None:
            out = out * self.weight.view(1, -1, *extra)
        if self.bias is not None:
            out = out + self.bias.view(1, -1, *extra)
        return out

    def reset(self) -> None:
        """Components back to their initial draw."""
        self.means.copy_(self.initial_means)
        self.vars.copy_(self.initial_vars)

    def extra_repr(self) -> str:
        return f"{self.num_features}, K={self.config.num_components}, eps={self.eps}"


@method("unmixtns", UnMixTNSConfig, defaults=UNMIXTNS_DEFAULTS)
class UnMixTNS(TTAMethod):
    """The source model with UnMix-TNS normalization layers in place of its BatchNorm2d layers (see module docs)."""

    def configure_model(self, model: nn.Module) -> nn.Module:
        model.eval().requires_grad_(False)
        generator = torch.Generator().manual_seed(self.protocol.seed if self.protocol.seed is not None else 0)
        # BatchNorm1d stays on its source statistics, as in the reference; the others draw their components in
        # module order from one generator, as the reference draws them from its seeded global one
        replaced = replace_batchnorms(model, lambda bn: bn if isinstance(bn, nn.BatchNorm1d) else
                                      UnMixTNSBatchNorm(bn, self.config, generator), "unmixtns")
        self.layers = [layer for layer in replaced if isinstance(layer, UnMixTNSBatchNorm)]
        if not self.layers:
            raise NotApplicable("unmixtns replaces BatchNorm2d layers; this model has none (GroupNorm and LayerNorm "
                                "models have no running statistics to un-mix)")
        return model

    @property
    def holds_state(self) -> bool:
        return not self.protocol.episodic

    def predict_held(self, x: torch.Tensor) -> torch.Tensor:
        """Normalized with the current components, which this batch does not move (a twin of the model whose
        UnMix-TNS layers do not update; the model itself is not touched)."""
        frozen = {name: (lambda m: functools.partial(m.normalize, update=False))
                  for name, m in self.model.named_modules() if isinstance(m, UnMixTNSBatchNorm)}
        return structural_twin(self.model, frozen)(x)

    def reset_extra_state(self) -> None:
        for layer in self.layers:
            layer.reset()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layers={len(self.layers)}"
