"""Nothing the project publishes names a folder of the machine that made it: checkpoints record
relative paths (or file names), and no committed file outside tests/ holds a machine path."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from aqr.models.checkpoint import read_file
from aqr.models.portable import portable_command, portable_path, portable_train_config
from aqr.models.train import train
from tests.test_train import make_npz, small_config

ROOT = Path(__file__).resolve().parents[1]
MACHINE_PATH = re.compile(rb"/(home|root|tmp|work|Users)/")


def test_paths_are_recorded_relative_to_the_working_folder_or_by_name(tmp_path: Path) -> None:
    assert portable_path(tmp_path / "runs" / "out.pt", cwd=tmp_path) == "runs/out.pt"
    assert portable_path("/elsewhere/data/train.npz", cwd=tmp_path) == "train.npz"
    assert portable_path("data/train.npz", cwd=tmp_path) == "data/train.npz"
    assert portable_path("../up/train.npz", cwd=tmp_path) == "train.npz"
    assert portable_path(None) is None
    cfg = portable_train_config({"data": "/tmp/x/train.npz", "out": str(tmp_path / "o.pt"), "lr": 0.1,
                                 "command": "aqr train --data /tmp/x/train.npz --lr 0.1"}, cwd=tmp_path)
    assert cfg == {"data": "train.npz", "out": "o.pt", "lr": 0.1, "command": "aqr train --data train.npz --lr 0.1"}
    assert portable_command("aqr train --out /root/out/m.pt") == "aqr train --out m.pt"


def test_a_trained_checkpoint_records_no_machine_path(tmp_path: Path, monkeypatch) -> None:
    data = make_npz(tmp_path / "train.npz", 64, 0), make_npz(tmp_path / "test.npz", 32, 1)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    cfg = small_config(data, tmp_path, out=str(work / "ckpt" / "m.pt"), work_dir=str(work / "state"),
                       command=f"aqr train --data {data[0]} --out {work / 'ckpt' / 'm.pt'}")
    out = train(cfg)["out"]
    meta = read_file(out)["meta"]
    assert meta["train_config"]["out"] == "ckpt/m.pt" and meta["train_config"]["work_dir"] == "state"
    assert meta["train_config"]["data"] == "train.npz"  # outside the working folder: its name
    assert meta["command"] == "aqr train --data train.npz --out m.pt"
    assert not MACHINE_PATH.search(repr(meta).encode()), meta["train_config"]


def _committed_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listed.decode().split("\0") if name]


def test_no_committed_file_outside_tests_names_a_machine_path() -> None:
    found = []
    for path in _committed_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("tests/") or rel == ".gitignore" or not path.is_file():
            continue
        if MACHINE_PATH.search(path.read_bytes()):
            found.append(rel)
    assert not found, f"machine paths in {found}"
