"""LAME: Laplacian-adjusted maximum-likelihood estimation (Boudiaf et al., "Parameter-free Online Test-time
Adaptation", CVPR 2022).

No weight changes: the model's output probabilities ``p`` on a batch are corrected by a Laplacian
regularization over the batch's features. With the affinity matrix ``W`` (N x N) of the L2-normalized
features ``f`` (the input of the classifier layer, see :func:`aqr.models.features.feature_layer`),
LAME minimizes over assignments ``Y`` (rows on the simplex)

    E(Y) = sum_i [ -<y_i, log p_i> + <y_i, log y_i> ] - lambda sum_ij W_ij <y_i, y_j>

by the fixed-point (concave-convex) iteration, following the test-time-adaptation benchmark repository
(mariodoebler/test-time-adaptation, ``methods/lame.py``) and the authors' code (fiveai/LAME):

    y_i <- softmax( log(p_i + 1e-10) + lambda sum_j W_ij y_j ),   starting from y_i = softmax(log(p_i + 1e-10)),

for at most ``max_steps`` iterations, stopping after the third when the energy changes by at most
``tol`` relative to the previous one. Affinities (``affinity``): ``"rbf"`` (default),
``W_ij = exp(-|f_i - f_j|^2 / (2 sigma^2))`` with ``sigma`` the mean over images of the distance to the
``knn``-th nearest image counting itself; ``"knn"``, ``W_ij = 1`` for the ``knn`` nearest other images;
``"linear"``, ``W_ij = <f_i, f_j>``. ``force_symmetry`` uses ``(W + W^T) / 2``. The defaults are the
reference's (rbf, knn 5, lambda 1, 100 steps) for CIFAR-10-C and ImageNet-C alike.

The scored logits are the last iteration's exponent, whose softmax is the returned assignment ``Y``
(the reference returns ``Y`` itself; the predicted classes are the same). Stateless: both protocols
agree. Differences from the reference: images whose features or logits are not finite are left out of
the affinity and keep the model's own logits; where ``sigma`` is 0 (a single image, or identical
features, where the reference divides 0 by 0) the rbf affinity is 1 between coinciding features, else 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from aqr.models.features import feature_layer_name

from .base import TTAMethod
from .declaration import method
from .options import check_positive

AFFINITIES = ("rbf", "knn", "linear")

#: The reference's settings per benchmark (``conf.py``'s ``LAME`` section; no dataset overrides it).
LAME_DEFAULTS: dict[str, dict[str, Any]] = {"cifar10": {}, "imagenet": {}}


@dataclass(frozen=True)
class LAMEConfig:
    """LAME options; the defaults are the reference's.

    Attributes:
        affinity: ``"rbf"``, ``"knn"`` or ``"linear"`` (see the module docs).
        knn: neighbours of the ``knn`` affinity, and the neighbour whose distance sets the ``rbf`` width.
        force_symmetry: symmetrize the affinity matrix.
        bound_lambda: weight ``lambda`` of the Laplacian term.
        max_steps: most fixed-point iterations.
        tol: relative energy change below which the iteration stops.
        feature_layer: the module whose input are the features; ``None`` finds the classifier head.
    """

    affinity: str = "rbf"
    knn: int = 5
    force_symmetry: bool = False
    bound_lambda: float = 1.0
    max_steps: int = 100
    tol: float = 1e-8
    feature_layer: str | None = None

    def __post_init__(self) -> None:
        if self.affinity not in AFFINITIES:
            raise ValueError(f"affinity must be one of {AFFINITIES}, got {self.affinity!r}")
        check_positive("knn", self.knn, integer=True)
        check_positive("max_steps", self.max_steps, integer=True)
        check_positive("bound_lambda", self.bound_lambda, zero=True)
        check_positive("tol", self.tol, zero=True)
        if not isinstance(self.force_symmetry, bool):
            raise ValueError(f"force_symmetry must be True or False, got {self.force_symmetry!r}")
        if self.feature_layer is not None and not isinstance(self.feature_layer, str):
            raise ValueError(f"feature_layer must be a module name or None, got {self.feature_layer!r}")


def pairwise_distances(f: torch.Tensor) -> torch.Tensor:
    """Euclidean distances between the rows of ``f`` (N, d); shape (N, N)."""
    return torch.norm(f.unsqueeze(0) - f.unsqueeze(1), dim=-1, p=2)


def affinity_matrix(features: torch.Tensor, kind: str = "rbf", knn: int = 5) -> torch.Tensor:
    """The affinity ``W`` of the rows of ``features`` (already normalized), see the module docs."""
    n = features.shape[0]
    if kind == "linear":
        return features @ features.t()
    dist = pairwise_distances(features)
    if kind == "knn":
        w = torch.zeros(n, n, device=features.device, dtype=features.dtype)
        neighbours = dist.topk(min(knn + 1, n), dim=-1, largest=False).indices[:, 1:]
        return w.scatter_(-1, neighbours, 1.0)
    sigma = dist.topk(min(knn, n), dim=-1, largest=False).values[:, -1].mean()
    if not bool(sigma > 0):  # one image, or identical features: affinity 1 where features coincide
        return (dist == 0).to(features.dtype)
    return torch.exp(-dist ** 2 / (2 * sigma ** 2))


def lame_energy(y: torch.Tensor, unary: torch.Tensor, pairwise: torch.Tensor, bound_lambda: float) -> torch.Tensor:
    """The reference's energy ``sum(unary*Y - lambda*pairwise*Y + Y log Y)``, ``pairwise = W Y_prev``."""
    return (unary * y - bound_lambda * pairwise * y + y * torch.log(y.clamp_min(1e-20))).sum()


