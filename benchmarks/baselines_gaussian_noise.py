"""Check the baselines on a real third-party model: akamaster ResNet-20 on CIFAR-10 + Gaussian noise.

Protocol (see the data folder's README.md): test images 5000-9999 of the lossless CIFAR-10 test set,
corrupted like CIFAR-10-C gaussian_noise severity 5 (x/255 + N(0, 0.10), clipped to [0, 1], stored
as uint8 by truncation like the released arrays; fixed seed), batches of 128 in order, every method
episodic. AQR calibrates on the clean images 0-4999.

The model is ``aqr.models.load("resnet20", checkpoint=...)`` (He et al. 2016 CIFAR variant in the
layout of github.com/akamaster/pytorch_resnet_cifar10, BSD-2-Clause).

    python benchmarks/baselines_gaussian_noise.py [--data-dir DIR] [--n 5000]   # DIR default: $AQR_DATA_DIR
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import aqr
from aqr import models
from aqr.data import DataDirError, resolve_data_dir, to_float
from aqr.methods import NotApplicable, create, declaration, softmax_entropy

def load_model(path: Path) -> nn.Module:
    """ResNet-20 with the akamaster weights, taking inputs in [0, 1] (normalization inside)."""
    return models.load("resnet20", checkpoint=path)


def gaussian_noise_sev5(x_uint8: np.ndarray, seed: int) -> np.ndarray:
    """CIFAR-10-C gaussian_noise at severity 5 (sigma 0.10), quantised to uint8."""
    rng = np.random.default_rng(seed)
    x = x_uint8.astype(np.float64) / 255.0
    x = np.clip(x + rng.normal(scale=0.10, size=x.shape), 0.0, 1.0) * 255.0
    return x.astype(np.uint8)


def predict(method: nn.Module, x: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, float]:
    """Predicted classes for ``x`` fed in order in batches, and the mean softmax entropy."""
    preds, entropy = [], 0.0
    for i in range(0, len(x), batch_size):
        logits = method(x[i : i + batch_size])
        preds.append(logits.argmax(1))
        entropy += softmax_entropy(logits).sum().item()
    return torch.cat(preds), entropy / len(x)


def _data_dir(parser: argparse.ArgumentParser, path: Path | str | None) -> Path:
    """The data folder, or a one-line usage error naming --data-dir and AQR_DATA_DIR."""
    try:
        return resolve_data_dir(path)
    except DataDirError as err:
        parser.error(str(err))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=None, help="data folder (default: $AQR_DATA_DIR)")
    parser.add_argument("--n", type=int, default=5000, help="test images used, from index 5000")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="noise seed")
    parser.add_argument("--methods", default="source,ttn,tent,sar,aqr")
    parser.add_argument("--protocol", default="episodic", choices=("episodic", "online"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    data_dir = _data_dir(parser, args.data_dir)
    data = np.load(data_dir / "cifar10_test.npz")
    model = load_model(data_dir / "checkpoints/akamaster/resnet20-12fca82f.th")
    lo, hi = 5000, 5000 + args.n
    y = torch.from_numpy(data["y"][lo:hi]).long()
    x_clean = to_float(data["x"][lo:hi])
    x_noisy = to_float(gaussian_noise_sev5(data["x"][lo:hi], args.seed))

    t0 = time.perf_counter()
    clean_acc = 100.0 * (predict(create("source", model), x_clean, args.batch_size)[0] == y).float().mean().item()
    print(f"clean source accuracy (images {lo}-{hi - 1}): {clean_acc:.2f}%  [{time.perf_counter() - t0:.1f}s]")
    print(f"gaussian_noise sev 5, {args.n} images, batch {args.batch_size}, {args.protocol}:")

    ttn_preds = None
    for name in args.methods.split(","):
        options: dict = {"protocol": args.protocol}
        t0 = time.perf_counter()
        if declaration(name).needs.stats is not None:
            clean_src = to_float(data["x"][:5000])
            options["stats"] = aqr.calibrate(model, [clean_src[i : i + 500] for i in range(0, 5000, 500)])
            print(f"  ({name} calibration on clean 0-4999: {time.perf_counter() - t0:.1f}s)")
            t0 = time.perf_counter()
        try:
            method = create(name, model, **options)
        except NotApplicable as err:
            print(f"  {name:6s}  n/a ({err})")
            continue
        preds, entropy = predict(method, x_noisy, args.batch_size)
        seconds = time.perf_counter() - t0
        acc = 100.0 * (preds == y).float().mean().item()
        extra = ""
        if name == "ttn":
            ttn_preds = preds
        elif ttn_preds is not None:
            extra += f"  differs from TTN on {(preds != ttn_preds).sum().item()} images"
        if hasattr(method, "recoveries"):
            extra += f"  recoveries={method.recoveries}"
        print(f"  {name:6s} {acc:6.2f}%  {seconds:6.1f}s  mean entropy {entropy:.4f}{extra}", flush=True)


if __name__ == "__main__":
    main()
