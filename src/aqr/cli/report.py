"""``aqr report``: the paper's tables and figures from a results database (library: :mod:`aqr.harness.report`;
Fig. 3: :mod:`aqr.experiments.tail_deviation`).

Without ``--out`` the Markdown tables go to stdout; with it, tables (Markdown, LaTeX, CSV), figures
(PNG, PDF), ``index.md`` and ``report.json`` are written there. ``--json`` prints the numbers instead.
``--tail-deviation MODEL`` computes Fig. 3 (tail percentiles of small source batches) instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from aqr.cli.common import count, seed
from aqr.util.files import check_writable_target

DEFAULT_DB = "runs/results.db"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``report`` parser."""
    p = subparsers.add_parser(
        "report", help="tables and figures of the paper from the results database",
        description="Summaries (Tables 4-6), ablations (Tables 2-3) and per-corruption tables (Table 1) "
                    "with Figs. 4-5 from --db; or, with --tail-deviation, Fig. 3 for a model.")
    p.add_argument("--db", default=DEFAULT_DB, help=f"results database (default {DEFAULT_DB})")
    p.add_argument("--experiment", default=None, help="only the cells of this experiment (grid name)")
    p.add_argument("--out", type=Path, default=None, help="write files here (default: print Markdown tables)")
    p.add_argument("--format", default="md,latex,csv", help="table formats to write: md, latex, csv")
    p.add_argument("--no-figures", action="store_true", help="do not draw figures")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    tail = p.add_argument_group("Fig. 3 (tail percentile deviations), instead of the database report")
    tail.add_argument("--tail-deviation", metavar="MODEL", default=None,
                      help="model to analyse (zoo name, aqr checkpoint, or architecture with --checkpoint)")
    tail.add_argument("--source-data", default=None, help="clean source images (CIFAR .npz or pickle folder)")
    tail.add_argument("--checkpoint", default=None, help="weights for an architecture name")
    tail.add_argument("--source-indices", default="0:10000", help="which source images ('start:stop' or a list)")
    tail.add_argument("--layer", default=None, help="normalization layer (default: the model's first)")
    tail.add_argument("--reference", type=count(1), default=None, help="reference images (default: all selected)")
    tail.add_argument("--batches", type=count(1), default=20, help="small batches drawn (default 20)")
    tail.add_argument("--batch-size", type=count(1), default=128, help="their size (default 128)")
    tail.add_argument("--seed", type=seed, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Dispatch to the database report or the Fig. 3 computation."""
    if args.out is not None:
        check_writable_target(args.out, folder=True, label="--out")
    return _tail_deviation(args) if args.tail_deviation else _db_report(args)


def _formats(text: str) -> tuple[str, ...]:
    from aqr.harness.report import FORMATS

    formats = tuple(f.strip() for f in text.split(",") if f.strip())
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ValueError(f"--format takes a comma list of {', '.join(FORMATS)}, got {text!r}")
    return formats


def _db_report(args: argparse.Namespace) -> int:
    from aqr.harness import report

    formats = _formats(args.format)
    if args.out is not None:
        result = report.report(args.db, args.out, args.experiment, formats, figures=not args.no_figures)
        if args.json:
            print(json.dumps(result))
        else:
            print(f"wrote {len(result['tables'])} tables and {args.out / 'index.md'}", file=sys.stderr)
        return 0 if result["tables"] else 1
    all_rows = report.load_rows(args.db, args.experiment, latest=False)
    rows = report.latest_rows(all_rows)
    tables = report.build_tables(rows)
    if args.json:
        print(json.dumps({"db": args.db, "experiment": args.experiment,
                          **report.report_dict(rows, tables, len(all_rows) - len(rows))}))
    else:
        print("\n".join(report.to_markdown(t) for t in tables), end="")
    if not tables:
        print(f"aqr report: no ok results in {args.db}"
              + (f" for experiment {args.experiment!r}" if args.experiment else ""), file=sys.stderr)
        return 1
    return 0


def _tail_deviation(args: argparse.Namespace) -> int:
    import numpy as np

    from aqr.models import load
    from aqr.data import load_cifar
    from aqr.experiments import tail_deviation
    from aqr.harness.cells import parse_range
    from aqr.util.plots import require_matplotlib

    if args.out is None or not args.source_data:
        raise ValueError("--tail-deviation needs --source-data NPZ and --out DIR")
    require_matplotlib("--tail-deviation's figure")
    model = load(args.tail_deviation, checkpoint=args.checkpoint)
    data = load_cifar(args.source_data)
    indices = parse_range(args.source_indices, len(data), args.source_data)
    images = np.asarray(data.images[indices])
    reference = args.reference or len(images)
    info = tail_deviation.tail_layer(model, args.layer)
    deviations = tail_deviation.percentile_deviations(model, images, info.name, args.batches, args.batch_size,
                                                      reference, seed=args.seed)
    name = Path(args.tail_deviation).stem if Path(args.tail_deviation).is_file() else args.tail_deviation
    title = (f"{name}, layer {info.name}: {args.batches} batches of {args.batch_size}\n"
             f"vs {reference} reference images (seed {args.seed})")
    figure = tail_deviation.plot_tail_deviation(deviations, args.out / "tail_deviation", title)
    result = {"model": args.tail_deviation, "layer": info.name, "batch_size": args.batch_size,
              "n_batches": args.batches, "reference": reference, "seed": args.seed,
              "source_data": args.source_data, "source_indices": args.source_indices,
              "unit": "reference std of the channel, averaged over channels",
              "deviations": {str(k): v.tolist() for k, v in deviations.items()},
              "files": [str(p) for p in figure]}
    (args.out / "tail_deviation.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
        return 0
    print(title.replace("\n", " "))
    print("| level | mean | median | min | max |\n|---|---:|---:|---:|---:|")
    for k, v in deviations.items():
        print(f"| p{k} | {v.mean():+.3f} | {np.median(v):+.3f} | {v.min():+.3f} | {v.max():+.3f} |")
    print(f"wrote {', '.join(map(str, figure))} and {args.out / 'tail_deviation.json'}")
    return 0
