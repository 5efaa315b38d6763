"""CPU cost of AQR's modes against the plain model, measured apart from ``benchmarks/speed.py``.

A second harness, written to miss what ``speed.py`` might: the baseline is the bare model called under
``torch.no_grad()`` (no method wrapper around it), the statistics come from 2,000 clean test images,
the images fed are Gaussian noise at severity 5 (CIFAR-10-C's recipe, :func:`aqr.data.corruptions.corrupt`),
and every mode sees the same images in batches of its size. Each round times every mode once, back to
back (round-robin), over ``--images`` images (at least ``--min-batches`` batches); a mode's ratio is the
median over the rounds of its time over the plain forward's time in the same round.

Rows (``--rows``, ``mode:batch``): ``batch`` is per-batch AQR (``aqr.AQR(model, stats)``), ``stream``
streaming AQR (``target="stream"``), ``robust`` its class-balanced form (``target="robust"``), ``mixed``
its form for streams that mix domains (``target="mixed"``; on these images of one corruption), each
after ``--warmup`` images that take the stateful modes past their warm-up (the own-batch share of
``robust`` needs 256 predictions). ``--memory`` also measures each mode's peak of tensor memory allocated
during one forward pass over what was allocated before it (torch's profiler, CPU allocator), against the
plain forward's.

    AQR_DATA_DIR=... python benchmarks/cost_check.py --threads 1
    AQR_DATA_DIR=... python benchmarks/cost_check.py --threads 2 --rows batch:128
    AQR_DATA_DIR=... python benchmarks/cost_check.py --memory --rounds 1

``--runs L`` orders the images in runs of ``L`` images of one true class (the classes' order drawn
at random), a class-correlated stream: there ``robust`` merges its groups, which it leaves out on the
default i.i.d. order (its own-batch share open, the groups weigh nothing).

``--lookups avx2 avx512`` runs every AQR row once with each of the C kernels' table lookups (the
kernels otherwise take the one they timed faster when they loaded; both give the same bits), side by
side in the same rounds, as rows named ``mode/lookup``:

    AQR_DATA_DIR=... python benchmarks/cost_check.py --rows batch:128 stream:16 --lookups avx2 avx512

``--channels-last`` feeds every row, the plain forward included, twice in each round: once the images
as they are (contiguous NCHW) and once made ``torch.channels_last`` (what a permuted NHWC array gives;
the model itself is left as it is), as rows named ``mode [channels_last]``, each layout's ratios to
the plain forward on the same layout:

    AQR_DATA_DIR=... python benchmarks/cost_check.py --channels-last --rounds 3

The CPU clock (``--clock cpu``, the default) counts the process's CPU time, which other jobs on a
shared machine inflate much less than the wall time; with several threads, threads that spin
waiting for each other count too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import aqr
from aqr import models
from aqr.data import load_npz_arrays, to_float
from aqr.data.corruptions import corrupt, image_rng

DEFAULT_ROWS = ["stream:1", "stream:16", "robust:16", "stream:64", "robust:64", "batch:128"]
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def noisy_images(clean: np.ndarray, severity: int = 5, seed: int = 0) -> torch.Tensor:
    """``clean`` (N, 32, 32, 3) uint8 with CIFAR-10-C's Gaussian noise at ``severity``, as float (N, 3, 32, 32)."""
    out = np.stack([corrupt(img, "gaussian_noise", severity, image_rng(seed, "gaussian_noise", severity, i))
                    for i, img in enumerate(clean)])
    return to_float(out)


