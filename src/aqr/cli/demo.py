"""``aqr demo``: Source, TTN, TENT, SAR, moments and AQR compared end to end (digits by default, or CIFAR-10-C)."""

from __future__ import annotations

import argparse
import sys

from aqr.cli.common import add_threads, count, counts, names, seed


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``demo`` sub-command."""
    p = subparsers.add_parser(
        "demo", help="compare Source, TTN, TENT, SAR, moments and AQR end to end in minutes (no data needed)",
        description="Without --data: train small BN/GN/LN models on scikit-learn's digits (needs "
                    "aqr[demo]), corrupt the test split, run every method and print the table. With "
                    "--data/--cifar-c/--checkpoint: the same comparison for an existing CIFAR model. "
                    "Resumable: rerunning reuses the models, data and finished cells in --out.")
    p.add_argument("--out", default="runs/demo", help="work folder (default runs/demo)")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--quick", action="store_true",
                   help="fewer epochs, corruptions and images (about half a minute; for tests)")
    add_threads(p, default=1, help="torch threads (default 1: tiny models; 0: torch's default)", minimum=0)
    p.add_argument("--no-figure", action="store_true", help="do not write <out>/demo.png")
    p.add_argument("--no-progress", action="store_true")
    cifar = p.add_argument_group("CIFAR instead of digits (all of --data, --cifar-c, --checkpoint)")
    cifar.add_argument("--data", default=None, help="clean CIFAR .npz; source statistics from its first images")
    cifar.add_argument("--cifar-c", default=None, help="CIFAR-C folder (<corruption>.npy + labels.npy) to evaluate on")
    cifar.add_argument("--checkpoint", default=None,
                       help="aqr checkpoint file or zoo name (third-party weights: with --arch)")
    cifar.add_argument("--arch", default=None, help="architecture of third-party weights, e.g. resnet20")
    cifar.add_argument("--model-name", default=None, help="label of the model in the table")
    cifar.add_argument("--source-indices", default=None,
                       help="npz images for the statistics, start:stop (default: first half, at most 5000)")
    cifar.add_argument("--eval-indices", default=None, help="CIFAR-C pool the cells draw from (default: second half)")
    grid = p.add_argument_group("grid (defaults depend on --quick)")
    grid.add_argument("--corruptions", type=names, default=None, help="comma list")
    grid.add_argument("--severities", type=counts(1, 5), default=None, help="comma list, e.g. 3,5")
    grid.add_argument("--batch-size", type=count(1), default=None)
    grid.add_argument("--n-images", type=count(1), default=None, help="evaluated images per cell")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the demo, print its table; exit code 1 if any cell failed, 2 on bad input."""
    from aqr.experiments.demo import DemoConfig, run_demo
    from aqr.util.files import check_writable_target

    check_writable_target(args.out, folder=True, label="--out")
    config = DemoConfig(out=args.out, seed=args.seed, quick=args.quick, threads=args.threads,
                        figure=not args.no_figure, progress=not args.no_progress, data=args.data,
                        cifar_c=args.cifar_c, checkpoint=args.checkpoint, model_name=args.model_name,
                        arch=args.arch, corruptions=args.corruptions, severities=args.severities,
                        batch_size=args.batch_size, n_images=args.n_images, source_indices=args.source_indices,
                        eval_indices=args.eval_indices)
    log = lambda message: print(message, file=sys.stderr)  # noqa: E731 - progress to stderr, table to stdout
    result = run_demo(config, log=log)
    print(result.format_table())
    if result.figure:
        print(f"figure: {result.figure}")
    print(f"results: {result.db} ({result.summary.ran} cells run, {result.summary.skipped} reused); "
          f"{result.wall_s:.1f} s")
    return 1 if result.summary.errors else 0