def laplacian_optimization(unary: torch.Tensor, kernel: torch.Tensor, bound_lambda: float = 1.0,
                           max_steps: int = 100, tol: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The fixed-point iteration of the module docs; returns ``(Y, exponent, iterations)`` with
    ``Y = softmax(exponent)``."""
    exponent = -unary
    y = exponent.softmax(-1)
    old = float("inf")
    steps = 0
    for i in range(max_steps):
        pairwise = bound_lambda * (kernel @ y)
        exponent = -unary + pairwise
        y = exponent.softmax(-1)
        steps = i + 1
        # as in the reference, the energy weighs the (already lambda-weighted) pairwise term by lambda again
        energy = float(lame_energy(y, unary, pairwise, bound_lambda))
        if i > 1 and abs(energy - old) <= tol * abs(old):
            break
        old = energy
    return y, exponent, steps


@method("lame", LAMEConfig, defaults=LAME_DEFAULTS, stateless=True)
class LAME(TTAMethod):
    """LAME behind the common protocol (see the module docs); no weights change."""

    carried = ("iterations",)  # of the last batch (diagnostics)

    def configure_model(self, model: nn.Module) -> nn.Module:
        model.eval().requires_grad_(False)
        self.feature_layer_name = feature_layer_name(model, self.config.feature_layer)
        self._features: torch.Tensor | None = None
        self._holding = False
        model.get_submodule(self.feature_layer_name).register_forward_pre_hook(self._keep_features)
        self.iterations = 0  # fixed-point iterations of the last batch
        return model

    def _keep_features(self, module: nn.Module, args: tuple) -> None:
        if getattr(self, "_holding", False):
            return  # forward_held's pass (the user's model, or AQR's held state) keeps nothing
        self._features = args[0] if args else None

    def forward_held(self, x: torch.Tensor) -> torch.Tensor:
        """As :meth:`TTAMethod.forward_held`; the feature hook keeps nothing of the pass."""
        self._holding = True
        try:
            return super().forward_held(x)
        finally:
            self._holding = False

    def logits_of(self, x: torch.Tensor) -> torch.Tensor:
        """The logits LAME corrects: the model's (``aqr+lame``: the AQR-adapted model's), whose pass over
        ``x`` leaves the features in the hook of the feature layer."""
        return self.model(x)

    def features_and_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The features (N, d) and logits (N, K) of ``x``."""
        self._features = None
        with torch.no_grad():
            logits = self.logits_of(x)
        feats, self._features = self._features, None
        if logits.ndim != 2:
            raise ValueError(f"lame needs logits of shape (images, classes), the model gives {tuple(logits.shape)}")
        if not isinstance(feats, torch.Tensor) or feats.ndim < 2 or feats.shape[0] != logits.shape[0]:
            raise ValueError(f"lame: the input of {self.feature_layer_name!r} is not one feature row per image; "
                             "pass feature_layer= the classifier layer")
        return feats.flatten(1), logits

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        feats, logits = self.features_and_logits(x)
        cfg = self.config
        finite = torch.isfinite(feats).all(1) & torch.isfinite(logits).all(1)
        f, z = (feats, logits) if bool(finite.all()) else (feats[finite], logits[finite])
        if len(z) == 0:
            return logits
        unary = -torch.log(z.softmax(1) + 1e-10)
        kernel = affinity_matrix(F.normalize(f, p=2, dim=-1), cfg.affinity, cfg.knn)
        if cfg.force_symmetry:
            kernel = 0.5 * (kernel + kernel.t())
        _, exponent, self.iterations = laplacian_optimization(unary, kernel.to(unary.dtype), cfg.bound_lambda,
                                                              cfg.max_steps, cfg.tol)
        if bool(finite.all()):
            return exponent
        out = logits.clone()
        out[finite] = exponent.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, features={self.feature_layer_name!r}"
