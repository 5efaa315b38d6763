"""Bad inputs are refused before any work, in one line: a stats file with an absurd tail draw, a text
file given as .npz, an empty source to corrupt, a bad image that must not poison a rerun, a DataLoader
worker's error."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import aqr
from aqr.cli import error_line, main
from aqr.data.arrays import load_npz_arrays
from tests.models_tiny import bn_cnn, images


def _stats_file(tmp_path):
    path = tmp_path / "s.aqr.safetensors"
    aqr.calibrate(bn_cnn(), [images(8)], num_quantiles=11).save(path)
    return path


def test_a_stats_file_with_an_absurd_tail_batch_is_refused_on_load(tmp_path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = _stats_file(tmp_path)
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["aqr"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for key in ("tail_batch", "tail_repeats"):
        edited = dict(meta, **{key: 10**12})
        save_file(tensors, str(path), metadata={"aqr": json.dumps(edited)})
        with pytest.raises(aqr.StatsError, match=rf"'{key}' must be an integer in \[1, 1048576\], got 1000000000000"):
            aqr.SourceStats.load(path)


def test_calibrate_refuses_an_absurd_tail_draw() -> None:
    with pytest.raises(ValueError, match=r"tail_batch must be in \[1, 1048576\]"):
        aqr.calibrate(bn_cnn(), [images(4)], tail_batch=10**12)


def test_a_text_file_given_as_npz_is_named_as_such(tmp_path) -> None:
    path = tmp_path / "notes.npz"
    path.write_text("hello world\n")
    with pytest.raises(ValueError, match=r"not an \.npz archive") as err:
        load_npz_arrays(path)
    assert "allow_pickle" not in str(err.value)


def _run(argv):
    try:
        return main(argv)
    except SystemExit as stop:
        return stop.code


def test_corrupting_an_empty_npz_is_refused(tmp_path, capsys) -> None:
    npz = tmp_path / "empty.npz"
    np.savez(npz, x=np.zeros((0, 32, 32, 3), np.uint8), y=np.zeros(0, np.int64))
    code = _run(["corrupt", "--data", str(npz), "--out", str(tmp_path / "c"), "--corruptions", "gaussian_noise",
                 "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "no images to corrupt" in err[-1]
    assert not (tmp_path / "c" / "gaussian_noise.npy").exists()


@pytest.mark.slow
def test_a_bad_image_leaves_nothing_a_rerun_would_refuse(tmp_path, capsys) -> None:
    from PIL import Image

    src = tmp_path / "imgs"
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (src / c).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(src / c / f"{i}.JPEG")
    bad = src / "b" / "bad.JPEG"
    bad.write_bytes(b"\xff\xd8garbage")
    out = tmp_path / "out"
    argv = ["corrupt", "--data", str(src), "--out", str(out), "--corruptions", "gaussian_noise", "--severities", "1",
            "--image-size", "32", "--no-progress"]
    assert _run(argv) != 0
    assert "bad.JPEG" in capsys.readouterr().err
    assert not (out / "manifest.json").exists() and not (out / "gaussian_noise").exists()
    bad.unlink()
    assert _run(argv) == 0
    assert len(list((out / "gaussian_noise" / "1").rglob("*.JPEG"))) == 4


def test_a_dataloader_workers_error_is_its_last_line() -> None:
    def fail(_index):
        raise ValueError("imgs/b/bad.JPEG: not a readable image (cannot identify image file)")

    class Bad(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        __getitem__ = staticmethod(fail)

    with pytest.raises(ValueError) as caught:
        next(iter(torch.utils.data.DataLoader(Bad(), batch_size=1, num_workers=1)))
    line = error_line(caught.value)
    assert line == "imgs/b/bad.JPEG: not a readable image (cannot identify image file)"
