"""Methods on a continual CIFAR-10-C stream in i.i.d., class-correlated and mixed orders.

One stream per order: the corruptions in the given (continual) order at one severity, each a block of
the same ``--n`` test images drawn from 5000-9999 with ``--seed``, put in the order by
:class:`aqr.data.streams.StreamOrder` (``iid``, ``delta=D`` as RoTTA builds it, ``mixed``); every method
sees the same images in the same order, online (no reset), at one batch size. Prints and appends one
JSON line per (order, method) to ``--out`` (rows already there are skipped: rerun to resume), and
with ``--table`` writes a markdown table of accuracy against order.

    python benchmarks/noniid_stream.py --cifar-c cache/cifar10c --out runs/noniid.jsonl --table runs/noniid.md

``--model`` is a zoo name or ``resnet20``, whose ``--checkpoint`` defaults to the data folder's akamaster
ResNet-20 (``--data-dir`` or ``$AQR_DATA_DIR``). Methods are names with options, as in ``aqr bench``
(``aqr:target=robust,groups=10``); those that need source statistics read ``--stats`` (``aqr calibrate``).
The ``stream-noniid`` bench preset runs the same streams as cells of a results database.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from aqr import SourceStats, methods, models
from aqr.data import DataDirError, load_cifar_c, resolve_data_dir, to_float
from aqr.data.streams import StreamOrder, mean_run_length, take
from aqr.harness.specs import MethodSpec

FOUR = "gaussian_noise,defocus_blur,fog,contrast"


def run_stream(method: torch.nn.Module, images: np.ndarray, labels: np.ndarray, batch: int) -> np.ndarray:
    """Whether each image of the stream was classified right, feeding ``method`` ``batch`` images at a time."""
    correct = np.zeros(len(labels), dtype=bool)
    for start in range(0, len(labels), batch):
        logits = method(to_float(images[start : start + batch]))
        correct[start : start + batch] = logits.argmax(1).numpy() == labels[start : start + batch]
    return correct


POSITIONS = (0, 64, 128, 256, 512)  # starts of the ranges of by_position


def by_position(correct: np.ndarray, blocks: np.ndarray) -> dict[str, float]:
    """Accuracy (%) by how many images of the same corruption came before an image in the stream
    (``"0-63"``, ``"64-127"``, ...): how fast a method follows a change of corruption."""
    position = np.zeros(len(blocks), dtype=np.int64)
    for block in np.unique(blocks):
        where = np.flatnonzero(blocks == block)
        position[where] = np.arange(len(where))
    out = {}
    for lo, hi in zip(POSITIONS, POSITIONS[1:] + (None,)):
        inside = (position >= lo) if hi is None else (position >= lo) & (position < hi)
        if inside.any():
            out[f"{lo}-{hi - 1}" if hi else f"{lo}+"] = round(100 * float(correct[inside].mean()), 2)
    return out


def method_list(text: str) -> list[str]:
    """``"source,aqr:target=robust,groups=10"`` -> ``["source", "aqr:target=robust,groups=10"]``: a comma
    starts a new method unless what follows is another ``key=value`` option of the one before."""
    entries: list[str] = []
    for token in text.split(","):
        if entries and "=" in token and ":" not in token:
            entries[-1] += "," + token
        else:
            entries.append(token)
    return entries


def table(rows: list[dict]) -> str:
    """Markdown: one line per method, one column per order (accuracy %, mean over the stream)."""
    orders = list(dict.fromkeys(r["order"] for r in rows))
    names = list(dict.fromkeys(r["method"] for r in rows))
    acc = {(r["order"], r["method"]): r["accuracy"] for r in rows}
    runs = {r["order"]: r["mean_class_run"] for r in rows}
    lines = ["| method | " + " | ".join(f"{o} (run {runs[o]:.1f})" for o in orders) + " |",
             "|---|" + "---|" * len(orders)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{acc[(o, name)]:.2f}" if (o, name) in acc else "—"
                                                 for o in orders) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cifar-c", required=True, help="CIFAR-10-C folder (aqr corrupt layout)")
    p.add_argument("--data-dir", default=None, help="data folder (default: $AQR_DATA_DIR)")
    p.add_argument("--model", default="resnet20", help="zoo name, or resnet20 (with --checkpoint)")
    p.add_argument("--checkpoint", default=None, help="resnet20's weights; default: the data folder's akamaster ResNet-20")
    p.add_argument("--stats", default=None, help="source statistics (aqr calibrate) for methods that need them")
    p.add_argument("--corruptions", default=FOUR, help="comma list, in stream order")
    p.add_argument("--severity", type=int, default=5)
    p.add_argument("--orders", default="iid,delta=1,delta=0.1,delta=0.01,mixed")
    p.add_argument("--methods", default="source,ttn,rbn")
    p.add_argument("--n", type=int, default=1000, help="images per corruption block")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True, help="JSON lines, one per (order, method); resumable")
    p.add_argument("--table", default=None, help="also write a markdown table here")
    args = p.parse_args(argv)
    if args.checkpoint is None and args.model == "resnet20":
        try:
            args.checkpoint = str(resolve_data_dir(args.data_dir) / "checkpoints/akamaster/resnet20-12fca82f.th")
        except DataDirError as err:
            p.error(str(err))
    torch.set_num_threads(args.threads)
    corruptions = args.corruptions.split(",")
    pool = np.arange(5000, 10000)
    drawn = pool[np.random.default_rng(args.seed).permutation(len(pool))[: args.n]]
    blocks = [load_cifar_c(args.cifar_c, c, args.severity, drawn) for c in corruptions]
    block_images, block_labels = [np.asarray(b.images) for b in blocks], [b.labels for b in blocks]
    model = models.load(args.model, checkpoint=args.checkpoint)
    stats = SourceStats.load(args.stats) if args.stats else None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    setting = {"corruptions": corruptions, "severity": args.severity, "n_images": args.n * len(corruptions),
               "batch": args.batch, "seed": args.seed, "model": args.model}
    rows = [r for r in map(json.loads, out.read_text().splitlines())] if out.is_file() else []
    rows = [r for r in rows if all(r.get(k) == v for k, v in setting.items())]
    done = {(r["order"], r["method"]) for r in rows}
    for text in args.orders.split(","):
        order = StreamOrder.parse(text)
        stream = order.stream(block_labels, args.seed)
        images, labels = take(block_images, stream), take(block_labels, stream)
        for name in method_list(args.methods):
            if (str(order), name) in done:
                continue
            spec = MethodSpec.parse(name)
            method_plan = methods.plan(spec.name, {**spec.options, "protocol": "online", "seed": args.seed},
                                       batch_size=args.batch)
            if method_plan.needs.stats is not None and stats is None:
                p.error(f"method {name!r} needs --stats")
            try:
                method = method_plan.build(model, stats=stats if method_plan.needs.stats is not None else None)
            except methods.NotApplicable as err:  # e.g. a BatchNorm method on a GroupNorm model
                print(f"{name}: not applicable ({err})", flush=True)
                continue
            t0 = time.perf_counter()
            correct = run_stream(method, images, labels, args.batch)
            row = {"order": str(order), "method": name, "accuracy": round(100 * float(correct.mean()), 2),
                   "per_corruption": {c: round(100 * float(correct[stream[:, 0] == k].mean()), 2)
                                      for k, c in enumerate(corruptions)},
                   "by_position": by_position(correct, stream[:, 0]),
                   **setting, "mean_class_run": round(mean_run_length(labels), 2),
                   "wall_s": round(time.perf_counter() - t0, 1), "threads": args.threads}
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.table:
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table).write_text(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
