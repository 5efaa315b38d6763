"""Image descriptors: each image's per-channel mean and log standard deviation at a layer, and their source spread.

A stream that mixes domains is told apart image by image by what its first recalibrated layers see:
:func:`image_descriptors` gives each image's descriptor at one layer, standardized by the layer's source
knots. The descriptors also vary with the images' content; :class:`DescriptorStats` holds how they spread
over the *source* images (their mean and a whitening of their covariance), so that distances measured after
whitening follow the shift of the domain rather than the content. :func:`aqr.calibrate` computes them with
``descriptors=True`` at the layers :func:`descriptor_layers` picks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Per-channel (scale, shift), float32 (C,): read scale * x + shift (as aqr.backends.base.Affine).
Affine = tuple[torch.Tensor, torch.Tensor]

# The floor of a descriptor's standard deviation, in units of the source's inter-quartile range: a flat image
# (one value per channel) is not infinitely far from every other.
STD_FLOOR = 0.05
#: the widest concatenation of descriptors (2 C per layer) :func:`descriptor_layers` picks.
MAX_DESCRIPTOR_WIDTH = 1024
#: the source images whose descriptors :func:`aqr.calibrate` keeps (the first ones).
MAX_DESCRIPTOR_IMAGES = 10_000
#: eigenvalues of the source covariance are floored at this fraction of their mean before whitening.
EIGENVALUE_FLOOR = 1e-3


def image_descriptors(x: torch.Tensor, images: int, pre: Affine | None, source: torch.Tensor) -> torch.Tensor:
    """Each image's descriptor ``(images, 2 C)`` float32 from the layer output ``x`` (A, C, B), read as
    ``pre[0] * x + pre[1]`` where ``pre`` is given: its per-channel mean and log standard deviation over its
    rows and positions, standardized by the source knots ``source`` (C, K): ``(mean - median) / iqr`` and
    ``log(std / iqr + STD_FLOOR)``."""
    return standardized_descriptors(*image_moments(x, images, pre), source)


def image_moments(x: torch.Tensor, images: int, pre: Affine | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each image's per-channel mean and population standard deviation ``(images, C)`` float32 over its rows and
    positions of the layer output ``x`` (A, C, B) (``images`` images of ``A // images`` rows each), read as
    ``pre[0] * x + pre[1]`` where ``pre`` is given."""
    a, c, b = x.shape
    if images < 1 or a % images:
        raise ValueError(f"a layer output of {a} rows cannot be split into {images} images")
    rows = a // images
    if b == 1:  # tokens as rows (a LayerNorm's output): reduce over the rows, no copy
        v, dim = x.reshape(images, rows, c).float(), 1
    else:
        v, dim = x.reshape(images, rows, c, b).float().transpose(1, 2).reshape(images, c, rows * b), 2
    # two passes (the mean, then the mean square of the deviations) over one dimension: on one CPU thread
    # about 10 x faster than torch.var_mean's single pass, and as accurate (torch's sums are pairwise)
    centre = v.mean(dim=dim, keepdim=True)
    deviation = v - centre
    std = (torch.linalg.vecdot(deviation, deviation, dim=dim) / v.shape[dim]).sqrt()
    mean = centre.squeeze(dim)
    if pre is not None:  # the moments of scale * x + shift, without a pass over the scaled values
        mean = mean * pre[0].float() + pre[1].float()
        std = std * pre[0].float().abs()
    return mean, std


