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
    python benchmarks/speed.py --device cuda --models resnet50 vit-b16 --batch-sizes 64 16 256 \
        --dtypes fp32 bf16 --layouts contiguous channels_last --compiled --json gpu.json
    python benchmarks/speed.py --stream --models resnet20-bn --threads 1   # per image at batch 1 and 4

``--channels-last`` times every row twice in each round, per-batch and ``--stream`` alike: once on the images
as they are (contiguous NCHW) and once made ``torch.channels_last`` (what a permuted NHWC array gives; the
model itself is left as it is), each layout's ratios against its own plain forward of the same round
(``--layouts channels_last`` instead converts the model too, and times the layouts in separate rounds):

    python benchmarks/speed.py --models resnet20-bn --batch-sizes 128 --threads 1 --channels-last
    python benchmarks/speed.py --stream --models resnet20-bn --stream-batch-sizes 1 16 --threads 1 --channels-last

``--clock cpu`` times with the process's CPU time instead of wall time (CPU only): on a machine shared
with other jobs the wall time of every method grows with the load, the CPU time much less.

``--stream`` measures small batches instead: per image, streaming AQR (``aqr-stream``),
its class-balanced form (``aqr-robust``; ``aqr-mixed``, ``target="mixed"``, its form for streams that mix
domains; ``aqr-robust-no-own`` with ``own_batch=False``, its cost on
a stream of class runs; ``aqr-robust-classes`` with ``balance=0.5`` and statistics calibrated with class
groups, whose class-conditional map works only on class runs: ``--stream-runs 32`` feeds every method
the images in runs of 32 of one class), bn-ema, rbn, per-batch AQR and the plain forward at ``--stream-batch-sizes`` (1 and 4): each round feeds
every method the same ``--stream-images`` images in batches, round-robin, after ``--stream-warmup``
images that take the stateful methods past their warm-up; ratios are per round against the plain
forward, medians over ``--repeats`` rounds.

Timings need a quiet machine: other processes inflate every row, but ratios within one run stay
comparable.
"""

from __future__ import annotations

import argparse
import contextlib
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

# the data folder ($AQR_DATA_DIR) is optional here: random weights and images cost the same, except
# for target="robust", whose work grows with the classes the model predicts (one group each): random
# weights predict few, so its rows need the trained weights and real images (see ROBUST_NEEDS_DATA)
DATA = Path(os.environ["AQR_DATA_DIR"]) if os.environ.get("AQR_DATA_DIR") else None
AKAMASTER = DATA / "checkpoints" / "akamaster" / "resnet20-12fca82f.th" if DATA else None
MODELS = {
    "resnet20-bn": lambda: models.load("resnet20", checkpoint=AKAMASTER) if AKAMASTER and AKAMASTER.is_file() else models.create("resnet20"),
    # the zoo's trained models when present (random weights give the same cost)
    "resnet20-gn": lambda: models.load("resnet20_gn") if "resnet20_gn" in models.zoo() else models.create("resnet20", norm="gn"),
    "vit": lambda: models.load("vit_ln") if "vit_ln" in models.zoo() else models.create("vit"),
}

def _resnet50() -> torch.nn.Module:
    """torchvision's ResNet-50 (random weights: the cost does not depend on them)."""
    return models.create("torchvision:resnet50", num_classes=1000)


def _vit_b16() -> torch.nn.Module:
    """ViT-B/16 at 224 px: timm's ``vit_base_patch16_224`` when timm loads, else aqr's ViT at that size."""
    try:
        return models.create("timm:vit_base_patch16_224", num_classes=1000)
    except Exception as err:  # noqa: BLE001 - timm missing or failing beside this torch
        print(f"timm unavailable ({type(err).__name__}: {err}); aqr's ViT at ViT-B/16 size", flush=True)
        return models.create("vit", image_size=224, patch_size=16, dim=768, depth=12, heads=12, mlp_ratio=4.0, num_classes=1000)


MODELS.update({"resnet50": _resnet50, "vit-b16": _vit_b16})
INPUT_SIZE = {"resnet50": 224, "vit-b16": 224}  # the rest take 32 x 32 images
# aqr-torch: native=False (no C kernels on CPU); aqr-triton: triton=True (aqr's Triton kernels on a GPU)
METHODS = ["source", "ttn", "aqr", "aqr-torch", "aqr-triton", "aqr-exact", "tent", "sar", "aqr-stream", "aqr-robust",
           "aqr-mixed", "aqr-robust-no-own", "aqr-robust-classes", "bn-ema", "rbn"]
