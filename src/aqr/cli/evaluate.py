"""``aqr evaluate``: a model + statistics + one corrupted dataset -> accuracy per method."""

from __future__ import annotations

import argparse
import json
import sys

from aqr.cli.common import (UsageError, add_image_arguments, add_model_arguments, count, model_from_args, method_specs,
                            seed, torch_threads)
from aqr.data.location import resolve_data_file


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("evaluate", help="accuracy of each method on one corruption and severity",
                              description="Evaluate methods (default Source/TTN/TENT/SAR/AQR) on one CIFAR-C or "
                                          "ImageNet-C corruption and severity, or on clean images: episodic (each "
                                          "batch from the model as given) unless --protocol online.")
    add_model_arguments(p)
    p.add_argument("--stats", default=None, help="statistics file from `aqr calibrate` (needed by aqr)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--cifar-c", default=None, help="CIFAR-C folder (<corruption>.npy + labels.npy)")
    where.add_argument("--imagenet-c", default=None, help="ImageNet-C folder (<corruption>/<severity>/<wnid>/*.JPEG)")
    where.add_argument("--data", default=None, type=resolve_data_file,
                       help="clean images instead: a CIFAR .npz / pickle folder, an image folder or a list of paths "
                            "(a relative name missing here is read from $AQR_DATA_DIR)")
    p.add_argument("--corruption", default=None, help="with --cifar-c / --imagenet-c")
    p.add_argument("--severity", type=count(1, 5), default=5, help="with --cifar-c / --imagenet-c")
    p.add_argument("--indices", default=None, help="test images, 'start:stop', 'start:stop~n' or a list (default: all)")
    add_image_arguments(p)
    p.add_argument("--methods", default="source,ttn,tent,sar,aqr",
                   help="comma list; options after a colon, e.g. 'aqr:tail=gaussian,K=11'")
    p.add_argument("--batch-size", type=count(1), default=128, help="test images per batch")
    p.add_argument("--protocol", default="episodic", choices=("episodic", "online"),
                   help="episodic (the default here, the paper's): every batch adapts from the model as given; "
                        "online (aqr.methods.create's default): the state carries over batches (needed by "
                        "aqr:target=stream / robust)")
    p.add_argument("--seed", type=seed, default=0, help="seeds the methods' randomness")
    p.add_argument("--json", action="store_true", help="print {method: accuracy} as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (there is none when stderr is not a terminal)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Evaluate each listed method; prints one line per method (and the JSON with ``--json``)."""
    with torch_threads(args.threads):
        return _run(args)


def _test_data(args: argparse.Namespace, model):
    """``(evaluate(method, label) -> (accuracy, n), description)`` for the chosen test images (a progress bar
    per method on a terminal, unless ``--no-progress``)."""
    import numpy as np
    from torch.utils.data import Subset

    from aqr.data import load_cifar, load_cifar_c
    from aqr.data.images import ImageFolder, is_image_source
    from aqr.harness.cells import ModelSpec, parse_range
    from aqr.harness.eval_loop import evaluate, evaluate_batches
    from aqr.harness.inputs import data_loader, model_preprocess

    progress = not args.no_progress and sys.stderr.isatty()
    if (args.cifar_c or args.imagenet_c) and not args.corruption:
        raise UsageError(f"{'--cifar-c' if args.cifar_c else '--imagenet-c'} needs --corruption")
    if args.cifar_c or (args.data and not is_image_source(args.data)):
        # memory-mapped: only the selected rows are read
        data = load_cifar_c(args.cifar_c, args.corruption, args.severity) if args.cifar_c else load_cifar(args.data)
        indices = parse_range(args.indices, len(data), args.cifar_c or args.data)
        if indices is not None:
            data.images, data.labels = np.ascontiguousarray(data.images[indices]), np.asarray(data.labels[indices])
    else:
        from aqr.data.imagenet_c import ImageNetCFolder

        preprocess = model_preprocess(ModelSpec("cli", args.model, image_size=args.image_size, resize=args.resize),
                                      model)
        folder = (ImageNetCFolder(args.imagenet_c, args.corruption, args.severity, preprocess=preprocess)
                  if args.imagenet_c else ImageFolder(args.data, preprocess))
        indices = parse_range(args.indices, len(folder), args.imagenet_c or args.data)
        images = folder if indices is None else Subset(folder, indices)
        where = (f"{args.corruption} severity {args.severity}" if args.imagenet_c else args.data) + f", {preprocess}"
        return (lambda method, label: evaluate_batches(method, data_loader(images, args.batch_size, args.workers,
                                                                           args.device), progress, label,
                                                       total=-(-len(images) // args.batch_size))), where
    where = f"{args.corruption} severity {args.severity}" if args.cifar_c else args.data
    return (lambda method, label: evaluate(method, data.images, data.labels, args.batch_size, progress, label)), where


def _run(args: argparse.Namespace) -> int:
    from aqr.core.stats import SourceStats
    from aqr.harness.cells import index_count
    from aqr.methods import NotApplicable, plan

    index_count(args.indices)  # the form of --indices, before any file is read (its bounds: once the data's size is)
    specs = method_specs(args.methods)
    chosen = []
    for spec in specs:  # every method is checked before any file is read or any method runs
        if args.protocol == "episodic" and spec.options.get("target") in ("stream", "robust"):
            raise UsageError(f"{spec.name}:target={spec.options['target']} keeps a running estimate across batches; "
                             "in the episodic protocol it restarts every batch (per-batch AQR): add --protocol online")
        try:
            method_plan = plan(spec.name, {**spec.options, "protocol": args.protocol, "seed": args.seed},
                               batch_size=args.batch_size)
        except (TypeError, ValueError) as err:
            raise UsageError(f"method {spec.label!r}: {err}") from None
        if method_plan.needs.stats is not None and not args.stats:
            raise UsageError(f"the {spec.name} method needs --stats (make one with `aqr calibrate`)")
        chosen.append((spec.label, method_plan))
    stats = SourceStats.load(args.stats) if args.stats else None
    if stats is not None:  # statistics that no chosen method can use are refused before anything runs
        for label, method_plan in chosen:
            if method_plan.stats_point is not None:
                stats.check_point(method_plan.stats_point, f"method {label!r}")
    model = model_from_args(args)
    if stats is not None and any(p.stats_point is not None for _, p in chosen):
        stats.check_model(model)
    run_on, where = _test_data(args, model)
    results: dict[str, float | None] = {}
    for label, method_plan in chosen:
        try:
            method = method_plan.build(model, stats=stats if method_plan.needs.stats is not None else None)
        except NotApplicable as err:
            results[label] = None
            print(f"{label:>24}: n/a ({err})", file=sys.stderr)
            continue
        acc, n = run_on(method, label)
        results[label] = acc
        print(f"{label:>24}: {acc:6.2f} %  ({n} images, {where}, batch {args.batch_size})", file=sys.stderr)
    if args.json:
        print(json.dumps(results))
    return 0
