"""aqr.export checked and timed in ONNX Runtime (docs/export.md).

(i) Agreement: the per-batch graph (form="batch") against eager ``aqr.AQR(mode="exact")`` on 2,000 CIFAR-10-C
images (severity 5, 400 from each of five corruptions, batches of 64 within a corruption): the same top-1 and
the largest |logit difference|; eager's default fast mode is compared apart. The explicit-state stream graph
stepped ``--stream-steps`` batch-1 images through ONNX Runtime against eager ``target="stream"`` (its torch
kernels, ``native=False``, the reference; and the default C kernels).
(ii) Cost: ONNX Runtime, one thread, batch 1, 16 and 64, the AQR graph beside the plain exported model, round
robin in one process (median seconds per batch over the rounds).

    aqr corrupt --data cifar10_test_5000-5399.npz --out C_DIR --severities 5 --seed 0 --params cifar \\
        --corruptions gaussian_noise,shot_noise,impulse_noise,brightness,contrast
    python benchmarks/export_check.py --corrupted C_DIR --out OUT_DIR

Needs $AQR_DATA_DIR (cifar10_test.npz; checkpoints/akamaster/resnet20-12fca82f.th) and ``pip install 'aqr[export]'``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings
from pathlib import Path

import numpy as np
import torch

import aqr
from aqr.deploy import export, stream_state

CORRUPTIONS = ("gaussian_noise", "shot_noise", "impulse_noise", "brightness", "contrast")
PER_CORRUPTION = 400
BATCH = 64


def images(array: np.ndarray) -> torch.Tensor:
    """uint8 N x H x W x 3 -> float N x 3 x H x W in [0, 1]."""
    return torch.from_numpy(np.ascontiguousarray(array)).permute(0, 3, 1, 2).float() / 255


def load_models(data_dir: Path) -> dict[str, torch.nn.Module]:
    checkpoint = data_dir / "checkpoints" / "akamaster" / "resnet20-12fca82f.th"
    return {"resnet20 (third-party, BN)": aqr.models.load("resnet20", checkpoint=checkpoint),
            "resnet20_gn (zoo, GN)": aqr.models.load("resnet20_gn"),
            "vit_ln (zoo, LN)": aqr.models.load("vit_ln")}


def session(path: Path):
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def agreement(model, stats, batches, out: Path, name: str) -> dict[str, object]:
    exact = aqr.AQR(model, stats, mode="exact")
    fast = aqr.AQR(model, stats)
    t = time.perf_counter()
    path = export(exact, batches[0], out / f"{name}_batch.onnx")
    export_s = time.perf_counter() - t
    run = session(path)
    same = same_fast = total = 0
    worst = 0.0
    for x in batches:
        want = exact(x)
        got = torch.from_numpy(run.run(None, {"input": x.numpy()})[0])
        worst = max(worst, (got - want).abs().max().item())
        same += int((got.argmax(1) == want.argmax(1)).sum())
        same_fast += int((got.argmax(1) == fast(x).argmax(1)).sum())
        total += len(x)
    return {"images": total, "same_top1_vs_exact": same / total, "max_abs_logit_diff_vs_exact": worst,
            "same_top1_vs_fast": same_fast / total, "export_s": round(export_s, 1), "graph": path}


def stream_check(model, stats, stream_images: torch.Tensor, out: Path, name: str) -> dict[str, object]:
    result: dict[str, object] = {"steps": len(stream_images)}
    reference = aqr.AQR(model, stats, target="stream", native=False)
    default = aqr.AQR(model, stats, target="stream")
    t = time.perf_counter()
    path = export(reference, stream_images[:2], out / f"{name}_stream.onnx")
    result["export_s"] = round(time.perf_counter() - t, 1)
    run = session(path)
    names = [i.name for i in run.get_inputs()]
    state = {k: v.numpy() for k, v in stream_state(reference).items()}
    same = same_default = 0
    worst = 0.0
    for i in range(len(stream_images)):
        x = stream_images[i : i + 1]
        got_all = run.run(None, {"input": x.numpy(), **state})
        state = dict(zip(names[1:], got_all[1:]))
        got = torch.from_numpy(got_all[0])
        want = reference(x)
        worst = max(worst, (got - want).abs().max().item())
        same += int(got.argmax(1).item() == want.argmax(1).item())
        same_default += int(got.argmax(1).item() == default(x).argmax(1).item())
    steps = len(stream_images)
    result.update(same_top1_vs_torch_kernels=same / steps, max_abs_logit_diff_vs_torch_kernels=worst,
                  same_top1_vs_c_kernels=same_default / steps)
    return result


def cost(graphs: dict[str, Path], shape: tuple[int, ...], rounds: int) -> dict[str, dict[int, float]]:
    """Median seconds per batch of each graph at batch 1, 16, 64, round robin."""
    sessions = {label: session(path) for label, path in graphs.items()}
    reps = {1: 20, 16: 4, 64: 1}
    times: dict[str, dict[int, list[float]]] = {label: {b: [] for b in reps} for label in graphs}
    g = torch.Generator().manual_seed(0)
    inputs = {b: torch.rand(b, *shape, generator=g).numpy() for b in reps}
    for label, run in sessions.items():  # warm-up
        for b in reps:
            run.run(None, {"input": inputs[b]})
    for _ in range(rounds):
        for b, n in reps.items():
            for label, run in sessions.items():
                t = time.perf_counter()
                for _ in range(n):
                    run.run(None, {"input": inputs[b]})
                times[label][b].append((time.perf_counter() - t) / n)
    return {label: {b: statistics.median(v) for b, v in per.items()} for label, per in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corrupted", type=Path, required=True, help="aqr corrupt's output folder (severity 5)")
    parser.add_argument("--out", type=Path, required=True, help="where the graphs and results.json go")
    parser.add_argument("--stream-model", default="vit_ln (zoo, LN)", help="the model of the stream check")
    parser.add_argument("--stream-steps", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    data_dir = Path(os.environ["AQR_DATA_DIR"])
    args.out.mkdir(parents=True, exist_ok=True)
    clean = np.load(data_dir / "cifar10_test.npz")
    source = images(clean["x"][:5000])
    test = torch.cat([images(np.load(args.corrupted / "5" / f"{c}.npy")[:PER_CORRUPTION])
                      if (args.corrupted / "5").is_dir() else images(np.load(args.corrupted / f"{c}.npy")[:PER_CORRUPTION])
                      for c in CORRUPTIONS])
    batches = [b for c in range(len(CORRUPTIONS))
               for b in test[c * PER_CORRUPTION:(c + 1) * PER_CORRUPTION].split(BATCH)]
    g = torch.Generator().manual_seed(0)
    stream_images = test[torch.randperm(len(test), generator=g)[: args.stream_steps]]
    results: dict[str, object] = {"versions": {"torch": torch.__version__, "onnxruntime": __import__("onnxruntime").__version__,
                                               "onnx": __import__("onnx").__version__, "aqr": aqr.__version__}}
    for name, model in load_models(data_dir).items():
        short = name.split()[0]
        t = time.perf_counter()
        stats = aqr.calibrate(model, source.split(250), seed=0)
        entry: dict[str, object] = {"calibrate_s": round(time.perf_counter() - t, 1), "layers": len(stats.layers)}
        entry["agreement"] = agreement(model, stats, batches, args.out, short)
        plain = args.out / f"{short}_plain.onnx"
        torch.onnx.export(model, (batches[0],), str(plain), input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=18, dynamo=False)
        graph = entry["agreement"].pop("graph")
        entry["cost_s_per_batch"] = cost({"plain": plain, "aqr batch graph": graph}, tuple(test.shape[1:]), args.rounds)
        if name == args.stream_model:
            entry["stream"] = stream_check(model, stats, stream_images, args.out, short)
        results[name] = entry
        print(json.dumps({name: entry}, indent=1), flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
