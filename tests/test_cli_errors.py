"""Every count, size and index is checked, and a command that fails prints
one line on stderr and exits 2 (usage) or 1 (runtime), with a traceback only when asked for."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from aqr.cli import main
from aqr.models import create, save_checkpoint


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A small aqr checkpoint and 24 CIFAR-shaped images."""
    root = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    model = create("resnet20", num_classes=10, width=4)
    ckpt = save_checkpoint(root / "tiny.pt", model, {"name": "resnet20", "num_classes": 10, "kwargs": {"width": 4}})
    rng = np.random.default_rng(0)
    npz = root / "images.npz"
    np.savez(npz, x=rng.integers(0, 256, (24, 32, 32, 3), dtype=np.uint8), y=np.arange(24) % 10)
    return {"ckpt": str(ckpt), "npz": str(npz), "root": root}


def _errors(capsys, argv, monkeypatch=None) -> tuple[int, list[str]]:
    """Run the CLI; its exit code and its stderr lines that are not argparse's usage lines."""
    code = main(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(("usage:", " "))]
    return code, lines


def _one_line(capsys, argv, status: int, *words: str) -> None:
    code, lines = _errors(capsys, argv)
    assert code == status, (code, lines)
    assert len(lines) == 1, lines
    for word in words:
        assert word in lines[0], (word, lines[0])


def test_a_missing_checkpoint_is_one_line(capsys, files):
    _one_line(capsys, ["calibrate", "resnet20", "--checkpoint", "/nonexistent/w.pt", "--data", files["npz"],
                       "--out", str(files["root"] / "s.safetensors")], 1, "/nonexistent/w.pt")
    _one_line(capsys, ["evaluate", "/nonexistent/model.pt", "--data", files["npz"], "--methods", "source"], 2,
              "/nonexistent/model.pt")


@pytest.mark.parametrize("indices, words", [
    ("-1", ["-1", "negative"]),  # used to take the last image
    ("5:3", ["5:3"]),
    ("0:999", ["0:999", "24 images"]),
    ("a,b", ["a,b"]),
])
def test_bad_indices_are_one_line(capsys, files, indices, words):
    _one_line(capsys, ["evaluate", files["ckpt"], "--data", files["npz"], "--methods", "source",
                       f"--indices={indices}"], 2, *words)
    _one_line(capsys, ["calibrate", files["ckpt"], "--data", files["npz"], f"--indices={indices}",
                       "--out", str(files["root"] / "s.safetensors"), "--no-progress"], 2, *words)


def test_unknown_architecture_and_tail_are_one_line(capsys, files):
    out = str(files["root"] / "s.safetensors")
    _one_line(capsys, ["calibrate", "resnet1000", "--data", files["npz"], "--out", out], 2, "resnet1000")
    _one_line(capsys, ["calibrate", files["ckpt"], "--data", files["npz"], "--out", out, "--tail", "bogus",
                       "--no-progress"], 2, "bogus")
    _one_line(capsys, ["evaluate", files["ckpt"], "--data", files["npz"], "--methods", "nomethod"], 2, "nomethod")


@pytest.mark.parametrize("argv", [
    ["evaluate", "{ckpt}", "--data", "{npz}", "--methods", "source", "--batch-size", "0"],
    ["evaluate", "{ckpt}", "--data", "{npz}", "--methods", "source", "--batch-size", "-5"],  # printed 0.00 %
    ["evaluate", "{ckpt}", "--data", "{npz}", "--methods", "source", "--threads", "-3"],
    ["evaluate", "{ckpt}", "--data", "{npz}", "--methods", "source", "--severity", "9"],
    ["calibrate", "{ckpt}", "--data", "{npz}", "--out", "x", "--batch-size", "0"],
    ["calibrate", "{ckpt}", "--data", "{npz}", "--out", "x", "--threads", "-3"],
    ["calibrate", "{ckpt}", "--data", "{npz}", "--out", "x", "-K", "2"],
    ["calibrate", "{ckpt}", "--data", "{npz}", "--out", "x", "--n-images", "0"],
    ["calibrate", "{ckpt}", "--data", "{npz}", "--out", "x", "--max-samples", "-1"],
    ["calibrate", "{ckpt}", "--data", "{npz}", "--out", "x", "--groups", "0"],
    ["bench", "--preset", "smoke", "--limit", "-1"],  # ran 7 of 8 cells
    ["bench", "--preset", "smoke", "--limit", "0"],
    ["bench", "--preset", "smoke", "--workers", "0"],
    ["bench", "--preset", "smoke", "--n-images", "0"],
    ["bench", "--preset", "smoke", "--batch-sizes", "128,-1"],
    ["bench", "--preset", "smoke", "--seeds", "-2"],
    ["bench", "--preset", "smoke", "--executor", "ray", "--cpus-per-cell", "0"],  # became --threads or 1
    ["bench", "--preset", "smoke", "--executor", "ray", "--cpus-per-cell", "inf"],  # OverflowError in a cell
    ["bench", "--preset", "smoke", "--executor", "ray", "--cpus-per-cell", "nan"],
    ["bench", "--preset", "smoke", "--executor", "ray", "--gpus-per-cell", "-1"],
    ["bench", "--preset", "smoke", "--executor", "ray", "--max-retries", "-1"],
    ["corrupt", "--data", "{npz}", "--out", "o", "--limit", "-1"],  # dropped the last image
    ["corrupt", "--data", "{npz}", "--out", "o", "--limit", "0"],  # wrote empty arrays
    ["corrupt", "--data", "{npz}", "--out", "o", "--workers", "0"],  # was accepted
    ["report", "--tail-deviation", "m", "--batches", "0"],
    ["report", "--tail-deviation", "m", "--batch-size", "-1"],
])
def test_counts_sizes_and_indices_are_checked_by_the_parser(capsys, files, argv):
    argv = [a.format(**files) for a in argv]
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"aqr {argv[0]}: error: argument") and "must be" in err[-1], err


