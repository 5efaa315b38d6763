"""Stream cells that checkpoint every N images: killed at any point (an exception, SIGKILL), they resume with
the predictions of an uninterrupted run, and the checkpoint is gone once the cell completes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from aqr.harness import continual
from aqr.harness.cell_run import build_method, run_cell, stream_checkpoint
from aqr.harness.cells import Cell
from aqr.harness.grid_driver import run_grid
from aqr.harness.results import ResultsDB
from aqr.harness.specs import MethodSpec
from aqr.harness.stream_checkpoint import CheckpointError, StreamCheckpoint
from tests.test_bench import _tiny_setup

pytestmark = pytest.mark.usefixtures("one_thread")

STREAM = "continual:gaussian_noise+contrast"
# a gradient method (TENT: SGD with momentum, the optimizer's state saved beside the weights) and streaming AQR
METHODS = (MethodSpec.parse("tent"), MethodSpec.parse("aqr:target=stream"))


@pytest.fixture()
def stream_grid(tmp_path: Path):
    grid, _ = _tiny_setup(tmp_path)
    return replace(grid, name="ckpt", corruptions=(STREAM,), batch_sizes=(4,), n_images=12, protocol="online",
                   methods=METHODS, models=grid.models[:1])


def _cell(grid, method: str) -> Cell:
    return next(c for c in grid.cells() if c.variant == method)


class _Stop(Exception):
    pass


def _predictions(cell: Cell, cache: Path, checkpoint: StreamCheckpoint | None = None,
                 stop_at: int | None = None) -> tuple[list[np.ndarray], np.ndarray | None]:
    """The stream through a freshly built method: the logits of each batch it saw and the correctness, or
    ``None`` when stopped by an exception raised before the batch that starts at image ``stop_at``."""
    torch.manual_seed(cell.seed)
    method = build_method(cell, cache)
    images, labels, starts = continual.stream_batches(cell, continual.stream_blocks(cell))
    seen: list[np.ndarray] = []
    count = [0]

    def before(module, args):
        if stop_at is not None and count[0] >= stop_at:
            raise _Stop
        count[0] += len(args[0])

    method.register_forward_pre_hook(before)
    method.register_forward_hook(lambda module, args, out: seen.append(out.numpy()))
    if checkpoint is not None:  # where a resumed stream starts counting
        resumed_at = torch.load(checkpoint.path, weights_only=True)["n_images"] if checkpoint.path.is_file() else 0
        count[0] = resumed_at
    try:
        correct = continual.evaluate_stream(method, images, labels, starts, checkpoint=checkpoint)
    except _Stop:
        return seen, None
    return seen, correct


@pytest.mark.parametrize("variant", ["tent", "aqr[target=stream]"])
def test_a_stream_stopped_by_an_exception_resumes_with_the_same_predictions(stream_grid, tmp_path: Path,
                                                                           variant: str) -> None:
    cell = _cell(stream_grid, variant)
    cache = tmp_path / "cache"
    whole, whole_correct = _predictions(cell, cache)
    assert len(whole) == 6 and whole_correct is not None
    checkpoint = stream_checkpoint(cell, cache, every=8)
    first, stopped = _predictions(cell, cache, checkpoint, stop_at=20)  # saved at 8 and 16 images, stopped at 20
    assert stopped is None and len(first) == 5
    assert torch.load(checkpoint.path, weights_only=True)["n_images"] == 16
    rest, correct = _predictions(cell, cache, checkpoint)
    assert len(rest) == 2  # the batches from image 16 on: the one at 16..20 again, then the last
    # the logits, bit for bit (the argmax alone would not show a lost optimizer state on so short a stream)
    assert all(np.array_equal(a, b) for a, b in zip(first[:4] + rest, whole, strict=True))
    assert np.array_equal(correct, whole_correct)
    # the checkpoint held a state the stream had moved away from a fresh method's: restoring it mattered
    saved = torch.load(checkpoint.path, weights_only=True)
    assert saved["batches_since_reset"] == 4
    assert _tensors(saved["method"]) and _tensors(saved["method"]) != _tensors(build_method(cell, cache).state_dict())


def _tensors(state) -> list[tuple]:
    """Every tensor of a nested state, as comparable tuples, in order."""
    if isinstance(state, torch.Tensor):
        return [tuple(state.flatten().tolist())]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import torch
    from aqr.harness.cell_run import run_cell
    from aqr.harness.cells import Cell
    from aqr.methods.base import TTAMethod

    cell = Cell.from_dict(json.loads(open(sys.argv[1]).read()))
    kill_at, seen = int(sys.argv[3]), [0]

    def before(module, args):
        if isinstance(module, TTAMethod):
            if seen[0] >= kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            seen[0] += len(args[0])

    torch.nn.modules.module.register_module_forward_pre_hook(before)
    result = run_cell(cell, sys.argv[2], checkpoint_every=8, threads=1)
    print(result.status, result.message, file=sys.stderr)
""")


