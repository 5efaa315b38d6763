"""``aqr bench``: run a grid of benchmark cells into the results database (resumable)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from aqr.cli.common import UsageError, add_image_arguments, add_threads, amount, count, counts, method_specs, seeds
from aqr.harness.settings import CORRELATED_SETTINGS, SETTINGS
from aqr.util.files import check_writable_target

DEFAULT_DB = "runs/results.db"
DEFAULT_CACHE = "cache"


def add_grid_arguments(p: argparse.ArgumentParser) -> None:
    """Flags that choose and shape a grid."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None,
                     help="main, tails, granularity, vit-blocks, smoke, imagenet, stream, stream-noniid or field")
    src.add_argument("--config", default=None, help="grid file (.yaml needs aqr[bench], or .json)")
    p.add_argument("--data-dir", default=None,
                   help="folder with cifar10_test.npz, cifar10_train_jpeg75.npz, checkpoints/, frost/ "
                        "(default: $AQR_DATA_DIR)")
    p.add_argument("--cifar-c", default="cache/cifar10c", help="CIFAR-10-C folder (generated when missing)")
    p.add_argument("--imagenet", default=None,
                   help="imagenet preset: ImageNet folder with train/<wnid>/*.JPEG (default: <data-dir>/imagenet)")
    p.add_argument("--imagenet-c", default=None,
                   help="imagenet preset: ImageNet-C folder, <corruption>/<severity>/<wnid>/*.JPEG "
                        "(default: <imagenet>/imagenet-c; make it with `aqr corrupt --params imagenet`)")
    p.add_argument("--models", default=None, help="comma list of model names to keep from the grid")
    p.add_argument("--methods", default=None, help="comma list replacing the grid's methods (e.g. 'source,aqr:tail=clip')")
    p.add_argument("--corruptions", default=None, help="'all' or a comma list")
    p.add_argument("--severities", type=counts(1, 5), default=None)
    p.add_argument("--batch-sizes", type=counts(1), default=None)
    p.add_argument("--seeds", type=seeds, default=None)
    p.add_argument("--n-images", type=count(1), default=None,
                   help="evaluated images per cell (per corruption block in a continual cell)")
    p.add_argument("--order", default=None,
                   help="stream order of each cell's images, replacing the grid's orders: 'iid' or 'delta=D' "
                        "(class-correlated, Dirichlet concentration D as in RoTTA; small D: long runs of one class), "
                        "'mixed' for continual cells; the grid's name, under which its cells are recorded, gets "
                        "'-<order>' appended")
    p.add_argument("--setting", default=None, choices=SETTINGS,
                   help="the grid in one of the field's settings (as the test-time-adaptation benchmark names them): "
                        "reset_each_shift (a fresh method per corruption, online), continual (one stream of the "
                        "corruptions, no reset), gradual (that stream with severities 1..5..1 per corruption), "
                        "mixed_domains (the stream's images mixed), correlated (class-correlated order; the same "
                        "cells as --order delta=D), and mixed_domains_correlated, gradual_correlated, "
                        "reset_each_shift_correlated (those settings in class-correlated order); each *correlated "
                        "setting needs --delta; ccc (Continuously Changing Corruptions: needs --baseline and --speed; "
                        "--n-images is the stream's length); the grid's name gets '-<setting>' appended")
    p.add_argument("--delta", type=float, default=None,
                   help="the correlated settings: Dirichlet concentration of the class order (small: long runs of "
                        "one class; 0: sorted by class)")
    p.add_argument("--baseline", type=amount(0, above=True), default=None,
                   help="--setting ccc: the source model's accuracy (%%) the stream's corruptions hold it at")
    p.add_argument("--speed", type=count(1), default=None,
                   help="--setting ccc: images per severity step of the corruptions' walks")
    p.add_argument("--protocols", default=None,
                   help="comma list of the protocols whose cells to keep (episodic, online, realtime), e.g. "
                        "'online' for the field preset without its realtime cells")
    add_image_arguments(p, workers=False)


CCC_IMAGES = 100_000  # --setting ccc: the stream's length without --n-images


