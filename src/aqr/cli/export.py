"""``aqr export``: a model + its statistics -> an AQR graph for ONNX Runtime or ``torch.export`` (:func:`aqr.export`)."""

from __future__ import annotations

import argparse
import sys

from aqr.cli.common import UsageError, add_model_arguments, model_from_args, torch_threads
from aqr.util.files import check_writable_target


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export", help="write AQR around a model as an ONNX graph or a torch.export program",
                              description="Write the model with AQR's map (per-batch, or streaming with its state as "
                                          "the graph's inputs and outputs) as a graph of plain operations: ONNX "
                                          "Runtime or torch.export run it without aqr (docs/export.md).")
    add_model_arguments(p)
    p.add_argument("--stats", required=True, help="statistics file from `aqr calibrate`")
    p.add_argument("--out", required=True, help="file to write (.onnx, or .pt2 with --format torch)")
    p.add_argument("--format", choices=("onnx", "torch"), default="onnx")
    p.add_argument("--form", choices=("batch", "stream"), default="batch",
                   help="batch: per-batch AQR (quantiles of each batch); stream: target='stream' with its running "
                        "state as graph inputs and outputs, from its initial state (a frozen map needs a state: "
                        "aqr.export in Python)")
    p.add_argument("--input-shape", default="3,32,32", help="one image's shape, C,H,W (the batch size is dynamic)")
    p.add_argument("--layers", default=None, help="all, top-half, bottom-half or comma-separated layer names")
    p.set_defaults(func=run)


def input_shape(text: str) -> tuple[int, ...]:
    """``C,H,W`` as integers >= 1 (:class:`UsageError` otherwise)."""
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise UsageError(f"--input-shape must be integers >= 1 separated by commas (e.g. 3,32,32), got {text!r}")
    return shape


def run(args: argparse.Namespace) -> int:
    """Wrap the model with AQR and write its graph."""
    import torch

    from aqr.adapt import AQR
    from aqr.core.stats import SourceStats
    from aqr.deploy import export

    shape = input_shape(args.input_shape)
    check_writable_target(args.out, label="--out")
    layers = None if args.layers is None else (
        args.layers if args.layers in ("all", "top-half", "bottom-half") else args.layers.split(","))
    with torch_threads(args.threads):
        model = model_from_args(args)
        stats = SourceStats.load(args.stats)
        options = {"mode": "exact"} if args.form == "batch" else {"target": "stream"}
        adapted = AQR(model, stats, layers=layers, **options)
        path = export(adapted, torch.rand(2, *shape), args.out, format=args.format, form=args.form)
    print(f"wrote {path}: {args.form} form, {len(adapted.layer_names)} layers recalibrated, {args.format}",
          file=sys.stderr)
    return 0
