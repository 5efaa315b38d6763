"""Compare test-time adaptation methods on your own data: a model, clean source images, and a shifted
test set with labels, all plain tensors. Every method is built by name with ``aqr.methods.create``
(``aqr.methods.available()`` lists them) around a private copy of the model, which stays untouched.

    python examples/compare_methods.py                          # a few seconds on a CPU
    python examples/compare_methods.py --methods source,ttn,aqr --batch-size 16

The model here is a small BatchNorm CNN trained for a few steps on synthetic images; replace
``your_data()`` with your own model and tensors (float inputs as your model takes them).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import aqr

# name -> options for aqr.methods.create; "online" adapts across batches, "episodic" restarts every batch
METHODS = {
    "source": {},
    "ttn": {},
    "tent": {"protocol": "online"},
    "bn-ema": {"protocol": "online"},
    "lame": {},
    "aqr": {},
    "aqr-stream": {"target": "stream", "protocol": "online"},  # the same method, another option set (see build())
}


def your_data(steps: int = 60) -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A trained model, clean source images, shifted test images and their labels (synthetic here)."""
    g = torch.Generator().manual_seed(0)
    templates = nn.functional.interpolate(torch.rand(4, 3, 4, 4, generator=g), size=16, mode="bilinear")

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.randint(0, 4, (n,), generator=g)
        return (templates[labels] + 0.15 * torch.randn(n, 3, 16, 16, generator=g)).clamp(0, 1), labels

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        x, y = draw(64)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    source, _ = draw(512)
    test, labels = draw(512)
    test = (0.4 * test + 0.3 + 0.25 * torch.randn(test.shape, generator=g)).clamp(0, 1)  # the shift
    return model, source, test, labels


def build(name: str, model: nn.Module, stats: aqr.SourceStats) -> nn.Module:
    options = dict(METHODS[name])
    method = "aqr" if name.startswith("aqr") else name
    needs_stats = aqr.methods.declaration(method).needs.stats
    return aqr.methods.create(method, model, stats=stats if needs_stats else None, **options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of: {', '.join(METHODS)}")
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()
    names = args.methods.split(",")
    unknown = [n for n in names if n not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; this example knows {list(METHODS)}")

    model, source, test, labels = your_data()
    stats = aqr.calibrate(model, source.split(128), compile=False)  # for the methods that need statistics
    print(f"{'method':<12} {'accuracy':>9} {'ms/batch':>9}")
    for name in names:
        method = build(name, model, stats)
        correct, start = 0, time.perf_counter()
        for x, y in zip(test.split(args.batch_size), labels.split(args.batch_size)):
            correct += int((method(x).argmax(1) == y).sum())  # a method takes care of its own gradients
        ms = 1000 * (time.perf_counter() - start) / len(test.split(args.batch_size))
        print(f"{name:<12} {100 * correct / len(test):>8.1f}% {ms:>9.2f}")


if __name__ == "__main__":
    main()
