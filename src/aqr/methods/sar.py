"""SAR: sharpness-aware and reliable entropy minimization (Niu et al., ICLR 2023).

Per adaptation step, following the official code (mr-eggplant/SAR, ``sar.py``):

1. forward; keep the samples whose softmax entropy is below ``E0 = 0.4 ln C`` (C = number of
   classes, read from the logits); the loss is their mean entropy;
2. SAM: move the trained parameters to the worst-case point within radius ``rho`` of the gradient;
3. forward again at the perturbed point; of the samples kept in 1, keep those still below ``E0``;
   their mean entropy is the second loss, which also updates a moving average
   ``ema <- 0.9 ema + 0.1 loss`` (first value: the loss itself; not updated when nothing is kept);
4. back at the original point, the base optimizer (SGD, momentum 0.9) steps with the gradient of
   the second loss;
5. model recovery: if ``ema < 0.2`` the weights, optimizer state and ema go back to the original.

The logits returned by a step are those of forward 1 (the official online output).

Choices (documented because the papers leave them open):

* Trained parameters: affine weight/bias of every BatchNorm/GroupNorm/LayerNorm layer except those
  inside frozen modules. The official code always skips modules named ``*layer4*``,
  ``*blocks.9*``-``*blocks.11*`` and the final ``norm``, silently matching nothing on other
  architectures. Here freezing is explicit: ``freeze`` is a name from ``FREEZE_RULES`` or module-name rules (a
  rule matches a module whose name equals it or starts with ``rule + "."``; rules containing
  ``* ? [`` are shell patterns matched against each module name and its ancestors), and a rule
  that matches no module raises ``ValueError``. ``"auto"`` (default) picks the first named set all
  of whose rules match the model (``"resnet"``: ``layer4``, the paper's ResNet-50 choice and the
  official default; ``"vit-base"``: ``blocks.9-11`` from the paper plus the final ``norm`` as in
  the official code), else freezes nothing (e.g. CIFAR ResNet-20, which has no ``layer4``);
  ``frozen_rules`` shows what was chosen. Frozen BatchNorm layers still use batch statistics.
* ``E0`` uses the model's own class count (the paper's table writes ``ln(1000)``, the ImageNet
  value; ``0.4 ln 1000 > ln 10`` would filter nothing on CIFAR-10). ``e0=`` overrides it.
* Episodic protocol: ``reset()`` before each batch also clears the EMA, so the EMA is the second
  loss of the current batch and recovery means "discard this batch's update" (the scored forward
  then runs on the original weights with batch-statistics BatchNorm).
* The copy stays in eval mode (as in the test-time-adaptation benchmark repository's SAR), so no
  dropout or stochastic depth.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .base import TTAMethod, softmax_entropy
from .norm_layers import norm_affine_parameters, train_norm_affine_parameters
from .sam import SAM
from .declaration import Needs, method
from .tent import TENT_DEFAULTS, TentConfig, configure_for_entropy_minimization

#: Named freezing rules: module-name rules whose norm layers SAR leaves untrained.
FREEZE_RULES: dict[str, tuple[str, ...]] = {
    "none": (),
    "resnet": ("layer4",),
    "vit-base": ("blocks.9", "blocks.10", "blocks.11", "norm"),
}
_AUTO_ORDER = ("resnet", "vit-base")


@dataclass(frozen=True)
class SARConfig(TentConfig):
    """SAR options (``lr``, ``momentum``, ``arch``, ``batch_size`` as in :class:`TentConfig`).

    Attributes:
        rho: SAM neighbourhood radius.
        e0: absolute entropy threshold; ``None`` means ``e0_factor * ln(C)``.
        e0_factor: the 0.4 in ``E0 = 0.4 ln C``.
        ema_momentum: weight of the old value in the loss moving average.
        recovery_threshold: reset the model when the moving average falls below this (``e_m``).
        freeze: ``"auto"``, a name from ``FREEZE_RULES``, one rule, or a sequence of rules.
    """

    rho: float = 0.05
    e0: float | None = None
    e0_factor: float = 0.4
    ema_momentum: float = 0.9
    recovery_threshold: float = 0.2
    freeze: str | Sequence[str] = "auto"

    def threshold(self, num_classes: int) -> float:
        """The entropy threshold ``E0`` for a ``num_classes``-way classifier."""
        return self.e0 if self.e0 is not None else self.e0_factor * math.log(num_classes)


def _rule_matches(name: str, rule: str) -> bool:
    if any(c in rule for c in "*?["):
        return fnmatch.fnmatchcase(name, rule)
    return name == rule or name.startswith(rule + ".")


def _self_and_ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def frozen_module_names(model: nn.Module, rules: Sequence[str]) -> frozenset[str]:
    """Names of the modules of ``model`` covered by ``rules`` (matched themselves or via an ancestor).

    Raises ``ValueError`` for a rule that matches no module.
    """
    names = [name for name, _ in model.named_modules() if name]
    frozen: set[str] = set()
    for rule in rules:
        hit = {n for n in names if any(_rule_matches(a, rule) for a in _self_and_ancestors(n))}
        if not hit:
            raise ValueError(f"freeze rule {rule!r} matches no module of {type(model).__name__}")
        frozen |= hit
    return frozenset(frozen)


def resolve_freeze_rules(model: nn.Module, freeze: str | Sequence[str]) -> tuple[str, ...]:
    """Turn the ``freeze`` option into explicit rules for ``model`` (see the module docstring)."""
    if isinstance(freeze, str):
        if freeze == "auto":
            for named in _AUTO_ORDER:
                try:
                    frozen_module_names(model, FREEZE_RULES[named])
                except ValueError:
                    continue
                return FREEZE_RULES[named]
            return ()
        return FREEZE_RULES.get(freeze, (freeze,))
    return tuple(freeze)


def _masked_mean(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Mean of ``values[keep]``; 0 (with zero gradients) when nothing is kept."""
    return (values * keep).sum() / keep.sum().clamp(min=1)


