"""ETA and EATA: efficient anti-forgetting test-time adaptation (Niu et al., ICML 2022).

Per adaptation step, as in the paper (Eqs. 3-9) and the benchmark code it is checked against
(``classification/methods/eata.py`` of github.com/mariodoebler/test-time-adaptation):

1. forward; the *reliable* samples are those whose softmax entropy is below ``E0 = 0.4 ln C``
   (C = number of classes, read from the logits; ``e0=`` overrides it);
2. of those, the *non-redundant* ones are those whose probability vector has cosine similarity
   below ``d_margin`` (in absolute value) with ``m``, a moving average of the probabilities of the
   samples selected so far; with no average yet (the first batch, or after a reset) every reliable
   sample is kept. ``m`` then moves to ``0.9 m + 0.1 mean(selected probabilities)`` (the first
   value: that mean itself; unchanged when nothing is selected);
3. the loss is the mean over the selected samples of ``entropy * exp(E0 - entropy)`` (the weight
   ``1 / exp(entropy - E0)``, taken without gradient), plus, for EATA, the Fisher regularizer
   ``fisher_alpha * sum_i F_i (theta_i - theta_i^0)^2`` over the trained parameters;
4. no update when nothing is selected.

The Fisher information ``F`` (EATA only) is estimated once, at construction, on clean source
images (``source=``): per source batch, the gradient of the mean cross-entropy of the model's
predictions against their own arg-max labels, squared, averaged over the batches; ``theta^0`` are
the weights before adaptation. The reference takes ``SOURCE.NUM_SAMPLES = 2000`` images in batches
of its test batch size, as ``source_images`` and ``fisher_batch_size`` do here. ETA is EATA
without the regularizer (the reference's ``FISHER_ALPHA = 0``) and needs no source images.

Presets (``defaults=``): ``"cifar10"`` (Adam, lr 1e-3, ``d_margin = 0.4``, EATA ``fisher_alpha = 1``,
batches of 200 for the Fisher) and ``"imagenet"`` (SGD with Nesterov momentum 0.9, lr 2.5e-4,
``d_margin = 0.05``, ``fisher_alpha = 2000``, batches of 64). Trained parameters, BatchNorm on
batch statistics and eval mode: :mod:`aqr.methods.norm_training`.

Differences from the reference code: the moving average ``m`` is cleared by ``reset()`` (as in the
reference) and so, under the episodic protocol, every batch starts without it, i.e. without the
redundancy filter; the source images are an argument (a tensor or an iterable of batches), not a
data set the method loads itself; images with non-finite values are kept out of the loss (see
:mod:`aqr.methods.norm_training`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import softmax_entropy
from .declaration import Needs, method
from .norm_training import NormTrainingMethod, finite_images
from .options import OPTIMIZER_DEFAULTS, OptimizerConfig, check_number

ETA_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "cifar10": MappingProxyType({**OPTIMIZER_DEFAULTS["cifar10"], "d_margin": 0.4}),
    "imagenet": MappingProxyType({**OPTIMIZER_DEFAULTS["imagenet"], "d_margin": 0.05}),
})
EATA_DEFAULTS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "cifar10": MappingProxyType({**ETA_DEFAULTS["cifar10"], "fisher_alpha": 1.0, "fisher_batch_size": 200}),
    "imagenet": MappingProxyType({**ETA_DEFAULTS["imagenet"], "fisher_alpha": 2000.0, "fisher_batch_size": 64}),
})


@dataclass(frozen=True)
class ETAConfig(OptimizerConfig):
    """ETA options (and the optimizer's, see :class:`~aqr.methods.options.OptimizerConfig`).

    Attributes:
        e0: absolute entropy threshold; ``None`` means ``e0_factor * ln(C)``.
        e0_factor: the 0.4 in ``E0 = 0.4 ln C``.
        d_margin: the redundancy filter keeps samples whose |cosine similarity| with the moving average is below it.
        probs_momentum: weight of the old value in the moving average of the selected probabilities.
    """

    e0: float | None = None
    e0_factor: float = 0.4
    d_margin: float = 0.4
    probs_momentum: float = 0.9

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.e0 is not None:
            check_number("e0", self.e0, 0.0)
        check_number("e0_factor", self.e0_factor, 0.0)
        check_number("d_margin", self.d_margin, 0.0)
        check_number("probs_momentum", self.probs_momentum, 0.0, 1.0)

    def threshold(self, num_classes: int) -> float:
        """The entropy threshold ``E0`` for a ``num_classes``-way classifier."""
        return self.e0 if self.e0 is not None else self.e0_factor * math.log(num_classes)


@dataclass(frozen=True)
class EATAConfig(ETAConfig):
    """EATA options: those of :class:`ETAConfig` and the Fisher regularizer's.

    Attributes:
        fisher_alpha: weight of the Fisher regularizer (``beta`` in the paper's Eq. 8).
        source_images: at most this many source images are used (the reference: 2000).
        fisher_batch_size: a tensor ``source=`` (the clean source images EATA is built with: an
            ``(N, C, H, W)`` tensor, or an iterable of batches, tensors or ``(image, label)`` pairs; needed
            when ``fisher_alpha > 0``) is split into batches of this size (the reference's
            test batch size); an iterable's own batches are used as they come.
    """

    fisher_alpha: float = 1.0
    source_images: int = 2000
    fisher_batch_size: int = 200

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number("fisher_alpha", self.fisher_alpha, 0.0)
        for name in ("source_images", "fisher_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


def eata_selection(probs: torch.Tensor, entropy: torch.Tensor, e0: float, d_margin: float,
                   moving: torch.Tensor | None, momentum: float = 0.9
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """EATA's sample selection (Eqs. 3-6) for one batch.

    Args:
        probs: ``(N, C)`` softmax probabilities; entropy: their ``(N,)`` entropies (nats).
        e0: the reliability threshold; d_margin: the redundancy threshold on |cosine similarity|.
        moving: the moving average of the selected probabilities so far, or ``None``.
    Returns:
        ``(selected, weights, moving)``: the boolean mask of selected samples, the weights
        ``exp(e0 - entropy)`` of the selected ones (in batch order) and the updated moving average.
    """
    selected = entropy < e0
    if moving is not None and bool(selected.any()):
        cosine = F.cosine_similarity(moving.unsqueeze(0), probs, dim=1)
        selected = selected & (cosine.abs() < d_margin)
    if bool(selected.any()):
        mean = probs[selected].mean(0)
        moving = mean if moving is None else momentum * moving + (1 - momentum) * mean
    weights = torch.exp(e0 - entropy[selected])
    return selected, weights, moving


def _source_batches(source: Any, batch_size: int, limit: int) -> Iterable[torch.Tensor]:
    """The image batches of ``source`` (see :class:`EATAConfig`'s ``fisher_batch_size``), at most ``limit`` images in all."""
    if isinstance(source, torch.Tensor):
        source = source.split(batch_size)
    seen = 0
    for batch in source:
        images = batch if isinstance(batch, torch.Tensor) else (batch[0] if isinstance(batch, (list, tuple)) else None)
        if not isinstance(images, torch.Tensor) or images.ndim < 2:
            raise TypeError("source must yield image tensors or (images, labels) batches, "
                            f"got {type(batch).__name__}")
        images = images[: limit - seen]
        if len(images):
            yield images
        seen += len(images)
        if seen >= limit:
            return


def fisher_information(model: nn.Module, params: Mapping[str, nn.Parameter],
                       batches: Iterable[torch.Tensor]) -> dict[str, torch.Tensor]:
    """EATA's diagonal Fisher information of ``params`` on ``batches`` (Eq. 9, as in the reference code).

    Per batch: the gradient of the mean cross-entropy between the model's logits and their own
    arg-max labels, squared; the result is the mean over batches. Parameters' ``.grad`` are left alone.
    Raises ``ValueError`` when there is no batch or a batch gives non-finite logits.
    """
    names = list(params)
    total = {name: torch.zeros_like(p) for name, p in params.items()}
    count = 0
    device = next(iter(params.values())).device
    with torch.enable_grad():
        for images in batches:
            images = images.to(device)
            if not bool(finite_images(images).all()):
                raise ValueError("source images for EATA's Fisher information contain NaN or Inf values")
            logits = model(images)
            loss = F.cross_entropy(logits, logits.argmax(1))
            grads = torch.autograd.grad(loss, [params[n] for n in names], allow_unused=True)
            for name, grad in zip(names, grads):
                if grad is not None:
                    total[name] += grad.detach() ** 2
            count += 1
    if count == 0:
        raise ValueError("EATA's source= gave no images for the Fisher information")
    return {name: value / count for name, value in total.items()}


def fisher_penalty(params: Mapping[str, torch.Tensor], fisher: Mapping[str, torch.Tensor],
                   anchor: Mapping[str, torch.Tensor], alpha: float) -> torch.Tensor:
    """EATA's anti-forgetting term ``alpha * sum_i F_i (theta_i - theta_i^0)^2`` (Eq. 8)."""
    return alpha * sum(((fisher[n] * (p - anchor[n]) ** 2).sum() for n, p in params.items()),
                       start=torch.zeros(()))


@method("eta", ETAConfig, defaults=ETA_DEFAULTS)
class ETA(NormTrainingMethod):
    """ETA behind the common protocol: EATA's sample selection and weighting, no Fisher regularizer."""

    carried = ("moving_probs", "selected_reliable", "selected")

    def setup(self, model: nn.Module) -> None:
        self.moving_probs: torch.Tensor | None = None
        self.selected_reliable = 0  # diagnostics since creation: samples past the entropy filter
        self.selected = 0  # ... and past both filters

    def reset_extra_state(self) -> None:
        self.moving_probs = None

    def regularizer(self) -> torch.Tensor | None:
        """The term added to the loss (EATA's Fisher penalty); none for ETA."""
        return None

    def loss(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor | None:
        entropy = softmax_entropy(logits)
        e0 = self.config.threshold(logits.shape[1])
        self.selected_reliable += int((entropy.detach() < e0).sum())
        selected, weights, self.moving_probs = eata_selection(
            logits.detach().softmax(1), entropy.detach(), e0, self.config.d_margin, self.moving_probs,
            self.config.probs_momentum)
        self.selected += int(selected.sum())
        if not bool(selected.any()):
            return None
        loss = (entropy[selected] * weights).mean()
        extra = self.regularizer()
        return loss if extra is None else loss + extra


@method("eata", EATAConfig, defaults=EATA_DEFAULTS, needs=Needs(source=True))
class EATA(ETA):
    """EATA behind the common protocol: ETA plus the Fisher regularizer from clean source images."""

    def setup(self, model: nn.Module) -> None:
        super().setup(model)
        params = dict(zip(self.param_names, self.trained))
        self.fisher: dict[str, torch.Tensor] | None = None
        if self.config.fisher_alpha > 0:
            if self.supplied_source is None:
                raise TypeError("the 'eata' method needs source= (clean source images for its Fisher regularizer; "
                                "'eta' is EATA without it)")
            batches = _source_batches(self.supplied_source, self.config.fisher_batch_size, self.config.source_images)
            self.fisher = fisher_information(model, params, batches)
        self.anchor = {name: p.detach().clone() for name, p in params.items()}

    def regularizer(self) -> torch.Tensor | None:
        if self.fisher is None:
            return None
        params = dict(zip(self.param_names, self.trained))
        return fisher_penalty(params, self.fisher, self.anchor, self.config.fisher_alpha)
