"""Does the fast AQR path cost accuracy? Fast vs exact AQR on ResNet-20 CIFAR-10-C cells.

Protocol of ../shared/data/README.md: statistics from the clean test images 0-4999, evaluation on
the corrupted images from 5000 on (``--n`` of them), batches of ``--batch-size`` in order. Prints
one row per (corruption, severity) and the mean difference fast - exact in accuracy points.

    python benchmarks/fast_vs_exact.py --cifar-c /path/to/cifar10c [--n 1000] [--severities 5]

The CIFAR-10-C folder is what ``aqr corrupt`` writes (or the released arrays).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

import aqr
from aqr import data, models

SHARED = Path(os.environ.get("AQR_SHARED_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data"))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cifar-c", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path, default=SHARED / "checkpoints" / "akamaster" / "resnet20-12fca82f.th")
    parser.add_argument("--clean", type=Path, default=SHARED / "cifar10_test.npz")
    parser.add_argument("--corruptions", default=",".join(CORRUPTIONS))
    parser.add_argument("--severities", default="5")
    parser.add_argument("--n", type=int, default=1000, help="evaluated images, from index 5000")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = models.load("resnet20", checkpoint=args.checkpoint)
    clean_x, _ = tensors(data.load_npz(args.clean))
    stats = aqr.calibrate(model, clean_x[:5000].split(500))
    fast, exact = aqr.AQR(model, stats), aqr.AQR(model, stats, mode="exact")
    rows = []
    print("| corruption | severity | exact | fast | fast - exact |\n|---|---|---|---|---|")
    for corruption in args.corruptions.split(","):
        for severity in (int(s) for s in args.severities.split(",")):
            x, y = tensors(data.load_cifar_c(args.cifar_c, corruption, severity, range(5000, 5000 + args.n)))
            start = time.perf_counter()
            acc_exact = accuracy(exact, x, y, args.batch_size)
            mid = time.perf_counter()
            acc_fast = accuracy(fast, x, y, args.batch_size)
            end = time.perf_counter()
            rows.append({"corruption": corruption, "severity": severity, "exact": acc_exact, "fast": acc_fast,
                         "exact_s": mid - start, "fast_s": end - mid})
            print(f"| {corruption} | {severity} | {acc_exact:.2f} | {acc_fast:.2f} | {acc_fast - acc_exact:+.2f} |", flush=True)
    mean = sum(r["fast"] - r["exact"] for r in rows) / len(rows)
    mean_abs = sum(abs(r["fast"] - r["exact"]) for r in rows) / len(rows)
    print(f"\nmean fast - exact: {mean:+.3f} points; mean |fast - exact|: {mean_abs:.3f} points over {len(rows)} cells "
          f"of {args.n} images (one image = {100 / args.n:.2f} points)")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "mean_diff": mean, "mean_abs_diff": mean_abs, "n": args.n}, indent=2))


if __name__ == "__main__":
    main()
