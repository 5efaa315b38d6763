"""The source model's accuracy table that CCC streams walk on (:mod:`aqr.harness.ccc`), and its command:

    python -m aqr.harness.ccc_table --model resnet20_trainstats --baseline 40

measures the model's accuracy on every ordered pair of CCC's corruptions for that baseline over a grid of
severities (0 to 5 in steps of 0.5), 100 clean test images a cell drawn from ``0:5000`` (outside the
presets' evaluation pool), and writes it where CCC cells read it (``<cifar-c>/ccc_accuracy/<model>.json``).
It resumes: every finished row of the grid (a first corruption at one severity, against every second one) is
kept in ``<table>.partial.json`` beside the table, which a rerun with the same arguments reads and the
finished table replaces.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from aqr.data.arrays import load_npz_arrays, to_float
from aqr.data.ccc import SEVERITY_GRID, AccuracyTable, ccc_corruptions
from aqr.data.corruption_params import CIFAR_PARAMS
from aqr.data.corruptions import corrupt, load_frost_overlays
from aqr.harness.ccc import table_path
from aqr.harness.cells import parse_range
from aqr.util.files import atomic_write


class _RowMeasure:
    """One grid row of the table: the model's accuracy on the images a first corruption makes at one severity,
    each second corruption applied at every severity of the grid (what :func:`measure_table` runs, in this process
    or in a worker of its pool)."""

    def __init__(self, model: nn.Module, base: np.ndarray, truth: torch.Tensor, corruptions: Sequence[str],
                 grid: Sequence[float], seed: int, frost_overlays: Sequence[np.ndarray] | None, device: str) -> None:
        self.model, self.base, self.truth, self.corruptions = model.to(device).eval(), base, truth, corruptions
        self.grid, self.seed, self.frost_overlays, self.device = grid, seed, frost_overlays, device
        self.crc = {name: zlib.crc32(name.encode()) for name in corruptions}

    def accuracy(self, batch: np.ndarray) -> float:
        with torch.no_grad():
            predicted = self.model(to_float(batch).to(self.device)).argmax(1).cpu()
        return 100.0 * float((predicted == self.truth).float().mean())

    def corrupted(self, batch: np.ndarray, name: str, severity: float, key: list[int]) -> np.ndarray:
        if severity == 0:
            return batch
        return np.stack([corrupt(img, name, float(severity), np.random.default_rng(np.random.SeedSequence(key + [k])),
                                 frost_overlays=self.frost_overlays) for k, img in enumerate(batch)])

    def row(self, a: str, i: int) -> dict[str, list[float]]:
        """Second corruption -> the accuracy at each severity, after ``a`` at the grid's ``i``-th severity."""
        crc, seed = self.crc, self.seed
        first = self.corrupted(self.base, a, self.grid[i], [seed, 3, crc[a], i])
        return {b: [self.accuracy(self.corrupted(first, b, s2, [seed, 4, crc[a], crc[b], i, j]))
                    for j, s2 in enumerate(self.grid)] for b in self.corruptions if b != a}


_WORKER: _RowMeasure | None = None  # a pool worker's measure (set by _start_worker in that process only)


def _start_worker(measure: _RowMeasure) -> None:
    global _WORKER
    torch.set_num_threads(1)  # one core a worker: the pool has one worker per core it was given
    _WORKER = measure


def _worker_row(a: str, i: int) -> tuple[str, int, dict[str, list[float]]]:
    assert _WORKER is not None
    return a, i, _WORKER.row(a, i)


def measure_table(model: nn.Module, images: np.ndarray, labels: np.ndarray, corruptions: Sequence[str],
                  grid: Sequence[float] = SEVERITY_GRID, per_cell: int = 100, seed: int = 0,
                  frost_overlays: Sequence[np.ndarray] | None = None, device: str | None = None,
                  progress: bool = False, about: dict | None = None,
                  checkpoint: str | Path | None = None, workers: int = 1) -> AccuracyTable:
    """The source model's accuracy (%) on every ordered pair of ``corruptions`` at every pair of ``grid``
    severities, each cell on the same ``per_cell`` images (drawn with ``seed``), each image corrupted with its
    own generator. The images a first corruption makes at a severity are reused for every second one.
    ``checkpoint``: a file that keeps every finished row (a first corruption at one severity), read back where it
    exists, so an interrupted measurement resumes with the same values; one made with other arguments is refused.
    ``workers`` > 1: the rows measured in that many processes (CPU only), the same values."""
    from tqdm.auto import tqdm

    if workers < 1 or (workers > 1 and (device or "cpu") != "cpu"):
        raise ValueError(f"workers must be >= 1, and 1 off the CPU (got {workers} on {device})")
    rng = np.random.default_rng(seed)
    picked = rng.choice(len(labels), min(per_cell, len(labels)), replace=False)
    base, truth = images[picked], torch.as_tensor(np.asarray(labels)[picked])
    measure = _RowMeasure(model, base, truth, tuple(corruptions), tuple(float(s) for s in grid), seed,
                          frost_overlays, device or "cpu")
    info = {"per_cell": len(picked), "seed": seed, **(about or {})}
    # what the values depend on besides the model's weights: a checkpoint made with anything else is refused
    key = {"corruptions": list(corruptions), "grid": [float(s) for s in grid], "picked": picked.tolist(), **info}
    done = _read_checkpoint(checkpoint, key) if checkpoint is not None else {}
    per_row = (len(corruptions) - 1) * len(grid)
    bar = tqdm(total=len(corruptions) * per_row * len(grid), disable=not progress, unit="cell",
               initial=len(done) * per_row)
    todo = [(a, i) for a in corruptions for i in range(len(grid)) if f"{a}|{i}" not in done]

    def keep(a: str, i: int, row: dict[str, list[float]]) -> None:
        done[f"{a}|{i}"] = row
        if checkpoint is not None:
            _write_checkpoint(checkpoint, key, done)
        bar.update(per_row)

    if workers == 1:
        for a, i in todo:
            keep(a, i, measure.row(a, i))
    elif todo:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # spawn: a forked child of a process whose torch started its thread pool can hang
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
                                 initargs=(measure,)) as pool:
            for future in as_completed([pool.submit(_worker_row, a, i) for a, i in todo]):
                keep(*future.result())
    bar.close()
    pairs: dict[tuple[str, str], np.ndarray] = {}
    for a in corruptions:
        for i in range(len(grid)):
            for b, values in done[f"{a}|{i}"].items():
                pairs.setdefault((a, b), np.zeros((len(grid), len(grid))))[i] = values
    return AccuracyTable(tuple(float(s) for s in grid), pairs, info)