STREAM_METHODS = ["aqr-stream", "aqr-robust", "aqr-mixed", "aqr-robust-no-own", "aqr-robust-classes", "bn-ema", "rbn",
                  "aqr"]  # --stream: per image at small batches
SLOW_METHODS = ("aqr-exact", "tent", "sar")  # timed at the first batch size only on a GPU


def images(n: int, seed: int = 0, size: int = 32) -> torch.Tensor:
    """Source-like images: the clean CIFAR-10 test set when available (32 px), else uniform noise."""
    return labelled_images(n, seed, size)[0]


def labelled_images(n: int, seed: int = 0, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`images` and their labels (random ones for noise)."""
    path = DATA / "cifar10_test.npz" if DATA else None
    if size == 32 and path and path.is_file():
        x, y = load_npz_arrays(path)
        return to_float(x[:n]), torch.as_tensor(y[:n]).long()
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, size, size, generator=g), torch.randint(0, 10, (n,), generator=g)


def class_runs(labels: torch.Tensor, run: int) -> torch.Tensor:
    """An order of the images in runs of ``run`` images of one class, the classes taking turns."""
    chunks = [(i, c, part) for c in labels.unique().tolist()
              for i, part in enumerate(torch.nonzero(labels == c).squeeze(1).split(run))]
    return torch.cat([part for _, _, part in sorted(chunks, key=lambda t: (t[0], t[1]))])


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # --clock


def run_once(fn, x: torch.Tensor, method: str, dtype: str = "fp32", timer=time.perf_counter) -> float:
    """Time of one batch by ``timer`` (gradients on for the methods that take a backward pass)."""
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    grad = torch.enable_grad() if method in ("tent", "sar") else torch.no_grad()
    autocast = torch.autocast(x.device.type, dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()
    with grad, autocast:
        start = timer()
        fn(x)
        sync()  # GPU work is asynchronous: a batch is done when its kernels are
    return timer() - start


def build(method: str, model: torch.nn.Module, stats: aqr.SourceStats, batch: int,
          grouped: aqr.SourceStats | None = None):
    if method == "aqr":
        return methods.create("aqr", model, stats=stats)
    if method == "aqr-exact":
        return methods.create("aqr", model, stats=stats, mode="exact")
    if method == "aqr-torch":  # the fast path without aqr's kernels (as on a machine with no compiler)
        return methods.create("aqr", model, stats=stats, native=False)
    if method == "aqr-triton":
        return methods.create("aqr", model, stats=stats, triton=True)
    if method == "aqr-stream":  # streaming AQR (target="stream"), online: its state carries over
        return methods.create("aqr", model, stats=stats, target="stream", protocol="online")
    if method == "aqr-robust":  # class-balanced streaming AQR (target="robust"), online
        return methods.create("aqr", model, stats=stats, target="robust", protocol="online")
    if method == "aqr-mixed":  # streaming AQR for streams that mix domains (target="mixed"), online
        return methods.create("aqr", model, stats=stats, target="mixed", protocol="online")
    if method == "aqr-robust-no-own":  # the same with the own-batch share shut, as on a stream of class runs
        return methods.create("aqr", model, stats=stats, target="robust", protocol="online", own_batch=False)
    if method == "aqr-robust-classes":  # with class-conditional source knots (statistics with groups)
        if grouped is None:
            raise methods.NotApplicable("aqr-robust-classes is timed with --stream (it needs labelled statistics)")
        return methods.create("aqr", model, stats=grouped, target="robust", protocol="online", balance=0.5)
    if method == "rbn":
        return methods.create("rbn", model, protocol="online")
    if method == "bn-ema":
        return methods.create("bn-ema", model, protocol="online")
    if method in ("tent", "sar"):
        arch = "vit" if "vit" in type(model.model if hasattr(model, "model") else model).__name__.lower() else "cnn"
        return methods.create(method, model, arch=arch, batch_size=batch, protocol="episodic")
    return methods.create(method, model, protocol="episodic")  # the per-batch cost: reset, adapt, scored forward


class CompiledAQR:
    """``torch.compile(model)`` called inside :func:`aqr.recalibrating`: the hooks and folded
    BatchNorms are in place while the model is traced, so the compiled graph calls aqr's kernels."""

    def __init__(self, model: torch.nn.Module, stats: aqr.SourceStats, mode: str | None = None) -> None:
        self.block = aqr.recalibrating(model, stats, triton=True)
        self.block.__enter__()  # left at exit of the process (a benchmark's model is not reused plainly)
        self.compiled = torch.compile(model, mode=mode)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.compiled(x)


def _round_robin(runners: dict, x: torch.Tensor | dict, dtype: str, warmup: int, repeats: int,
                 timer=time.perf_counter) -> dict:
    """Each runner's times over ``repeats`` rounds, every runner once per round; ``x``: the batch, or one per
    runner's key (``(method, layout)`` with ``--channels-last``)."""
    def method_of(key) -> str:
        return key[0] if isinstance(key, tuple) else key

    def batch_of(key) -> torch.Tensor:
        return x[key] if isinstance(x, dict) else x

    for key, runner in runners.items():
        for _ in range(warmup):  # torch.compile happens here
            run_once(runner, batch_of(key), method_of(key), dtype)
    times: dict = {key: [] for key in runners}
    for _ in range(repeats):
        for key, runner in runners.items():
            times[key].append(run_once(runner, batch_of(key), method_of(key), dtype, timer))
    return times


SIDE_BY_SIDE = ("contiguous", "channels_last")  # --channels-last: the images' layouts timed in the same rounds


def in_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x`` (N, C, H, W) in the memory format ``layout``."""
    return x.contiguous(memory_format=torch.channels_last if layout == "channels_last" else torch.contiguous_format)


def _peak_memory(runner, x: torch.Tensor, method: str, dtype: str) -> float | None:
    """Peak GPU memory (MiB) allocated during one batch, over what was allocated before it."""
    if x.device.type != "cuda":
        return None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run_once(runner, x, method, dtype)
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def per_batch(args: argparse.Namespace) -> list[dict]:
    """Per model, dtype, layout and batch size: every method warmed up, then ``repeats`` rounds that
    time each method once, back to back. A method's ratio is the median over rounds of its time over
    the plain forward's time in the same round, so the machine's drift cancels within a round."""
    rows = []
    for name in args.models:
        size = INPUT_SIZE.get(name, 32)
        model = MODELS[name]().eval().to(args.device)
        source = images(args.calib_images if size == 32 and not args.quick else 256 if size == 32 else 64, size=size)
        stats = aqr.calibrate(model, source.split(500 if size == 32 else 32), device=args.device)
        for dtype in args.dtypes:
            # --channels-last: one pass whose rounds time both layouts of the images (the model as it is)
            for layout in (["side by side"] if args.channels_last else args.layouts):
                if layout == "channels_last" and size == 32 and name.startswith("vit"):
                    continue
                if layout != "side by side":
                    model = model.to(memory_format=torch.channels_last if layout == "channels_last"
                                     else torch.contiguous_format)
                layouts = SIDE_BY_SIDE if layout == "side by side" else (layout,)
                for i, batch in enumerate(args.batch_sizes):
                    x = images(batch, seed=1, size=size)
                    x = (x + 0.1 * torch.randn(x.shape, generator=torch.Generator().manual_seed(2))).clamp(0, 1)
                    inputs = {lay: in_layout(x.to(args.device), lay) for lay in layouts}
                    runners = {}
                    for method in ["source", *args.methods]:  # the plain forward: the baseline of every ratio
                        if args.device != "cpu" and i > 0 and method in SLOW_METHODS:
                            continue
                        for lay in layouts:
                            try:
                                runners[method, lay] = build(method, model, stats, batch)
                            except methods.NotApplicable:
                                rows.append({"model": name, "batch": batch, "method": method, "dtype": dtype,
                                             "layout": lay, "compiled": False, "seconds": None, "ratio": None})
                    times = _round_robin(runners, {key: inputs[key[1]] for key in runners}, dtype, args.warmup,
                                         args.repeats, CLOCKS[args.clock])
                    for (method, lay), runner in runners.items():
                        base = times["source", lay]
                        ratio = statistics.median(t / b for t, b in zip(times[method, lay], base))
                        seconds = statistics.median(times[method, lay])
                        row = {"model": name, "batch": batch, "method": method, "dtype": dtype, "layout": lay,
                               "compiled": False, "seconds": seconds, "ratio": ratio,
                               "peak_mib": _peak_memory(runner, inputs[lay], method, dtype)}
                        rows.append(row)
                        _print(row)
                    _flush(args, rows)
        if args.compiled:
            model = model.to(memory_format=torch.contiguous_format)
            batch = args.batch_sizes[0]
            x = images(batch, seed=1, size=size).to(args.device)
            plain = torch.compile(model, mode=args.compile_mode)
            runners = {"source": lambda t: plain(t), "aqr": CompiledAQR(model, stats, args.compile_mode)}
            times = _round_robin(runners, x, "fp32", args.warmup, args.repeats, CLOCKS[args.clock])
            for method, runner in runners.items():
                ratio = statistics.median(t / base for t, base in zip(times[method], times["source"]))
                row = {"model": name, "batch": batch, "method": method, "dtype": "fp32", "layout": "contiguous",
                       "compiled": True, "compile_mode": args.compile_mode or "default", "seconds": statistics.median(times[method]), "ratio": ratio,
                       "peak_mib": _peak_memory(runner, x, method, "fp32")}
                rows.append(row)
                _print(row)
            runners["aqr"].block.__exit__(None, None, None)
            _flush(args, rows)
    return rows


ROBUST_NEEDS_DATA = ("warning: no $AQR_DATA_DIR, so random weights: they predict few classes, and the aqr-robust "
                     "rows understate the robust variant's cost (its work grows with the classes predicted)")


def small_batches(args: argparse.Namespace) -> list[dict]:
    """Per model and small batch size: the per-image cost of each method against the plain forward,
    each round streaming the same images through every method in turn (see the module docs)."""
    rows = []
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    for name in args.models:
        model = MODELS[name]().eval().to(args.device)
        source, labels = labelled_images(2000)
        # with the images' descriptors, which target="mixed" clusters by (the other methods read none)
        stats = aqr.calibrate(model, source.split(500), device=args.device, descriptors="aqr-mixed" in args.methods)
        grouped = None
        if "aqr-robust-classes" in args.methods:
            grouped = aqr.calibrate(model, list(zip(source.split(500), labels.split(500))), groups=16,
                                    device=args.device)
        total = args.stream_warmup + args.stream_images
        x, y = labelled_images(total, seed=1)
        x = (x + 0.1 * torch.randn(total, 3, 32, 32, generator=torch.Generator().manual_seed(2))).clamp(0, 1)
        if args.stream_runs:  # every method sees the images in class runs
            x = x[class_runs(y, args.stream_runs)]
        layouts = SIDE_BY_SIDE if args.channels_last else ("contiguous",)
        inputs = {lay: in_layout(x.to(args.device), lay) for lay in layouts}  # a batch's slice keeps its layout
        for batch in args.stream_batch_sizes:
            runners = {}
            for method in ["source", *args.methods]:
                for lay in layouts:
                    try:
                        runners[method, lay] = build(method, model, stats, batch, grouped)
                    except methods.NotApplicable:
                        continue
            feed = lambda runner, part: [runner(part[i : i + batch]) for i in range(0, len(part), batch)]  # noqa: E731
            with torch.no_grad():
                for (_, lay), runner in runners.items():
                    feed(runner, inputs[lay][: args.stream_warmup])
                times: dict[tuple[str, str], list[float]] = {key: [] for key in runners}
                for _ in range(args.repeats):
                    for (method, lay), runner in runners.items():
                        part = inputs[lay][args.stream_warmup :]
                        sync()
                        start = CLOCKS[args.clock]()
                        feed(runner, part)
                        sync()  # a GPU's batches are done when their kernels are
                        times[method, lay].append((CLOCKS[args.clock]() - start) / len(part))
            for method, lay in runners:
                ratio = statistics.median(t / base for t, base in zip(times[method, lay], times["source", lay]))
                row = {"model": name, "batch": batch, "method": method, "dtype": "fp32", "layout": lay,
                       "compiled": False, "seconds": statistics.median(times[method, lay]), "ratio": ratio,
                       "per": "image"}
                rows.append(row)
                _print(row)
            _flush(args, rows)
    return rows


def _print(row: dict) -> None:
    mem = f"  +{row['peak_mib']:.0f} MiB" if row.get("peak_mib") is not None else ""
    tag = f"{row['dtype']}{' cl' if row['layout'] == 'channels_last' else ''}{' compiled' if row['compiled'] else ''}"
    print(f"{row['model']:12s} batch {row['batch']:4d} {tag:16s} {row['method']:10s} {row['seconds'] * 1e3:9.2f} ms  "
          f"x{row['ratio']:.2f}{mem}", flush=True)


def _flush(args: argparse.Namespace, rows: list[dict]) -> None:
    """Write the rows so far (a run stopped at a time limit keeps what it measured)."""
    if args.json:
        args.json.write_text(json.dumps({**environment(args), "rows": rows}, indent=2))


def environment(args: argparse.Namespace) -> dict:
    on_gpu = args.device.startswith("cuda")
    return {"device": "cuda" if on_gpu else args.device,
            "device_name": torch.cuda.get_device_name(args.device) if on_gpu else platform.processor() or platform.machine(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "aqr": aqr.__version__,
            "threads": torch.get_num_threads(), "python": sys.version.split()[0], "clock": args.clock}


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
    present = [m for m in dict.fromkeys(["source", *METHODS]) if any(r["method"] == m for r in rows)]
    lines = ["| model | batch | dtype | layout | compiled | " + " | ".join(present) + " |",
             "|---|---|---|---|---|" + "---|" * len(present)]
    keys = sorted({(r["model"], r["batch"], r["dtype"], r["layout"], r["compiled"]) for r in rows},
                  key=lambda k: (list(MODELS).index(k[0]), k[4], k[2], k[3] != "contiguous", k[3], k[1]))
    for key in keys:
        cells = []
        for method in present:
            r = next((r for r in rows if (r["model"], r["batch"], r["dtype"], r["layout"], r["compiled"]) == key
                      and r["method"] == method), None)
            if r is None:
                cells.append("")
            elif r["seconds"] is None:
                cells.append("n/a")
            else:
                cells.append(f"{r['seconds'] * 1e3:.1f} ms (x{r['ratio']:.2f})")
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | {'yes' if key[4] else 'no'} | " + " | ".join(cells) + " |")
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
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time, or the process's CPU time (CPU only: steadier on a shared machine)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda; on a GPU the calibration part (peak RSS) is skipped")
    parser.add_argument("--dtypes", nargs="+", default=["fp32"], choices=["fp32", "bf16"],
                        help="bf16: the forward under torch.autocast(bfloat16)")
    parser.add_argument("--layouts", nargs="+", default=["contiguous"], choices=["contiguous", "channels_last"],
                        help="the model and images in each layout, one after the other")
    parser.add_argument("--channels-last", action="store_true",
                        help="every row on contiguous and on channels_last images in the same rounds (the model as it is)")
    parser.add_argument("--compile-mode", default=None, choices=[None, "reduce-overhead", "max-autotune"],
                        help="torch.compile's mode for --compiled (reduce-overhead: CUDA graphs, no launch cost)")
    parser.add_argument("--compiled", action="store_true",
                        help="also torch.compile(model) plain and inside aqr.recalibrating, at the first batch size")
    parser.add_argument("--stream", action="store_true",
                        help="per-image cost at small batches instead (streaming AQR, bn-ema, per-batch AQR)")
    parser.add_argument("--stream-batch-sizes", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--stream-images", type=int, default=256, help="images per round with --stream")
    parser.add_argument("--stream-warmup", type=int, default=512, help="images before the rounds with --stream")
    parser.add_argument("--stream-runs", type=int, default=0,
                        help="with --stream: feed the images in runs of this many of one class (0: in their order)")
    args = parser.parse_args()
    if args.device != "cpu":
        args.skip_calibration = True
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["AQR_BENCH_THREADS"] = str(args.threads)
    if args.clock == "cpu" and args.device != "cpu":
        parser.error("--clock cpu times CPU work only; use --clock wall with --device cuda")
    if args.quick:
        args.models, args.batch_sizes, args.repeats, args.warmup, args.calib_images = ["resnet20-bn"], [128], 3, 2, 2000
    print(", ".join(f"{k} {v}" for k, v in environment(args).items()), flush=True)
    if args.stream:
        if args.methods == METHODS:
            args.methods = STREAM_METHODS
        if DATA is None and any(m.startswith("aqr-robust") for m in args.methods):
            print(ROBUST_NEEDS_DATA, file=sys.stderr, flush=True)
        rows = small_batches(args)
        print()
        print(markdown(rows).replace("| model | batch |", "| model | batch (ms per image) |"))
        if args.json:
            args.json.write_text(json.dumps({**environment(args), "rows": rows}, indent=2))
        return
    rows = per_batch(args)
    result = {**environment(args), "rows": rows}
    if not args.skip_calibration:
        result["calibration"] = calibration(args)
    print()
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
