"""Hardening, round 4: output paths that are not files, costs files written by several processes, NaN in
``quantile_map``, tracing, non-finite hyperparameters, unchecked labels and sizes, grid values checked up
front, the user's model left alone, and small raw errors.

Each test reproduces an attack that used to replace a device, give a wrong number or fail late."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from aqr.cli import main
from tests.cli_lines import one_error_line
from tests.models_tiny import tiny_checkpoint_and_images

N_IMAGES = 40


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """A small aqr checkpoint, 40 CIFAR-shaped images with labels 0..9, a grid file over them."""
    root = tmp_path_factory.mktemp("round4")
    ckpt, npz, rng = tiny_checkpoint_and_images(root, N_IMAGES)
    grid = {"name": "round4", "models": [{"name": "tiny", "model": str(ckpt), "source_data": str(npz),
                                         "source_indices": f"0:{N_IMAGES}"}],
            "data": {"root": str(root / "generated"), "clean": str(npz), "eval_indices": f"20:{N_IMAGES}"},
            "corruptions": ["fog"], "severities": [1], "batch_sizes": [10], "seeds": [0], "n_images": 10,
            "methods": ["source"]}
    (root / "grid.json").write_text(json.dumps(grid))
    return {"ckpt": str(ckpt), "npz": str(npz), "grid": str(root / "grid.json"), "root": str(root),
            "generated": str(root / "generated")}


# ---- 1. output paths that are not regular files (folders) ----------------------------------------

def _fifo(tmp_path: Path) -> Path:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    return fifo


def _commands(files: dict[str, str], tmp_path: Path, fifo: Path, a_file: Path) -> list[tuple[list[str], str]]:
    """Every command that writes, given a FIFO where it writes a file and a file where it fills a folder."""
    bench = ["bench", "--config", files["grid"], "--no-progress"]
    return [
        (["calibrate", files["ckpt"], "--data", files["npz"], "--out", str(fifo), "--no-progress"], "a FIFO"),
        (["train", "--model", "resnet20", "--data", files["npz"], "--out", str(fifo), "--epochs", "1"], "a FIFO"),
        (["train", "--model", "resnet20", "--data", files["npz"], "--work-dir", str(a_file), "--epochs", "1"],
         "not a folder"),
        (["train", "--export", "--work-dir", str(tmp_path), "--out", str(fifo)], "a FIFO"),
        (["corrupt", "--data", files["npz"], "--out", str(a_file), "--no-progress"], "not a folder"),
        (["report", "--db", str(tmp_path / "r.db"), "--out", str(a_file)], "not a folder"),
        ([*bench, "--db", str(fifo), "--cache", str(tmp_path / "cache")], "a FIFO"),
        ([*bench, "--db", str(tmp_path / "r.db"), "--cache", str(a_file)], "not a folder"),
        ([*bench, "--db", str(tmp_path / "r.db"), "--cache", str(tmp_path / "c"), "--costs", str(fifo)], "a FIFO"),
        (["demo", "--out", str(a_file), "--quick", "--no-progress"], "not a folder"),
        (["synth", "shapes", "--out", str(a_file), "--quick"], "not a folder"),
    ]


def test_every_command_refuses_a_target_that_is_not_a_regular_file_or_folder(capsys, files, tmp_path):
    fifo = _fifo(tmp_path)
    a_file = tmp_path / "a-file"
    a_file.write_text("keep me\n")
    for argv, words in _commands(files, tmp_path, fifo, a_file):
        one_error_line(capsys, argv, 2, words)  # calibrate used to replace the FIFO with its statistics, exit 0
        assert stat.S_ISFIFO(fifo.stat().st_mode) and a_file.read_text() == "keep me\n", argv
    assert not (tmp_path / "r.db").exists() and not Path(files["generated"]).exists()


def test_atomic_write_and_the_savers_refuse_a_fifo_and_a_path_under_a_file(tmp_path):
    from aqr.models import create, save_checkpoint
    from aqr.util.files import WriteTargetError, atomic_write, check_writable_target

    fifo = _fifo(tmp_path)
    with pytest.raises(WriteTargetError, match="is a FIFO, not a regular file"):
        atomic_write(fifo, lambda tmp: tmp.write_text("x"))
    with pytest.raises(WriteTargetError, match="is a FIFO"):
        save_checkpoint(fifo, create("resnet20", num_classes=10, width=4), {"name": "resnet20"})
    assert stat.S_ISFIFO(fifo.stat().st_mode) and os.listdir(tmp_path) == ["fifo"]  # no temporary left
    (tmp_path / "f").write_text("")
    with pytest.raises(WriteTargetError, match="is a regular file, not a folder"):
        check_writable_target(tmp_path / "f" / "deeper" / "out.pt")
    with pytest.raises(WriteTargetError, match="is a folder; give a file name"):
        check_writable_target(tmp_path)
    assert check_writable_target(tmp_path / "new" / "out.pt") == tmp_path / "new" / "out.pt"
    assert check_writable_target(tmp_path, folder=True) == tmp_path


# ---- 6. a costs file saved by several writers at once ----------------------------------------------

def test_costs_saved_by_several_writers_at_once_never_fail_or_tear(tmp_path):
    import threading

    from aqr.harness.realtime.costs import CostTable

    path = tmp_path / "costs.json"
    table = CostTable({f"m|v{i}|64": {"cost": 1.5} for i in range(200)})
    table.save(path)
    errors: list[str] = []
    done = threading.Event()

    def write() -> None:
        for _ in range(100):
            try:
                table.save(path)  # one fixed <file>.tmp: FileNotFoundError when another writer renamed it first
            except Exception as err:  # noqa: BLE001 - counted
                errors.append(repr(err))

    def read() -> None:
        while not done.is_set():
            try:
                assert len(CostTable.load(path).entries) == 200
            except Exception as err:  # noqa: BLE001 - a torn file
                errors.append(repr(err))

    writers = [threading.Thread(target=write) for _ in range(4)]
    reader = threading.Thread(target=read)
    for t in (*writers, reader):
        t.start()
    for t in writers:
        t.join()
    done.set()
    reader.join()
    assert errors == []
    assert sorted(os.listdir(tmp_path)) == ["costs.json"]


# ---- 7. NaN and Inf in aqr.quantile_map ---------------------------------------------------------------

@pytest.mark.parametrize("where", ["one", "channel", "inf", "given-knots"])
def test_quantile_map_refuses_nan_and_inf_naming_the_channel(where):
    import aqr

    torch.manual_seed(0)
    x = torch.randn(4, 1000)
    source = aqr.channel_quantiles(torch.randn(4, 5000) * 2 + 1, 101)
    target = aqr.channel_quantiles(x, 101) if where == "given-knots" else None
    if where == "channel":
        x[2] = float("nan")  # used to become a constant channel
    else:
        x[2, 17] = float("inf") if where == "inf" else float("nan")  # used to move the other 999 by up to 2.2
    count = 1000 if where == "channel" else 1
    with pytest.raises(ValueError, match=rf"NaN or Inf: {count} of the 1000 values of channel 2"):
        aqr.quantile_map(x, source, target)
    with pytest.raises(ValueError, match=r"source_q holds NaN"):
        aqr.quantile_map(torch.randn(4, 10), torch.full((4, 101), float("nan")))
    assert torch.isfinite(aqr.quantile_map(torch.randn(4, 1000), source)).all()


# ---- 13. small raw errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("k, error", [(3.5, TypeError), ("101", TypeError), (True, TypeError), (2, ValueError)])
def test_a_non_integer_num_quantiles_is_named(k, error):
    import aqr

    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).eval()
    with pytest.raises(error, match=rf"num_quantiles must be.*{k!r}" if error is TypeError else "num_quantiles"):
        aqr.calibrate(net, [torch.randn(8, 3)], num_quantiles=k, progress=False)
    with pytest.raises(error, match="num_quantiles"):
        aqr.channel_quantiles(torch.randn(4, 10), k)


def test_absurd_knot_counts_and_sample_sizes_are_refused_before_allocating():
    import aqr
    from aqr.util import memory

    with pytest.raises(MemoryError, match="num_quantiles=100000000 for 512 channels needs about"):
        aqr.channel_quantiles(torch.randn(512, 10), 10**8)  # used to try about 400 GB
    assert memory.available_bytes() is None or aqr.channel_quantiles(torch.randn(2, 10), 11).shape == (2, 11)
    for n, delta in ((0, 0.05), (-3, 0.05), (2.5, 0.05), (100, 0.0), (100, 1.5), (100, float("nan"))):
        with pytest.raises(ValueError, match="dkw_epsilon needs"):
            aqr.dkw_epsilon(n, delta)  # (0, .05) was a ZeroDivisionError
    assert 0 < aqr.dkw_epsilon(100, 0.05) < 1


def test_a_channel_mismatch_on_the_last_dim_names_what_it_found():
    from aqr.core.layers import LayerError, LayerInfo, check_output

    info = LayerInfo("norm", "LayerNorm", 8, -1)
    with pytest.raises(LayerError, match=r"expected 8 channels on the last dim \(-1\), it has 5"):
        check_output(info, torch.zeros(4, 8, 5))  # read "expected 8 channels on dim -1" beside a shape with an 8


# ---- 8 and 12. aqr.AQR: tracing, and the user's model left alone ---------------------------------------

def _bn_net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(4, 3)).eval()


@pytest.fixture()
def net_stats():
    import aqr

    torch.manual_seed(0)
    net = _bn_net()
    return net, aqr.calibrate(net, [torch.rand(16, 3, 12, 12) for _ in range(2)], progress=False)


@pytest.mark.parametrize("target", ["batch", "stream"])
@pytest.mark.parametrize("check_trace", [True, False])
def test_tracing_aqr_is_refused_inone_error_line(net_stats, target, check_trace):
    import aqr

    net, stats = net_stats
    adapted = aqr.AQR(net, stats, target=target)
    x = torch.rand(8, 3, 12, 12)
    with pytest.raises(RuntimeError, match=r"^aqr.AQR cannot be recorded by torch.jit.trace") as caught:
        torch.jit.trace(adapted, x, check_trace=check_trace)  # check_trace=False: a trace off by 7.7e31 on its batch
    assert "\n" not in str(caught.value)
    with torch.no_grad():
        assert torch.isfinite(adapted(x)).all()  # eager use goes on


def test_the_wrappers_train_flag_and_conversions_leave_the_users_model_alone(net_stats):
    import aqr

    net, stats = net_stats
    adapted = aqr.AQR(net, stats)
    running = net[1].running_mean.clone()
    assert adapted.train() is adapted and adapted.training
    assert not net.training and not any(m.training for m in net.modules())  # was: the user's model in train mode
    with torch.no_grad():
        net(torch.rand(8, 3, 12, 12) * 3)
    assert torch.equal(net[1].running_mean, running)  # a plain m(x) did not update its running statistics
    net.train()
    adapted.eval()
    assert net.training and not adapted.training  # nor does eval() change it the other way
    net.eval()
    weight = net[0].weight
    for convert in (lambda a: a.half(), lambda a: a.to(torch.float64), lambda a: a.double(), lambda a: a.bfloat16()):
        with pytest.raises(ValueError, match="never converts the user's model in place"):
            convert(adapted)
        assert net[0].weight is weight and weight.dtype == torch.float32 and net[1].running_var.dtype == torch.float32
    assert adapted.to("cpu") is adapted and adapted.float() is adapted  # conversions that change nothing pass
    with torch.no_grad():
        assert adapted(torch.rand(8, 3, 12, 12)).dtype == torch.float32


# ---- 9. non-finite hyperparameters ------------------------------------------------------------------

@pytest.mark.parametrize("name, options", [("sar", {"rho": float("nan")}), ("sar", {"e0_factor": float("inf")}),
                                           ("tent", {"lr": float("nan")}), ("eata", {"lr": float("inf")}),
                                           ("aqr", {"gaussian_p": float("nan")}), ("cotta", {"ema": float("nan")})])
def test_every_method_refuses_a_non_finite_option(name, options):
    from aqr.methods import create
    from aqr.models import create as architecture

    (key, value), = options.items()
    with pytest.raises(ValueError, match=rf"{key}={value!r}.*finite"):
        create(name, architecture("resnet20", num_classes=10, width=4), **options)  # sar's rho=nan was accepted


@pytest.mark.parametrize("argv, words", [
    (["--lr", "nan"], ["--lr", "finite", "'nan'"]),  # was exit 0 and a checkpoint of 59 NaN parameters
    (["--lr", "-1"], ["--lr"]), (["--momentum", "inf"], ["--momentum"]), (["--weight-decay", "-1"], ["--weight-decay"]),
    (["--label-smoothing", "nan"], ["--label-smoothing"]), (["--warmup-epochs", "inf"], ["--warmup-epochs"]),
])
def test_train_refuses_non_finite_hyperparameters(capsys, files, tmp_path, argv, words):
    out = tmp_path / "m.pt"
    one_error_line(capsys, ["train", "--model", "resnet20", "--data", files["npz"], "--epochs", "1", "--out", str(out),
                       *argv], 2, *words)
    assert not out.exists()


def test_train_config_checks_its_hyperparameters():
    from aqr.models.train import TrainConfig

    for field, value in (("lr", float("nan")), ("min_lr", float("inf")), ("momentum", 1.5), ("label_smoothing", -0.1)):
        with pytest.raises(ValueError, match=rf"{field} must be a finite number"):
            TrainConfig(model="resnet20", data="d.npz", **{field: value})


# ---- 10. labels and sizes ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def label_files(files) -> dict[str, str]:
    """The fixture's images with labels -1, 10 (past the checkpoint's 10 classes) and 10**12."""
    root = Path(files["root"])
    x = np.random.default_rng(1).integers(0, 256, (12, 32, 32, 3), dtype=np.uint8)
    made = {}
    for name, label in (("negative", -1), ("ten", 10), ("huge", 10**12)):
        np.savez(root / f"{name}.npz", x=x, y=np.full(12, label))
        made[name] = str(root / f"{name}.npz")
    return made


def test_labels_outside_the_classes_are_refused(capsys, files, label_files, tmp_path):
    for name, words in (("negative", ["holds the label -1"]), ("ten", ["the label 10", "10 classes"])):
        one_error_line(capsys, ["evaluate", files["ckpt"], "--data", label_files[name], "--methods", "source"], 2,
                  *words)  # was "0.00 %", exit 0
    one_error_line(capsys, ["corrupt", "--data", label_files["negative"], "--out", str(tmp_path / "c"),
                       "--corruptions", "fog", "--severities", "1", "--no-progress"], 2, "label -1")  # was copied
    assert not (tmp_path / "c").exists()
    one_error_line(capsys, ["train", "--model", "resnet20", "--data", label_files["huge"], "--epochs", "1"], 2,
              "label 1000000000000")  # was an attempt at 256 TB


def test_train_refuses_absurd_sizes_before_building(capsys, files):
    one_error_line(capsys, ["train", "--model", "resnet20", "--data", files["npz"], "--epochs", "1",
                       "--model-kwargs", '{"width": 100000}'], 2, "model_kwargs['width']", "4096")  # was 360 GB
    one_error_line(capsys, ["train", "--model", "resnet20", "--data", files["npz"], "--epochs", "1",
                       "--threads", "100000"], 2, "--threads", "1024")  # was a segmentation fault in libgomp
    from aqr.util.threads import torch_threads

    with pytest.raises(ValueError, match="1024"):
        with torch_threads(100_000):
            pass


# ---- 11. grid values checked up front ----------------------------------------------------------------

@pytest.mark.parametrize("change, words", [
    ({"seeds": [-1]}, ["seeds", "-1"]), ({"seeds": [10**20]}, ["seeds", "2**63 - 1"]),
    ({"severities": [2.7]}, ["severities", "2.7"]),  # was run as severity 2
    ({"severities": [True]}, ["severities", "True"]),  # was run as severity 1
    ({"n_images": 2.5}, ["n_images", "2.5"]),  # was 2
    ({"batch_sizes": ["8"]}, ["batch_sizes", "'8'"]),
])
def test_grid_file_values_are_refused_as_written(capsys, files, tmp_path, change, words):
    grid = {**json.loads(Path(files["grid"]).read_text()), **change}
    path = tmp_path / "grid.json"
    path.write_text(json.dumps(grid))
    one_error_line(capsys, ["bench", "--config", str(path), "--db", str(tmp_path / "r.db"), "--dry-run"], 2, *words)


def test_seeds_past_what_torch_holds_are_refused_by_the_parser(capsys, files, tmp_path):
    big = "99999999999999999999"  # passed --dry-run, then an OverflowError in every cell
    one_error_line(capsys, ["bench", "--config", files["grid"], "--db", str(tmp_path / "r.db"), "--dry-run",
                       "--seeds", big], 2, "--seeds")
    one_error_line(capsys, ["evaluate", files["ckpt"], "--data", files["npz"], "--methods", "source", "--seed", big], 2,
              "--seed")
    from aqr.methods.base import ProtocolConfig

    with pytest.raises(ValueError, match="seed must be an integer"):
        ProtocolConfig(seed=10**20)


def test_a_cost_that_rounds_to_zero_is_refused_on_load(tmp_path):
    from aqr.harness.realtime.costs import COSTS_FORMAT, CostTable

    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"format": COSTS_FORMAT, "version": 1, "entries": {"m|v|64": {"cost": 0.001}}}))
    with pytest.raises(ValueError, match="rounds to 0.00"):
        CostTable.load(path)  # was loaded, and its cells written as error rows


# ---- CI: the real-data tests run where the data folder lies beside the checkout -------------------------

@pytest.mark.parametrize("preset", [None, "/elsewhere"])
def test_ci_points_aqr_data_dir_at_the_shared_folder_beside_the_checkout(tmp_path, preset):
    import subprocess

    script = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    head = script.split("python3 -m venv", 1)[0]  # up to the install: the environment it sets
    checkout = tmp_path / "checkout"
    (checkout / ".ci").mkdir(parents=True)
    (tmp_path / "shared" / "data").mkdir(parents=True)
    (checkout / ".ci" / "run").write_text(head + 'echo "AQR_DATA_DIR=${AQR_DATA_DIR:-}"\n')
    env = {k: v for k, v in os.environ.items() if k != "AQR_DATA_DIR"}
    if preset:
        env["AQR_DATA_DIR"] = preset
    done = subprocess.run(["bash", str(checkout / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    want = preset or str((tmp_path / "shared" / "data").resolve())
    assert done.stdout.strip().splitlines()[-1] == f"AQR_DATA_DIR={want}"  # was unset: the data tests skipped


def test_report_on_an_empty_file_refuses_and_leaves_it_empty(tmp_path, capsys):
    db = tmp_path / "empty.db"
    db.touch()
    assert main(["report", "--db", str(db), "--no-figures"]) == 1
    assert "holds no results database" in capsys.readouterr().err
    assert db.stat().st_size == 0  # no schema written into a file the report only reads


def test_a_locked_database_is_named_in_the_error(tmp_path):
    import sqlite3

    from aqr.harness.cells import Cell, DataSpec, ModelSpec
    from aqr.harness.results import ResultsDB, ResultsDBError

    path = tmp_path / "runs.db"
    ResultsDB(path).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # another process's write transaction
    cell = Cell(ModelSpec("m", "m"), DataSpec(), "source", (), "fog", 1, 8, 0, 16).to_dict()
    try:
        with pytest.raises(ResultsDBError, match=r"runs\.db stayed locked for 0\.1 s"):
            with ResultsDB(path, timeout=0.1) as db:
                db.add("k", cell, "ok", 0.5, 16, 1.0, {})
    finally:
        holder.rollback()
        holder.close()
