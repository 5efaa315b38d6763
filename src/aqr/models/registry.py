"""Registry of the architectures aqr can build by name, plus ``timm:`` / ``torchvision:`` names."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from aqr.data.images import Preprocess
from aqr.models import pretrained as pretrained_models
from aqr.models.normalize import IMAGENET_MEAN, IMAGENET_STD, NormalizedModel
from aqr.models.resnet_cifar import CifarResNet, ResNet18
from aqr.models.vit import ViT

EXTERNAL_PREFIXES: tuple[str, ...] = ("timm:", "torchvision:")


@dataclass(frozen=True)
class Architecture:
    """How to build one registered architecture.

    ``builder(num_classes=..., norm=..., **kwargs)`` returns the bare network (normalized input);
    ``defaults`` are its keyword defaults; ``mean``/``std`` the input normalization put in front.
    ``norms`` lists the norm kinds it accepts (the first is the default).
    """

    builder: Callable[..., nn.Module]
    description: str
    norms: tuple[str, ...]
    defaults: dict[str, Any] = field(default_factory=dict)
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    input_size: int = 32  # image files are resized (shorter side) and centre-cropped to this


def _cifar_resnet(depth: int) -> Callable[..., nn.Module]:
    def build(**kwargs: Any) -> nn.Module:
        return CifarResNet(depth=depth, **kwargs)
    return build


_CIFAR_NORMS = ("bn", "gn", "ln", "none")

REGISTRY: dict[str, Architecture] = {
    **{f"resnet{d}": Architecture(_cifar_resnet(d), f"CIFAR ResNet-{d} (16-32-64, option-A shortcuts; "
                               "akamaster layout)", _CIFAR_NORMS, {"width": 16, "groups": 8, "shortcut": "A"})
       for d in (20, 26, 32, 44, 56)},
    "resnet18": Architecture(ResNet18, "CIFAR ResNet-18 (64-512 channels, 1x1-conv shortcuts)", _CIFAR_NORMS,
                          {"width": 64, "groups": 8}),
    "vit": Architecture(ViT, "ViT for 32x32 inputs: patch 4, pre-norm LayerNorm blocks", ("ln",),
                     {"patch_size": 4, "dim": 128, "depth": 6, "heads": 4, "mlp_ratio": 2.0, "pool": "cls"},
                     mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)),
}


def available() -> list[str]:
    """Names accepted by :func:`create` (``timm:<name>``/``torchvision:<name>`` are accepted too when installed)."""
    return sorted(REGISTRY)


def create(name: str, num_classes: int = 10, norm: str | None = None, *, pretrained: bool = False,
           **kwargs: Any) -> NormalizedModel:
    """Build model ``name`` (random weights unless ``pretrained`` for timm/torchvision) taking [0, 1] images.

    The returned module is ``NormalizedModel(normalize, model)``: its input normalization is inside.
    ``norm`` picks the normalization layer kind (None: the architecture's default); extra ``kwargs``
    override the architecture's defaults (``mean``/``std`` override the input normalization).
    Raises ``KeyError`` for an unknown name and ``ValueError`` for an unsupported norm.
    """
    mean = kwargs.pop("mean", None)
    std = kwargs.pop("std", None)
    if name.startswith(EXTERNAL_PREFIXES):
        if norm not in (None, "default"):
            raise ValueError(f"{name}: norm cannot be changed for external models (got {norm!r})")
        net, ext_mean, ext_std, preprocess = _create_external(name, num_classes, pretrained, **kwargs)
        return NormalizedModel(net, mean or ext_mean, std or ext_std, preprocess)
    if name not in REGISTRY:
        raise KeyError(f"unknown model {name!r}; available: {', '.join(available())}, "
                       "or timm:<name> / torchvision:<name>")
    if pretrained:
        raise ValueError(f"{name}: no pretrained weights; use aqr.models.load with a checkpoint")
    spec = REGISTRY[name]
    norm = norm or spec.norms[0]
    if norm not in spec.norms:
        raise ValueError(f"{name} does not support norm {norm!r}; choose one of {', '.join(spec.norms)}")
    options = {**spec.defaults, **kwargs}
    if len(spec.norms) > 1:
        options["norm"] = norm
    net = spec.builder(num_classes=num_classes, **options)
    size = spec.input_size
    return NormalizedModel(net, mean or spec.mean, std or spec.std, Preprocess(crop=size, resize=size))


def _create_external(name: str, num_classes: int, pretrained: bool,
                     **kwargs: Any) -> tuple[nn.Module, tuple[float, ...], tuple[float, ...], Preprocess]:
    """Build a timm or torchvision model; return it with the mean/std and preprocessing its weights expect."""
    package, _, model_name = name.partition(":")
    if not model_name:
        raise KeyError(f"model name missing after '{package}:'")
    if package == "timm":
        net = pretrained_models.create_timm(model_name, num_classes, pretrained, **kwargs)
        cfg = getattr(net, "pretrained_cfg", None) or getattr(net, "default_cfg", None) or {}
        mean = tuple(float(v) for v in cfg.get("mean", IMAGENET_MEAN))
        std = tuple(float(v) for v in cfg.get("std", IMAGENET_STD))
        return net, mean, std, pretrained_models.timm_preprocess(net)
    net, preprocess, mean, std = pretrained_models.create_torchvision(model_name, num_classes, pretrained, **kwargs)
    return net, tuple(mean or IMAGENET_MEAN), tuple(std or IMAGENET_STD), preprocess
