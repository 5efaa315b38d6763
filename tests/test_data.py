"""Tests of the dataset loaders, the CIFAR-C generator's layout and ``aqr corrupt``."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from aqr.cli import main as cli_main
from aqr.data import (
    ArrayImageDataset,
    ImageNetCFolder,
    load_cifar,
    load_cifar_c,
    load_cifar_pickle,
    load_npz,
    load_npz_arrays,
    to_float,
)
from aqr.data.cifar_c import GenerationConfig, generate_cifar_c
from aqr.data.corruptions import corrupt, image_rng


def tiny_set(n: int = 6, size: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8), rng.integers(0, 10, n).astype(np.int64)


@pytest.fixture
def npz_file(tmp_path: Path) -> Path:
    x, y = tiny_set()
    path = tmp_path / "tiny.npz"
    np.savez(path, x=x, y=y)
    return path


# ----------------------------------------------------------------------------- npz


def test_npz_dataset(npz_file: Path) -> None:
    x, y = tiny_set()
    ds = load_npz(npz_file)
    assert len(ds) == 6
    img, label = ds[2]
    assert img.dtype == torch.float32 and img.shape == (3, 32, 32)
    assert 0.0 <= img.min() and img.max() <= 1.0
    assert label == int(y[2])
    torch.testing.assert_close(img, torch.from_numpy(x[2]).permute(2, 0, 1).float() / 255)
    assert load_cifar(npz_file).images.shape == x.shape


@pytest.mark.parametrize(
    "arrays, match",
    [
        ({"x": np.zeros((2, 32, 32, 3), np.uint8)}, r"missing key\(s\) \['y'\]"),
        ({"x": np.zeros((2, 32, 32, 3), np.float32), "y": np.zeros(2, np.int64)}, "'x' must be uint8"),
        ({"x": np.zeros((2, 3, 32, 32), np.uint8), "y": np.zeros(2, np.int64)}, r"\(N, H, W, 3\)"),
        ({"x": np.zeros((2, 32, 32, 3), np.uint8), "y": np.zeros(3, np.int64)}, r"'y' must be integer labels of shape \(2,\)"),
    ],
)
def test_npz_malformed(tmp_path: Path, arrays: dict, match: str) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=match) as info:
        load_npz_arrays(path)
    assert "bad.npz" in str(info.value)


def test_npz_missing_and_garbage(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nothere.npz"):
        load_npz(tmp_path / "nothere.npz")
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip file")
    with pytest.raises(ValueError, match="garbage.npz"):
        load_npz(garbage)


def test_npz_with_object_array_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "obj.npz"
    np.savez(path, x=np.array([{"a": 1}], dtype=object), y=np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="obj.npz"):
        load_npz(path)


# ----------------------------------------------------------------------------- official CIFAR pickles


def _cifar_batch(n: int, fine: bool) -> dict:
    x, y = tiny_set(n)
    data = np.ascontiguousarray(x.transpose(0, 3, 1, 2).reshape(n, 3072))
    return {b"batch_label": b"testing batch 1 of 1", b"fine_labels" if fine else b"labels": [int(v) for v in y], b"data": data}


@pytest.mark.parametrize("protocol", [2, 4])
@pytest.mark.parametrize("fine", [False, True])
def test_cifar_pickle(tmp_path: Path, protocol: int, fine: bool) -> None:
    x, y = tiny_set(5)
    folder = tmp_path / ("cifar-100-python" if fine else "cifar-10-batches-py")
    folder.mkdir()
    path = folder / ("test" if fine else "test_batch")
    path.write_bytes(pickle.dumps(_cifar_batch(5, fine), protocol=protocol))
    for ds in (load_cifar_pickle(path), load_cifar(folder)):
        np.testing.assert_array_equal(ds.images, x)
        np.testing.assert_array_equal(ds.labels, y)


class _Evil:
    def __reduce__(self):
        return (os.getcwd, ())


def test_cifar_pickle_refuses_code(tmp_path: Path) -> None:
    path = tmp_path / "test_batch"
    path.write_bytes(pickle.dumps({b"data": _Evil(), b"labels": [1]}, protocol=2))
    with pytest.raises(ValueError, match=r"test_batch.*posix.getcwd is not allowed|test_batch.*getcwd"):
        load_cifar_pickle(path)
    bad = tmp_path / "other"
    bad.write_bytes(pickle.dumps({b"labels": [1]}))
    with pytest.raises(ValueError, match="'data'"):
        load_cifar_pickle(bad)


# ----------------------------------------------------------------------------- CIFAR-C layout


def _fake_cifar_c(root: Path, n: int, labels_len_factor: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    arr = rng.integers(0, 256, (5 * n, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, n).astype(np.uint8)
    root.mkdir(parents=True, exist_ok=True)
    np.save(root / "fog.npy", arr)
    np.save(root / "labels.npy", np.tile(labels, labels_len_factor))
    return arr, labels


@pytest.mark.parametrize("labels_len_factor", [1, 5])
def test_cifar_c_released_layout(tmp_path: Path, labels_len_factor: int) -> None:
    n = 8
    arr, labels = _fake_cifar_c(tmp_path, n, labels_len_factor)
    ds = load_cifar_c(tmp_path, "fog", 3)
    np.testing.assert_array_equal(ds.images, arr[2 * n : 3 * n])
    np.testing.assert_array_equal(ds.labels, labels)
    sub = load_cifar_c(tmp_path, "fog", 5, indices=range(5, 8))
    np.testing.assert_array_equal(sub.images, arr[4 * n + 5 : 4 * n + 8])
    np.testing.assert_array_equal(sub.labels, labels[5:8])
    img, label = sub[0]
    assert img.shape == (3, 32, 32) and label == int(labels[5])


def test_cifar_c_errors(tmp_path: Path) -> None:
    _fake_cifar_c(tmp_path, 4)
    with pytest.raises(FileNotFoundError, match="snow.npy"):
        load_cifar_c(tmp_path, "snow", 1)
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        load_cifar_c(tmp_path, "fog", 1, indices=[4])
    np.save(tmp_path / "snow.npy", np.zeros((10, 32, 32, 3), np.float32))
    with pytest.raises(ValueError, match="snow.npy.*uint8"):
        load_cifar_c(tmp_path, "snow", 1)
    np.save(tmp_path / "snow.npy", np.zeros((21, 32, 32, 3), np.uint8))
    with pytest.raises(ValueError, match="multiple of 5"):
        load_cifar_c(tmp_path, "snow", 1)
    np.save(tmp_path / "labels.npy", np.zeros(7, np.uint8))
    with pytest.raises(ValueError, match=r"labels.npy: expected integer labels of shape \(4,\) or \(20,\)"):
        load_cifar_c(tmp_path, "fog", 1)
    np.save(tmp_path / "fog.npy", np.array([1, 2], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="fog.npy"):
        load_cifar_c(tmp_path, "fog", 1)


def test_generator_writes_what_loader_reads(tmp_path: Path) -> None:
    x, y = tiny_set(4)
    cfg = GenerationConfig(corruptions=("contrast", "impulse_noise"), severities=(4, 2), seed=5)
    timings = generate_cifar_c(x, y, tmp_path, cfg, progress=False)
    assert set(timings) == {"contrast", "impulse_noise"}
    assert np.load(tmp_path / "impulse_noise.npy").shape == (8, 32, 32, 3)
    for s in (2, 4):
        ds = load_cifar_c(tmp_path, "impulse_noise", s, indices=[1, 3])
        for row, i in enumerate([1, 3]):
            expected = corrupt(x[i], "impulse_noise", s, image_rng(5, "impulse_noise", s, i))
            np.testing.assert_array_equal(ds.images[row], expected)
        np.testing.assert_array_equal(ds.labels, y[[1, 3]])
    with pytest.raises(ValueError, match="severity 3 not present"):
        load_cifar_c(tmp_path, "contrast", 3)
    # resumable: a second call finds both complete and regenerates nothing
    mtime = (tmp_path / "contrast.npy").stat().st_mtime_ns
    assert generate_cifar_c(x, y, tmp_path, cfg, progress=False) == {}
    assert (tmp_path / "contrast.npy").stat().st_mtime_ns == mtime
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["corruptions"]["contrast"]["severities"] == [4, 2]
    assert not list(tmp_path.glob("*.tmp"))


def test_generator_rejects_bad_config(tmp_path: Path) -> None:
    x, y = tiny_set(2)
    with pytest.raises(ValueError, match="severities"):
        generate_cifar_c(x, y, tmp_path, GenerationConfig(severities=(0, 1)), progress=False)
    with pytest.raises(ValueError, match="frost"):
        generate_cifar_c(x, y, tmp_path, GenerationConfig(corruptions=("frost",)), progress=False)
    with pytest.raises(ValueError, match="uint8"):
        generate_cifar_c(x.astype(float), y, tmp_path, GenerationConfig(), progress=False)


def test_cli_corrupt_parallel_matches_serial(tmp_path: Path, npz_file: Path, capsys: pytest.CaptureFixture) -> None:
    common = ["--data", str(npz_file), "--corruptions", "fog,glass_blur", "--limit", "5", "--seed", "9", "--no-progress"]
    assert cli_main(["corrupt", "--out", str(tmp_path / "a"), "--workers", "1", *common]) == 0
    assert cli_main(["corrupt", "--out", str(tmp_path / "b"), "--workers", "2", *common]) == 0
    for name in ("fog", "glass_blur", "labels"):
        a, b = np.load(tmp_path / "a" / f"{name}.npy"), np.load(tmp_path / "b" / f"{name}.npy")
        np.testing.assert_array_equal(a, b)
    x, y = tiny_set()
    ds = load_cifar_c(tmp_path / "a", "fog", 4)
    assert len(ds) == 5
    np.testing.assert_array_equal(ds.labels, y[:5])
    np.testing.assert_array_equal(ds.images[2], corrupt(x[2], "fog", 4, image_rng(9, "fog", 4, 2)))
    assert np.load(tmp_path / "a" / "labels.npy").shape == (25,)  # released layout: one label per row
    assert cli_main(["corrupt", "--out", str(tmp_path / "a"), "--workers", "1", *common]) == 0
    assert "already complete, skipped: fog, glass_blur" in capsys.readouterr().out


def test_cli_corrupt_bad_input(tmp_path: Path, npz_file: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["corrupt", "--data", str(npz_file), "--out", str(tmp_path), "--corruptions", "rain"]) == 2
    assert "unknown name(s) rain" in capsys.readouterr().err
    assert cli_main(["corrupt", "--data", str(tmp_path / "none.npz"), "--out", str(tmp_path)]) == 2
    assert "none.npz" in capsys.readouterr().err


# ----------------------------------------------------------------------------- ImageNet-C


def test_imagenet_c_folder(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    sizes = {"n02": [(300, 260), (260, 300)], "n01": [(224, 224)]}
    for wnid, shapes in sizes.items():
        folder = tmp_path / "fog" / "3" / wnid
        folder.mkdir(parents=True)
        for k, (w, h) in enumerate(shapes):
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / f"img{k}.JPEG", quality=90)
        (folder / "notes.txt").write_text("not an image")
    ds = ImageNetCFolder(tmp_path, "fog", 3)
    assert ds.classes == ["n01", "n02"]
    assert len(ds) == 3
    labels = [ds[i][1] for i in range(3)]
    assert labels == [0, 1, 1]
    for i in range(3):
        img, _ = ds[i]
        assert img.shape == (3, 224, 224) and img.dtype == torch.float32
        assert 0 <= img.min() and img.max() <= 1
    with pytest.raises(FileNotFoundError, match=r"fog[/\\]5"):
        ImageNetCFolder(tmp_path, "fog", 5)
    broken = tmp_path / "fog" / "3" / "n01" / "broken.JPEG"
    broken.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="broken.JPEG"):
        ImageNetCFolder(tmp_path, "fog", 3)[0]


# ----------------------------------------------------------------------------- the one uint8 -> float conversion


def test_to_float_gives_nchw_in_unit_range_from_arrays_and_tensors() -> None:
    images = np.random.default_rng(0).integers(0, 256, (3, 5, 4, 3), dtype=np.uint8)
    x = to_float(images)
    assert x.shape == (3, 3, 5, 4) and x.dtype == torch.float32 and x.is_contiguous()
    assert torch.equal(x, torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0)
    kept = to_float(torch.from_numpy(images), channels_last=True)  # NHWC memory kept, same values
    assert torch.equal(kept, x) and kept.is_contiguous(memory_format=torch.channels_last)
    image, label = ArrayImageDataset(images, np.arange(3))[1]  # the datasets use the same conversion
    assert torch.equal(image, x[1]) and image.is_contiguous() and label == 1
    with pytest.raises(ValueError, match="uint8"):
        to_float(images.astype(np.float32))


# ----------------------------------------------------------------------------- shared data


@pytest.mark.data
def test_shared_cifar10_test_set(data_dir: Path) -> None:
    path = data_dir / "cifar10_test.npz"
    if not path.is_file():
        pytest.skip(f"no CIFAR-10 test set at {path}")
    ds = load_npz(path)
    assert ds.images.shape == (10000, 32, 32, 3)
    assert ds.labels[:10].tolist() == [3, 8, 8, 0, 6, 6, 1, 6, 3, 1]
