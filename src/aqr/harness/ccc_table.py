"""The source model's accuracy table that CCC streams walk on (:mod:`aqr.harness.ccc`), and its command:

    python -m aqr.harness.ccc_table --model resnet20_trainstats --baseline 40

measures the model's accuracy on every ordered pair of CCC's corruptions for that baseline over a grid of
severities (0 to 5 in steps of 0.5), 100 clean test images a cell drawn from ``0:5000`` (outside the
presets' evaluation pool), and writes it where CCC cells read it (``<cifar-c>/ccc_accuracy/<model>.json``).
"""

from __future__ import annotations

import argparse
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


def measure_table(model: nn.Module, images: np.ndarray, labels: np.ndarray, corruptions: Sequence[str],
                  grid: Sequence[float] = SEVERITY_GRID, per_cell: int = 100, seed: int = 0,
                  frost_overlays: Sequence[np.ndarray] | None = None, device: str | None = None,
                  progress: bool = False, about: dict | None = None) -> AccuracyTable:
    """The source model's accuracy (%) on every ordered pair of ``corruptions`` at every pair of ``grid``
    severities, each cell on the same ``per_cell`` images (drawn with ``seed``), each image corrupted with its
    own generator. The images a first corruption makes at a severity are reused for every second one."""
    from tqdm.auto import tqdm

    rng = np.random.default_rng(seed)
    picked = rng.choice(len(labels), min(per_cell, len(labels)), replace=False)
    base, truth = images[picked], torch.as_tensor(np.asarray(labels)[picked])
    model = model.to(device or "cpu").eval()

    def accuracy(batch: np.ndarray) -> float:
        with torch.no_grad():
            predicted = model(to_float(batch).to(device or "cpu")).argmax(1).cpu()
        return 100.0 * float((predicted == truth).float().mean())

    def corrupted(batch: np.ndarray, name: str, severity: float, key: list[int]) -> np.ndarray:
        if severity == 0:
            return batch
        return np.stack([corrupt(img, name, float(severity), np.random.default_rng(np.random.SeedSequence(key + [k])),
                                 frost_overlays=frost_overlays) for k, img in enumerate(batch)])

    crc = {name: zlib.crc32(name.encode()) for name in corruptions}
    pairs: dict[tuple[str, str], np.ndarray] = {}
    bar = tqdm(total=len(corruptions) * (len(corruptions) - 1) * len(grid) ** 2, disable=not progress, unit="cell")
    for a in corruptions:
        for i, s1 in enumerate(grid):
            first = corrupted(base, a, s1, [seed, 3, crc[a], i])
            for b in corruptions:
                if b == a:
                    continue
                table = pairs.setdefault((a, b), np.zeros((len(grid), len(grid))))
                for j, s2 in enumerate(grid):
                    table[i, j] = accuracy(corrupted(first, b, s2, [seed, 4, crc[a], crc[b], i, j]))
                    bar.update(1)
    bar.close()
    info = {"per_cell": len(picked), "seed": seed, **(about or {})}
    return AccuracyTable(tuple(float(s) for s in grid), pairs, info)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m aqr.harness.ccc_table``: measure a model's CCC accuracy table into the data folder."""
    from aqr.harness.inputs import load_model
    from aqr.harness.presets import default_data, default_models

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
    args = p.parse_args(argv)
    models = default_models(args.data_dir)
    if args.model not in models:
        print(f"error: unknown model {args.model!r}; expected one of {', '.join(models)}", file=sys.stderr)
        return 2
    if not 0 < args.grid_step <= 5 or args.per_cell < 1:
        print("error: --grid-step must be in (0, 5] and --per-cell >= 1", file=sys.stderr)
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
    table = measure_table(load_model(spec), images, labels, corruptions, grid, args.per_cell, args.seed, overlays,
                          args.device, progress=True,
                          about={"model": spec.name, "indices": args.indices, "grid_step": args.grid_step})
    out = Path(args.out) if args.out else table_path(data, spec)
    table.save(out)
    print(f"wrote {out}: {len(table.pairs)} pairs x {len(grid)} x {len(grid)} severities", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
