"""Sanity check of a generated CIFAR-10-C folder with the third-party akamaster ResNet-20.

Loads the CIFAR ResNet-20 with ``aqr.models.load("resnet20", checkpoint=...)``, checks its clean
accuracy on the lossless test set (published: 91.73 %), then prints a markdown table of accuracy
per corruption and severity on the generated folder.

    python benchmarks/cifar10c_sanity.py --cifar-c cache/cifar10c [--data-dir DIR] \
        [--out docs/results/cifar10c_sanity.md]

``--clean`` and ``--checkpoint`` default to the data folder's ``cifar10_test.npz`` and akamaster
ResNet-20 (``--data-dir`` or ``$AQR_DATA_DIR``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from aqr import models
from aqr.data import DataDirError, load_cifar_c, load_npz_arrays, resolve_data_dir, to_float
from aqr.data.corruption_params import CORRUPTIONS


def load_model(path: str) -> nn.Module:
    """The akamaster ResNet-20, taking inputs in [0, 1] (its normalization is inside)."""
    return models.load("resnet20", checkpoint=path)


@torch.inference_mode()
def accuracy(model: nn.Module, images: np.ndarray, labels: np.ndarray, batch: int = 1000) -> float:
    correct = 0
    for i in range(0, len(images), batch):
        pred = model(to_float(np.asarray(images[i : i + batch]))).argmax(1).numpy()
        correct += int((pred == labels[i : i + batch]).sum())
    return 100.0 * correct / len(images)


def _data_dir(parser: argparse.ArgumentParser, path: Path | str | None) -> Path:
    """The data folder, or a one-line usage error naming --data-dir and AQR_DATA_DIR."""
    try:
        return resolve_data_dir(path)
    except DataDirError as err:
        parser.error(str(err))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=None, help="data folder (default: $AQR_DATA_DIR)")
    p.add_argument("--clean", default=None, help="default: the data folder's cifar10_test.npz")
    p.add_argument("--checkpoint", default=None, help="default: the data folder's akamaster ResNet-20")
    p.add_argument("--cifar-c", required=True)
    p.add_argument("--corruptions", default=",".join(CORRUPTIONS))
    p.add_argument("--severities", default="1,2,3,4,5")
    p.add_argument("--limit", type=int, default=None, help="first N test images only (corrupted sets)")
    p.add_argument("--clean-limit", type=int, default=None, help="first N test images only (clean set)")
    p.add_argument("--cache", default=None, help="JSON file of finished accuracies; reruns skip them")
    p.add_argument("--wait", action="store_true", help="wait for each corruption to appear in manifest.json")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = p.parse_args(argv)
    if args.clean is None or args.checkpoint is None:
        data_dir = _data_dir(p, args.data_dir)
        args.clean = args.clean or str(data_dir / "cifar10_test.npz")
        args.checkpoint = args.checkpoint or str(data_dir / "checkpoints" / "akamaster" / "resnet20-12fca82f.th")
    torch.set_num_threads(args.threads)

    model = load_model(args.checkpoint)
    x, y = load_npz_arrays(args.clean)
    cache: dict = json.loads(Path(args.cache).read_text()) if args.cache and Path(args.cache).is_file() else {}

    def cached(key: str, compute) -> float:
        if key not in cache:
            cache[key] = compute()
            if args.cache:
                Path(args.cache).write_text(json.dumps(cache, indent=1))
        return cache[key]

    n_clean = min(args.clean_limit or len(x), len(x))
    clean = cached(f"clean/{n_clean}", lambda: accuracy(model, x[:n_clean], y[:n_clean]))
    print(f"clean accuracy: {clean:.2f} % on {n_clean} images (published 91.73 %)", file=sys.stderr)

    n = min(args.limit or len(x), len(x))
    severities = [int(s) for s in args.severities.split(",")]
    idx = np.arange(n)
    rows = []
    t0 = time.perf_counter()
    for name in args.corruptions.split(","):
        while args.wait and name not in json.loads((Path(args.cifar_c) / "manifest.json").read_text()).get(
            "corruptions", {}
        ):
            time.sleep(20)
        accs = []
        for s in severities:
            ds = load_cifar_c(args.cifar_c, name, s, indices=idx)
            accs.append(cached(f"{name}/{s}/{n}", lambda: accuracy(model, ds.images, ds.labels)))
        rows.append((name, accs))
        print(f"{name}: {' '.join(f'{a:.2f}' for a in accs)} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)

    lines = [
        f"| corruption | {' | '.join(f'sev {s}' for s in severities)} | mean |",
        "|---" * (len(severities) + 2) + "|",
    ]
    for name, accs in rows:
        lines.append(f"| {name} | {' | '.join(f'{a:.2f}' for a in accs)} | {np.mean(accs):.2f} |")
    means = np.mean([a for _, a in rows], axis=0)
    lines.append(f"| **mean** | {' | '.join(f'{a:.2f}' for a in means)} | {means.mean():.2f} |")
    table = "\n".join(lines)
    print(f"clean: {clean:.2f} %\n\n{table}")
    if args.out:
        cmd = "python benchmarks/cifar10c_sanity.py " + " ".join(argv if argv is not None else sys.argv[1:])
        text = (
            "# CIFAR-10-C sanity check: akamaster ResNet-20 accuracy (%)\n\n"
            f"Made by:\n\n```\n{cmd}\n```\n\n"
            f"Clean accuracy on the first {n_clean} lossless test images: **{clean:.2f} %** (published 91.73 %).\n\n"
            f"Accuracy on the corrupted versions of the first {n} test images, per corruption and severity:\n\n"
            f"{table}\n"
        )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
