"""Per-batch cost of each adaptation method, as a ratio to the unadapted forward pass.

Everything is measured in one process, side by side: for each model and batch size, every method
runs ``--warmup`` batches (torch.compile happens there), then ``--repeats`` rounds time each method
once, back to back. The table reports the median wall time per batch and the median over rounds of
its ratio to the plain forward of the same round (drift of a shared machine cancels within a round). A second part measures AQR's calibration on ``--calib-images`` source images: wall
time against one plain forward pass over the same images, and peak resident memory of a fresh
process doing only that calibration against one doing only the forward pass.

    python benchmarks/speed.py                     # all models, batch 128 and 512
    python benchmarks/speed.py --quick             # ResNet-20, batch 128, fewer repeats
    python benchmarks/speed.py --json out.json     # also write the numbers

Timings need a quiet machine: other processes inflate every row, but ratios within one run stay
comparable.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

import aqr
from aqr import methods, models
from aqr.data import load_npz_arrays, to_float

# the data folder ($AQR_DATA_DIR) is optional here: random weights and images cost the same
DATA = Path(os.environ["AQR_DATA_DIR"]) if os.environ.get("AQR_DATA_DIR") else None
AKAMASTER = DATA / "checkpoints" / "akamaster" / "resnet20-12fca82f.th" if DATA else None
MODELS = {
    "resnet20-bn": lambda: models.load("resnet20", checkpoint=AKAMASTER) if AKAMASTER and AKAMASTER.is_file() else models.create("resnet20"),
    # the zoo's trained models when present (random weights give the same cost)
    "resnet20-gn": lambda: models.load("resnet20_gn") if "resnet20_gn" in models.zoo() else models.create("resnet20", norm="gn"),
    "vit": lambda: models.load("vit_ln") if "vit_ln" in models.zoo() else models.create("vit"),
}
METHODS = ["source", "ttn", "aqr", "aqr-torch", "aqr-exact", "tent", "sar"]  # aqr-torch: native=False


def images(n: int, seed: int = 0) -> torch.Tensor:
    """Source-like images: the clean CIFAR-10 test set when available, else uniform noise."""
    path = DATA / "cifar10_test.npz" if DATA else None
    if path and path.is_file():
        return to_float(load_npz_arrays(path)[0][:n])
    return torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def run_once(fn, x: torch.Tensor, method: str) -> float:
    """Wall time of one batch (gradients on for the methods that take a backward pass)."""
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    with torch.no_grad() if method not in ("tent", "sar") else torch.enable_grad():
        start = time.perf_counter()
        fn(x)
        sync()  # GPU work is asynchronous: a batch is done when its kernels are
    return time.perf_counter() - start


def build(method: str, model: torch.nn.Module, stats: aqr.SourceStats, batch: int):
    if method == "aqr":
        return methods.create("aqr", model, stats=stats)
    if method == "aqr-exact":
        return methods.create("aqr", model, stats=stats, mode="exact")
    if method == "aqr-torch":  # the fast path without aqr's C kernels (as on a machine with no compiler)
        return methods.create("aqr", model, stats=stats, native=False)
    if method in ("tent", "sar"):
        arch = "vit" if "vit" in type(model.model).__name__.lower() else "cnn"
        return methods.create(method, model, arch=arch, batch_size=batch)
    return methods.create(method, model)


def per_batch(args: argparse.Namespace) -> list[dict]:
    """Per model and batch size: every method warmed up, then ``repeats`` rounds that time each
    method once, back to back. A method's ratio is the median over rounds of its time over the
    plain forward's time in the same round, so the machine's drift cancels within a round."""
    rows = []
    source = images(args.calib_images if not args.quick else 1000)
    for name in args.models:
        model = MODELS[name]().eval().to(args.device)
        stats = aqr.calibrate(model, source.split(500))
        for batch in args.batch_sizes:
            x = images(batch, seed=1)
            x = (x + 0.1 * torch.randn(x.shape, generator=torch.Generator().manual_seed(2))).clamp(0, 1)
            x = x.to(args.device)
            runners = {"source": build("source", model, stats, batch)}  # the baseline of every ratio
            for method in args.methods:
                try:
                    runners[method] = build(method, model, stats, batch)
                except methods.NotApplicable:
                    rows.append({"model": name, "batch": batch, "method": method, "seconds": None, "ratio": None})
            for method, runner in runners.items():
                for _ in range(args.warmup):  # torch.compile happens here
                    run_once(runner, x, method)
            times: dict[str, list[float]] = {method: [] for method in runners}
            for _ in range(args.repeats):
                for method, runner in runners.items():
                    times[method].append(run_once(runner, x, method))
            for method in runners:
                if method not in args.methods:
                    continue
                ratio = statistics.median(t / base for t, base in zip(times[method], times["source"]))
                seconds = statistics.median(times[method])
                rows.append({"model": name, "batch": batch, "method": method, "seconds": seconds, "ratio": ratio})
                print(f"{name:12s} batch {batch:4d} {method:10s} {seconds * 1e3:9.1f} ms  x{ratio:.2f}", flush=True)
    return rows


def _peak_rss_child(task: str, n: int, queue: mp.Queue) -> None:
    torch.set_num_threads(int(os.environ.get("AQR_BENCH_THREADS", torch.get_num_threads())))
    model = MODELS["resnet20-bn"]().eval()
    x = images(n)
    start = time.perf_counter()
    if task == "forward":
        with torch.no_grad():
            for xb in x.split(500):
                model(xb)
    else:
        aqr.calibrate(model, x.split(500))
    seconds = time.perf_counter() - start
    queue.put({"seconds": seconds, "peak_rss_mb": _peak_rss_mb()})


def _peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM belongs to the address space made by exec, whereas
    ``ru_maxrss`` keeps the peak of the parent it was forked from (the benchmark process itself)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def calibration(args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    out = {}
    for task in ("forward", "calibrate"):
        queue = ctx.Queue()
        proc = ctx.Process(target=_peak_rss_child, args=(task, args.calib_images, queue))
        proc.start()
        out[task] = queue.get()
        proc.join()
    out["time_ratio"] = out["calibrate"]["seconds"] / out["forward"]["seconds"]
    print(f"calibration on {args.calib_images} images (ResNet-20): {out['calibrate']['seconds']:.1f} s vs forward "
          f"{out['forward']['seconds']:.1f} s (x{out['time_ratio']:.2f}); peak RSS {out['calibrate']['peak_rss_mb']:.0f} MB "
          f"vs {out['forward']['peak_rss_mb']:.0f} MB", flush=True)
    return out


def markdown(rows: list[dict]) -> str:
    lines = ["| model | batch | " + " | ".join(METHODS) + " |", "|---|---|" + "---|" * len(METHODS)]
    keys = sorted({(r["model"], r["batch"]) for r in rows}, key=lambda k: (list(MODELS).index(k[0]), k[1]))
    for model, batch in keys:
        cells = []
        for method in METHODS:
            r = next((r for r in rows if (r["model"], r["batch"], r["method"]) == (model, batch, method)), None)
            if r is None:
                cells.append("")
            elif r["seconds"] is None:
                cells.append("n/a")
            else:
                cells.append(f"{r['seconds'] * 1e3:.0f} ms (x{r['ratio']:.2f})")
        lines.append(f"| {model} | {batch} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[128, 512])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--calib-images", type=int, default=10_000)
    parser.add_argument("--skip-calibration", action="store_true")
    parser.add_argument("--quick", action="store_true", help="ResNet-20, batch 128, 3 repeats, 2,000 calibration images")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    parser.add_argument("--device", default="cpu", help="cpu or cuda; on a GPU the calibration part (peak RSS) is skipped")
    args = parser.parse_args()
    if args.device != "cpu":
        args.skip_calibration = True
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["AQR_BENCH_THREADS"] = str(args.threads)
    if args.quick:
        args.models, args.batch_sizes, args.repeats, args.warmup, args.calib_images = ["resnet20-bn"], [128], 3, 2, 2000
    where = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else ""
    print(f"torch {torch.__version__}, aqr {aqr.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, python {sys.version.split()[0]}, device {args.device} {where}", flush=True)
    rows = per_batch(args)
    result = {"rows": rows, "torch": torch.__version__, "aqr": aqr.__version__, "threads": torch.get_num_threads(),
              "device": args.device, "device_name": where}
    if not args.skip_calibration:
        result["calibration"] = calibration(args)
    print()
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
