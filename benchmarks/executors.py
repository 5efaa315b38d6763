"""The Ray executor against the local one on a grid: same rows, and what Ray costs per cell.

One process, side by side: a local Ray instance of ``--cpus`` CPUs is started once (its start is
timed apart), the statistics are computed once into a shared cache, then ``--rounds`` rounds run
the grid into fresh databases under both executors with the same parallelism and threads
(``--executor local --workers CPUS`` and ``--executor ray --cpus-per-cell 1``), alternating which
goes first. Every run must write the same keys with the same statuses and accuracies, and the Ray
rows must say ``ray``. The overhead per cell is (Ray's wall time - local's) / cells, per round;
the first round is reported apart (Ray starts its worker processes there). With ``--cpus 1`` the
local executor runs cells in this process (its caches stay warm across rounds, like Ray's
workers), which isolates Ray's cost per task; with more CPUs it spawns a pool in every run, which
Ray does not, so there the difference includes process start-up.

    python benchmarks/executors.py --cifar-c cache/cifar10c           # smoke grid, $AQR_DATA_DIR
    python benchmarks/executors.py --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from aqr.harness.grid_driver import run_grid
from aqr.harness.presets import preset
from aqr.harness.ray_executor import RayOptions, import_ray
from aqr.harness.results import ResultsDB


def run(grid, folder: Path, cache: Path, executor: str, cpus: int, threads: int) -> tuple[float, dict]:
    """Wall time of one run of ``grid`` into a fresh database, and its rows (key -> what must match)."""
    with ResultsDB(folder / f"{executor}.db") as db:
        t0 = time.perf_counter()
        summary = run_grid(grid, db, cache, workers=cpus, threads=threads, progress=False, log=lambda m: None,
                           executor=executor, ray=RayOptions(cpus_per_cell=1))
        wall = time.perf_counter() - t0
        if summary.errors:
            raise SystemExit(f"{executor}: {summary.error_messages[0]}")
        rows = {r.key: (r.status, r.accuracy, r.provenance["executor"], r.provenance["threads"], r.wall_s)
                for r in db.rows()}
    return wall, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="smoke")
    p.add_argument("--data-dir", default=None, help="default: $AQR_DATA_DIR")
    p.add_argument("--cifar-c", default="cache/cifar10c", help="as for aqr bench (the smoke preset reads its sibling cifar10c-smoke)")
    p.add_argument("--cpus", type=int, default=2, help="Ray CPUs and local worker processes")
    p.add_argument("--threads", type=int, default=1, help="torch threads inside each cell, both executors")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()

    ray = import_ray()
    grid = preset(args.preset, args.data_dir, args.cifar_c)
    work = Path(tempfile.mkdtemp(prefix="aqr-executors-"))
    cache = work / "cache"
    with ResultsDB(work / "stats.db") as db:  # statistics (and generated data) once, outside the timings
        run_grid(grid.override(name="stats", methods=tuple(m for m in grid.methods if m.name == "aqr")), db,
                 cache, threads=args.threads, progress=False, log=lambda m: None)
    t0 = time.perf_counter()
    ray.init(address="local", num_cpus=args.cpus, object_store_memory=200 * 1024**2, include_dashboard=False,
             log_to_driver=False)
    ray_start = time.perf_counter() - t0
    n = len(grid)
    walls: dict[str, list[float]] = {"local": [], "ray": []}
    in_cells: dict[str, list[float]] = {"local": [], "ray": []}   # summed wall time inside the cells
    reference = None
    try:
        for r in range(args.rounds):
            order = ("local", "ray") if r % 2 == 0 else ("ray", "local")
            for executor in order:
                folder = work / f"round{r}"
                folder.mkdir(exist_ok=True)
                wall, rows = run(grid, folder, cache, executor, args.cpus, args.threads)
                walls[executor].append(wall)
                in_cells[executor].append(sum(v[4] for v in rows.values()))
                same = {k: v[:2] for k, v in rows.items()}
                reference = reference or same
                if same != reference:
                    raise SystemExit(f"round {r}: {executor} wrote other rows than the first run")
                if {v[2] for v in rows.values()} != {executor} or {v[3] for v in rows.values()} != {args.threads}:
                    raise SystemExit(f"round {r}: {executor} rows record {set(v[2:] for v in rows.values())}")
    finally:
        ray.shutdown()
    per_round = [(walls["ray"][r] - walls["local"][r]) / n * 1000 for r in range(args.rounds)]
    warm = per_round[1:] or per_round
    result = {
        "grid": grid.name, "cells": n, "cpus": args.cpus, "threads": args.threads, "rounds": args.rounds,
        "ray_start_s": ray_start, "wall_s": walls, "in_cells_s": in_cells, "overhead_ms_per_cell_by_round": per_round,
        "overhead_ms_per_cell_first_round": per_round[0],
        "overhead_ms_per_cell_median_later_rounds": statistics.median(warm),
        "same_rows": True,
    }
    print(f"{grid.name}: {n} cells, {args.cpus} CPUs, {args.threads} thread(s) per cell; Ray start {ray_start:.1f} s")
    # wall time not spent inside cells, per cell, with cpus cells running at once
    outside = {e: [(w - c / args.cpus) / n * 1000 for w, c in zip(walls[e], in_cells[e])] for e in walls}
    result["outside_cells_ms_per_cell"] = outside
    for executor, values in walls.items():
        print(f"  {executor:5s} wall per round: " + ", ".join(f"{v:.2f} s" for v in values)
              + "; inside the cells: " + ", ".join(f"{v:.2f} s" for v in in_cells[executor])
              + "; outside them per cell: " + ", ".join(f"{v:.0f} ms" for v in outside[executor]))
    print(f"  Ray - local per cell: first round {per_round[0]:+.0f} ms, later rounds median "
          f"{statistics.median(warm):+.0f} ms ({', '.join(f'{v:+.0f}' for v in per_round)})")
    print(f"  rows: same {len(reference)} keys, statuses and accuracies under both executors; Ray rows say 'ray'")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
