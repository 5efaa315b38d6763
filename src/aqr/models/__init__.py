"""Models for aqr: CIFAR ResNets (BN/GN/LN), a small ViT, timm/torchvision models, and the zoo.

Every model built or loaded here takes images in [0, 1] (NCHW float) and normalizes them itself.

* :func:`create` builds an architecture by name with random weights.
* :func:`load` returns a ready model in eval mode from a zoo name, a checkpoint path, a registered
  name plus a (third-party) checkpoint, or a ``timm:``/``torchvision:`` pretrained name.
* :func:`available` lists the registered names; :func:`zoo` the committed checkpoints.
* :func:`preprocessing` says how image files become a model's inputs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aqr.data.images import Preprocess
from aqr.models.checkpoint import (CheckpointError, check_fit, checked_config, is_aqr_checkpoint, load_weights,
                                   read_file, save_checkpoint, third_party_state_dict)
from aqr.models.normalize import Normalize, NormalizedModel, with_normalization
from aqr.models.pretrained import WeightsNotFound
from aqr.models.registry import EXTERNAL_PREFIXES, available, create
from aqr.models.zoo import zoo, zoo_dir

__all__ = ["CheckpointError", "Normalize", "NormalizedModel", "WeightsNotFound", "available", "create", "load",
           "from_checkpoint", "preprocessing", "save_checkpoint", "with_normalization", "zoo", "zoo_dir"]


def from_checkpoint(path: str | os.PathLike[str]) -> NormalizedModel:
    """Rebuild the model stored in an aqr checkpoint file (its ``config``) and load its weights (eval mode)."""
    obj = read_file(path)
    if not is_aqr_checkpoint(obj):
        raise CheckpointError(f"{path} is not an aqr checkpoint (no 'format': 'aqr-model'); "
                              "pass it as load(<architecture name>, checkpoint=path) instead")
    config = checked_config(obj.get("config"), path)
    state_dict = obj.get("state_dict")
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise CheckpointError(f"checkpoint {path} holds no state dict of tensors")

    def build() -> NormalizedModel:
        try:
            return create(config["name"], num_classes=config["num_classes"], norm=config["norm"], **config["kwargs"])
        except (KeyError, ValueError, TypeError) as err:
            raise CheckpointError(f"checkpoint {path}: cannot rebuild model from config {config}: {err}") from err

    # The architecture is built on the meta device first (no memory) and must fit the weights
    # exactly: a config that would build far more than its file holds is refused before allocating.
    with torch.device("meta"):
        check_fit(build(), state_dict, path)
    model = build()
    load_weights(model, state_dict, path)
    return model.eval()


def load(name_or_path: str | os.PathLike[str], checkpoint: str | os.PathLike[str] | None = None,
         num_classes: int | None = None, norm: str | None = None, **kwargs: Any) -> nn.Module:
    """Return a model in eval mode that takes [0, 1] images.

    Resolution order for ``name_or_path`` when ``checkpoint`` is None: an existing file (an aqr
    checkpoint), a zoo name, a ``timm:``/``torchvision:`` name (pretrained weights). With a
    ``checkpoint``, ``name_or_path`` is an architecture: an aqr checkpoint is loaded whole
    (architecture must match), any other file is treated as a state dict (``module.`` prefixes
    stripped) of the bare network. Errors: ``KeyError`` for unknown names, :class:`CheckpointError`
    (naming the file) for unreadable or mismatching checkpoints.
    """
    name = os.fspath(name_or_path)
    if checkpoint is None:
        if Path(name).is_file():
            return from_checkpoint(name)
        entries = zoo()
        if name in entries:
            return from_checkpoint(entries[name])
        if name.startswith(EXTERNAL_PREFIXES):
            return create(name, num_classes=num_classes or 1000, pretrained=True, **kwargs).eval()
        if name in available():
            raise ValueError(f"{name!r} is an architecture; give checkpoint=<file> to load weights "
                             "(or use aqr.models.create for random weights)")
        raise KeyError(f"unknown model {name!r}: not a file, not in the zoo ({', '.join(entries) or 'empty'}) "
                       f"and not timm:/torchvision:; architectures: {', '.join(available())}")
    obj = read_file(checkpoint)
    if is_aqr_checkpoint(obj):
        model = from_checkpoint(checkpoint)
        if obj["config"].get("name") != name:
            raise CheckpointError(f"checkpoint {checkpoint} holds {obj['config'].get('name')!r}, not {name!r}")
        return model
    # timm/torchvision architectures default to ImageNet's 1000 classes, ours to CIFAR-10's 10
    default_classes = 1000 if name.startswith(EXTERNAL_PREFIXES) else 10
    model = create(name, num_classes=num_classes or default_classes, norm=norm, **kwargs)
    load_weights(model.model, third_party_state_dict(obj, checkpoint), checkpoint)
    return model.eval()


def preprocessing(model: nn.Module) -> Preprocess:
    """How image files become ``model``'s inputs: what its architecture or weights state (timm's
    pretrained config, torchvision's weight transforms, 32 px for aqr's CIFAR architectures), else
    ImageNet's usual resize 256 / crop 224 (bilinear)."""
    return getattr(model, "preprocess", None) or Preprocess()
