"""Source: the unadapted model, in eval mode (BatchNorm uses its running statistics)."""

from __future__ import annotations

from .base import TTAMethod


class Source(TTAMethod):
    """The model as trained, evaluated in eval mode with gradients off."""

    name = "source"