def build(mode: str, model: torch.nn.Module, stats: aqr.SourceStats):
    """The callable of one mode (gradients off)."""
    if mode == "plain":
        def plain(x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                return model(x)
        return plain
    target = {"batch": "batch", "stream": "stream", "robust": "robust", "mixed": "mixed"}[mode]
    return aqr.AQR(model, stats, target=target)


def class_runs(labels: np.ndarray, n: int, length: int, seed: int = 0) -> np.ndarray:
    """Indices of ``n`` of the images with ``labels``, in runs of ``length`` images of one class (each run's
    class drawn at random among those with images left), each class's images in their own order."""
    rng = np.random.default_rng(seed)
    left = {int(c): list(np.flatnonzero(labels == c)) for c in np.unique(labels)}
    order: list[int] = []
    while len(order) < n:
        classes = [c for c, idx in left.items() if idx]
        if not classes:
            raise ValueError(f"--runs: only {len(order)} images for {n}")
        c = classes[int(rng.integers(len(classes)))]
        order += left[c][:length]
        left[c] = left[c][length:]
    return np.asarray(order[:n])


def feed(fn, x: torch.Tensor, batch: int) -> None:
    for i in range(0, len(x), batch):
        fn(x[i : i + batch])


def peak_bytes(fn, x: torch.Tensor) -> int:
    """Peak tensor memory allocated during ``fn(x)`` over what was allocated before it (CPU allocator)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(x)
    # each op's own allocations less its own frees, and the frees between ops ("[memory]"), in time order
    changes = sorted((e.time_range.start, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
                     for e in prof.events())
    live = peak = 0
    for _, change in changes:
        live += change
        peak = max(peak, live)
    return peak


LOOKUPS = ("avx2", "avx512")
LAYOUTS = ("contiguous", "channels_last")  # --channels-last: the images' memory formats, side by side


def in_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` (N, C, H, W) in the memory format ``layout`` (channels_last: channels the fastest axis)."""
    return x.contiguous(memory_format=torch.channels_last if layout == "channels_last" else torch.contiguous_format)


def with_layout(mode: str, layout: str) -> str:
    """The row name of ``mode`` on images of ``layout``: the mode itself on contiguous ones."""
    return mode if layout == LAYOUTS[0] else f"{mode} [{layout}]"


def layout_of(name: str) -> str:
    """The layout a row name (:func:`with_layout`) runs on."""
    return name.split("[")[1].rstrip("]") if "[" in name else LAYOUTS[0]


def set_lookup(name: str) -> None:
    """Make aqr's C kernels (per-batch and streaming) use the table lookup ``name``; exits where it is missing."""
    from aqr.adapt.stream.native_kernels import native_stream_kernels
    from aqr.backends import build

    wide = int(name == "avx512")
    for lib in (build.native_kernels(), native_stream_kernels()):
        if lib is None or lib.aqr_set_lookup(wide) != wide:
            sys.exit(f"cost_check: --lookups {name}: this CPU, or aqr's C kernels here, have no such lookup")


def kernel_lookup() -> str:
    """The table lookups aqr's C kernels chose when they loaded: "avx512", "avx2" (or scalar), or "none"."""
    from aqr.backends import build

    lib = build.native_kernels()
    if lib is None:
        return "none"
    return "avx512" if build.wide_lookup(lib) else "avx2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, help="mode:batch, mode in batch, stream, robust")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--images", type=int, default=128, help="images per mode and round (at least --min-batches batches)")
    parser.add_argument("--min-batches", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=512, help="images before the rounds")
    parser.add_argument("--calib-images", type=int, default=2000)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="cpu")
    parser.add_argument("--memory", action="store_true", help="also the peak tensor memory of one forward pass")
    parser.add_argument("--runs", type=int, default=0, help="images per run of one class (0: the test set's order)")
    parser.add_argument("--lookups", nargs="+", choices=LOOKUPS, default=[],
                        help="each AQR row once per table lookup (default: the one the kernels chose)")
    parser.add_argument("--channels-last", action="store_true",
                        help="every row also on channels_last images, in the same rounds")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    data = os.environ.get("AQR_DATA_DIR")
    if not data:
        sys.exit("cost_check needs $AQR_DATA_DIR (cifar10_test.npz and the akamaster ResNet-20 checkpoint)")
    torch.set_num_threads(args.threads)
    data = Path(data)
    model = models.load("resnet20", checkpoint=data / "checkpoints" / "akamaster" / "resnet20-12fca82f.th").eval()
    clean, labels = load_npz_arrays(data / "cifar10_test.npz")
    rows = [(r.split(":")[0], int(r.split(":")[1])) for r in args.rows]
    # target="mixed" whitens its images' descriptors by their spread over the source images
    stats = aqr.calibrate(model, to_float(clean[: args.calib_images]).split(500),
                          descriptors=any(mode == "mixed" for mode, _ in rows))
    per_round = max(args.images, args.min_batches * max(b for _, b in rows))
    start = args.calib_images
    n_images = args.warmup + per_round
    if args.runs > 0:
        picked = start + class_runs(labels[start:], n_images, args.runs)
    else:
        picked = np.arange(start, start + n_images)
    x = noisy_images(clean[picked])
    warm, timed = x[: args.warmup], x[args.warmup :]
    clock = CLOCKS[args.clock]
    lookup = kernel_lookup()
    print(f"threads {args.threads}, clock {args.clock}, torch {torch.__version__}, {args.rounds} rounds, "
          f"{per_round} images per mode and round, " + (f"runs of {args.runs} images of one class" if args.runs
                                                       else "the test set's order") + f", {lookup} lookups", flush=True)
    layouts = [LAYOUTS[0], LAYOUTS[1]] if args.channels_last else [LAYOUTS[0]]
    inputs = {layout: (in_layout(warm, layout), in_layout(timed, layout)) for layout in layouts}
    results = []
    for batch in sorted({b for _, b in rows}):
        kinds = ["plain"] + [m if not args.lookups else f"{m}/{name}" for m, b in rows if b == batch
                             for name in (args.lookups or [None])]
        # each mode once per layout, its own runner (a streaming state sees one layout's images only)
        modes = [with_layout(m, layout) for layout in layouts for m in kinds]
        runners = {m: build(m.split("/")[0].split(" ")[0], model, stats) for m in modes}
        n = (len(timed) // batch) * batch

        def use(mode: str) -> None:  # the lookup a mode/lookup row runs with (the same state for "plain")
            if "/" in mode:
                set_lookup(mode.split(" ")[0].split("/")[1])

        for m, fn in runners.items():
            use(m)
            feed(fn, inputs[layout_of(m)][0], batch)
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for m, fn in runners.items():
                use(m)
                xs = inputs[layout_of(m)][1][:n]
                t0 = clock()
                feed(fn, xs, batch)
                times[m].append((clock() - t0) / n)
        with torch.no_grad():
            predicted = model(timed[:n]).argmax(1).unique().numel()
        for m in modes:
            layout = layout_of(m)
            plain = with_layout("plain", layout)
            if m == plain:
                continue
            ratio = statistics.median(t / p for t, p in zip(times[m], times[plain]))
            row = {"mode": m, "batch": batch, "layout": layout, "ratio": ratio,
                   "ms_per_image": statistics.median(times[m]) * 1e3,
                   "plain_ms_per_image": statistics.median(times[plain]) * 1e3,
                   "ratios": [t / p for t, p in zip(times[m], times[plain])], "classes_predicted": predicted}
            if args.memory:
                xb = inputs[layout][1][:batch]
                plain_peak = peak_bytes(runners[plain], xb)
                row["extra_peak_bytes"] = peak_bytes(runners[m], xb)
                row["plain_peak_bytes"] = plain_peak
                if not m.startswith("batch"):
                    row["state_bytes"] = runners[m].memory_bytes()
            results.append(row)
            mem = (f"  peak {row['extra_peak_bytes'] / 2**20:.2f} MiB vs plain {row['plain_peak_bytes'] / 2**20:.2f} MiB"
                   f" (x{row['extra_peak_bytes'] / row['plain_peak_bytes']:.3f})" if args.memory else "")
            print(f"{m:7s} batch {batch:4d}: x{ratio:.2f}  ({row['ms_per_image']:.3f} vs "
                  f"{row['plain_ms_per_image']:.3f} ms per image; {predicted} classes predicted){mem}", flush=True)
    by = {(r["mode"], r["batch"]): r["ratio"] for r in results}
    for b in sorted({b for _, b in rows}):
        for layout in layouts:
            robust, stream = with_layout("robust", layout), with_layout("stream", layout)
            if (robust, b) in by and (stream, b) in by:
                print(f"{robust} / {stream} at batch {b}: {by[(robust, b)] / by[(stream, b)]:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "clock": args.clock, "torch": torch.__version__,
                                         "rounds": args.rounds, "images_per_round": per_round, "runs": args.runs,
                                         "lookup": lookup, "lookups": args.lookups, "layouts": layouts,
                                         "rows": results}, indent=2))


if __name__ == "__main__":
    main()
