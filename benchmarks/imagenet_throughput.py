"""Throughput of the ImageNet recipe on one machine: images per second for each stage, how long the
model waited for the data loader, and how busy the GPU was.

Stages, each timed on its own:

1. ``generate``: write ``--calib-images`` JPEGs (ImageNet-like: 256-500 px sides, textured) into
   ``WORK/train/<class>/`` in parallel; skipped with ``--data DIR`` (your image folder) or when
   WORK already holds them.
2. ``corrupt``: write one ImageNet-C cell (``--corruption`` at ``--severity``) of ``--eval-images``
   class-balanced source images with ``aqr``'s generator (``aqr corrupt`` semantics), in parallel.
3. ``loader``: the DataLoader alone decoding calibration images (its capacity, no model).
4. ``calibrate``: ``aqr.calibrate`` over ``--calib-images`` images (10,000 as in the paper).
5. ``source`` and ``aqr``: evaluation of the corrupted cell, unadapted and with AQR.

The model is ``timm:resnet50`` by default, with pretrained weights when timm's local cache has
them and random weights otherwise (the output says which; throughput does not depend on it). For
each model stage: wall seconds, images/s (also without the first batch, which includes
``torch.compile``), seconds spent waiting for the next batch ("loader wait") against the rest
("compute", which includes host-to-device copies), and GPU utilisation sampled every 0.1 s
(``torch.cuda.utilization``, else ``nvidia-smi``).

    python benchmarks/imagenet_throughput.py --device cuda --json docs/results/imagenet/throughput_h100.json
    python benchmarks/imagenet_throughput.py --device cpu --model resnet20 --calib-images 64 \\
        --eval-images 64 --image-size 64 --workers 2          # a quick check on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

import aqr
from aqr import methods, models
from aqr.data.imagenet_c import FolderGenerationConfig, ImageNetCFolder, generate_imagenet_c
from aqr.data.images import ImageFolder, Preprocess, balanced_subset
from aqr.harness.inputs import data_loader

CLASSES = 100  # synthetic classes (class folders) of the generated images


# ----------------------------------------------------------------------------- synthetic images


def _write_images(root: str, items: list[tuple[int, int]], min_side: int, max_side: int) -> int:
    """Write one textured JPEG per ``(index, class)``: a random low-resolution pattern upscaled plus noise."""
    from PIL import Image

    for index, label in items:
        rng = np.random.default_rng(index)
        w, h = (int(v) for v in rng.integers(min_side, max_side + 1, 2))
        base = Image.fromarray(rng.integers(0, 256, (max(2, h // 16), max(2, w // 16), 3), dtype=np.uint8))
        pixels = np.asarray(base.resize((w, h), Image.BICUBIC), dtype=np.int16)
        pixels = np.clip(pixels + rng.integers(-24, 25, (h, w, 3), dtype=np.int16), 0, 255).astype(np.uint8)
        path = Path(root) / f"c{label:03d}" / f"img{index:06d}.JPEG"
        Image.fromarray(pixels).save(path, "JPEG", quality=90)
    return len(items)


def generate_images(root: Path, n: int, image_size: int, workers: int) -> dict[str, Any]:
    """``n`` JPEGs in ``root/c000 .. c099``, written by ``workers`` processes; reused when already there."""
    if root.is_dir() and sum(1 for _ in root.rglob("*.JPEG")) == n:
        return {"images": n, "seconds": 0.0, "reused": True}
    shutil.rmtree(root, ignore_errors=True)
    for c in range(CLASSES):
        (root / f"c{c:03d}").mkdir(parents=True)
    items = [(i, i % CLASSES) for i in range(n)]
    chunks = [items[k:k + 64] for k in range(0, n, 64)]
    # ImageNet-like sides: from the resize size (256 for 224 crops) to about twice it
    min_side = max(image_size, image_size * 8 // 7)
    t0 = time.perf_counter()
    with ProcessPoolExecutor(workers) as pool:
        done = sum(pool.map(_write_images, [str(root)] * len(chunks), chunks, [min_side] * len(chunks),
                            [2 * min_side] * len(chunks)))
    seconds = time.perf_counter() - t0
    return {"images": done, "seconds": round(seconds, 3), "images_per_s": round(done / seconds, 1), "reused": False}


# ----------------------------------------------------------------------------- measuring


class GPUUtilisation:
    """Samples the GPU's utilisation (percent) every ``period`` seconds in a thread while in use."""

    def __init__(self, device: torch.device, period: float = 0.1) -> None:
        self.device, self.period = device, period
        self.samples: list[float] = []
        self.source = self._pick_source()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _pick_source(self) -> str | None:
        if self.device.type != "cuda":
            return None
        try:
            torch.cuda.utilization(self.device)
            return "torch.cuda.utilization"
        except Exception:  # needs pynvml
            pass
        if shutil.which("nvidia-smi") and self._smi() is not None:
            return "nvidia-smi"
        return None

    def _smi(self) -> float | None:
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        try:
            out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=utilization.gpu",
                                  "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
            return float(out.stdout.strip().splitlines()[0])
        except (OSError, ValueError, IndexError, subprocess.SubprocessError):
            return None

    def _run(self) -> None:
        while not self._stop.is_set():
            value = torch.cuda.utilization(self.device) if self.source == "torch.cuda.utilization" else self._smi()
            if value is not None:
                self.samples.append(float(value))
            self._stop.wait(self.period)

    def __enter__(self) -> "GPUUtilisation":
        self.samples = []
        if self.source is not None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def summary(self) -> dict[str, Any]:
        if not self.samples:
            return {"gpu_util_mean": None, "gpu_util_median": None, "gpu_util_samples": 0,
                    "gpu_util_source": self.source}
        return {"gpu_util_mean": round(statistics.fmean(self.samples), 1),
                "gpu_util_median": round(statistics.median(self.samples), 1),
                "gpu_util_samples": len(self.samples), "gpu_util_source": self.source}


