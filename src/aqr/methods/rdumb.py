"""RDumb: ETA reset to the source model every 1,000 updates (Press et al., "RDumb: A simple approach that
questions our progress in continual test-time adaptation", NeurIPS 2023).

On long streams nearly every continual method drifts below the unadapted model; RDumb bounds the drift by
forgetting on a schedule. It is :class:`~aqr.methods.eata.ETA` (entropy minimization on reliable,
non-redundant samples; :mod:`aqr.methods.eata`) whose weights, optimizer state and moving average of the
selected probabilities go back to their initial values after every ``reset_every`` adaptation steps, as
the test-time-adaptation benchmark code does with ``MODEL.RESET_AFTER_NUM_UPDATES = 1000``
(``cfgs/*/rdumb.yaml``). A step counts whether or not it updated the weights (a batch whose samples are
all filtered out counts too, as there). The batch that completes the count is scored with the logits
of its own step, before the reset; the next batch starts from the source.

Presets (``defaults=``): ETA's ``"cifar10"`` (Adam, lr 1e-3, ``d_margin`` 0.4) and ``"imagenet"`` (SGD with
Nesterov momentum, lr 2.5e-4, ``d_margin`` 0.05; also the reference's CCC setting), each with
``reset_every = 1000``. Under the episodic protocol every batch starts from the source anyway, so the
schedule never fires.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from .declaration import method
from .eata import ETA, ETA_DEFAULTS, ETAConfig
from .options import check_positive

RDUMB_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    name: MappingProxyType({**options, "reset_every": 1000}) for name, options in ETA_DEFAULTS.items()})


@dataclass(frozen=True)
class RDumbConfig(ETAConfig):
    """RDumb options: ETA's (:class:`~aqr.methods.eata.ETAConfig`) and the reset schedule.

    Attributes:
        reset_every: adaptation steps after which the model, optimizer and ETA's moving average return to
            their initial state (the reference's ``RESET_AFTER_NUM_UPDATES``, 1,000).
    """

    reset_every: int = 1000

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("reset_every", self.reset_every, integer=True)


@method("rdumb", RDumbConfig, defaults=RDUMB_DEFAULTS)
class RDumb(ETA):
    """ETA reset to the source every ``reset_every`` adaptation steps (see module docs)."""

    carried = ("steps_since_reset", "scheduled_resets")

    def setup(self, model: nn.Module) -> None:
        super().setup(model)
        self.steps_since_reset = 0  # adaptation steps since the last reset, scheduled or asked for
        self.scheduled_resets = 0  # diagnostics: resets the schedule made since creation

    def adapt(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().adapt(x)
        self.steps_since_reset += 1
        if self.steps_since_reset == self.config.reset_every:
            # weights, optimizer and ETA's moving average back to the start; the protocol's batch counter
            # (which seeds forward) keeps running, as the reference's does
            self.restore_initial_state()
            self.scheduled_resets += 1
        return logits

    def reset_extra_state(self) -> None:
        super().reset_extra_state()
        self.steps_since_reset = 0
