"""Input normalization kept inside the model, so every model in aqr takes images in [0, 1]."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from aqr.data.images import Preprocess

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)


class Normalize(nn.Module):
    """Per-channel ``(x - mean) / std`` on NCHW input; mean and std are buffers (saved, moved with ``.to``)."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        if len(mean) != len(std):
            raise ValueError(f"mean and std differ in length: {len(mean)} vs {len(std)}")
        if any(float(s) <= 0 for s in std):
            raise ValueError(f"std must be positive, got {list(std)}")
        self.register_buffer("mean", torch.tensor([float(m) for m in mean]).view(1, -1, 1, 1))
        self.register_buffer("std", torch.tensor([float(s) for s in std]).view(1, -1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def extra_repr(self) -> str:
        return f"mean={self.mean.flatten().tolist()}, std={self.std.flatten().tolist()}"


class NormalizedModel(nn.Sequential):
    """``Normalize`` followed by the network: children are named ``normalize`` and ``model``.

    ``preprocess`` is how image files are turned into its inputs (size, resize, interpolation),
    when the architecture or its weights say so (see :func:`aqr.models.preprocessing`).
    """

    def __init__(self, model: nn.Module, mean: Sequence[float], std: Sequence[float],
                 preprocess: Preprocess | None = None) -> None:
        super().__init__(OrderedDict([("normalize", Normalize(mean, std)), ("model", model)]))
        self.preprocess = preprocess


def with_normalization(model: nn.Module, mean: Sequence[float], std: Sequence[float]) -> NormalizedModel:
    """Return ``model`` wrapped so that it takes [0, 1] images and normalizes them itself."""
    return NormalizedModel(model, mean, std)
