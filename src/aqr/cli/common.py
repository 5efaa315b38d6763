"""Arguments several commands share: torch threads, the model and its weights, image preprocessing, comma lists,
method lists."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from aqr.util.threads import torch_threads  # noqa: F401  (the commands import it from here)

if TYPE_CHECKING:
    from torch import nn

    from aqr.bench.grid import MethodSpec


def names(text: str) -> tuple[str, ...]:
    """``"a, b,c"`` -> ``("a", "b", "c")``."""
    return tuple(v.strip() for v in text.split(",") if v.strip())


def ints(text: str) -> tuple[int, ...]:
    """``"1,3,5"`` -> ``(1, 3, 5)``."""
    return tuple(int(v) for v in names(text))


def add_threads(p: argparse.ArgumentParser, default: int | None = None,
                help: str = "torch CPU threads (torch.set_num_threads; default: torch's)") -> None:
    """``--threads N``."""
    p.add_argument("--threads", type=int, default=default, help=help)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL, ``--checkpoint`` and ``--pretrained`` (see :func:`load_model`), ``--device`` and ``--threads``."""
    p.add_argument("model", help="zoo name, aqr checkpoint file, architecture (with --checkpoint) or timm:/torchvision: name")
    p.add_argument("--checkpoint", default=None,
                   help="weights for an architecture or timm:/torchvision: name (safetensors or a weights-only state dict)")
    p.add_argument("--pretrained", action="store_true",
                   help="timm:/torchvision: names: their pretrained weights from the local cache (never downloaded)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default cpu)")
    add_threads(p)


def add_image_arguments(p: argparse.ArgumentParser, workers: bool = True) -> None:
    """``--image-size`` / ``--resize`` (override the model's preprocessing of image files) and ``--workers``."""
    p.add_argument("--image-size", type=int, default=None,
                   help="image files: centre crop to N x N (default: the model's, e.g. 224 for timm's ResNet-50)")
    p.add_argument("--resize", type=int, default=None,
                   help="image files: shorter side to N before the crop (default: the model's ratio to the crop)")
    if workers:
        p.add_argument("--workers", type=int, default=0, help="DataLoader processes decoding image files (default 0)")


def load_model(args: argparse.Namespace) -> nn.Module:
    """The model MODEL, ``--checkpoint`` and ``--pretrained`` name, on ``--device``.

    A ``timm:``/``torchvision:`` name needs ``--pretrained`` (weights from the local cache) or
    ``--checkpoint FILE``, so random weights are never evaluated by accident.
    """
    from aqr import models

    external = args.model.startswith(models.EXTERNAL_PREFIXES)
    if args.pretrained and not external:
        raise ValueError(f"--pretrained applies to timm:/torchvision: names, not {args.model!r}")
    if args.pretrained and args.checkpoint:
        raise ValueError("give --pretrained or --checkpoint, not both")
    if external and not (args.pretrained or args.checkpoint):
        raise ValueError(f"{args.model} needs weights: --pretrained (from timm's / torch hub's local cache) "
                         "or --checkpoint FILE (safetensors or a weights-only state dict)")
    model = models.load(args.model, checkpoint=args.checkpoint)
    return model.to(args.device) if args.device else model


def split_methods(text: str) -> list[str]:
    """Split ``'source,aqr:tail=clip,K=11,tent'`` on the commas that start a new method, not an option."""
    out: list[str] = []
    for part in text.split(","):
        if "=" in part and ":" not in part and out:
            out[-1] += "," + part
        else:
            out.append(part)
    return out


def method_specs(text: str) -> list[MethodSpec]:
    """A method list (``'source,aqr:tail=clip,K=11'``) as :class:`aqr.bench.grid.MethodSpec` entries."""
    from aqr.bench.grid import MethodSpec

    return [MethodSpec.parse(m) for m in split_methods(text)]
