"""``aqr corrupt``: write the 19 common corruptions of a clean image set, seeded, parallel and resumable."""

from __future__ import annotations

import argparse
import sys

from aqr.cli.common import UsageError, add_image_arguments, count, seed
from aqr.data.corruption_params import CORRUPTIONS, PARAM_SETS
from aqr.data.location import default_frost_dir, resolve_data_file
from aqr.util.files import check_writable_target


DESCRIPTION = """\
Write the 19 common corruptions of a clean image set, seeded, parallel and resumable.

From an .npz (x uint8 N x H x W x 3, y labels): the CIFAR-10-C layout, one <corruption>.npy per
corruption holding one block of all images per requested severity, in the order of --severities
(the released layout when all five are requested), plus labels.npy and manifest.json (which tells
`aqr evaluate --cifar-c` where a severity's block is).

From an image folder (DIR/<class>/*.JPEG, e.g. the ImageNet validation set) or a text file listing
image paths: the released ImageNet-C layout, OUT/<corruption>/<severity>/<class>/<name>.JPEG, each
image resized (shorter side 256) and centre-cropped to 224 (--resize, --image-size), corrupted
with --params imagenet.

Finished files are kept, so an interrupted run resumes where it stopped."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``corrupt`` sub-command."""
    p = subparsers.add_parser(
        "corrupt",
        help="generate the CIFAR-10-C / ImageNet-C corruptions of an image set (.npz or image folder)",
        description=DESCRIPTION,
    )
    p.add_argument("--data", required=True, type=resolve_data_file,
                   help=".npz with x uint8 (N,H,W,3) and y int labels, or an image folder (DIR/<class>/*.JPEG) or list "
                        "(a relative name missing here is read from $AQR_DATA_DIR)")
    p.add_argument("--out", required=True, help="output folder (created; existing complete files are kept)")
    p.add_argument("--corruptions", default="all", help="'all' or a comma-separated list of: " + ", ".join(CORRUPTIONS))
    p.add_argument("--severities", default="1,2,3,4,5", help="comma-separated severities in 1..5 (block order)")
    p.add_argument("--frost-dir", default=None, type=resolve_data_file,
                   help="folder with frost1.png .. frost5.jpg (needed for frost; default $AQR_DATA_DIR/frost)")
    p.add_argument("--seed", type=seed, default=0, help="base seed; each image uses (seed, corruption, severity, index)")
    p.add_argument("--limit", type=count(1), default=None, help="use only the first N images")
    p.add_argument("--n-images", type=count(1), default=None,
                   help="image folders: N images drawn class-balanced at random (--seed) instead of all")
    p.add_argument("--workers", type=count(1), default=1, help="worker processes")
    p.add_argument("--params", choices=sorted(PARAM_SETS), default=None,
                   help="severity table: cifar (32 px; default for .npz) or imagenet (224 px; default for image folders)")
    add_image_arguments(p, workers=False, model=False)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Execute the command; returns the exit code."""
    from aqr.data.images import is_image_source

    check_writable_target(args.out, folder=True, label="--out")
    if is_image_source(args.data):
        return _run_folder(args)
    if args.image_size or args.resize or args.n_images:
        raise UsageError("--image-size, --resize and --n-images apply to image folders, not to .npz arrays")
    from aqr.data.cifar_c import GenerationConfig, generate_cifar_c, parse_list
    from aqr.data import load_npz_arrays
    from aqr.util.files import sha256_file

    corruptions = parse_list(args.corruptions, CORRUPTIONS)
    severities = [int(s) for s in parse_list(args.severities)]
    images, labels = load_npz_arrays(args.data)
    if args.limit is not None:
        images, labels = images[: args.limit], labels[: args.limit]
    source = {"file": str(args.data), "sha256": sha256_file(args.data), "limit": args.limit}
    config = GenerationConfig(
        corruptions=tuple(corruptions),
        severities=tuple(severities),
        params=args.params or "cifar",
        seed=args.seed,
        workers=args.workers,
        frost_dir=args.frost_dir or default_frost_dir(),
        source=source,
    )
    timings = generate_cifar_c(images, labels, args.out, config, progress=not args.no_progress)
    for name, seconds in timings.items():
        print(f"{name}: {seconds:.1f} s")
    skipped = [c for c in corruptions if c not in timings]
    if skipped:
        print(f"already complete, skipped: {', '.join(skipped)}")
    return 0


def _run_folder(args: argparse.Namespace) -> int:
    """An image folder or list -> the ImageNet-C folder layout."""
    import numpy as np

    from aqr.data.cifar_c import parse_list
    from aqr.data.images import ImageFolder, balanced_subset, listing_fingerprint
    from aqr.data.imagenet_c import IMAGENET_C_PREPROCESS, FolderGenerationConfig, generate_imagenet_c

    source = ImageFolder(args.data)
    indices = np.arange(len(source))
    if args.n_images is not None:
        indices = balanced_subset(source.labels, args.n_images, args.seed)
    if args.limit is not None:
        indices = indices[: args.limit]
    config = FolderGenerationConfig(
        corruptions=tuple(parse_list(args.corruptions, CORRUPTIONS)),
        severities=tuple(int(s) for s in parse_list(args.severities)),
        params=args.params or "imagenet",
        seed=args.seed,
        workers=args.workers,
        frost_dir=args.frost_dir or default_frost_dir(),
        preprocess=IMAGENET_C_PREPROCESS.with_overrides(args.image_size, args.resize),
        source={"listing": listing_fingerprint(args.data), "n_images": args.n_images, "limit": args.limit},
    )
    print(f"{len(indices)} images of {len(source.classes)} classes from {args.data} ({config.preprocess}) "
          f"-> {args.out}", file=sys.stderr)
    timings = generate_imagenet_c(source, args.out, config, indices, progress=not args.no_progress)
    for name, seconds in timings.items():
        print(f"{name}: {seconds:.1f} s")
    skipped = len(config.corruptions) * len(config.severities) - len(timings)
    if skipped:
        print(f"already complete, skipped: {skipped} corruption/severity folders")
    return 0
