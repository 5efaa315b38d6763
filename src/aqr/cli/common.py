"""Arguments several commands share: torch threads, the model and its checkpoint, comma lists, method lists."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Within the block torch uses ``n`` CPU threads (unchanged for ``None`` or 0); restored after."""
    import torch

    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """MODEL and ``--checkpoint``, as :func:`aqr.models.load` takes them, and ``--threads``."""
    p.add_argument("model", help="zoo name, aqr checkpoint file, architecture (with --checkpoint) or timm:/torchvision: name")
    p.add_argument("--checkpoint", default=None, help="weights for an architecture name (third-party state dict)")
    add_threads(p)


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
