"""ROID: universal test-time adaptation through weight ensembling, diversity weighting and prior
correction (Marsden, Doebler and Yang, WACV 2024).

Per adaptation step, as in the benchmark code it is checked against (``classification/methods/roid.py``
of github.com/mariodoebler/test-time-adaptation, by the paper's authors):

1. forward; per sample, the *diversity* ``d = 1 - cos(p, m)`` of its probabilities ``p`` from ``m``,
   a moving average of batch-mean probabilities (uniform at the start), and the *certainty*
   ``c = -entropy(p)``, each min-max normalized over the batch; samples with ``d`` below the batch's
   mean ``d`` get weight 0 (they are dropped), the others ``w = exp(d * c / temperature)``; then
   ``m <- 0.9 m + 0.1 mean(p)`` over the whole batch;
2. loss: the soft likelihood ratio ``-sum_k p_k log(p_k / (1 - p_k) + 1e-5)`` (``p`` clipped to
   at most 0.99) weighted by ``w``, plus the consistency loss, the symmetric cross-entropy (0.5/0.5)
   between the logits of the kept samples and those of an augmented copy of them
   (:func:`aqr.methods.augment.roid_augment`), weighted by ``w``; both summed over the kept samples
   and divided by the batch size;
3. optimizer step, then weight ensembling: every trained parameter moves towards its source value,
   ``theta <- 0.99 theta + 0.01 theta_source``;
4. prior correction of the scored output: with ``q`` the batch-mean probability,
   ``smooth = max(1/N, 1/C) / max(q)`` and ``prior = (q + smooth) / (1 + C smooth)``, the output
   is ``logits * prior`` (per class).

Presets (``defaults=``): ``"cifar10"`` (Adam, lr 1e-3) and ``"imagenet"`` (SGD with Nesterov
momentum 0.9, lr 2.5e-4); the ROID options have the same defaults in both. Trained parameters,
BatchNorm on batch statistics and eval mode: :mod:`aqr.methods.norm_training`.

Differences from the reference code: the prior correction multiplies the *logits* by the prior, as
the reference does (the paper writes it on probabilities), and is also applied to the episodic
protocol's scored forward pass (its prior from that pass); the losses are divided by the size of
the batch at hand (the reference divides by the configured batch size, the same except for a last,
smaller batch); when all samples of a batch share the same diversity (or certainty), e.g. a batch
of one, the min-max normalization gives 0 instead of NaN (so nothing is dropped and every weight
is 1); images with non-finite values are kept out of adaptation (see :mod:`aqr.methods.norm_training`).
The consistency augmentation needs RGB image batches ``(N, 3, H, W)`` in [0, 1]; set
``use_consistency=False`` for other inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .augment import roid_augment
from .base import softmax_entropy
from .declaration import method
from .norm_training import NormTrainingMethod
from .options import OPTIMIZER_DEFAULTS, OptimizerConfig, check_number


@dataclass(frozen=True)
class ROIDConfig(OptimizerConfig):
    """ROID options (and the optimizer's, see :class:`~aqr.methods.options.OptimizerConfig`).

    Attributes:
        use_weighting: certainty and diversity weighting (and dropping the least diverse samples).
        use_prior_correction: correct the scored output by the smoothed batch prior.
        use_consistency: add the consistency loss on augmented images.
        use_batch_statistics: BatchNorm normalizes with each batch's statistics; ``False``: with its running
            (source) statistics, as in eval mode, the affine parameters still trained.
        momentum_src: weight ensembling, ``theta <- momentum_src theta + (1 - momentum_src) theta_source``
            (1.0: no ensembling).
        momentum_probs: weight of the old value in the moving average of the batch-mean probabilities.
        temperature: the weights are ``exp(d * c / temperature)``.
    """

    use_weighting: bool = True
    use_prior_correction: bool = True
    use_consistency: bool = True
    use_batch_statistics: bool = True
    momentum_src: float = 0.99
    momentum_probs: float = 0.9
    temperature: float = 1.0 / 3.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("use_weighting", "use_prior_correction", "use_consistency", "use_batch_statistics"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_number("momentum_src", self.momentum_src, 0.0, 1.0)
        check_number("momentum_probs", self.momentum_probs, 0.0, 1.0)
        check_number("temperature", self.temperature, 0.0, low_open=True)


def _min_max(values: torch.Tensor) -> torch.Tensor:
    """``values`` mapped affinely onto [0, 1]; all zeros when they are all equal."""
    low, span = values.min(), values.max() - values.min()
    return (values - low) / span if bool(span > 0) else torch.zeros_like(values)


def roid_weights(logits: torch.Tensor, moving_probs: torch.Tensor, temperature: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """ROID's sample weights for one batch: ``(weights, dropped)``, weight 0 where ``dropped``."""
    probs = logits.softmax(1)
    diversity = _min_max(1 - F.cosine_similarity(moving_probs.unsqueeze(0), probs, dim=1))
    dropped = diversity < diversity.mean()
    certainty = _min_max(-softmax_entropy(logits))
    weights = torch.exp(diversity * certainty / temperature)
    weights = torch.where(dropped, torch.zeros_like(weights), weights)
    return weights, dropped


def soft_likelihood_ratio(logits: torch.Tensor, clip: float = 0.99, eps: float = 1e-5) -> torch.Tensor:
    """Per-sample soft likelihood ratio loss ``-sum_k p_k log(p_k / (1 - p_k) + eps)``, ``p`` clipped at ``clip``."""
    probs = logits.softmax(1).clamp(0.0, clip)
    return -(probs * torch.log(probs / (1 - probs) + eps)).sum(1)


def symmetric_cross_entropy(logits: torch.Tensor, target_logits: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """Per-sample ``-(1-alpha) sum q log p - alpha sum p log q`` with ``p, q`` the softmax of ``logits``, ``target_logits``."""
    return (-(1 - alpha) * (target_logits.softmax(1) * logits.log_softmax(1)).sum(1)
            - alpha * (logits.softmax(1) * target_logits.log_softmax(1)).sum(1))


def prior_correction(logits: torch.Tensor) -> torch.Tensor:
    """ROID's output: ``logits`` times the smoothed batch prior (see the module docs)."""
    n, classes = logits.shape
    prior = logits.softmax(1).mean(0)
    smooth = max(1.0 / n, 1.0 / classes) / prior.max()
    return logits * ((prior + smooth) / (1 + smooth * classes))


@method("roid", ROIDConfig, defaults=OPTIMIZER_DEFAULTS)
class ROID(NormTrainingMethod):
    """ROID behind the common protocol (see :mod:`aqr.methods.base`)."""

    carried = ("moving_probs",)

    def setup(self, model: nn.Module) -> None:
        self.source_weights = [p.detach().clone() for p in self.trained]
        self.moving_probs: torch.Tensor | None = None  # uniform, sized on the first batch

    def reset_extra_state(self) -> None:
        self.moving_probs = None

    def batch_statistics(self) -> bool:
        return self.config.use_batch_statistics

    def loss(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        n, classes = logits.shape
        if self.moving_probs is None:
            self.moving_probs = torch.full((classes,), 1.0 / classes, device=logits.device)
        per_sample = soft_likelihood_ratio(logits)
        weights = torch.ones_like(per_sample)
        kept = torch.ones(n, dtype=torch.bool, device=logits.device)
        if self.config.use_weighting:
            with torch.no_grad():
                weights, dropped = roid_weights(logits.detach(), self.moving_probs, self.config.temperature)
                kept = ~dropped
                m = self.config.momentum_probs
                self.moving_probs = m * self.moving_probs + (1 - m) * logits.detach().softmax(1).mean(0)
        loss = (per_sample * weights)[kept].sum() / n
        if self.config.use_consistency and bool(kept.any()):
            augmented = self.model(roid_augment(x[kept]))
            consistency = symmetric_cross_entropy(augmented, logits[kept]) * weights[kept]
            loss = loss + consistency.sum() / n
        return loss

    @torch.no_grad()
    def after_step(self) -> None:
        m = self.config.momentum_src
        if m < 1.0:
            for p, source in zip(self.trained, self.source_weights):
                p.mul_(m).add_(source, alpha=1 - m)

    def postprocess(self, logits: torch.Tensor) -> torch.Tensor:
        return prior_correction(logits) if self.config.use_prior_correction else logits

