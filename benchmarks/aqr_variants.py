"""AQR's per-batch cost under different options, as ratios to the plain forward, timed round-robin.

On a shared or throttled machine the speed of the whole box drifts by 10-20 % over a minute, so
timing each variant in its own block (as ``speed.py`` does) can rank two close variants wrongly.
Here every round times the plain forward and each variant once, back to back, and the ratio is
taken within the round; the table reports the median over rounds.

    python benchmarks/aqr_variants.py --variants default target_samples=4096 grid=256 \\
        "target_samples=2048,grid=256" --rounds 25
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import aqr
import speed  # benchmarks/speed.py, beside this file: the same models and images


def parse_variant(text: str) -> dict[str, object]:
    """``"target_samples=4096,grid=256"`` -> options of :class:`aqr.AQRConfig`; ``"default"`` -> {}."""
    if text == "default":
        return {}
    options: dict[str, object] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        options[key] = int(value) if value.lstrip("-").isdigit() else value
    return options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet20-bn", choices=list(speed.MODELS))
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--variants", nargs="+", default=["default"])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = speed.MODELS[args.model]().eval()
    stats = aqr.calibrate(model, speed.images(2000).split(500))
    x = speed.images(args.batch, seed=1)
    x = (x + 0.1 * torch.randn(x.shape, generator=torch.Generator().manual_seed(2))).clamp(0, 1)
    runners = {"plain": model} | {v: aqr.AQR(model, stats, **parse_variant(v)) for v in args.variants}
    times: dict[str, list[float]] = {name: [] for name in runners}
    with torch.no_grad():
        for _ in range(args.warmup):
            for run in runners.values():
                run(x)
        for _ in range(args.rounds):
            for name, run in runners.items():
                start = time.perf_counter()
                run(x)
                times[name].append(time.perf_counter() - start)
    print(f"{args.model}, batch {args.batch}, {torch.get_num_threads()} threads, {args.rounds} rounds")
    print("| variant | median ms | median ratio to plain (per round) |\n|---|---:|---:|")
    for name, ts in times.items():
        ratios = [t / p for t, p in zip(ts, times["plain"])]
        print(f"| {name} | {statistics.median(ts) * 1e3:.1f} | x{statistics.median(ratios):.2f} |")


if __name__ == "__main__":
    main()
