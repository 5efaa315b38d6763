"""Does the fast AQR path cost accuracy? Fast vs exact AQR on ResNet-20 CIFAR-10-C cells.

Protocol of the data folder's README.md: statistics from the clean test images 0-4999, evaluation on
the corrupted images from 5000 on (``--n`` of them), batches of ``--batch-size`` in order. Prints
one row per (corruption, severity) and the mean difference fast - exact in accuracy points.

    python benchmarks/fast_vs_exact.py --cifar-c /path/to/cifar10c [--data-dir DIR] [--n 1000] [--severities 5] \
        [--target-samples 8192,4096] [--variants default native=0 "target_samples=4096,native=0"]

``--variants`` names fast columns by their options (see ``benchmarks/aqr_variants.py``);
``--target-samples`` is the shorthand for ``target_samples=S`` columns.

The CIFAR-10-C folder is what ``aqr corrupt`` writes (or the released arrays); the checkpoint and
the clean test set default to the data folder (``--data-dir`` or ``$AQR_DATA_DIR``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import aqr
from aqr import data, models
from aqr.data import DataDirError, resolve_data_dir
from aqr_variants import parse_variant  # benchmarks/aqr_variants.py, beside this file: the same option syntax

CORRUPTIONS = [
    "gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise", "defocus_blur", "gaussian_blur",
    "motion_blur", "zoom_blur", "glass_blur", "brightness", "contrast", "saturate", "fog", "frost",
    "snow", "elastic_transform", "pixelate", "jpeg_compression", "spatter",
]


def tensors(dataset: torch.utils.data.Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    loader = torch.utils.data.DataLoader(dataset, batch_size=len(dataset))
    return next(iter(loader))


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int) -> float:
    correct = 0
    for xb, yb in zip(x.split(batch), y.split(batch)):
        correct += int((model(xb).argmax(1) == yb).sum())
    return 100.0 * correct / len(y)


def _data_dir(parser: argparse.ArgumentParser, path: Path | str | None) -> Path:
    """The data folder, or a one-line usage error naming --data-dir and AQR_DATA_DIR."""
    try:
        return resolve_data_dir(path)
    except DataDirError as err:
        parser.error(str(err))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cifar-c", type=Path, required=True)
    parser.add_argument("--data-dir", type=Path, default=None, help="data folder (default: $AQR_DATA_DIR)")
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: the data folder's akamaster ResNet-20")
    parser.add_argument("--clean", type=Path, default=None, help="default: the data folder's cifar10_test.npz")
    parser.add_argument("--corruptions", default=",".join(CORRUPTIONS))
    parser.add_argument("--severities", default="5")
    parser.add_argument("--n", type=int, default=1000, help="evaluated images, from index 5000")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--target-samples", default="8192",
                        help="comma-separated target_samples values: one fast column per value")
    parser.add_argument("--variants", nargs="+", help="fast columns by options, e.g. default native=0 (overrides --target-samples)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.checkpoint is None or args.clean is None:
        data_dir = _data_dir(parser, args.data_dir)
        args.checkpoint = args.checkpoint or data_dir / "checkpoints" / "akamaster" / "resnet20-12fca82f.th"
        args.clean = args.clean or data_dir / "cifar10_test.npz"
    if args.threads:
        torch.set_num_threads(args.threads)
    model = models.load("resnet20", checkpoint=args.checkpoint)
    clean_x, _ = tensors(data.load_npz(args.clean))
    stats = aqr.calibrate(model, clean_x[:5000].split(500))
    variants = args.variants or [f"target_samples={v}" for v in args.target_samples.split(",")]
    exact = aqr.AQR(model, stats, mode="exact")
    fast = {v: aqr.AQR(model, stats, **parse_variant(v)) for v in variants}
    sizes = list(fast)  # column labels
    rows = []
    print("| corruption | severity | exact | " + " | ".join(f"fast {s} (diff)" for s in sizes) + " |")
    print("|---|---|---|" + "---|" * len(sizes))
    for corruption in args.corruptions.split(","):
        for severity in (int(s) for s in args.severities.split(",")):
            x, y = tensors(data.load_cifar_c(args.cifar_c, corruption, severity, range(5000, 5000 + args.n)))
            start = time.perf_counter()
            row = {"corruption": corruption, "severity": severity, "exact": accuracy(exact, x, y, args.batch_size)}
            row["exact_s"] = time.perf_counter() - start
            for s, method in fast.items():
                start = time.perf_counter()
                row[f"fast_{s}"] = accuracy(method, x, y, args.batch_size)
                row[f"fast_{s}_s"] = time.perf_counter() - start
            rows.append(row)
            cells = " | ".join(f"{row[f'fast_{s}']:.2f} ({row[f'fast_{s}'] - row['exact']:+.2f})" for s in sizes)
            print(f"| {corruption} | {severity} | {row['exact']:.2f} | {cells} |", flush=True)
    summary = {}
    for s in sizes:
        diffs = [r[f"fast_{s}"] - r["exact"] for r in rows]
        summary[s] = {"mean_diff": sum(diffs) / len(diffs), "mean_abs_diff": sum(map(abs, diffs)) / len(diffs)}
        print(f"\n{s}: mean fast - exact {summary[s]['mean_diff']:+.3f} points; mean |fast - exact| "
              f"{summary[s]['mean_abs_diff']:.3f} points over {len(rows)} cells of {args.n} images "
              f"(one image = {100 / args.n:.2f} points)")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary, "n": args.n}, indent=2))


if __name__ == "__main__":
    main()
