"""Arguments several commands share: torch threads, the model and its weights, image preprocessing, comma lists,
method lists; the argument types that check counts and sizes, and :class:`UsageError`."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from aqr.util.seeds import MAX_SEED
from aqr.util.threads import MAX_THREADS, torch_threads  # noqa: F401  (the commands import it from here)

MAX_IMAGE_SIDE = 4096  # --image-size / --resize: larger sides only exhaust memory (aqr.data.images checks it too)

if TYPE_CHECKING:
    from torch import nn

    from aqr.harness.specs import MethodSpec


class UsageError(Exception):
    """A command's arguments do not fit together; the CLI prints the message and exits with status 2."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (their line breaks kept) and each option's default after its help, unless
    the help already speaks of its default or there is none to show (``None``, a flag's ``False``)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (not action.option_strings or "default" in text or default is None or default is False
                or default is argparse.SUPPRESS or isinstance(action, argparse._HelpAction)):
            return action.help
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def use_help_formatter(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` and every sub-command parser below it :class:`HelpFormatter`."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                use_help_formatter(child)


def count(minimum: int = 1, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer of at least ``minimum`` (and at most ``maximum``), else a usage error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"between {minimum} and {maximum}" if maximum is not None else (
                "a positive integer" if minimum == 1 else f"an integer >= {minimum}")
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text!r}")
        return value

    parse.__name__ = "count"  # argparse names the type in some messages
    return parse


def counts(minimum: int = 1, maximum: int | None = None) -> Callable[[str], tuple[int, ...]]:
    """An argparse ``type``: a comma list of integers, each as :func:`count` checks it."""
    one = count(minimum, maximum)

    def parse(text: str) -> tuple[int, ...]:
        values = tuple(one(v) for v in names(text))
        if not values:
            raise argparse.ArgumentTypeError(f"must be a comma list of integers, got {text!r}")
        return values

    parse.__name__ = "counts"
    return parse


def amount(minimum: float = 0.0, *, above: bool = False) -> Callable[[str], float]:
    """An argparse ``type``: a finite number of at least ``minimum`` (greater, with ``above``), else a usage error."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (above and value == minimum):
            raise argparse.ArgumentTypeError(f"must be a finite number {'>' if above else '>='} {minimum:g}, got {text!r}")
        return value

    parse.__name__ = "amount"
    return parse


#: argparse ``type``s of a seed and a comma list of seeds: integers in ``[0, MAX_SEED]`` (what torch's generator holds)
seed = count(0, MAX_SEED)
seeds = counts(0, MAX_SEED)


def names(text: str) -> tuple[str, ...]:
    """``"a, b,c"`` -> ``("a", "b", "c")``."""
    return tuple(v.strip() for v in text.split(",") if v.strip())


def add_threads(p: argparse.ArgumentParser, default: int | None = None,
                help: str = "torch CPU threads (torch.set_num_threads; default: torch's)", minimum: int = 1) -> None:
    """``--threads N`` (at least ``minimum``)."""
    p.add_argument("--threads", type=count(minimum, MAX_THREADS), default=default, help=help)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL, ``--checkpoint`` and ``--pretrained`` (see :func:`model_from_args`), ``--device`` and ``--threads``."""
    p.add_argument("model", help="zoo name, aqr checkpoint file, architecture (with --checkpoint) or timm:/torchvision: name")
    p.add_argument("--checkpoint", default=None,
                   help="weights for an architecture or timm:/torchvision: name (safetensors or a weights-only state dict)")
    p.add_argument("--pretrained", action="store_true",
                   help="timm:/torchvision: names: their pretrained weights from the local cache (never downloaded)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default cpu)")
    add_threads(p)


def add_image_arguments(p: argparse.ArgumentParser, workers: bool = True, model: bool = True) -> None:
    """``--image-size`` / ``--resize`` (override the preprocessing of image files: the model's, or with
    ``model=False`` ImageNet-C's) and ``--workers``."""
    crop = "the model's, e.g. 224 for timm's ResNet-50" if model else "224, as ImageNet-C"
    ratio = "the model's ratio to the crop" if model else "256 for a 224 crop, the same ratio otherwise"
    p.add_argument("--image-size", type=count(1, MAX_IMAGE_SIDE), default=None,
                   help=f"image files: centre crop to N x N (default: {crop})")
    p.add_argument("--resize", type=count(1, MAX_IMAGE_SIDE), default=None,
                   help=f"image files: shorter side to N before the crop (default: {ratio})")
    if workers:
        p.add_argument("--workers", type=count(0), default=0, help="DataLoader processes decoding image files (default 0)")


def model_from_args(args: argparse.Namespace) -> nn.Module:
    """The model MODEL, ``--checkpoint`` and ``--pretrained`` name, on ``--device``.

    A ``timm:``/``torchvision:`` name needs ``--pretrained`` (weights from the local cache) or
    ``--checkpoint FILE``, so random weights are never evaluated by accident.
    """
    from pathlib import Path

    from aqr.models import EXTERNAL_PREFIXES, available, load, zoo

    external = args.model.startswith(EXTERNAL_PREFIXES)
    if args.pretrained and not external:
        raise UsageError(f"--pretrained applies to timm:/torchvision: names, not {args.model!r}")
    if args.pretrained and args.checkpoint:
        raise UsageError("give --pretrained or --checkpoint, not both")
    if external and not (args.pretrained or args.checkpoint):
        raise UsageError(f"{args.model} needs weights: --pretrained (from timm's / torch hub's local cache) "
                         "or --checkpoint FILE (safetensors or a weights-only state dict)")
    if args.checkpoint is None and args.model in available() and not Path(args.model).is_file():
        raise UsageError(f"{args.model} is an architecture without weights: add --checkpoint FILE, or name a zoo "
                         f"model ({', '.join(zoo())})")
    model = load(args.model, checkpoint=args.checkpoint)
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
    """A method list (``'source,aqr:tail=clip,K=11'``) as :class:`aqr.harness.specs.MethodSpec` entries."""
    from aqr.harness.specs import MethodSpec

    return [MethodSpec.parse(m) for m in split_methods(text)]