def standardized_descriptors(mean: torch.Tensor, std: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Descriptors ``(images, 2 C)`` from per-image moments ``(images, C)``, standardized by the source knots
    ``source`` (C, K): ``(mean - median) / iqr`` and ``log(std / iqr + STD_FLOOR)`` (median: knot
    ``(K - 1) // 2``; iqr: knot ``3 (K - 1) // 4`` minus knot ``(K - 1) // 4``, at least 1e-6)."""
    k = source.shape[1]
    median = source[:, (k - 1) // 2].to(mean)
    iqr = (source[:, 3 * (k - 1) // 4] - source[:, (k - 1) // 4]).to(mean).clamp_min(1e-6)
    return torch.cat([(mean - median) / iqr, torch.log(std / iqr + STD_FLOOR)], dim=1)


def descriptor_layers(layers: Sequence[str], channels: Sequence[int]) -> list[str]:
    """The layers whose descriptors are used, of the recalibrated ``layers`` (in execution order, with their
    ``channels``): the first ``ceil(L / 3)``, cut so that their width ``2 * sum(C)`` stays at most
    :data:`MAX_DESCRIPTOR_WIDTH` (the first layer always)."""
    if len(layers) != len(channels):
        raise ValueError(f"descriptor_layers needs one channel count per layer: {len(layers)} layers, "
                         f"{len(channels)} channel counts")
    if not layers:
        raise ValueError("descriptor_layers needs at least one layer")
    chosen, width = [layers[0]], 2 * channels[0]
    for name, c in zip(layers[1:math.ceil(len(layers) / 3)], channels[1:]):
        if width + 2 * c > MAX_DESCRIPTOR_WIDTH:
            break
        chosen.append(name)
        width += 2 * c
    return chosen


@dataclass
class DescriptorStats:
    """How the descriptors of ``layers`` (concatenated in that order, execution order) spread over ``images``
    source images: ``(d - mean) @ whitening`` has identity covariance over them (``mean`` (D,), ``whitening``
    (D, D), float32; directions of the covariance flatter than :data:`EIGENVALUE_FLOOR` of its mean eigenvalue
    are scaled as if they were that flat)."""

    layers: tuple[str, ...]
    mean: torch.Tensor
    whitening: torch.Tensor
    images: int

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the field that is unusable."""
        if (not isinstance(self.layers, tuple) or not self.layers
                or not all(isinstance(n, str) for n in self.layers)):
            raise ValueError(f"descriptors: 'layers' must be a non-empty tuple of layer names, got {self.layers!r}")
        if len(set(self.layers)) != len(self.layers):
            raise ValueError(f"descriptors: 'layers' names a layer twice: {self.layers!r}")
        if isinstance(self.images, bool) or not isinstance(self.images, int) or self.images < 2:
            raise ValueError(f"descriptors: 'images' must be an integer >= 2, got {self.images!r}")
        if not isinstance(self.mean, torch.Tensor) or self.mean.ndim != 1 or self.mean.numel() < 1:
            raise ValueError(f"descriptors: mean must be a (D,) tensor, got shape {tuple(getattr(self.mean, 'shape', ()))}")
        d = self.mean.shape[0]
        for key, shape in (("mean", (d,)), ("whitening", (d, d))):
            t = getattr(self, key)
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"descriptors: {key} must be a tensor, got {type(t).__name__}")
            if t.dtype != torch.float32:
                raise ValueError(f"descriptors: {key} must be float32, got {t.dtype}")
            if tuple(t.shape) != shape:
                raise ValueError(f"descriptors: {key} has shape {tuple(t.shape)}, expected {shape}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"descriptors: {key} holds NaN or Inf")

    def __repr__(self) -> str:
        return (f"DescriptorStats({len(self.layers)} layers, width {self.mean.shape[0]}, "
                f"{self.images} source images)")

    @property
    def width(self) -> int:
        """``D``, the width of the concatenated descriptors."""
        return int(self.mean.shape[0])

    def whiten(self, descriptors: torch.Tensor) -> torch.Tensor:
        """``(descriptors - mean) @ whitening`` for descriptors ``(N, D)`` (on their device and dtype)."""
        return (descriptors - self.mean.to(descriptors)) @ self.whitening.to(descriptors)


def descriptor_stats(rows: torch.Tensor, layers: Sequence[str]) -> DescriptorStats:
    """The :class:`DescriptorStats` of the source images' descriptors ``rows`` ``(N, D)`` (``layers``'
    descriptors concatenated), computed in float64; ``ValueError`` for fewer than 2 rows or a non-finite value."""
    if not isinstance(rows, torch.Tensor) or rows.ndim != 2 or rows.shape[1] < 1:
        raise ValueError(f"descriptor_stats needs descriptor rows (N, D), got shape {tuple(getattr(rows, 'shape', ()))}")
    if rows.shape[0] < 2:
        raise ValueError(f"descriptor_stats needs the descriptors of at least 2 source images, got {rows.shape[0]}")
    if not bool(torch.isfinite(rows).all()):
        raise ValueError("descriptor_stats: the source images' descriptors hold NaN or Inf")
    x = rows.detach().to("cpu", torch.float64)
    mean = x.mean(dim=0)
    covariance = torch.cov(x.T, correction=1).reshape(x.shape[1], x.shape[1])
    values, vectors = torch.linalg.eigh(covariance)
    if not float(values.mean()) > 0:
        raise ValueError(f"descriptor_stats: the descriptors of the {x.shape[0]} source images do not vary")
    values = values.clamp_min(EIGENVALUE_FLOOR * values.mean())
    whitening = vectors / values.sqrt()
    return DescriptorStats(layers=tuple(layers), mean=mean.float(), whitening=whitening.float(), images=int(x.shape[0]))
