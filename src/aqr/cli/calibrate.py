"""``aqr calibrate``: a model + clean source images -> a statistics file (safetensors)."""

from __future__ import annotations

import argparse
import sys
import warnings

from aqr.cli.common import (UsageError, add_image_arguments, add_model_arguments, count, model_from_args, seed,
                            torch_threads)
from aqr.core.tails import DEFAULT_TAIL_UNIT, TAIL_UNITS
from aqr.data.location import resolve_data_file
from aqr.util.files import check_writable_target


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("calibrate", help="compute a model's source statistics once and save them",
                              description="Run the model over clean source images and write the per-channel "
                                          "percentiles of every normalization layer to a safetensors file.")
    add_model_arguments(p)
    p.add_argument("--data", required=True, type=resolve_data_file,
                   help="clean source images: an image folder (DIR/<class>/*.JPEG), a text file listing image "
                        "paths, a CIFAR .npz or python-pickle folder (a relative name missing here is read from "
                        "$AQR_DATA_DIR)")
    p.add_argument("--indices", default=None,
                   help="which images may be drawn: 'start:stop', 'start:stop~n' or a list (default: all)")
    p.add_argument("--n-images", type=count(1), default=10_000,
                   help="draw this many, class-balanced at random (--seed), from them (default 10,000, the paper's "
                        "n; all of them when fewer)")
    add_image_arguments(p)
    p.add_argument("--out", required=True, help="statistics file to write (e.g. model.aqr.safetensors)")
    p.add_argument("--num-quantiles", "-K", type=count(3), default=101, help="K knots (101 = percentiles p0..p100)")
    p.add_argument("--tail", default="average", help="default tail strategy stored with the statistics")
    p.add_argument("--tail-unit", choices=TAIL_UNITS, default=DEFAULT_TAIL_UNIT,
                   help="Average Sample Tails: a 'batch of 100' is 100 activation values or 100 images")
    p.add_argument("--layers", default="all", help="all, top-half, bottom-half or comma-separated layer names")
    p.add_argument("--max-samples", type=count(2), default=100_000, help="values kept per channel for the quantiles")
    p.add_argument("--groups", type=count(1, 4096), default=None,
                   help="also keep each group's knots (source class y in group y %% G), for target='robust' with "
                        "balance < 1 (its groups: 16 by default)")
    p.add_argument("--point", choices=("output", "pre-affine"), default="output",
                   help="where the values are read: each layer's output (for aqr, aqr+lame; default) or before its "
                        "affine step (for aqr+tent, aqr+eta, aqr+roid)")
    p.add_argument("--descriptors", action="store_true",
                   help="also keep how the images' descriptors (per-channel mean and log std at the first layers) "
                        "spread over the source images, for target='mixed'")
    p.add_argument("--batch-size", type=count(1), default=500)
    p.add_argument("--seed", type=seed, default=0, help="seeds the image draw and the statistics' sampling")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Calibrate the model on the selected source images and write the statistics file."""
    from aqr.core.calibrate import ClassCoverageWarning, calibrate
    from aqr.data.images import is_image_source
    from aqr.harness.cells import ModelSpec, index_count
    from aqr.harness.inputs import data_loader, model_preprocess, source_dataset

    if args.num_quantiles > args.max_samples:
        raise UsageError(f"--num-quantiles {args.num_quantiles} must be at most --max-samples {args.max_samples}, "
                         "the values kept per channel that the knots are read from")
    check_writable_target(args.out, label="--out")
    if not (args.indices or "").strip().startswith("balanced~"):
        index_count(args.indices)  # the form of --indices, before the model is loaded
    with torch_threads(args.threads):
        model = model_from_args(args)
        spec = ModelSpec("cli", args.model, args.checkpoint, args.data, args.indices, args.image_size, args.resize)
        preprocess = model_preprocess(spec, model)
        source = source_dataset(spec, preprocess, args.n_images, args.seed)
        layers = args.layers if args.layers in ("all", "top-half", "bottom-half") else args.layers.split(",")
        with warnings.catch_warnings():  # source_dataset warned already, naming --n-images
            warnings.simplefilter("ignore", ClassCoverageWarning)
            stats = calibrate(model, data_loader(source, args.batch_size, args.workers, args.device), layers=layers,
                              num_quantiles=args.num_quantiles, tail=args.tail, tail_unit=args.tail_unit,
                              max_samples=args.max_samples, seed=args.seed, progress=not args.no_progress,
                              groups=args.groups, point=args.point, descriptors=args.descriptors)
    path = stats.save(args.out)
    how = f" ({preprocess})" if is_image_source(args.data) else ""
    print(f"wrote {path}: {len(stats.layer_names)} layers, K={args.num_quantiles}, {len(source)} source images{how}",
          file=sys.stderr)
    return 0
