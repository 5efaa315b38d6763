"""Source: the unadapted model, in eval mode (BatchNorm uses its running statistics)."""

from __future__ import annotations

from .base import NoOptions, TTAMethod
from .declaration import method


@method("source", NoOptions, stateless=True)
class Source(TTAMethod):
    """The model as trained, evaluated in eval mode with gradients off."""