def test_a_corrupted_results_database_is_one_line(capsys, tmp_path):
    from aqr.harness.results import ResultsDB

    path = tmp_path / "r.db"
    with ResultsDB(path) as db:
        db.add_membership("main", [f"k{i}" for i in range(2000)])  # several pages
    data = bytearray(path.read_bytes())
    assert len(data) > 4 * 4096
    data[2 * 4096 : 3 * 4096] = b"\xa5" * 4096  # a page of garbage
    path.write_bytes(bytes(data))
    _one_line(capsys, ["report", "--db", str(path)], 1, str(path))
    _one_line(capsys, ["bench", "--preset", "smoke", "--db", str(path), "--data-dir", str(tmp_path)], 1, str(path))


def test_an_unknown_key_in_a_grid_file_is_one_line(capsys, tmp_path):
    config = tmp_path / "grid.json"
    config.write_text(json.dumps({"preset": "smoke", "bogus_key": 1}))
    _one_line(capsys, ["bench", "--config", str(config), "--dry-run", "--data-dir", str(tmp_path)], 2, "bogus_key")


@pytest.mark.parametrize("order, status, words", [
    ("mixed", 2, ["error: --order 'mixed'", "one corruption"]),  # every cell used to become an error row
    ("mixed,delta=0.1", 2, ["mixes corruptions"]),
    ("delta=-1", 2, ["delta must be >= 0"]),
    ("delta=nan", 2, ["delta must be >= 0"]),
    ("sorted", 2, ["stream order must look like"]),
])
def test_a_bad_stream_order_is_one_line(capsys, tmp_path, order, status, words):
    _one_line(capsys, ["bench", "--preset", "smoke", "--order", order, "--dry-run", "--data-dir", str(tmp_path)],
              status, *words)


def test_usage_errors_read_as_plain_messages(capsys, files, tmp_path):
    """A UsageError is the expected kind of failure: its line is the message, not 'UsageError: ...'."""
    _one_line(capsys, ["bench", "--preset", "smoke", "--models", "nosuch", "--dry-run", "--data-dir", str(tmp_path)],
              2, "aqr bench: error: models ['nosuch'] are not in grid")
    _one_line(capsys, ["evaluate", "timm:resnet50", "--data", files["npz"], "--methods", "source"], 2,
              "aqr evaluate: error: timm:resnet50 needs weights")


def test_debug_shows_the_traceback(capsys, files, monkeypatch):
    argv = ["calibrate", "resnet1000", "--data", files["npz"], "--out", "x"]
    with pytest.raises(KeyError, match="resnet1000"):
        main(["--debug", *argv])
    with pytest.raises(KeyError, match="resnet1000"):
        main([*argv, "--debug"])
    monkeypatch.setenv("AQR_DEBUG", "1")
    with pytest.raises(KeyError, match="resnet1000"):
        main(argv)


def test_library_counts_are_checked(files):
    """The same checks where the CLI calls the library."""
    from aqr.cli.common import torch_threads
    from aqr.core.calibrate import calibrate
    from aqr.harness.cells import parse_range
    from aqr.harness.eval_loop import evaluate

    model = create("resnet20", num_classes=10, width=4).eval()
    x = torch.rand(4, 3, 32, 32)
    with pytest.raises(ValueError, match="batch_size"):
        evaluate(model, x, np.zeros(4), 0)
    with pytest.raises(ValueError, match="negative"):
        parse_range("3,-1")
    with pytest.raises(ValueError, match="max_batches"):
        calibrate(model, [x], max_batches=0)
    with pytest.raises(ValueError, match="threads"):
        with torch_threads(-3):
            pass
    from aqr.harness.ray_executor import RayOptions
    for bad in ({"cpus_per_cell": float("inf")}, {"cpus_per_cell": float("nan")}, {"gpus_per_cell": float("inf")},
                {"max_retries": -1}, {"max_retries": 1.5}):
        with pytest.raises(ValueError):
            RayOptions(**bad)
    from aqr.adapt import AQRConfig
    for bad in ({"target_samples": 10**9}, {"grid": 0}, {"grid": 10**7}, {"target_samples": 64.5}):
        with pytest.raises(ValueError):
            AQRConfig(**bad)


def test_calibrate_with_groups_writes_class_conditional_knots(capsys, files):
    import aqr

    out = files["root"] / "groups.aqr.safetensors"
    assert main(["calibrate", files["ckpt"], "--data", files["npz"], "--out", str(out), "--groups", "4",
                 "--no-progress"]) == 0
    stats = aqr.SourceStats.load(out)
    assert stats.groups == 4 and sum(stats.group_images) == 24  # labels 0-9: groups 0, 1 hold three classes
    assert stats.group_images == (7, 7, 5, 5)
