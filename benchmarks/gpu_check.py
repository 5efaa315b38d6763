"""The GPU checks of issue 60 as one prepared run: each step a subprocess, its result written as it ends.

In the order the issue asks: the Triton tests (all must pass before the histogram path becomes CUDA's
default); ResNet-50 and ViT-B/16, fp32, batch 64; the stream targets on the GPU (the sync and move tests of
``tests/test_stream_device.py``, then per-image timings at batch 1, 16 and 64); then batch 16 and 256, bf16
autocast, channels_last and compiled AQR. ``--out`` holds, after every step, the device, the versions, each
step's command, exit status, seconds and output tail, and the timing rows (``model``, ``batch``, ``method``,
``dtype``, ``layout``, ``compiled``, ``seconds``, ``ratio``) of the steps that time.

    python benchmarks/gpu_check.py --out gpu_check.json            # every step, within --budget seconds
    python benchmarks/gpu_check.py --only triton-tests stream-tests  # some of them
    python benchmarks/gpu_check.py --dry-run                       # the steps' commands (no GPU needed)
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPEED = [sys.executable, str(ROOT / "benchmarks" / "speed.py"), "--device", "cuda"]
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA"]


def steps(args: argparse.Namespace) -> list[tuple[str, list[str], Path | None]]:
    """``(name, command, timing JSON or None)`` of every step, in the issue's order."""
    out = args.out.parent
    timing = lambda name: out / f"{args.out.stem}_{name}.json"  # noqa: E731
    repeats = ["--repeats", str(args.repeats), "--warmup", "3"]
    return [
        ("triton-tests", [*PYTEST, str(ROOT / "tests" / "test_triton.py")], None),
        ("fp32-batch64", [*SPEED, "--models", "resnet50", "vit-b16", "--batch-sizes", "64", "--methods", "ttn", "aqr",
                          "aqr-triton", *repeats, "--json", str(timing("fp32-batch64"))], timing("fp32-batch64")),
        ("stream-tests", [*PYTEST, str(ROOT / "tests" / "test_stream_device.py")], None),
        ("stream-targets", [*SPEED, "--stream", "--models", *args.stream_models, "--stream-batch-sizes", "1", "16", "64",
                            "--methods", *args.stream_methods, "--stream-images", "256", "--stream-warmup", "256",
                            "--repeats", str(args.repeats), "--json", str(timing("stream-targets"))],
         timing("stream-targets")),
        ("other-rows", [*SPEED, "--models", "resnet50", "vit-b16", "--batch-sizes", "16", "256", "64", "--dtypes", "fp32",
                        "bf16", "--layouts", "contiguous", "channels_last", "--compiled", "--methods", "ttn",
                        "aqr-triton", *repeats, "--json", str(timing("other-rows"))], timing("other-rows")),
    ]


def versions() -> dict[str, str]:
    import torch

    found = {"python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda)}
    try:
        import triton

        found["triton"] = triton.__version__
    except ImportError:
        found["triton"] = "absent"
    return found


def run_step(name: str, command: list[str], timing: Path | None, limit: float) -> dict[str, object]:
    """Run one step within ``limit`` seconds; its record (and the timing rows it wrote, also when cut short)."""
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=limit)
        rc, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as cut:
        rc = 124
        text = "".join(part.decode() if isinstance(part, bytes) else part or "" for part in (cut.stdout, cut.stderr))
    record: dict[str, object] = {"step": name, "command": " ".join(command), "rc": rc,
                                 "seconds": round(time.perf_counter() - start, 1), "tail": text[-4000:]}
    if timing is not None and timing.is_file():
        record["rows"] = json.loads(timing.read_text()).get("rows", [])
    if name.endswith("-tests"):
        summary = [line for line in text.splitlines() if " passed" in line or " failed" in line]
        record["summary"] = summary[-1] if summary else ""
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON written after every step")
    parser.add_argument("--only", nargs="+", default=None, help="run these steps only (names: see --dry-run)")
    parser.add_argument("--repeats", type=int, default=10, help="timing rounds per row")
    parser.add_argument("--step-timeout", type=float, default=300.0, help="seconds one step may take")
    parser.add_argument("--budget", type=float, default=540.0,
                        help="seconds for the whole run: a step gets what is left, none starts with under 30 s left")
    parser.add_argument("--stream-models", nargs="+", default=["resnet20-bn", "resnet50"])
    parser.add_argument("--stream-methods", nargs="+", default=["aqr-stream", "aqr-robust", "aqr-mixed", "aqr"])
    parser.add_argument("--dry-run", action="store_true", help="print the steps' commands and stop")
    args = parser.parse_args(argv)
    plan = steps(args)
    names = [name for name, _, _ in plan]
    unknown = sorted(set(args.only or []) - set(names))
    if unknown:
        parser.error(f"unknown step(s) {', '.join(unknown)}; the steps: {', '.join(names)}")
    if args.only:
        plan = [step for step in plan if step[0] in args.only]
    if args.dry_run:
        for name, command, _ in plan:
            print(f"{name}: {' '.join(command)}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: needs a CUDA GPU (torch.cuda.is_available() is False); --dry-run lists the steps",
              file=sys.stderr)
        return 2
    result: dict[str, object] = {"device": torch.cuda.get_device_name(0), "versions": versions(), "steps": []}
    start = time.perf_counter()
    for name, command, timing in plan:
        left = args.budget - (time.perf_counter() - start)
        if left < 30:
            result["skipped"] = [*result.get("skipped", []), name]  # type: ignore[list-item]
            args.out.write_text(json.dumps(result, indent=2))
            continue
        print(f"== {name}", flush=True)
        record = run_step(name, command, timing, min(args.step_timeout, left))
        result["steps"].append(record)  # type: ignore[union-attr]
        result["rows"] = [row for step in result["steps"] for row in step.get("rows", [])]  # type: ignore[union-attr]
        args.out.write_text(json.dumps(result, indent=2))
        print(f"   rc {record['rc']} in {record['seconds']} s {record.get('summary', '')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