# needs the batch size: the ViT learning rate scales with it
@method("sar", SARConfig, defaults=TENT_DEFAULTS, needs=Needs(batch_size=True))
class SAR(TTAMethod):
    """SAR behind the common protocol (see :mod:`aqr.methods.base`)."""

    carried = ("ema", "recoveries")

    def configure_model(self, model: nn.Module) -> nn.Module:
        model = configure_for_entropy_minimization(model)
        self.frozen_rules = resolve_freeze_rules(model, self.config.freeze)
        skip = frozen_module_names(model, self.frozen_rules)
        self.param_names = train_norm_affine_parameters(model, "SAR", skip=skip)
        self.ema: float | None = None
        self.recoveries = 0  # diagnostics only: total recoveries since creation, never reset
        return model

    def build_optimizer(self) -> SAM:
        params = [p for _, p in norm_affine_parameters(self.model) if p.requires_grad]
        base = self.config.build(params, lr=self.config.resolve_lr(self.model))
        return SAM(base, rho=self.config.rho)

    def reset_extra_state(self) -> None:
        self.ema = None

    def reliable(self, entropy: torch.Tensor, num_classes: int) -> torch.Tensor:
        """Boolean mask of the samples SAR trusts: entropy below ``E0``."""
        return entropy < self.config.threshold(num_classes)

    def adapt(self, x: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad()
        logits = self.model(x)
        entropy = softmax_entropy(logits)
        keep1 = self.reliable(entropy, logits.shape[1])
        _masked_mean(entropy, keep1).backward()
        self.optimizer.perturb()

        entropy2 = softmax_entropy(self.model(x))[keep1]
        keep2 = self.reliable(entropy2, logits.shape[1])
        loss2 = _masked_mean(entropy2, keep2)
        if keep2.any():
            value = loss2.item()
            m = self.config.ema_momentum
            self.ema = value if self.ema is None else m * self.ema + (1 - m) * value
        loss2.backward()
        self.optimizer.unperturb_and_step()

        if self.ema is not None and self.ema < self.config.recovery_threshold:
            self.restore_initial_state()  # also clears the EMA
            self.recoveries += 1
        return logits
