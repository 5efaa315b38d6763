"""timm and torchvision models offline: pretrained weights from the local caches, and their preprocessing.

aqr never downloads weights. ``timm:NAME`` with pretrained weights reads them from timm's caches
(the Hugging Face hub cache, or torch hub's ``checkpoints/`` for weights timm fetches by URL);
``torchvision:NAME`` from torch hub's ``checkpoints/``. When they are absent,
:class:`WeightsNotFound` says where they were looked for and how to provide them. Weight files are
read without unpickling code (safetensors, or ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

from aqr.data.images import Preprocess
from aqr.models.checkpoint import CheckpointError, read_state_dict

HF_FILENAMES = ("model.safetensors", "pytorch_model.bin")  # what timm reads from a hub repo, in its order


class WeightsNotFound(CheckpointError):
    """Pretrained weights are not in the local cache; the message says how to provide them."""


def import_optional(package: str) -> Any:
    """Import timm or torchvision, or raise ImportError saying which extra to install and why it failed."""
    try:
        return importlib.import_module(package)
    except Exception as err:  # a torchvision built for another torch raises RuntimeError, not ImportError
        raise ImportError(f"models named '{package}:<name>' need the optional package {package!r} "
                          f"(pip install 'aqr[{package}]'), which could not be imported: "
                          f"{type(err).__name__}: {err}") from err


def _torch_hub_file(url: str) -> Path:
    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)


def _how_to_provide(name: str, looked: list[str]) -> str:
    package, _, model_name = name.partition(":")
    fetch = (f"python -c \"import timm; timm.create_model('{model_name}', pretrained=True)\"" if package == "timm"
             else f"python -c \"import torchvision; torchvision.models.get_model('{model_name}', weights='DEFAULT')\"")
    return (f"{name}: pretrained weights are not in the local cache (looked for: {'; '.join(looked) or 'nothing to look for'}). "
            f"aqr does not download weights. On a machine with internet run {fetch} and copy its cache "
            "(the Hugging Face hub cache, HF_HOME, and torch hub's checkpoints/, TORCH_HOME) here, "
            "or pass the weights as --checkpoint FILE (safetensors or a weights-only state dict)")


def timm_cached_file(model_name: str) -> tuple[Path | None, list[str]]:
    """The cached weight file of a timm model name (with or without its tag), and what was looked for."""
    timm = import_optional("timm")
    try:
        cfg = timm.models.get_pretrained_cfg(model_name)
    except RuntimeError as err:  # an unknown tag
        raise KeyError(f"timm:{model_name}: {err}") from None
    if cfg is None:
        raise KeyError(f"timm:{model_name}: timm has no pretrained weights registered for this name")
    looked: list[str] = []
    if cfg.file:
        looked.append(str(cfg.file))
        if Path(cfg.file).is_file():
            return Path(cfg.file), looked
    if cfg.hf_hub_id:
        from huggingface_hub import try_to_load_from_cache

        repo, _, revision = str(cfg.hf_hub_id).partition("@")
        for filename in ([cfg.hf_hub_filename] if cfg.hf_hub_filename else HF_FILENAMES):
            looked.append(f"{filename} of {repo} in the Hugging Face hub cache")
            found = try_to_load_from_cache(repo, filename, revision=revision or None)
            if isinstance(found, str) and Path(found).is_file():
                return Path(found), looked
    if isinstance(cfg.url, str) and cfg.url:
        path = _torch_hub_file(cfg.url)
        looked.append(str(path))
        if path.is_file():
            return path, looked
    return None, looked


def create_timm(model_name: str, num_classes: int, pretrained: bool, **kwargs: Any) -> nn.Module:
    """A timm model; with ``pretrained``, its weights from the local cache (or :class:`WeightsNotFound`)."""
    timm = import_optional("timm")
    if not pretrained:
        return timm.create_model(model_name, pretrained=False, num_classes=num_classes, **kwargs)
    path, looked = timm_cached_file(model_name)
    if path is None:
        raise WeightsNotFound(_how_to_provide(f"timm:{model_name}", looked))
    # timm adapts the file as it would a download (its checkpoint filter, classifier size)
    net = timm.create_model(model_name, pretrained=True, num_classes=num_classes,
                            pretrained_cfg_overlay={"state_dict": read_state_dict(path)}, **kwargs)
    if isinstance(getattr(net, "pretrained_cfg", None), dict):
        net.pretrained_cfg.pop("state_dict", None)  # don't keep a second copy of the weights
    return net


def timm_preprocess(net: nn.Module) -> Preprocess:
    """The eval preprocessing a timm model's pretrained config states (size, crop_pct, interpolation)."""
    cfg = getattr(net, "pretrained_cfg", None) or {}
    crop = int((cfg.get("input_size") or (3, 224, 224))[-1])
    crop_pct = float(cfg.get("crop_pct") or 0.875)
    interpolation = str(cfg.get("interpolation") or "bicubic")
    return Preprocess(crop=crop, resize=max(crop, int(crop / crop_pct)),  # timm: floor(size / crop_pct)
                      interpolation=interpolation if interpolation != "random" else "bilinear")


def create_torchvision(model_name: str, num_classes: int, pretrained: bool,
                       **kwargs: Any) -> tuple[nn.Module, Preprocess, tuple | None, tuple | None]:
    """A torchvision model, its preprocessing and mean/std (None: ImageNet's); weights from torch hub's cache."""
    tv_models = import_optional("torchvision").models
    try:
        weights = tv_models.get_model_weights(model_name).DEFAULT
    except (ValueError, KeyError, AttributeError):
        weights = None
    if not pretrained:
        net = tv_models.get_model(model_name, weights=None, num_classes=num_classes, **kwargs)
        return net, Preprocess(crop=224, resize=256, interpolation="bilinear"), None, None
    if weights is None:
        raise KeyError(f"torchvision:{model_name}: torchvision has no pretrained weights for this name")
    path = _torch_hub_file(weights.url)
    if not path.is_file():
        raise WeightsNotFound(_how_to_provide(f"torchvision:{model_name}", [str(path)]))
    net = tv_models.get_model(model_name, weights=None, num_classes=len(weights.meta["categories"]), **kwargs)
    from aqr.models.checkpoint import load_weights

    load_weights(net, read_state_dict(path), path)
    transforms = weights.transforms()
    interpolation = getattr(getattr(transforms, "interpolation", None), "value", "bilinear")
    preprocess = Preprocess(crop=int(transforms.crop_size[0]), resize=int(transforms.resize_size[0]),
                            interpolation=str(interpolation))
    return net, preprocess, tuple(transforms.mean), tuple(transforms.std)
