"""Does the fast AQR path cost accuracy? Fast vs exact AQR on ResNet-20 CIFAR-10-C cells.

Protocol of the data folder's README.md: statistics from the clean test images 0-4999, evaluation on
the corrupted images from 5000 on (``--n`` of them), batches of ``--batch-size`` in order. Prints
one row per (corruption, severity) and the mean difference fast - exact in accuracy points.

    python benchmarks/fast_vs_exact.py --cifar-c /path/to/cifar10c [--data-dir DIR] [--n 1000] [--severities 5] \
        [--target-samples 8192,4096] [--variants default native=0 "target_samples=4096,native=0"]
    python benchmarks/fast_vs_exact.py --cifar-c DIR --device cuda --models resnet20 resnet20_gn vit_ln \
        --batch-sizes 128 512 --corruptions gaussian_noise,fog,contrast

Besides accuracy, each fast column reports the share of images whose prediction differs from the
exact path's (``disagree``). ``--models`` takes ``resnet20`` (the third-party checkpoint,
``--checkpoint``) and zoo names; every model's statistics come from the clean images 0-4999.

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


def predictions(model: torch.nn.Module, x: torch.Tensor, batch: int, device: str) -> torch.Tensor:
    return torch.cat([model(xb.to(device)).argmax(1).cpu() for xb in x.split(batch)])


def load_model(name: str, checkpoint: Path) -> torch.nn.Module:
    return models.load("resnet20", checkpoint=checkpoint) if name == "resnet20" else models.load(name)


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
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[128])
    parser.add_argument("--models", nargs="+", default=["resnet20"],
                        help="resnet20 (the --checkpoint) and/or zoo names, e.g. resnet20_gn vit_ln")
    parser.add_argument("--device", default="cpu")
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
    clean_x, _ = tensors(data.load_npz(args.clean))
    variants = args.variants or [f"target_samples={v}" for v in args.target_samples.split(",")]
    rows = []
    print("| model | batch | corruption | severity | exact | " + " | ".join(f"fast {v} (diff, disagree %)" for v in variants) + " |")
    print("|---|---|---|---|---|" + "---|" * len(variants))
    for name in args.models:
        model = load_model(name, args.checkpoint).eval().to(args.device)
        stats = aqr.calibrate(model, clean_x[:5000].split(500), device=args.device)
        exact = aqr.AQR(model, stats, mode="exact")
        fast = {v: aqr.AQR(model, stats, **parse_variant(v)) for v in variants}
        for batch in args.batch_sizes:
            for corruption in args.corruptions.split(","):
                for severity in (int(s) for s in args.severities.split(",")):
                    x, y = tensors(data.load_cifar_c(args.cifar_c, corruption, severity, range(5000, 5000 + args.n)))
                    start = time.perf_counter()
                    want = predictions(exact, x, batch, args.device)
                    row = {"model": name, "batch": batch, "corruption": corruption, "severity": severity,
                           "exact": 100.0 * float((want == y).float().mean()), "exact_s": time.perf_counter() - start}
                    for v, method in fast.items():
                        start = time.perf_counter()
                        got = predictions(method, x, batch, args.device)
                        row[f"fast_{v}_s"] = time.perf_counter() - start
                        row[f"fast_{v}"] = 100.0 * float((got == y).float().mean())
                        row[f"disagree_{v}"] = 100.0 * float((got != want).float().mean())
                    rows.append(row)
                    cells = " | ".join(f"{row[f'fast_{v}']:.2f} ({row[f'fast_{v}'] - row['exact']:+.2f}, "
                                       f"{row[f'disagree_{v}']:.2f})" for v in variants)
                    print(f"| {name} | {batch} | {corruption} | {severity} | {row['exact']:.2f} | {cells} |", flush=True)
                    if args.json:
                        args.json.write_text(json.dumps({"rows": rows, "n": args.n, "device": args.device}, indent=2))
    summary = {}
    for name in args.models:
        for batch in args.batch_sizes:
            cell_rows = [r for r in rows if r["model"] == name and r["batch"] == batch]
            for v in variants:
                diffs = [r[f"fast_{v}"] - r["exact"] for r in cell_rows]
                disagree = sum(r[f"disagree_{v}"] for r in cell_rows) / len(cell_rows)
                summary[f"{name} batch {batch} {v}"] = {"mean_diff": sum(diffs) / len(diffs), "disagree": disagree,
                                                        "mean_abs_diff": sum(map(abs, diffs)) / len(diffs)}
                print(f"{name} batch {batch} {v}: mean fast - exact {sum(diffs) / len(diffs):+.3f} points, "
                      f"mean |fast - exact| {sum(map(abs, diffs)) / len(diffs):.3f}, predictions differing "
                      f"{disagree:.2f} % over {len(cell_rows)} cells of {args.n} images")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary, "n": args.n, "device": args.device,
                                         "torch": torch.__version__, "aqr": aqr.__version__}, indent=2))


if __name__ == "__main__":
    main()
