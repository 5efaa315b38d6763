"""Sizes that would exhaust the machine's memory are refused before anything is allocated: K at most
the kept sample, image sides at most 4,096, and a calibration larger than the available memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import aqr
from aqr.core import calibrate as calibrate_module
from aqr.cli import main
from aqr.data.images import Preprocess
from aqr.models import create, save_checkpoint
from aqr.util import memory
from tests.models_tiny import bn_cnn, images

MEMORY_MODULE = Path(memory.__file__)


def test_k_above_the_kept_sample_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match=r"num_quantiles \(1000000\).*max_samples \(100000\)"):
        aqr.calibrate(bn_cnn(), [images(4)], num_quantiles=10**6)


def test_a_calibration_larger_than_the_available_memory_is_refused(monkeypatch) -> None:
    model = bn_cnn()
    needed = calibrate_module.calibration_bytes(aqr.norm_layers(model), 10**9, 101, True, None)
    monkeypatch.setattr(memory, "available_bytes", lambda: needed - 1)
    with pytest.raises(MemoryError, match=r"needs about .* but only .* is available"):
        aqr.calibrate(model, [images(4)], max_samples=10**9)
    monkeypatch.setattr(memory, "available_bytes", lambda: None)  # unknown: nothing refused
    stats = aqr.calibrate(model, [images(4)], max_samples=1000)
    assert stats.max_samples == 1000


def test_the_memory_estimate_grows_with_the_sample_and_the_groups() -> None:
    infos = aqr.norm_layers(bn_cnn())
    base = calibrate_module.calibration_bytes(infos, 1000, 11, False, None)
    assert calibrate_module.calibration_bytes(infos, 2000, 11, False, None) > base
    assert calibrate_module.calibration_bytes(infos, 1000, 11, True, None) > base
    assert calibrate_module.calibration_bytes(infos, 1000, 11, False, 4) > base
    channels = sum(i.channels for i in infos)
    assert base >= channels * 1000 * 4  # at least the kept float32 sample


def test_available_memory_reads_meminfo_and_the_address_space_limit(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 100 kB\nMemAvailable:  2048 kB\n")
    status = tmp_path / "status"
    status.write_text("VmSize: 10 kB\n")
    assert memory.available_bytes(meminfo, status) <= 2048 * 1024  # MemAvailable, or less under RLIMIT_AS
    meminfo.write_text("MemTotal: 100 kB\n")  # unreadable: nothing is refused (unless RLIMIT_AS is set)
    assert memory.available_bytes(meminfo, status) is None or memory.available_bytes(meminfo, status) >= 0
    # RLIMIT_AS in a child process (the module loaded from its file: no torch under the limit)
    code = (f"import importlib.util, resource\n"
            f"spec = importlib.util.spec_from_file_location('m', {str(MEMORY_MODULE)!r})\n"
            f"m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            f"resource.setrlimit(resource.RLIMIT_AS, (2 << 30, resource.RLIM_INFINITY))\n"
            f"print(m.available_bytes())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert 0 < int(out) < 2 << 30


def test_check_memory_names_both_numbers() -> None:
    with pytest.raises(MemoryError, match=r"demo run needs about 2\.0 GiB of memory, but only 1\.0 GiB"):
        memory.check_memory(2 << 30, "demo run", available=1 << 30)
    memory.check_memory(1 << 30, "demo run", available=2 << 30)


def test_image_sides_above_4096_are_refused() -> None:
    with pytest.raises(ValueError, match="at most 4096"):
        Preprocess(crop=100_000, resize=100_000)
    Preprocess(crop=4096, resize=4096)


def test_empty_batches_are_skipped_and_only_empty_data_is_refused() -> None:
    x = images(6)
    stats = aqr.calibrate(bn_cnn(), [x[:0], x, x[:0]])
    reference = aqr.calibrate(bn_cnn(), [x])
    for name in stats.layer_names:
        assert torch.equal(stats.layers[name].quantiles, reference.layers[name].quantiles)
    with pytest.raises(ValueError, match="no images"):
        aqr.calibrate(bn_cnn(), [x[:0]])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bombs")
    torch.manual_seed(0)
    model = create("resnet20", num_classes=10, width=4)
    ckpt = save_checkpoint(root / "tiny.pt", model, {"name": "resnet20", "num_classes": 10, "kwargs": {"width": 4}})
    npz = root / "images.npz"
    np.savez(npz, x=np.random.default_rng(0).integers(0, 256, (12, 32, 32, 3), dtype=np.uint8), y=np.arange(12) % 10)
    return {"ckpt": str(ckpt), "npz": str(npz), "root": root}


@pytest.mark.parametrize("extra, words", [
    (["-K", "1000000000"], ["--num-quantiles 1000000000", "--max-samples 100000"]),
    (["--image-size", "100000"], ["--image-size", "4096"]),
    (["--resize", "100000"], ["--resize", "4096"]),
    (["--out-is-folder"], ["is a folder"]),
])
def test_cli_refuses_sizes_before_any_work(files, capsys, extra, words) -> None:
    out = str(files["root"] / "s.aqr.safetensors")
    if extra == ["--out-is-folder"]:
        out, extra = str(files["root"]), []
    try:
        code = main(["calibrate", files["ckpt"], "--data", files["npz"], "--out", out, *extra])
    except SystemExit as stop:  # argparse's own refusals
        code = stop.code
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and not ln.startswith(("usage:", " "))]
    assert code == 2 and len(err) == 1, err
    assert all(w in err[0] for w in words), err
    assert not list(files["root"].glob("*.safetensors"))
