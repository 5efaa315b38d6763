"""A batch-1 service loop with save and resume: streaming AQR (``target="stream"``) adapts across
requests of one image each; its running state is saved mid-stream, and a fresh wrapper that loads it
(as a restarted service would) gives the same outputs, bit for bit, as the run that never stopped.

    python examples/service_loop.py                 # a few seconds on a CPU
    python examples/service_loop.py --images 256    # a longer stream

The model is the zoo's BatchNorm ResNet-20 (CIFAR-10, shipped with aqr); random tensors stand in for
its source images and for the shifted requests.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import aqr


def requests(n: int, seed: int) -> torch.Tensor:
    """``n`` shifted "requests", one image each (low contrast and noise over random images)."""
    g = torch.Generator().manual_seed(seed)
    x = 0.5 * torch.rand(n, 3, 32, 32, generator=g) + 0.25 + 0.1 * torch.randn(n, 3, 32, 32, generator=g)
    return x.clamp(0, 1)


def serve(service: aqr.AQR, images: torch.Tensor) -> torch.Tensor:
    """The service's loop: one request at a time, each answered before the next arrives."""
    with torch.no_grad():
        return torch.cat([service(x.unsqueeze(0)) for x in images])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=64, help="requests in the stream")
    parser.add_argument("--horizon", type=int, default=64, help="images the running target remembers")
    args = parser.parse_args()
    stream = requests(args.images, seed=1)
    half = args.images // 2

    with tempfile.TemporaryDirectory() as tmp:
        stats_path, state_path = Path(tmp) / "resnet20_bn.aqr.safetensors", Path(tmp) / "service_state.pt"
        model = aqr.models.load("resnet20_bn")
        aqr.calibrate(model, torch.rand(256, 3, 32, 32).split(128)).save(stats_path)  # once, offline

        # The uninterrupted service: every request, with the state saved after the first half.
        service = aqr.AQR(model, aqr.SourceStats.load(stats_path), target="stream", horizon=args.horizon)
        first = serve(service, stream[:half])
        torch.save(service.state_dict(), state_path)  # e.g. before a deploy or on SIGTERM
        second = serve(service, stream[half:])

        # A restarted service: a new model object, the same statistics file, the saved state.
        restarted = aqr.AQR(aqr.models.load("resnet20_bn"), aqr.SourceStats.load(stats_path),
                            target="stream", horizon=args.horizon)
        restarted.load_state_dict(torch.load(state_path, weights_only=True))
        resumed = serve(restarted, stream[half:])

        # Without the saved state, a fresh stream starts from the source statistics again.
        cold = aqr.AQR(model, aqr.SourceStats.load(stats_path), target="stream", horizon=args.horizon)
        unresumed = serve(cold, stream[half:])

    same = torch.equal(resumed, second)
    print(f"served {args.images} requests at batch 1; state saved after {half} "
          f"({state_path.name}, running state {service.memory_bytes() / 1024:.0f} KiB)")
    print(f"first half: {len(first)} outputs; second half: {len(second)} outputs")
    print(f"resumed outputs match the uninterrupted run: {same}")
    print(f"a cold restart (no saved state) differs from it: {not torch.equal(unresumed, second)}")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
