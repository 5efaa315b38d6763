"""MSE of AQR vs an affine mean/std match on a 2-mode source under an exponential corruption.

Run: python benchmarks/core_mse.py  (seconds, CPU). Prints one row per (n_source, n_target).
"""

from __future__ import annotations

import argparse

import torch

import aqr


def bimodal(n: int, g: torch.Generator) -> torch.Tensor:
    """35 % N(-1.5, 0.4^2) + 65 % N(1, 0.7^2), one channel."""
    mode = torch.rand(1, n, generator=g) < 0.35
    return torch.where(mode, torch.randn(1, n, generator=g) * 0.4 - 1.5, torch.randn(1, n, generator=g) * 0.7 + 1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(args.seed)
    print("| n_source | n_target | affine mean/std MSE | AQR K=11 MSE | AQR K=101 MSE |")
    print("|---|---|---|---|---|")
    for n_s, n_t in [(10_000, 10_000), (100_000, 10_000), (100_000, 100_000)]:
        source, clean = bimodal(n_s, g), bimodal(n_t, g)
        shifted = torch.exp(clean)  # strictly increasing, non-affine
        affine = (shifted - shifted.mean()) / shifted.std() * source.std() + source.mean()
        cells = [float(((affine - clean) ** 2).mean())]
        for k in (11, 101):
            mapped = aqr.quantile_map(shifted, aqr.channel_quantiles(source, k), tail="standard")
            cells.append(float(((mapped - clean) ** 2).mean()))
        print(f"| {n_s} | {n_t} | " + " | ".join(f"{c:.5f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