@pytest.mark.parametrize("variant", ["tent", "aqr[target=stream]"])
def test_a_cell_killed_mid_stream_resumes_with_the_results_of_an_uninterrupted_run(stream_grid, tmp_path: Path,
                                                                                  variant: str) -> None:
    cell = _cell(stream_grid, variant)
    cache = tmp_path / "cache"
    whole = run_cell(cell, cache)
    assert whole.status == "ok", whole.message
    cell_file = tmp_path / "cell.json"
    cell_file.write_text(json.dumps(cell.to_dict()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "src"),
                                                        os.environ.get("PYTHONPATH", "")])}
    child = subprocess.run([sys.executable, "-c", _CHILD, str(cell_file), str(cache), "20"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr
    checkpoint = stream_checkpoint(cell, cache, every=8)
    assert torch.load(checkpoint.path, weights_only=True)["n_images"] == 16
    resumed = run_cell(cell, cache, checkpoint_every=8)
    assert resumed.status == "ok", resumed.message
    assert resumed.detail == whole.detail and resumed.accuracy == whole.accuracy
    assert not checkpoint.path.exists()  # removed once the cell completed


def test_run_grid_passes_checkpoint_every_to_its_cells_and_leaves_no_checkpoint(stream_grid, tmp_path: Path) -> None:
    with ResultsDB(tmp_path / "r.db") as db:
        summary = run_grid(stream_grid, db, tmp_path / "cache", progress=False, log=lambda m: None,
                           checkpoint_every=4)
        assert summary.ran == 2 and summary.errors == 0, summary.error_messages
    assert not list((tmp_path / "cache" / "stream_checkpoints").glob("*"))
    with ResultsDB(tmp_path / "r2.db") as db, pytest.raises(ValueError, match="checkpoint_every"):
        run_grid(stream_grid, db, tmp_path / "cache", progress=False, log=lambda m: None, checkpoint_every=0)


def test_a_checkpoint_of_another_cell_or_stream_is_refused_with_its_file_named(stream_grid, tmp_path: Path) -> None:
    cell = _cell(stream_grid, "tent")
    cache = tmp_path / "cache"
    checkpoint = stream_checkpoint(cell, cache, every=8)
    _predictions(cell, cache, checkpoint, stop_at=12)
    assert checkpoint.path.is_file()
    other = StreamCheckpoint(checkpoint.path, "another-key", 8)
    with pytest.raises(CheckpointError, match=f"{checkpoint.path}.*belongs to the cell"):
        other.resume(build_method(cell, cache), 24)
    with pytest.raises(CheckpointError, match="stream of 24 images; this one has 30"):
        checkpoint.resume(build_method(cell, cache), 30)
    aqr_cell = _cell(stream_grid, "aqr[target=stream]")
    with pytest.raises(CheckpointError, match="does not fit the cell's method"):
        checkpoint.resume(build_method(aqr_cell, cache), 24)
    checkpoint.path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot be read"):
        checkpoint.resume(build_method(cell, cache), 24)
    # and a cell whose checkpoint cannot be resumed records an error naming it, rather than a wrong result
    result = run_cell(cell, cache, checkpoint_every=8)
    assert result.status == "error" and "remove it to run the cell from the start" in result.message


def test_checkpoint_every_must_be_a_positive_count() -> None:
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="checkpoint_every must be an integer >= 1"):
            StreamCheckpoint(Path("x.pt"), "k", bad)  # type: ignore[arg-type]
    assert StreamCheckpoint(Path("x.pt"), "k", 8).due(4, 8) and not StreamCheckpoint(Path("x.pt"), "k", 8).due(8, 12)



def test_a_state_that_weights_only_could_not_read_is_refused_when_saved(stream_grid, tmp_path: Path) -> None:
    cell = _cell(stream_grid, "tent")
    method = build_method(cell, tmp_path / "cache")
    checkpoint = StreamCheckpoint(tmp_path / "c.pt", "k", 8)
    original = method.state_dict

    def odd_state(*args, **kwargs):
        return {**original(*args, **kwargs), "memory": [object()]}

    method.state_dict = odd_state  # type: ignore[method-assign]
    with pytest.raises(CheckpointError, match=r"state_dict\(\)\['memory'\]\[0\] \(object\) is not a tensor"):
        checkpoint.save(method, 1, np.zeros(24, dtype=bool), 4)
    assert not checkpoint.path.exists()