class TimedBatches:
    """Wraps a loader: records how long each ``next`` waited and when each batch was handed out."""

    def __init__(self, batches: Iterable) -> None:
        self.batches = batches
        self.wait_s = 0.0
        self.handed: list[float] = []  # perf_counter when each batch was handed to the consumer

    def __iter__(self) -> Iterator:
        iterator = iter(self.batches)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                return
            now = time.perf_counter()
            self.wait_s += now - t0
            self.handed.append(now)
            yield batch


def stage_numbers(n_images: int, batch_size: int, t0: float, t1: float, timed: TimedBatches,
                  gpu: GPUUtilisation) -> dict[str, Any]:
    """Wall time, images/s (also after the first batch), loader wait against compute, GPU use."""
    wall = t1 - t0
    steady = None
    if len(timed.handed) > 1:  # from the second batch on: no compile, no worker start
        later = n_images - min(batch_size, n_images)
        steady = later / (t1 - timed.handed[1]) if t1 > timed.handed[1] else None
    return {"images": n_images, "seconds": round(wall, 3), "images_per_s": round(n_images / wall, 1),
            "steady_images_per_s": round(steady, 1) if steady else None,
            "loader_wait_s": round(timed.wait_s, 3), "compute_s": round(wall - timed.wait_s, 3),
            "loader_wait_fraction": round(timed.wait_s / wall, 3), **gpu.summary()}


def evaluate(method: torch.nn.Module, loader: Iterable, device: torch.device, gpu: GPUUtilisation,
             batch_size: int) -> dict[str, Any]:
    """One pass of ``method`` over ``loader``: accuracy and :func:`stage_numbers` (synchronised per batch)."""
    timed = TimedBatches(loader)
    correct = n = 0
    with gpu:
        t0 = time.perf_counter()
        for x, y in timed:
            logits = method(x.to(device, non_blocking=True))
            correct += int((logits.argmax(1).cpu() == y).sum())  # .cpu() waits for the GPU
            n += len(y)
        t1 = time.perf_counter()
    return {**stage_numbers(n, batch_size, t0, t1, timed, gpu), "accuracy": round(100.0 * correct / n, 2)}


# ----------------------------------------------------------------------------- main


