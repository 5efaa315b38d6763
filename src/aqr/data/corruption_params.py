"""Severity parameter tables for the 19 common corruptions (CIFAR-10-C and ImageNet-C).

Values are those of the public reference generators ``make_cifar_c.py`` (32 px) and
``make_imagenet_c.py`` (224 px) of hendrycks/robustness (Apache-2.0). Each table maps a
corruption name to a 5-tuple (severity 1 -> 5) of its parameters; the meaning of each entry is
documented on the corresponding function in :mod:`aqr.data.corruptions`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

# Reference order of make_cifar_c.py: the 15 benchmark corruptions, then the 4 "extra" ones.
CORRUPTIONS: tuple[str, ...] = (
    "gaussian_noise",
    "shot_noise",
    "impulse_noise",
    "defocus_blur",
    "glass_blur",
    "motion_blur",
    "zoom_blur",
    "snow",
    "frost",
    "fog",
    "brightness",
    "contrast",
    "elastic_transform",
    "pixelate",
    "jpeg_compression",
    "speckle_noise",
    "gaussian_blur",
    "spatter",
    "saturate",
)


@dataclass(frozen=True)
class ParamSet:
    """One table of severity parameters.

    ``frost_scale`` is the factor the frost overlays are resized by before the random crop
    (0.2 for CIFAR, 1 for ImageNet); ``elastic_scale`` multiplies the elastic parameters
    (32 for CIFAR; 244 for ImageNet, a value the reference notes "should have been 224").
    ``zoom_factors`` holds the zoom-blur factor ranges as (start, stop, step) for np.arange.
    """

    name: str
    image_size: int
    frost_scale: float
    elastic_scale: float
    table: Mapping[str, tuple[Any, ...]] = field(repr=False)

    def get(self, corruption: str, severity: int) -> Any:
        """Return the parameter(s) of ``corruption`` at ``severity`` (1..5); raises on bad input."""
        if corruption not in self.table:
            raise ValueError(f"unknown corruption {corruption!r}; expected one of {', '.join(CORRUPTIONS)}")
        if not (isinstance(severity, (int, np.integer)) and 1 <= severity <= 5):
            raise ValueError(f"severity must be an integer in 1..5, got {severity!r}")
        return self.table[corruption][int(severity) - 1]

    def interpolated(self, corruption: str, severity: float) -> Any:
        """The parameter(s) of ``corruption`` at a severity anywhere in ``[1, 5]``: each entry linear between
        the two levels around it (a photon count through its reciprocal, the noise's variance scale; integer
        entries rounded), the table's own values at whole severities."""
        if corruption not in self.table:
            raise ValueError(f"unknown corruption {corruption!r}; expected one of {', '.join(CORRUPTIONS)}")
        if isinstance(severity, bool) or not isinstance(severity, (int, float, np.integer, np.floating)) \
                or not 1 <= float(severity) <= 5:
            raise ValueError(f"severity must be a number in [1, 5], got {severity!r}")
        low = int(np.floor(severity))
        weight = float(severity) - low
        if weight == 0:
            return self.get(corruption, low)
        a, b = self.table[corruption][low - 1], self.table[corruption][low]
        if corruption in _RECIPROCAL_ENTRIES:
            return 1.0 / ((1 - weight) / a + weight / b)
        if not isinstance(a, tuple):
            return _mix(a, b, weight, corruption in _INTEGER_ENTRIES)
        integers = _INTEGER_ENTRIES.get(corruption, ())
        return tuple(_mix(u, v, weight, k in integers) for k, (u, v) in enumerate(zip(a, b)))


# entries that must stay integers when interpolated (by position in a tuple; () for a plain number), and
# parameters interpolated through their reciprocal (shot noise's photon count)
_INTEGER_ENTRIES: dict[str, tuple[int, ...]] = {"glass_blur": (1, 2), "jpeg_compression": (), "spatter": (5,)}
_RECIPROCAL_ENTRIES = frozenset({"shot_noise"})


def _mix(a: float, b: float, weight: float, integer: bool) -> float:
    """``a`` and ``b`` mixed linearly (``weight`` on ``b``), rounded half up when ``integer``."""
    value = (1 - weight) * a + weight * b
    return int(np.floor(value + 0.5)) if integer else value


