"""Factory for the normalization layers a network may use ("bn", "gn", "ln", "none")."""

from __future__ import annotations

from torch import nn

NORMS: tuple[str, ...] = ("bn", "gn", "ln", "none")


def norm2d(kind: str, channels: int, groups: int = 8) -> nn.Module:
    """Return a normalization layer for NCHW feature maps with ``channels`` channels.

    ``bn`` is BatchNorm2d, ``gn`` GroupNorm with ``min(groups, channels)`` groups (must divide
    ``channels``), ``ln`` GroupNorm with one group (LayerNorm over C, H, W), ``none`` Identity.
    """
    if kind == "bn":
        return nn.BatchNorm2d(channels)
    if kind == "gn":
        g = min(groups, channels)
        if channels % g:
            raise ValueError(f"GroupNorm: {g} groups do not divide {channels} channels")
        return nn.GroupNorm(g, channels)
    if kind == "ln":
        return nn.GroupNorm(1, channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm {kind!r}; choose one of {', '.join(NORMS)}")