def _read_checkpoint(path: str | Path, key: dict) -> dict[str, dict[str, list[float]]]:
    """The finished rows a checkpoint holds (none where there is no file); a checkpoint of other arguments is refused."""
    path = Path(path)
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        rows, made_with = data["rows"], data["key"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a CCC table checkpoint ({e}); remove it to start again") from None
    if made_with != key:
        raise ValueError(f"{path}: a checkpoint of other arguments (model, corruptions, grid, images or seed); "
                         "remove it to start again, or rerun with its arguments")
    return rows


def _write_checkpoint(path: str | Path, key: dict, rows: dict[str, dict[str, list[float]]]) -> None:
    """Keep the finished rows, whole or not at all (written to a temporary file, then renamed)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps({"key": key, "rows": rows})))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m aqr.harness.ccc_table``: measure a model's CCC accuracy table into the data folder; bad input is
    one line on stderr and exit status 2."""
    p = argparse.ArgumentParser(prog="python -m aqr.harness.ccc_table",
                                description="Measure the source model's accuracy on every ordered pair of CCC's "
                                            "corruptions over a severity grid (what --setting ccc walks on).")
    p.add_argument("--model", required=True, help="a model of the presets (e.g. resnet20_trainstats)")
    p.add_argument("--baseline", type=float, default=40.0, help="picks CCC's corruptions for this baseline (default 40)")
    p.add_argument("--corruptions", default=None, help="comma-separated corruptions instead (smoke runs)")
    p.add_argument("--grid-step", type=float, default=0.5, help="severity step of the grid from 0 to 5 (default 0.5)")
    p.add_argument("--per-cell", type=int, default=100, help="images per grid cell (default 100)")
    p.add_argument("--indices", default="0:5000", help="clean test images the cells draw from (default 0:5000, "
                                                       "outside the presets' evaluation pool)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None, help="the data folder (default $AQR_DATA_DIR)")
    p.add_argument("--cifar-c", default="cache/cifar10c", help="the CIFAR-10-C folder the table is written to")
    p.add_argument("--out", default=None, help="the table file (default <cifar-c>/ccc_accuracy/<model>.json)")
    p.add_argument("--device", default=None)
    p.add_argument("--workers", type=int, default=1, help="processes measuring rows at once, one core each (CPU only; "
                                                           "default 1)")
    args = p.parse_args(argv)
    try:
        return _measure(args)
    except (ValueError, OSError) as e:  # no data folder, a missing or unreadable file, a refused checkpoint
        print(f"error: {e}", file=sys.stderr)
        return 2


def _measure(args: argparse.Namespace) -> int:
    """The command's work for its parsed ``args``; ``ValueError`` / ``OSError`` on bad input."""
    from aqr.harness.inputs import load_model
    from aqr.harness.presets import default_data, default_models

    models = default_models(args.data_dir)
    if args.model not in models:
        print(f"error: unknown model {args.model!r}; expected one of {', '.join(models)}", file=sys.stderr)
        return 2
    if not 0 < args.grid_step <= 5 or args.per_cell < 1 or args.workers < 1:
        print("error: --grid-step must be in (0, 5], --per-cell and --workers >= 1", file=sys.stderr)
        return 2
    spec, data = models[args.model], default_data(args.data_dir, args.cifar_c)
    corruptions = (tuple(c.strip() for c in args.corruptions.split(",")) if args.corruptions
                   else ccc_corruptions(args.baseline))
    unknown = [c for c in corruptions if c not in CIFAR_PARAMS.table]
    if unknown or len(corruptions) < 2:
        print(f"error: --corruptions needs two or more known corruptions; unknown: {unknown}", file=sys.stderr)
        return 2
    grid = tuple(float(s) for s in np.arange(0, 5 + 1e-9, args.grid_step))
    images, labels = load_npz_arrays(data.clean)  # type: ignore[arg-type]
    pool = parse_range(args.indices, len(labels), "--indices")
    if pool is not None:
        images, labels = images[pool], labels[pool]
    overlays = load_frost_overlays(data.frost_dir, CIFAR_PARAMS.frost_scale) if "frost" in corruptions else None  # type: ignore[arg-type]
    out = Path(args.out) if args.out else table_path(data, spec)
    checkpoint = out.with_name(out.name + ".partial.json")
    table = measure_table(load_model(spec), images, labels, corruptions, grid, args.per_cell, args.seed,
                          overlays, args.device, progress=True, checkpoint=checkpoint, workers=args.workers,
                          about={"model": spec.name, "indices": args.indices, "grid_step": args.grid_step})
    table.save(out)
    checkpoint.unlink(missing_ok=True)
    print(f"wrote {out}: {len(table.pairs)} pairs x {len(grid)} x {len(grid)} severities", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
