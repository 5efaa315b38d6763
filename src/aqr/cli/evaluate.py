"""``aqr evaluate``: a model + statistics + one corrupted dataset -> accuracy per method."""

from __future__ import annotations

import argparse
import json
import sys

from aqr.cli.common import add_model_arguments, method_specs, torch_threads


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("evaluate", help="accuracy of each method on one corruption and severity",
                              description="Evaluate Source/TTN/TENT/SAR/AQR (episodic) on one CIFAR-C corruption "
                                          "and severity, or on a clean .npz.")
    add_model_arguments(p)
    p.add_argument("--stats", default=None, help="statistics file from `aqr calibrate` (needed by aqr)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--cifar-c", default=None, help="CIFAR-C folder (<corruption>.npy + labels.npy)")
    where.add_argument("--data", default=None, help="a clean .npz / pickle folder instead")
    p.add_argument("--corruption", default=None, help="with --cifar-c")
    p.add_argument("--severity", type=int, default=5, help="with --cifar-c")
    p.add_argument("--indices", default=None, help="test images, 'start:stop' (default: all)")
    p.add_argument("--methods", default="source,ttn,tent,sar,aqr",
                   help="comma list; options after a colon, e.g. 'aqr:tail=gaussian,K=11'")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--protocol", default="episodic", choices=("episodic", "online"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print {method: accuracy} as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Evaluate each listed method; prints one line per method (and the JSON with ``--json``)."""
    with torch_threads(args.threads):
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from aqr import models
    from aqr.bench.grid import parse_range
    from aqr.bench.runner import evaluate
    from aqr.core.stats import SourceStats
    from aqr.data import load_cifar, load_cifar_c
    from aqr.methods import NotApplicable, create, method_class

    indices = parse_range(args.indices)
    if args.cifar_c:
        if not args.corruption:
            raise SystemExit("aqr evaluate: --cifar-c needs --corruption")
        data = load_cifar_c(args.cifar_c, args.corruption, args.severity, indices)
        where = f"{args.corruption} severity {args.severity}"
    else:
        data = load_cifar(args.data)
        if indices is not None:
            data.images, data.labels = data.images[indices], data.labels[indices]
        where = args.data
    model = models.load(args.model, checkpoint=args.checkpoint)
    stats = SourceStats.load(args.stats) if args.stats else None
    results: dict[str, float | None] = {}
    for spec in method_specs(args.methods):
        label = spec.name + (f"[{','.join(f'{k}={v}' for k, v in spec.options.items())}]" if spec.options else "")
        try:
            cls = method_class(spec.name)
        except KeyError as err:
            raise SystemExit(f"aqr evaluate: {err.args[0]}") from None
        options = dict(spec.options)
        if cls.needs_stats:
            if stats is None:
                raise SystemExit(f"aqr evaluate: the {spec.name} method needs --stats (make one with `aqr calibrate`)")
            options["stats"] = stats
        if cls.needs_batch_size:
            options.setdefault("batch_size", args.batch_size)
        try:
            method = create(spec.name, model, protocol=args.protocol, seed=args.seed, **options)
        except NotApplicable as err:
            results[label] = None
            print(f"{label:>24}: n/a ({err})", file=sys.stderr)
            continue
        acc, n = evaluate(method, data.images, data.labels, args.batch_size)
        results[label] = acc
        print(f"{label:>24}: {acc:6.2f} %  ({n} images, {where}, batch {args.batch_size})", file=sys.stderr)
    if args.json:
        print(json.dumps(results))
    return 0
