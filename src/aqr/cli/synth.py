"""``aqr synth {shapes,mlp,rates}``: the paper's synthetic experiments (library code in
:mod:`aqr.experiments.shapes`, :mod:`~aqr.experiments.mlp` and :mod:`~aqr.experiments.rates`).

Each run writes ``<name>.png`` and ``<name>.json`` under ``--out`` (``<name>_quick.*`` with ``--quick``,
so a quick run never overwrites the committed full results) and prints a summary, or the JSON with
``--json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from aqr.cli.common import add_threads, seed, torch_threads

if TYPE_CHECKING:
    from aqr.experiments.mlp import MLPResult
    from aqr.experiments.rates import RatesResult
    from aqr.experiments.shapes import ShapesResult

DEFAULT_OUT = Path("docs/results/synthetic")


def register(subparsers) -> None:
    """Add the ``synth`` parser with one sub-command per experiment."""
    parser = subparsers.add_parser("synth", help="synthetic experiments that test the paper's analysis")
    sub = parser.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    helps = {
        "shapes": "Fig. 1: KDEs of source, shifted, TTN- and AQR-corrected values; W1 to the source",
        "mlp": "one-hidden-layer MLP: MSE of AQR and TTN on corrupted hidden units over n and K",
        "rates": "finite-sample/discretisation rates: MSE vs K, n_S, n_T; slopes; theorem bound check",
    }
    for name, text in helps.items():
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
        p.add_argument("--json", action="store_true", help="print the numbers as JSON")
        p.add_argument("--quick", action="store_true", help="reduced run (seconds), files get a _quick suffix")
        p.add_argument("--seed", type=seed, default=0, help="seed of every random draw (default 0)")
        add_threads(p, default=1, help="torch CPU threads while running (default 1)")
        p.set_defaults(func=_run, experiment=name)


def _run(args: argparse.Namespace) -> int:
    from aqr.experiments import mlp, rates, shapes
    from aqr.experiments.synthetic_tools import jsonable
    from aqr.util.files import check_writable_target

    check_writable_target(args.out, folder=True, label="--out")
    experiments = {
        "shapes": (shapes.ShapesConfig, shapes.run_shapes, shapes.plot_shapes, _summary_shapes),
        "mlp": (mlp.MLPConfig, mlp.run_mlp, mlp.plot_mlp, _summary_mlp),
        "rates": (rates.RatesConfig, rates.run_rates, rates.plot_rates, _summary_rates),
    }
    config_cls, run, plot, summary = experiments[args.experiment]
    config = config_cls.quick(seed=args.seed) if args.quick else config_cls(seed=args.seed)
    with torch_threads(max(1, args.threads)):
        result = run(config)
    stem = args.experiment + ("_quick" if args.quick else "")
    numbers = jsonable(result.to_dict())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(numbers, indent=1) + "\n")
    png = plot(result, args.out / f"{stem}.png")
    if args.json:
        print(json.dumps(numbers))
    else:
        print(summary(result))
        print(f"wrote {png} and {args.out / f'{stem}.json'}")
    return 0


def _summary_shapes(r: ShapesResult) -> str:
    c = r.config
    return (
        f"shapes: n_source={c.n_source} n_target={c.n_target} K={c.num_quantiles} seed={c.seed}\n"
        f"W1 to source: shifted {r.w1_shifted:.4f} | TTN {r.w1_ttn:.4f} | AQR {r.w1_aqr:.4f}"
    )


def _summary_mlp(r: MLPResult) -> str:
    lines = ["| scenario | n | K | MSE AQR | MSE TTN | output MSE AQR | output MSE TTN |", "|---|---|---|---|---|---|---|"]
    for c in r.cells:
        lines.append(
            f"| {c.scenario} | {c.n} | {c.num_quantiles} | {c.mse_aqr:.3e} | {c.mse_ttn:.3e} "
            f"| {c.output_mse_aqr:.3e} | {c.output_mse_ttn:.3e} |"
        )
    top = r.largest("mixed")
    flags = r.nonaffine["mixed"]
    lines.append("per-neuron MSE at the largest n, K (mixed): " + ", ".join(
        f"{name}{' (non-affine)' if na else ''}: AQR {a:.2e} TTN {t:.2e}"
        for name, na, a, t in zip(r.corruptions["mixed"], flags, top.mse_aqr_per_neuron, top.mse_ttn_per_neuron)
    ))
    return "\n".join(lines)


def _summary_rates(r: RatesResult) -> str:
    d = r.config.density
    lines = [f"rates: f(x) = 1 - {d.a:g} cos(2 pi {d.modes} x) on [0,1], f_min={d.f_min:g}, L={d.lipschitz:.4f}, "
             f"k(h)=exp(2h), delta={r.config.delta:g}, repeats={r.config.repeats}, seed={r.config.seed}"]
    for sw in list(r.sweeps.values()) + [r.uniform_population]:
        s = sw.slope
        lines.append(f"{sw.name}: slope {s.slope:.3f} CI [{s.ci_low:.3f}, {s.ci_high:.3f}] ({s.method}); "
                     f"fixed {sw.fixed}; bound violations {sw.violations}, max MSE/bound {sw.max_ratio:.3g}")
        lines.append("  x:        " + " ".join(f"{v:.4g}" for v in sw.x))
        lines.append("  MSE mean: " + " ".join(f"{v:.3e}" for v in sw.mean))
        lines.append("  bound:    " + " ".join(f"{v:.3e}" for v in sw.bound))
        lines.append("  local slopes: " + " ".join(f"{v:.2f}" for v in sw.local_slopes))
    lines.append(f"bound holds at every point (cosine source): {r.bound_holds}")
    lines.append(f"predicted K^4 MSE (n=inf): {r.predicted['K4_mse']:.4f}; uniform source {r.predicted_uniform['K4_mse']:.4f}; "
                 f"predicted n MSE per side: {r.predicted['n_mse']:.4f}")
    return "\n".join(lines)
