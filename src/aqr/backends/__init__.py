"""The fast recalibration path behind one interface: a backend object per layer and device.

:class:`LayerBackend` (in :mod:`aqr.backends.base`) is the interface; :class:`TorchBackend` runs on
any device, :class:`NativeBackend` in aqr's C kernels on CPU, :class:`aqr.backends.triton_backend.TritonBackend`
in aqr's Triton kernels on a GPU. :func:`choose_backend` picks one for a layer once; :class:`aqr.AQR`
keeps it for every batch on that device.
"""

from __future__ import annotations

import warnings

from aqr.backends.base import Affine, LayerBackend, LayerSource, Targets
from aqr.backends.build import native_kernels
from aqr.backends.native import NativeBackend
from aqr.backends.subsets import SubsetCache
from aqr.backends.torch_backend import TorchBackend

# The tails aqr's Triton kernels implement (their codes 0-4 in TAIL_CODES); "clip-source" runs in torch there.
TRITON_TAILS = ("standard", "average", "none", "clip", "interval", "gaussian")


def choose_backend(source: LayerSource, subsets: SubsetCache, *, native: bool = True, triton: bool = False,
                   compile: bool = True) -> LayerBackend:
    """The backend for one layer on ``source``'s device.

    With ``native``, on CPU: aqr's C kernels (built on first use; where they cannot be built, a
    warning once and torch). With ``triton``, on a CUDA GPU: aqr's Triton kernels (where triton is
    missing, a warning once and torch; a tail the Triton kernels lack, torch). Both hand inputs they
    do not take (float64, autograd) to torch. Otherwise: torch, compiled with ``torch.compile`` when
    ``compile``.
    """
    torch_backend = TorchBackend(source, subsets, compile)
    if native and source.device.type == "cpu":
        lib = native_kernels()
        if lib is not None:
            return NativeBackend(source, subsets, lib, torch_backend)
    if triton and source.tail in TRITON_TAILS and (
            source.device.type == "cuda" or (source.device.type == "cpu" and not native)):
        from aqr.backends import triton_backend  # imports triton: only where a GPU is used

        if triton_backend.available(source.device):
            return triton_backend.TritonBackend(source, subsets, torch_backend)
        warnings.warn(f"aqr's Triton kernels are unavailable ({triton_backend.UNAVAILABLE or 'no GPU'}); "
                      "the fast path runs through torch", stacklevel=3)
    return torch_backend


__all__ = ["Affine", "LayerBackend", "LayerSource", "NativeBackend", "SubsetCache", "Targets", "TorchBackend",
           "choose_backend"]
