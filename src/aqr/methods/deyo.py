"""DeYO: destroy your object, test-time adaptation by the pseudo-label probability difference
(Lee et al., ICLR 2024).

Per adaptation step, as in the benchmark code it is checked against (``classification/methods/deyo.py``
of github.com/mariodoebler/test-time-adaptation, after the authors' code):

1. forward; keep the samples whose softmax entropy is below ``margin * ln C`` (0.5 ln C);
2. destroy the object in the kept images (``aug="patch"``: cut each image into a ``patch_len x
   patch_len`` grid of patches and shuffle the patches, a fresh permutation per image; ``"pixel"``:
   one random permutation of the pixel positions for the batch; ``"occ"``: an
   ``occlusion_size`` square at ``(row_start, column_start)`` filled with each channel's image mean)
   and forward them without gradient;
3. PLPD, the pseudo-label probability difference: ``p(x)[y] - p(x')[y]`` with ``y = argmax p(x)``;
   keep the samples whose PLPD exceeds ``plpd_threshold`` (0.2);
4. loss: the mean over the samples kept of ``entropy * (exp(E0 - entropy) + exp(PLPD))`` with
   ``E0 = 0.4 ln C`` (either term can be switched off: ``reweight_ent``, ``reweight_plpd``; the
   weights carry no gradient); no update when nothing is kept.

Trained parameters: the affine weight/bias of the norm layers, except those in frozen modules chosen
by ``freeze`` exactly as SAR does (:mod:`aqr.methods.sar`; ``"auto"`` freezes ``layer4`` of ResNets
and ``blocks.9``-``blocks.11`` and the final ``norm`` of ViT-Base, nothing on e.g. the CIFAR
ResNet-20). BatchNorm on batch statistics and eval mode: :mod:`aqr.methods.norm_training`.

Presets (``defaults=``): ``"cifar10"`` (Adam, lr 1e-3) and ``"imagenet"`` (SGD with Nesterov momentum
0.9, lr 2.5e-4); the DeYO options have the reference's defaults in both.

Differences from the reference code: the reference skips modules whose name *contains* ``layer4``,
``blocks.9``-``blocks.11`` or ``norm.`` and matches nothing elsewhere; here the rules are SAR's
(whole-name matches, a rule that matches nothing raises). The patch shuffle resizes an image whose
sides are not multiples of ``patch_len`` to the nearest smaller multiples and back (bilinear,
antialiased; the reference resizes to a square). Images with non-finite values are kept out of
adaptation (see :mod:`aqr.methods.norm_training`). The input must be image batches ``(N, C, H, W)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import softmax_entropy
from .declaration import method
from .norm_training import NormTrainingMethod
from .options import OPTIMIZER_DEFAULTS, OptimizerConfig, check_number
from .sar import frozen_module_names, resolve_freeze_rules

AUGMENTATIONS = ("patch", "pixel", "occ")


@dataclass(frozen=True)
class DeYOConfig(OptimizerConfig):
    """DeYO options (and the optimizer's, see :class:`~aqr.methods.options.OptimizerConfig`).

    Attributes:
        margin: the entropy filter keeps samples below ``margin * ln C``.
        e0_factor: ``E0 = e0_factor * ln C`` in the entropy weight.
        plpd_threshold: the PLPD filter keeps samples whose PLPD is above it.
        reweight_ent: weight by ``exp(E0 - entropy)``.
        reweight_plpd: weight by ``exp(PLPD)``.
        aug: how the object is destroyed: ``"patch"``, ``"pixel"`` or ``"occ"``.
        patch_len: patches per side for ``"patch"``.
        occlusion_size, row_start, column_start: the occluded square for ``"occ"`` (pixels).
        freeze: norm layers left untrained, as SAR's ``freeze`` option.
    """

    margin: float = 0.5
    e0_factor: float = 0.4
    plpd_threshold: float = 0.2
    reweight_ent: bool = True
    reweight_plpd: bool = True
    aug: str = "patch"
    patch_len: int = 4
    occlusion_size: int = 112
    row_start: int = 56
    column_start: int = 56
    freeze: str | Sequence[str] = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_number("margin", self.margin, 0.0)
        check_number("e0_factor", self.e0_factor, 0.0)
        check_number("plpd_threshold", self.plpd_threshold, -1.0, 1.0)
        if self.aug not in AUGMENTATIONS:
            raise ValueError(f"aug must be one of {AUGMENTATIONS}, got {self.aug!r}")
        for name in ("patch_len", "occlusion_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("row_start", "column_start"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def patch_shuffle(x: torch.Tensor, patch_len: int, order: torch.Tensor | None = None) -> torch.Tensor:
    """Images ``x`` (N, C, H, W) cut into a ``patch_len x patch_len`` grid whose patches are permuted.

    ``order``: ``(N, patch_len**2)``, output patch ``j`` (row-major) of image ``i`` is input patch
    ``order[i, j]``; ``None`` draws a random permutation per image. Sides that are not multiples of
    ``patch_len`` are resized to the nearest smaller multiples and back.
    """
    n, c, height, width = x.shape
    h, w = height // patch_len, width // patch_len
    if h == 0 or w == 0:
        raise ValueError(f"patch_len {patch_len} is larger than the image ({height}x{width})")
    resized = (h * patch_len, w * patch_len) != (height, width)
    if resized:
        x = F.interpolate(x, size=(h * patch_len, w * patch_len), mode="bilinear", align_corners=False, antialias=True)
    if order is None:
        order = torch.argsort(torch.rand(n, patch_len * patch_len), dim=1)
    patches = x.reshape(n, c, patch_len, h, patch_len, w).permute(0, 2, 4, 1, 3, 5).reshape(n, patch_len ** 2, c, h, w)
    patches = patches[torch.arange(n, device=x.device).unsqueeze(1), order.to(device=x.device, dtype=torch.long)]
    x = patches.reshape(n, patch_len, patch_len, c, h, w).permute(0, 3, 1, 4, 2, 5).reshape(n, c, h * patch_len,
                                                                                           w * patch_len)
    if resized:
        x = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False, antialias=True)
    return x


def pixel_shuffle(x: torch.Tensor) -> torch.Tensor:
    """Images ``x`` (N, C, H, W) with their pixel positions permuted (one permutation for the batch)."""
    n, c, height, width = x.shape
    order = torch.randperm(height * width).to(x.device)
    return x.reshape(n, c, -1)[:, :, order].reshape(n, c, height, width)


def occlude(x: torch.Tensor, size: int, row: int, column: int) -> torch.Tensor:
    """Images ``x`` with the square ``[row:row+size, column:column+size]`` set to each channel's image mean."""
    out = x.clone()
    mean = x.mean(dim=(2, 3), keepdim=True)
    window = out[:, :, row:row + size, column:column + size]
    window.copy_(mean.expand_as(window))
    return out


def plpd(probs: torch.Tensor, probs_destroyed: torch.Tensor) -> torch.Tensor:
    """Pseudo-label probability difference ``p[y] - p'[y]``, ``y = argmax p``, per sample."""
    label = probs.argmax(1, keepdim=True)
    return (probs.gather(1, label) - probs_destroyed.gather(1, label)).squeeze(1)


@method("deyo", DeYOConfig, defaults=OPTIMIZER_DEFAULTS)
class DeYO(NormTrainingMethod):
    """DeYO behind the common protocol (see :mod:`aqr.methods.base`)."""

    carried = ("selected_entropy", "selected")

    def frozen_modules(self, model: nn.Module) -> frozenset[str]:
        self.frozen_rules = resolve_freeze_rules(model, self.config.freeze)
        return frozen_module_names(model, self.frozen_rules)

    def setup(self, model: nn.Module) -> None:
        self.selected_entropy = 0  # diagnostics since creation: samples past the entropy filter
        self.selected = 0  # ... and past both filters

    def destroy(self, x: torch.Tensor) -> torch.Tensor:
        """The object-destroying augmentation of the configured kind."""
        if x.ndim != 4:
            raise ValueError(f"deyo augments image batches (N, C, H, W), got shape {tuple(x.shape)}")
        if self.config.aug == "patch":
            return patch_shuffle(x, self.config.patch_len)
        if self.config.aug == "pixel":
            return pixel_shuffle(x)
        return occlude(x, self.config.occlusion_size, self.config.row_start, self.config.column_start)

    def loss(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor | None:
        classes = logits.shape[1]
        entropy = softmax_entropy(logits)
        keep = entropy.detach() < self.config.margin * math.log(classes)
        self.selected_entropy += int(keep.sum())
        if not bool(keep.any()):
            return None
        with torch.no_grad():
            destroyed = self.model(self.destroy(x[keep].detach()))
            difference = plpd(logits.detach()[keep].softmax(1), destroyed.softmax(1))
        chosen = difference > self.config.plpd_threshold
        self.selected += int(chosen.sum())
        if not bool(chosen.any()):
            return None
        entropy, difference = entropy[keep][chosen], difference[chosen]
        if self.config.reweight_ent or self.config.reweight_plpd:
            e0 = self.config.e0_factor * math.log(classes)
            weight = (float(self.config.reweight_ent) * torch.exp(e0 - entropy.detach())
                      + float(self.config.reweight_plpd) * torch.exp(difference))
            entropy = entropy * weight
        return entropy.mean()
