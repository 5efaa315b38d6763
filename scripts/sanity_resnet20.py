"""Sanity check of a generated CIFAR-10-C folder with the third-party akamaster ResNet-20.

Defines the CIFAR ResNet-20 inline (so it does not depend on aqr's model code), checks its clean
accuracy on the lossless test set (published: 91.73 %), then prints a markdown table of accuracy
per corruption and severity on the generated folder.

    PYTHONPATH=src python scripts/sanity_resnet20.py \
        --clean ../shared/data/cifar10_test.npz \
        --checkpoint ../shared/data/checkpoints/akamaster/resnet20-12fca82f.th \
        --cifar-c /work/cache/cifar10c [--out docs/results/cifar10c_sanity.md]
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
import torch.nn.functional as F

from aqr.corruption_params import CORRUPTIONS
from aqr.data import load_cifar_c, load_npz_arrays

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


class BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.pad = planes // 4 if (stride != 1 or in_planes != planes) else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        # option A shortcut: subsample by 2 and zero-pad the new channels (no parameters)
        shortcut = F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, self.pad, self.pad)) if self.pad else x
        return F.relu(out + shortcut)


class ResNet20(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        layers, in_planes = [], 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            blocks = []
            for i in range(3):
                blocks.append(BasicBlock(in_planes, planes, stride if i == 0 else 1))
                in_planes = planes
            layers.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = layers
        self.linear = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        return self.linear(out.mean(dim=(2, 3)))


def load_model(path: str) -> ResNet20:
    ckpt = torch.load(path, weights_only=True, map_location="cpu")
    state = {k.removeprefix("module."): v for k, v in ckpt["state_dict"].items()}
    model = ResNet20()
    model.load_state_dict(state)
    return model.eval()


@torch.inference_mode()
def accuracy(model: nn.Module, images: np.ndarray, labels: np.ndarray, batch: int = 1000) -> float:
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    correct = 0
    for i in range(0, len(images), batch):
        x = torch.from_numpy(np.asarray(images[i : i + batch], dtype=np.float32) / 255.0).permute(0, 3, 1, 2)
        pred = model((x - mean) / std).argmax(1).numpy()
        correct += int((pred == labels[i : i + batch]).sum())
    return 100.0 * correct / len(images)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clean", required=True)
    p.add_argument("--checkpoint", required=True)
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
        cmd = "PYTHONPATH=src python scripts/sanity_resnet20.py " + " ".join(argv if argv is not None else sys.argv[1:])
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