_CIFAR: dict[str, tuple[Any, ...]] = {
    "gaussian_noise": (0.04, 0.06, 0.08, 0.09, 0.10),
    "shot_noise": (500, 250, 100, 75, 50),
    "impulse_noise": (0.01, 0.02, 0.03, 0.05, 0.07),
    "speckle_noise": (0.06, 0.10, 0.12, 0.16, 0.20),
    "gaussian_blur": (0.4, 0.6, 0.7, 0.8, 1.0),
    "glass_blur": ((0.05, 1, 1), (0.25, 1, 1), (0.4, 1, 1), (0.25, 1, 2), (0.4, 1, 2)),
    "defocus_blur": ((0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)),
    "motion_blur": ((6, 1), (6, 1.5), (6, 2), (8, 2), (9, 2.5)),
    "zoom_blur": ((1, 1.06, 0.01), (1, 1.11, 0.01), (1, 1.16, 0.01), (1, 1.21, 0.01), (1, 1.26, 0.01)),
    "snow": (
        (0.1, 0.2, 1, 0.6, 8, 3, 0.95),
        (0.1, 0.2, 1, 0.5, 10, 4, 0.9),
        (0.15, 0.3, 1.75, 0.55, 10, 4, 0.9),
        (0.25, 0.3, 2.25, 0.6, 12, 6, 0.85),
        (0.3, 0.3, 1.25, 0.65, 14, 12, 0.8),
    ),
    "frost": ((1, 0.2), (1, 0.3), (0.9, 0.4), (0.85, 0.4), (0.75, 0.45)),
    "fog": ((0.2, 3), (0.5, 3), (0.75, 2.5), (1, 2), (1.5, 1.75)),
    "brightness": (0.05, 0.1, 0.15, 0.2, 0.3),
    "contrast": (0.75, 0.5, 0.4, 0.3, 0.15),
    "elastic_transform": ((0, 0, 0.08), (0.05, 0.2, 0.07), (0.08, 0.06, 0.06), (0.1, 0.04, 0.05), (0.1, 0.03, 0.03)),
    "pixelate": (0.95, 0.9, 0.85, 0.75, 0.65),
    "jpeg_compression": (80, 65, 58, 50, 40),
    "spatter": (
        (0.62, 0.1, 0.7, 0.7, 0.5, 0),
        (0.65, 0.1, 0.8, 0.7, 0.5, 0),
        (0.65, 0.3, 1, 0.69, 0.5, 0),
        (0.65, 0.1, 0.7, 0.69, 0.6, 1),
        (0.65, 0.1, 0.5, 0.68, 0.6, 1),
    ),
    "saturate": ((0.3, 0), (0.1, 0), (1.5, 0), (2, 0.1), (2.5, 0.2)),
}

_IMAGENET: dict[str, tuple[Any, ...]] = {
    "gaussian_noise": (0.08, 0.12, 0.18, 0.26, 0.38),
    "shot_noise": (60, 25, 12, 5, 3),
    "impulse_noise": (0.03, 0.06, 0.09, 0.17, 0.27),
    "speckle_noise": (0.15, 0.2, 0.35, 0.45, 0.6),
    "gaussian_blur": (1, 2, 3, 4, 6),
    "glass_blur": ((0.7, 1, 2), (0.9, 2, 1), (1, 2, 3), (1.1, 3, 2), (1.5, 4, 2)),
    "defocus_blur": ((3, 0.1), (4, 0.5), (6, 0.5), (8, 0.5), (10, 0.5)),
    "motion_blur": ((10, 3), (15, 5), (15, 8), (15, 12), (20, 15)),
    "zoom_blur": ((1, 1.11, 0.01), (1, 1.16, 0.01), (1, 1.21, 0.02), (1, 1.26, 0.02), (1, 1.31, 0.03)),
    "snow": (
        (0.1, 0.3, 3, 0.5, 10, 4, 0.8),
        (0.2, 0.3, 2, 0.5, 12, 4, 0.7),
        (0.55, 0.3, 4, 0.9, 12, 8, 0.7),
        (0.55, 0.3, 4.5, 0.85, 12, 8, 0.65),
        (0.55, 0.3, 2.5, 0.85, 12, 12, 0.55),
    ),
    "frost": ((1, 0.4), (0.8, 0.6), (0.7, 0.7), (0.65, 0.7), (0.6, 0.75)),
    "fog": ((1.5, 2), (2, 2), (2.5, 1.7), (2.5, 1.5), (3, 1.4)),
    "brightness": (0.1, 0.2, 0.3, 0.4, 0.5),
    "contrast": (0.4, 0.3, 0.2, 0.1, 0.05),
    "elastic_transform": ((2, 0.7, 0.1), (2, 0.08, 0.2), (0.05, 0.01, 0.02), (0.07, 0.01, 0.02), (0.12, 0.01, 0.02)),
    "pixelate": (0.6, 0.5, 0.4, 0.3, 0.25),
    "jpeg_compression": (25, 18, 15, 10, 7),
    "spatter": (
        (0.65, 0.3, 4, 0.69, 0.6, 0),
        (0.65, 0.3, 3, 0.68, 0.6, 0),
        (0.65, 0.3, 2, 0.68, 0.5, 0),
        (0.65, 0.3, 1, 0.65, 1.5, 1),
        (0.67, 0.4, 1, 0.65, 1.5, 1),
    ),
    "saturate": ((0.3, 0), (0.1, 0), (2, 0), (5, 0.1), (20, 0.2)),
}

CIFAR_PARAMS = ParamSet("cifar", 32, frost_scale=0.2, elastic_scale=32.0, table=MappingProxyType(_CIFAR))
IMAGENET_PARAMS = ParamSet("imagenet", 224, frost_scale=1.0, elastic_scale=244.0, table=MappingProxyType(_IMAGENET))

PARAM_SETS: Mapping[str, ParamSet] = MappingProxyType({"cifar": CIFAR_PARAMS, "imagenet": IMAGENET_PARAMS})


def get_param_set(name: str | ParamSet) -> ParamSet:
    """Return the named parameter set ('cifar' or 'imagenet'); a ParamSet is passed through."""
    if isinstance(name, ParamSet):
        return name
    try:
        return PARAM_SETS[name]
    except KeyError:
        raise ValueError(f"unknown parameter set {name!r}; expected one of {', '.join(PARAM_SETS)}") from None


def check_corruption_name(name: str) -> None:
    """Raise ``ValueError`` naming the known corruptions (and the closest one) when ``name`` is not one
    of :data:`CORRUPTIONS`; called where a corruption's file is missing, so custom files still load."""
    import difflib

    if name in CORRUPTIONS:
        return
    close = difflib.get_close_matches(name, CORRUPTIONS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"unknown corruption {name!r}{hint}; known: {', '.join(CORRUPTIONS)}")