def grid_from_args(args: argparse.Namespace):
    """The GridSpec the flags describe."""
    from aqr.data.corruption_params import CORRUPTIONS
    from aqr.harness.grid_files import load_grid
    from aqr.harness.presets import preset

    if args.config:
        grid = load_grid(args.config, args.data_dir, args.cifar_c)
    else:
        grid = preset(args.preset or "smoke", args.data_dir, args.cifar_c, args.imagenet, args.imagenet_c)
    changes = {}
    if args.models:
        wanted = args.models.split(",")
        unknown = set(wanted) - {m.name for m in grid.models}
        if unknown:
            raise UsageError(f"models {sorted(unknown)} are not in grid {grid.name!r} "
                             f"({', '.join(m.name for m in grid.models)})")
        changes["models"] = tuple(m for m in grid.models if m.name in wanted)
    if args.methods:
        changes["methods"] = tuple(method_specs(args.methods))
    if args.corruptions:
        changes["corruptions"] = CORRUPTIONS if args.corruptions == "all" else tuple(args.corruptions.split(","))
    if args.image_size or args.resize:
        changes["models"] = tuple(replace(m, image_size=args.image_size or m.image_size, resize=args.resize or m.resize)
                                  for m in changes.get("models", grid.models))
    setting, delta = getattr(args, "setting", None), getattr(args, "delta", None)
    if setting and args.order:
        raise UsageError("--setting and --order both set the stream order; give one (--setting correlated "
                         "--delta D is --order delta=D)")
    if delta is not None and setting not in CORRELATED_SETTINGS:
        raise UsageError(f"--delta goes with --setting {'|'.join(CORRELATED_SETTINGS)}")
    if setting in CORRELATED_SETTINGS and delta is None:
        raise UsageError(f"--setting {setting} needs --delta D (e.g. 0.1; 0 sorts by class), the Dirichlet "
                         "concentration")
    baseline, speed = getattr(args, "baseline", None), getattr(args, "speed", None)
    if (baseline is not None or speed is not None) and setting != "ccc":
        raise UsageError("--baseline and --speed go with --setting ccc")
    if setting == "ccc" and (baseline is None or speed is None):
        raise UsageError("--setting ccc needs --baseline A (the source model's accuracy, %) and --speed S "
                         "(images per severity step)")
    if args.order:  # the report reads an experiment's rows by its name: keep orders apart
        from aqr.harness.cells import canonical_order, stream_corruptions

        order = canonical_order(args.order)
        single = [c for c in changes.get("corruptions", grid.corruptions) if stream_corruptions(c) is None]
        if order.startswith("mixed") and single:  # those cells would fail: they hold one corruption
            raise UsageError(f"--order {args.order!r} mixes corruptions; a bench cell of one corruption cannot "
                             "(use 'iid' or 'delta=D', or continual cells)")
        changes.update(orders=(order,), name=f"{grid.name}-{order}",
                       parts=tuple(part.override(orders=(order,)) for part in grid.parts))
    changes.update(severities=args.severities, batch_sizes=args.batch_sizes, seeds=args.seeds,
                   n_images=None if setting == "ccc" else args.n_images)
    grid = grid.override(**changes)
    if setting == "ccc":
        from aqr.harness.settings import apply_ccc

        grid = apply_ccc(grid, baseline, speed, args.n_images or CCC_IMAGES)
    elif setting:
        from aqr.harness.settings import apply_setting

        grid = apply_setting(grid, setting, delta)
    protocols = getattr(args, "protocols", None)
    if protocols is not None:
        names = [p.strip() for p in protocols.split(",") if p.strip()]
        if not names:
            raise UsageError("--protocols names no protocol; give a comma list such as 'online' or 'online,realtime'")
        try:
            grid = grid.only_protocols(names)
        except ValueError as err:
            raise UsageError(f"--protocols: {err}") from None
    return grid


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench", help="run a benchmark grid into the results database (resumable)",
        description="Run models x methods x corruptions x severities x batch sizes x seeds. Finished cells "
                    "already in --db are skipped, so rerunning an interrupted command resumes it.")
    add_grid_arguments(p)
    p.add_argument("--db", default=DEFAULT_DB, help=f"results database (default {DEFAULT_DB})")
    p.add_argument("--cache", default=DEFAULT_CACHE, help="folder for cached source statistics")
    p.add_argument("--executor", choices=("local", "ray"), default="local",
                   help="where cells run: 'local' processes (default) or tasks on a Ray cluster (needs aqr[ray])")
    p.add_argument("--workers", type=count(1), default=1, help="local worker processes (the parent writes the database)")
    p.add_argument("--device", default=None,
                   help="cpu or cuda[:N]: where the models run (default cpu; under Ray, cuda when --gpus-per-cell > 0)")
    p.add_argument("--loader-workers", type=count(0), default=0,
                   help="DataLoader processes decoding image files, per cell (image-folder grids)")
    add_threads(p, help="torch threads inside each cell, under either executor (default: torch's, or "
                        "--cpus-per-cell under Ray)")
    ray = p.add_argument_group("Ray executor")
    ray.add_argument("--ray-address", default=None,
                     help="'auto' (a running cluster) or HOST:PORT of the head node (default: Ray's choice: "
                          "RAY_ADDRESS, a cluster started on this machine, else a new local one)")
    ray.add_argument("--cpus-per-cell", type=amount(0, above=True), default=None, help="CPUs Ray reserves per cell (default: --threads or 1)")
    ray.add_argument("--gpus-per-cell", type=amount(0), default=0.0,
                     help="GPUs Ray reserves per cell (fractions share a GPU); > 0 runs the cells on CUDA")
    ray.add_argument("--max-retries", type=count(0), default=2, help="reruns of a cell whose Ray worker died (default 2)")
    p.add_argument("--costs", default=None,
                   help="realtime protocol: JSON of each method's cost C (per model and batch size); entries it "
                        "lacks are measured by a timing round on this machine and added, so a resumed or repeated "
                        "run reuses them (default: <db>.costs.json beside the database)")
    p.add_argument("--checkpoint-every", type=count(1), default=None, metavar="N",
                   help="stream cells save their state every N images in --cache; rerunning a killed command "
                        "resumes them mid-stream with the predictions of an uninterrupted run")
    p.add_argument("--limit", type=count(1), default=None, help="run at most this many new cells")
    p.add_argument("--dry-run", action="store_true", help="list the cells and exit")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print a JSON summary at the end")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the grid (or list its cells); 1 when a cell failed."""
    from aqr.harness.grid_driver import describe_cells, result_json, run_grid
    from aqr.harness.results import ResultsDB

    grid = grid_from_args(args)
    check_writable_target(args.db, label="--db")
    check_writable_target(args.cache, folder=True, label="--cache")
    if args.costs is not None:
        check_writable_target(args.costs, label="--costs")
    grid.check_methods()  # before the database is created or any data generated
    costs = args.costs or str(Path(args.db).with_suffix(".costs.json"))
    if args.dry_run:
        from aqr.harness.realtime.costs import CostTable

        grid = grid.override(costs=tuple(sorted(CostTable.load(costs).as_mapping().items())) or None)
        print("model\tmethod\tcorruption\tseverity\tbatch_size\torder\tseed\tn_images\tprotocol")
        for line in describe_cells(grid):
            print(line)
        print(f"{len(grid)} cells", file=sys.stderr)
        from aqr.harness.cells import data_corruptions
        from aqr.harness.inputs import planned_generation

        generation = planned_generation(grid.data, data_corruptions(grid.all_corruptions), grid.all_severities)
        if generation:
            print(generation, file=sys.stderr)
        if args.limit is not None:
            print(f"--limit {args.limit}: a run takes at most {args.limit} of the cells not yet in {args.db}",
                  file=sys.stderr)
        return 0
    ray = None
    if args.executor == "ray":
        from aqr.harness.ray_executor import RayOptions

        ray = RayOptions(address=args.ray_address, cpus_per_cell=args.cpus_per_cell or args.threads or 1,
                         gpus_per_cell=args.gpus_per_cell, max_retries=args.max_retries)
    with ResultsDB(args.db) as db:
        summary = run_grid(grid, db, args.cache, workers=args.workers, threads=args.threads, costs_file=costs,
                           progress=not args.no_progress, limit=args.limit,
                           log=lambda m: print(m, file=sys.stderr), device=args.device,
                           loader_workers=args.loader_workers, executor=args.executor, ray=ray,
                           checkpoint_every=args.checkpoint_every)
    others = f", {summary.by_others} run by another process on the database" if summary.by_others else ""
    print(f"{summary.ran} cells run ({summary.errors} errors, {summary.not_applicable} n/a), "
          f"{summary.skipped} skipped as finished{others}, {summary.wall_s:.1f} s", file=sys.stderr)
    for msg in summary.error_messages[:10]:
        print(f"error: {msg}", file=sys.stderr)
    if args.json:
        print(result_json(summary))
    return 1 if summary.errors else 0
