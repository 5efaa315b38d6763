"""Wrap your own model: calibrate it on source images, keep the statistics next to its checkpoint,
load both later and adapt to shifted images.

Two home-made CNNs: one with BatchNorm, one with GroupNorm and a LayerNorm before its classifier. Each
is trained for a few steps on synthetic "source" images, saved (weights and statistics side by side),
rebuilt from the files as a service would, and run on a shifted test set with and without AQR.

    python examples/wrap_your_model.py            # a few seconds on a CPU; files in a temporary folder
    python examples/wrap_your_model.py --out DIR  # keep the checkpoints and statistics
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch import nn

import aqr

CLASSES = 4


def make_model(norm: str) -> nn.Module:
    """A small CNN for 3x16x16 images; ``norm`` is "bn" (BatchNorm) or "gn" (GroupNorm, then a LayerNorm)."""
    def block(c_in: int, c_out: int) -> list[nn.Module]:
        layer = nn.BatchNorm2d(c_out) if norm == "bn" else nn.GroupNorm(4, c_out)
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), layer, nn.ReLU(), nn.MaxPool2d(2)]
    head = [nn.LayerNorm(16)] if norm == "gn" else []
    return nn.Sequential(*block(3, 8), *block(8, 16), nn.AdaptiveAvgPool2d(1), nn.Flatten(), *head,
                         nn.Linear(16, CLASSES))


def images(n: int, seed: int, shifted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic images in [0, 1]: one smooth colour pattern per class plus noise; ``shifted`` lowers the
    contrast and adds strong noise (a stand-in for fog, blur, sensor noise...)."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.nn.functional.interpolate(torch.rand(CLASSES, 3, 4, 4, generator=torch.Generator().manual_seed(0)),
                                                size=16, mode="bilinear", align_corners=False)
    labels = torch.randint(0, CLASSES, (n,), generator=g)
    x = templates[labels] + 0.15 * torch.randn(n, 3, 16, 16, generator=g)
    if shifted:
        x = 0.4 * x + 0.3 + 0.25 * torch.randn(n, 3, 16, 16, generator=g)
    return x.clamp(0, 1), labels


def train(model: nn.Module, steps: int) -> nn.Module:
    x, y = images(64 * steps, seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for xb, yb in zip(x.split(64), y.split(64)):
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    return model.eval()


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return 100.0 * (logits.argmax(1) == labels).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for the checkpoints and statistics (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=60, help="training steps per model")
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        source, _ = images(512, seed=2)       # clean images from the training distribution, labels unused
        test_x, test_y = images(512, seed=3, shifted=True)
        for norm in ("bn", "gn"):
            # 1. Once, where the model is trained: calibrate and store the statistics beside the weights.
            model = train(make_model(norm), args.steps)
            stats = aqr.calibrate(model, source.split(128), compile=False)
            torch.save(model.state_dict(), out / f"cnn_{norm}.pt")
            stats.save(out / f"cnn_{norm}.aqr.safetensors")

            # 2. Later, where the model serves: rebuild it, load both files, wrap it.
            served = make_model(norm)
            served.load_state_dict(torch.load(out / f"cnn_{norm}.pt", weights_only=True))
            served.eval()
            loaded = aqr.SourceStats.load(out / f"cnn_{norm}.aqr.safetensors")  # checks it fits this model
            adapted = aqr.AQR(served, loaded)

            with torch.no_grad():
                plain = torch.cat([served(x) for x in test_x.split(128)])
                recalibrated = torch.cat([adapted(x) for x in test_x.split(128)])
                reference = aqr.AQR(model, stats)(test_x[:128])  # the statistics before they were saved
            same = torch.equal(recalibrated[:128], reference)
            print(f"{norm}: {len(adapted.layer_names)} layers recalibrated ({', '.join(adapted.layer_names)})")
            print(f"{norm}: shifted test accuracy {accuracy(plain, test_y):.1f} % without AQR, "
                  f"{accuracy(recalibrated, test_y):.1f} % with AQR")
            print(f"{norm}: saved and loaded statistics give the same outputs: {same}")
            if not same:
                raise SystemExit(1)


if __name__ == "__main__":
    main()
