"""``aqr corrupt``: write a CIFAR-10-C-style corrupted copy of an ``.npz`` test set.

Output layout and resumability are described in :mod:`aqr.data.cifar_c`: one ``<corruption>.npy`` per
corruption holding one block of all images per requested severity, in the order given by
``--severities`` (the released layout when all five are requested), plus ``labels.npy`` and
``manifest.json`` (which :func:`aqr.data.load_cifar_c` uses to find a severity's block).
"""

from __future__ import annotations

import argparse
import sys

from aqr.data.corruption_params import CORRUPTIONS, PARAM_SETS


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``corrupt`` sub-command."""
    p = subparsers.add_parser(
        "corrupt",
        help="generate CIFAR-10-C-style corruptions of an .npz image set",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--data", required=True, help=".npz with x uint8 (N,H,W,3) and y int labels")
    p.add_argument("--out", required=True, help="output folder (created; existing complete files are kept)")
    p.add_argument("--corruptions", default="all", help="'all' or a comma-separated list of: " + ", ".join(CORRUPTIONS))
    p.add_argument("--severities", default="1,2,3,4,5", help="comma-separated severities in 1..5 (block order)")
    p.add_argument("--frost-dir", default=None, help="folder with frost1.png .. frost5.jpg (needed for frost)")
    p.add_argument("--seed", type=int, default=0, help="base seed; each image uses (seed, corruption, severity, index)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N images")
    p.add_argument("--workers", type=int, default=1, help="worker processes")
    p.add_argument("--params", choices=sorted(PARAM_SETS), default="cifar", help="severity table (cifar: 32 px)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Execute the command; returns the exit code."""
    from aqr.data.cifar_c import GenerationConfig, generate_cifar_c, parse_list
    from aqr.data import load_npz_arrays
    from aqr.util.files import sha256_file

    try:
        corruptions = parse_list(args.corruptions, CORRUPTIONS)
        severities = [int(s) for s in parse_list(args.severities)]
        images, labels = load_npz_arrays(args.data)
    except (ValueError, FileNotFoundError) as err:
        print(f"aqr corrupt: {err}", file=sys.stderr)
        return 2
    if args.limit is not None:
        images, labels = images[: args.limit], labels[: args.limit]
    source = {"file": str(args.data), "sha256": sha256_file(args.data), "limit": args.limit}
    config = GenerationConfig(
        corruptions=tuple(corruptions),
        severities=tuple(severities),
        params=args.params,
        seed=args.seed,
        workers=max(1, args.workers),
        frost_dir=args.frost_dir,
        source=source,
    )
    try:
        timings = generate_cifar_c(images, labels, args.out, config, progress=not args.no_progress)
    except (ValueError, FileNotFoundError) as err:
        print(f"aqr corrupt: {err}", file=sys.stderr)
        return 2
    for name, seconds in timings.items():
        print(f"{name}: {seconds:.1f} s")
    skipped = [c for c in corruptions if c not in timings]
    if skipped:
        print(f"already complete, skipped: {', '.join(skipped)}")
    return 0
