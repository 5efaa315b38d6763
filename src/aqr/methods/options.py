"""Options shared by the field's methods (ETA/EATA, ROID, DeYO, CoTTA, RoTTA, LAME): checks of numeric
options, the optimizer config and the option sets that ``defaults=`` picks.

The optimizer is the reference's ``OPTIM`` section (github.com/mariodoebler/test-time-adaptation):
Adam (``betas=(beta, 0.999)``) or SGD (``momentum``, dampening 0, Nesterov); neither scales the learning
rate with the batch size. ``defaults=`` names the option set that fills the options a caller does not give,
``"cifar10"`` (the reference's ``cfgs/cifar10_c``) or ``"imagenet"`` (``cfgs/imagenet_c``); each method
keeps its own values (:data:`OPTIMIZER_DEFAULTS` are those of ETA/EATA, ROID and DeYO).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import torch
from torch import nn

OPTIMIZERS = ("adam", "sgd")

#: The reference's optimizer settings per benchmark (``cfgs/cifar10_c/*.yaml``, ``cfgs/imagenet_c/*.yaml``).
OPTIMIZER_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "cifar10": MappingProxyType({"optimizer": "adam", "lr": 1e-3}),
    "imagenet": MappingProxyType({"optimizer": "sgd", "lr": 2.5e-4}),
})


def check_number(name: str, value: Any, low: float, high: float = math.inf, low_open: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite real number in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        bound = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high != math.inf else "")
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")


def check_unit(name: str, value: Any, low_open: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a real number in [0, 1] (``(0, 1]`` with ``low_open``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (0 < value <= 1 if low_open else 0 <= value <= 1)
    if not ok:
        raise ValueError(f"{name} must lie in {'(0, 1]' if low_open else '[0, 1]'}, got {value!r}")


def check_positive(name: str, value: Any, integer: bool = False, zero: bool = False) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite positive number (an int with ``integer``; 0 allowed
    with ``zero``)."""
    kinds = (int,) if integer else (int, float)
    ok = isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value)
    if not (ok and (value >= 0 if zero else value > 0)):
        what = "integer" if integer else "number"
        raise ValueError(f"{name} must be a {'non-negative' if zero else 'positive'} {what}, got {value!r}")


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer options of the field's methods (defaults: the reference's CIFAR-10-C ones).

    Attributes:
        defaults: the option set the unset options came from, ``"cifar10"`` or ``"imagenet"``.
        optimizer: ``"adam"`` or ``"sgd"``.
        lr: learning rate (not scaled with the batch size, as in the reference). A config whose
            ``lr_rule`` is set (TENT's, SAR's) takes ``None``: the method's own rule picks it (:meth:`build`'s ``lr``).
        beta: Adam's first beta (the second is 0.999).
        momentum: SGD momentum (dampening 0).
        nesterov: SGD with Nesterov momentum (the reference's default; plain SGD when ``momentum`` is 0).
        weight_decay: L2 penalty of either optimizer.
    """

    defaults: str = "cifar10"
    optimizer: str = "adam"
    lr: float | None = 1e-3
    beta: float = 0.9
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 0.0
    #: ``lr=None`` is allowed: the method computes the learning rate (e.g. from the architecture)
    lr_rule: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.lr is not None or not self.lr_rule:
            check_number("lr", self.lr, 0.0)
        check_number("beta", self.beta, 0.0, 1.0)
        check_number("momentum", self.momentum, 0.0, 1.0)
        check_number("weight_decay", self.weight_decay, 0.0)
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"nesterov must be True or False, got {self.nesterov!r}")

    def build(self, params: Iterable[nn.Parameter], lr: float | None = None) -> torch.optim.Optimizer:
        """The configured optimizer over ``params``, at learning rate ``lr`` where the method computed it
        (``lr=None`` in a config with ``lr_rule``), else the config's."""
        params = list(params)
        lr = self.lr if lr is None else lr
        if self.optimizer == "adam":
            return torch.optim.Adam(params, lr=lr, betas=(self.beta, 0.999), weight_decay=self.weight_decay)
        return torch.optim.SGD(params, lr=lr, momentum=self.momentum, dampening=0.0,
                               weight_decay=self.weight_decay, nesterov=self.nesterov and self.momentum > 0)