def load_model(name: str) -> tuple[torch.nn.Module, str]:
    """The model with cached pretrained weights when there are any, else random weights; and which."""
    if name.startswith(models.EXTERNAL_PREFIXES):
        try:
            return models.load(name), "pretrained (local cache)"
        except models.WeightsNotFound:
            return models.create(name, num_classes=1000).eval(), "random (no pretrained weights in the local cache)"
    if name in models.zoo() or Path(name).is_file():
        return models.load(name), "aqr checkpoint"
    return models.create(name).eval(), "random"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="timm:resnet50", help="aqr model name (default timm:resnet50)")
    parser.add_argument("--data", type=Path, default=None, help="your image folder (DIR/<class>/*.JPEG) instead of generated images")
    parser.add_argument("--work", type=Path, default=Path("runs/imagenet_throughput"),
                        help="folder for the generated images and the ImageNet-C cell (reused when present)")
    parser.add_argument("--calib-images", type=int, default=10_000)
    parser.add_argument("--eval-images", type=int, default=5_000)
    parser.add_argument("--loader-images", type=int, default=2_560, help="images decoded in the loader-only stage")
    parser.add_argument("--corruption", default="gaussian_noise")
    parser.add_argument("--severity", type=int, default=5)
    parser.add_argument("--image-size", type=int, default=None, help="crop size (default: the model's, 224)")
    parser.add_argument("--batch-size", type=int, default=64, help="evaluation batch (the imagenet preset's)")
    parser.add_argument("--calib-batch-size", type=int, default=500, help="calibration batch (aqr calibrate's)")
    parser.add_argument("--workers", type=int, default=None,
                        help="DataLoader and generation processes (default: CPU count - 1)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = parser.parse_args()

    device = torch.device(args.device)
    workers = args.workers if args.workers is not None else max(1, (os.cpu_count() or 2) - 1)
    result: dict[str, Any] = {
        "aqr": aqr.__version__, "torch": torch.__version__, "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "cpus": os.cpu_count(), "workers": workers, "model": args.model, "batch_size": args.batch_size,
        "calib_batch_size": args.calib_batch_size, "stages": {}}
    stages = result["stages"]
    t_start = time.perf_counter()
    try:
        model, weights = load_model(args.model)
    except ImportError as err:
        print(f"imagenet_throughput: {err}\n(for a measurement without timm, --model resnet18 is aqr's own "
              "ResNet-18, run at the given --image-size)", file=sys.stderr)
        return 2
    model.to(device)
    result["weights"] = weights
    preprocess = models.preprocessing(model).with_overrides(args.image_size)
    result["preprocess"] = str(preprocess)
    print(f"{args.model} on {result['device']}: {weights} weights; {preprocess}; {workers} loader workers",
          file=sys.stderr)

    # 1-2: the images
    if args.data is None:
        train = args.work / "train"
        stages["generate"] = generate_images(train, max(args.calib_images, args.eval_images), preprocess.crop, workers)
        result["data"] = f"generated JPEGs, {CLASSES} classes"
    else:
        train = args.data
        result["data"] = str(args.data)
    source = ImageFolder(train, preprocess)
    cell_root = args.work / "imagenet-c"
    cell_pre = Preprocess(crop=preprocess.crop, resize=max(preprocess.crop, preprocess.crop * 8 // 7))  # 256 / 224
    config = FolderGenerationConfig(corruptions=(args.corruption,), severities=(args.severity,), workers=workers,
                                    preprocess=cell_pre, source={"images": str(train), "n": len(source)})
    chosen = balanced_subset(source.labels, args.eval_images, seed=0)
    t0 = time.perf_counter()
    try:
        written = generate_imagenet_c(source, cell_root, config, chosen, progress=False)
    except ValueError:  # a cell of an earlier run with other sizes: this script's own folder, made again
        shutil.rmtree(cell_root)
        t0 = time.perf_counter()
        written = generate_imagenet_c(source, cell_root, config, chosen, progress=False)
    seconds = time.perf_counter() - t0
    stages["corrupt"] = ({"images": len(chosen), "seconds": round(seconds, 3),
                          "images_per_s": round(len(chosen) / seconds, 1), "reused": False}
                         if written else {"images": len(chosen), "seconds": 0.0, "reused": True})
    calib = torch.utils.data.Subset(source, balanced_subset(source.labels, args.calib_images, seed=0).tolist())
    cell = ImageNetCFolder(cell_root, args.corruption, args.severity, preprocess=preprocess)

    # 3: the loader alone
    n_loader = min(args.loader_images, len(calib))
    timed = TimedBatches(data_loader(torch.utils.data.Subset(calib, range(n_loader)), args.batch_size, workers, device))
    t0 = time.perf_counter()
    for x, _ in timed:
        pass
    t1 = time.perf_counter()
    stages["loader"] = {"images": n_loader, "seconds": round(t1 - t0, 3), "images_per_s": round(n_loader / (t1 - t0), 1),
                        "steady_images_per_s": round((n_loader - args.batch_size) / (t1 - timed.handed[1]), 1)
                        if len(timed.handed) > 1 else None}

    # 4: calibration
    gpu = GPUUtilisation(device)
    timed = TimedBatches(data_loader(calib, args.calib_batch_size, workers, device))
    with gpu:
        t0 = time.perf_counter()
        stats = aqr.calibrate(model, timed, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t1 = time.perf_counter()
    stages["calibrate"] = stage_numbers(len(calib), args.calib_batch_size, t0, t1, timed, gpu)

    # 5: evaluation of the cell
    for name, method in (("source", methods.create("source", model)), ("aqr", methods.create("aqr", model, stats=stats))):
        stages[name] = evaluate(method, data_loader(cell, args.batch_size, workers, device), device, gpu, args.batch_size)
    result["total_s"] = round(time.perf_counter() - t_start, 1)
    if device.type == "cuda":
        result["gpu_peak_memory_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)

    print("| stage | images | s | img/s | img/s after batch 1 | loader wait | GPU util (mean) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, s in stages.items():
        util = s.get("gpu_util_mean")
        wait = s.get("loader_wait_fraction")
        print(f"| {name} | {s['images']} | {s['seconds']:.1f} | {s.get('images_per_s', '-')} | "
              f"{s.get('steady_images_per_s') or '-'} | {'-' if wait is None else f'{100 * wait:.0f} %'} | "
              f"{'-' if util is None else f'{util:.0f} %'} |")
    print(f"total {result['total_s']} s; weights: {weights}; accuracy source {stages['source']['accuracy']} %, "
          f"aqr {stages['aqr']['accuracy']} %")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
