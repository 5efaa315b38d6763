"""The ImageNet setting end to end on small generated image folders: image datasets, class-balanced
source subsets, ImageNet-C writing and reading, calibrate / corrupt / evaluate / bench from the CLI,
and weights for timm / torchvision architectures (tested where those packages import)."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
pytest.importorskip("scipy")

from PIL import Image  # noqa: E402

from aqr import models  # noqa: E402
from aqr.cli import main as cli_main  # noqa: E402
from aqr.data.imagenet_c import FolderGenerationConfig, ImageNetCFolder, generate_imagenet_c  # noqa: E402
from aqr.data.images import ImageFolder, Preprocess, balanced_subset, listing_fingerprint  # noqa: E402
from aqr.harness.cells import DataSpec, ModelSpec  # noqa: E402
from aqr.harness.eval_loop import evaluate_batches  # noqa: E402
from aqr.harness.grid_driver import run_grid  # noqa: E402
from aqr.harness.inputs import source_selection  # noqa: E402
from aqr.harness.results import ResultsDB  # noqa: E402
from aqr.harness.specs import GridSpec, MethodSpec  # noqa: E402
from tests.optional_packages import require  # noqa: E402

CLASSES = ("n01", "n02", "n03")
PER_CLASS = 12


def make_image_folder(root: Path, per_class: int = PER_CLASS) -> Path:
    """3 classes of ``per_class`` JPEG/PNG images, 48-64 px, of class-dependent brightness."""
    rng = np.random.default_rng(0)
    for label, wnid in enumerate(CLASSES):
        (root / wnid).mkdir(parents=True)
        for k in range(per_class):
            w, h = rng.integers(48, 65, 2)
            pixels = np.clip(rng.normal(60 + 60 * label, 30, (h, w, 3)), 0, 255).astype(np.uint8)
            suffix = ".png" if k % 4 == 0 else ".JPEG"
            Image.fromarray(pixels).save(root / wnid / f"img{k:03d}{suffix}")
        (root / wnid / "README.txt").write_text("not an image")
    return root


@pytest.fixture(autouse=True)
def one_thread() -> None:
    """Tiny models run fastest on one thread, and don't stall when the machine is busy."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("images") / "train")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CIFAR-size registry architecture (ResNet-20, BN) with 3 classes, as an aqr checkpoint."""
    model = models.create("resnet20", num_classes=3, width=4)
    path = tmp_path_factory.mktemp("model") / "r20.pt"
    return models.save_checkpoint(path, model, {"name": "resnet20", "num_classes": 3, "kwargs": {"width": 4}})


@pytest.fixture(scope="module")
def imagenet_c(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("c") / "imagenet-c"
    args = ["corrupt", "--data", str(folder), "--params", "imagenet", "--out", str(out), "--corruptions",
            "gaussian_noise,contrast", "--severities", "1,3", "--image-size", "48", "--workers", "2", "--no-progress"]
    assert cli_main(args) == 0
    return out


# ----------------------------------------------------------------------------- preprocessing and folders


def test_preprocess_resizes_the_shorter_side_then_crops_the_centre() -> None:
    image = Image.fromarray(np.arange(60 * 80 * 3, dtype=np.uint8).reshape(60, 80, 3) % 251)
    out = Preprocess(crop=32, resize=40).apply(image)
    assert out.shape == (32, 32, 3) and out.dtype == np.uint8
    same = Preprocess(crop=60, resize=60).apply(image)  # no resize: the central 60 x 60 pixels
    assert np.array_equal(same, np.asarray(image)[:, 10:70])
    timm_like = Preprocess(crop=224, resize=235, interpolation="bicubic")
    assert timm_like.with_overrides(image_size=64) == Preprocess(64, 67, "bicubic")  # keeps crop_pct
    assert timm_like.with_overrides(resize=300).crop == 224
    for bad in ({"crop": 0}, {"crop": 64, "resize": 32}, {"interpolation": "fancy"}):
        with pytest.raises(ValueError):
            Preprocess(**bad)


def test_image_folder_tree_and_lists(folder: Path, tmp_path: Path) -> None:
    data = ImageFolder(folder, Preprocess(crop=32, resize=36))
    assert data.classes == list(CLASSES) and len(data) == 3 * PER_CLASS
    assert data.labels.tolist() == [k for k in range(3) for _ in range(PER_CLASS)]
    image, label = data[PER_CLASS]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and label == 1
    assert 0 <= float(image.min()) and float(image.max()) <= 1
    # a list of paths: labels from the parent folders, or given
    listing = tmp_path / "list.txt"
    listing.write_text("# two images\n" + "\n".join(os.path.relpath(p, tmp_path) for p, _ in data.samples[::PER_CLASS]))
    listed = ImageFolder(listing, data.preprocess)
    assert listed.classes == list(CLASSES) and listed.labels.tolist() == [0, 1, 2]
    assert torch.equal(listed[1][0], image)
    listing.write_text(f"{data.samples[0][0]} 7\n{data.samples[1][0]} 2\n")
    assert ImageFolder(listing).labels.tolist() == [7, 2]
    listing.write_text(f"{data.samples[0][0]} 7\n{data.samples[1][0]}\n")
    with pytest.raises(ValueError, match="some lines have a label"):
        ImageFolder(listing)
    binary = tmp_path / "frost1.png"  # an image where a list was expected: named, not a decoding traceback
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    with pytest.raises(ValueError, match="frost1.png: not a list of images"):
        ImageFolder(binary)
    (tmp_path / "flat").mkdir()
    with pytest.raises(FileNotFoundError, match="no class sub-folders"):
        ImageFolder(tmp_path / "flat")
    broken = tmp_path / "broken" / "n01"
    broken.mkdir(parents=True)
    (broken / "x.JPEG").write_bytes(b"not a jpeg")
    with pytest.raises(ValueError, match="x.JPEG"):
        ImageFolder(broken.parent)[0]
    before = listing_fingerprint(folder)
    assert before == listing_fingerprint(folder) and before != listing_fingerprint(broken.parent)


def test_balanced_subsets_are_seeded_and_even() -> None:
    labels = np.repeat(np.arange(4), [50, 30, 5, 40])
    pick = balanced_subset(labels, 40, seed=1)
    assert len(pick) == 40 and len(set(pick.tolist())) == 40 and np.all(np.diff(pick) > 0)
    counts = np.bincount(labels[pick], minlength=4)
    assert counts[2] == 5 and counts.max() - counts[[0, 1, 3]].min() <= 1  # a short class gives all it has
    assert np.array_equal(pick, balanced_subset(labels, 40, seed=1))
    assert not np.array_equal(pick, balanced_subset(labels, 40, seed=2))
    pool = np.arange(0, 125, 2)
    assert set(balanced_subset(labels, 20, 0, pool).tolist()) <= set(pool.tolist())
    assert np.array_equal(balanced_subset(labels, 500), np.arange(125))  # asking for more gives all


def test_source_selection_warns_when_few_classes_are_covered() -> None:
    labels = np.repeat(np.arange(3), 40)                     # sorted by class, as an ImageNet listing is
    with pytest.warns(UserWarning, match="cover only 1 of 3 classes"):
        source_selection(labels, "0:40", where="train")
    with pytest.warns(UserWarning, match="cover only 1 of 3"):  # a draw from a one-class pool is one class
        assert np.bincount(labels[source_selection(labels, "0:40", n_images=30)]).tolist() == [30]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.bincount(labels[source_selection(labels, None, n_images=30, seed=3)]).tolist() == [10, 10, 10]
        assert np.bincount(labels[source_selection(labels, "balanced~60")]).tolist() == [20, 20, 20]
    with pytest.raises(ValueError, match="exceed"):
        source_selection(labels, "0:500", where="train")


# ----------------------------------------------------------------------------- ImageNet-C layout


def test_corrupt_writes_the_released_layout_and_resumes(folder: Path, imagenet_c: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    for corruption in ("gaussian_noise", "contrast"):
        for severity in (1, 3):
            cell = ImageNetCFolder(imagenet_c, corruption, severity, preprocess=Preprocess(48, 48))
            assert cell.classes == list(CLASSES) and len(cell) == 3 * PER_CLASS
            assert cell.labels.tolist() == ImageFolder(folder).labels.tolist()
    with Image.open(next((imagenet_c / "contrast" / "3" / "n02").iterdir())) as im:
        assert im.size == (48, 48) and im.format == "JPEG"
    files = sorted((imagenet_c / "gaussian_noise" / "1").rglob("*.JPEG"))
    stamps = {p: p.stat().st_mtime_ns for p in files}
    args = ["corrupt", "--data", str(folder), "--params", "imagenet", "--out", str(imagenet_c), "--corruptions",
            "gaussian_noise,contrast", "--severities", "1,3", "--image-size", "48", "--no-progress"]
    assert cli_main(args) == 0
    assert "skipped: 4" in capsys.readouterr().out
    assert all(p.stat().st_mtime_ns == stamps[p] for p in files)      # nothing rewritten
    # an interrupted folder: its manifest entry and one file gone -> only that file is written again
    manifest = json.loads((imagenet_c / "manifest.json").read_text())
    del manifest["done"]["gaussian_noise/1"]
    (imagenet_c / "manifest.json").write_text(json.dumps(manifest))
    original = files[3].read_bytes()
    files[3].unlink()
    assert cli_main(args) == 0
    assert files[3].read_bytes() == original                          # same seed, same image
    assert all(p.stat().st_mtime_ns == stamps[p] for p in files if p != files[3])
    # one worker writes the same bytes as two
    one = tmp_path / "one"
    config = FolderGenerationConfig(corruptions=("gaussian_noise",), severities=(1,),
                                    preprocess=Preprocess(48, 54), source=manifest["settings"]["source"])
    generate_imagenet_c(ImageFolder(folder), one, config, progress=False)
    assert [p.read_bytes() for p in sorted((one / "gaussian_noise" / "1").rglob("*.JPEG"))] == \
        [p.read_bytes() for p in files]
    # a folder written with other settings is refused, not mixed
    assert cli_main(args[:-1] + ["--seed", "1", "--no-progress"]) == 2
    assert "other settings" in capsys.readouterr().err


# ----------------------------------------------------------------------------- CLI end to end


def test_calibrate_then_evaluate_on_image_folders(folder: Path, imagenet_c: Path, model_file: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    from aqr.core.stats import SourceStats
    from aqr.methods import create

    stats_file = tmp_path / "r20.aqr.safetensors"
    args = ["calibrate", str(model_file), "--data", str(folder), "--n-images", "24", "--workers", "2",
            "--image-size", "40", "-K", "11", "--out", str(stats_file), "--no-progress"]
    assert cli_main(args) == 0
    assert "24 source images (resize 40, crop 40, bilinear)" in capsys.readouterr().err
    stats = SourceStats.load(stats_file)
    assert stats.num_quantiles == 11 and len(stats.layer_names) == 19
    # the same statistics in one process (the draw and the decoding do not depend on the workers)
    assert cli_main(args[:7] + ["0"] + args[8:]) == 0
    again = SourceStats.load(stats_file)
    name = stats.layer_names[0]
    assert torch.equal(stats.layers[name].quantiles, again.layers[name].quantiles)

    capsys.readouterr()
    args = ["evaluate", str(model_file), "--stats", str(stats_file), "--imagenet-c", str(imagenet_c),
            "--corruption", "gaussian_noise", "--severity", "3", "--image-size", "40", "--batch-size", "8",
            "--methods", "source,aqr,tent", "--workers", "2", "--json"]
    assert cli_main(args) == 0
    accs = json.loads(capsys.readouterr().out)
    assert set(accs) == {"source", "aqr", "tent"} and all(0 <= a <= 100 for a in accs.values())
    # the library path gives the same number
    model = models.load(model_file)
    cell = ImageNetCFolder(imagenet_c, "gaussian_noise", 3, preprocess=Preprocess(40, 40))
    loader = torch.utils.data.DataLoader(cell, batch_size=8)
    assert evaluate_batches(create("aqr", model, stats=stats), loader)[0] == accs["aqr"]
    # clean images from a folder, a subset by indices
    assert cli_main(["evaluate", str(model_file), "--data", str(folder), "--indices", "0:36~10", "--methods",
                     "source", "--image-size", "40", "--json"]) == 0
    assert "10 images" in capsys.readouterr().err


def test_bench_runs_an_image_folder_grid_and_generates_missing_cells(folder: Path, model_file: Path,
                                                                       tmp_path: Path) -> None:
    spec = ModelSpec("r20", str(model_file), None, str(folder), "balanced~24", image_size=40)
    data = DataSpec("tiny-imagenet-c", str(tmp_path / "c"), "all", clean=str(folder))
    grid = GridSpec("tiny-imagenet", (spec,), data, (MethodSpec("source"), MethodSpec("aqr", {"K": 11})),
                    corruptions=("gaussian_noise", "contrast"), severities=(5,), batch_sizes=(8,), seeds=(0,),
                    n_images=20)
    with ResultsDB(tmp_path / "r.db") as db:
        summary = run_grid(grid, db, tmp_path / "cache", progress=False, log=lambda m: None, loader_workers=1)
        assert summary.ran == 4 and summary.errors == 0, summary.error_messages
        rows = db.rows("tiny-imagenet")
        assert all(r.status == "ok" and r.n_images == 20 for r in rows)
        assert (tmp_path / "c" / "contrast" / "5" / "n03").is_dir()       # written from the clean folder
        again = run_grid(grid, db, tmp_path / "cache", progress=False, log=lambda m: None)
        assert again.skipped == 4 and again.ran == 0
    # the CLI: the preset lists its cells; a grid file runs the same cells; missing ImageNet-C is explained
    config = tmp_path / "grid.json"
    config.write_text(json.dumps({"name": "tiny-imagenet", "models": [{
        "name": "r20", "model": str(model_file), "source_data": str(folder), "source_indices": "balanced~24",
        "image_size": 40}], "data": {"name": "tiny-imagenet-c", "root": str(tmp_path / "c"),
                                     "eval_indices": "all", "clean": str(folder)},
        "methods": ["source", "aqr:K=11"], "corruptions": ["gaussian_noise", "contrast"], "severities": [5],
        "batch_sizes": [8], "seeds": [0], "n_images": 20}))
    assert cli_main(["bench", "--config", str(config), "--db", str(tmp_path / "r.db"), "--cache",
                     str(tmp_path / "cache"), "--no-progress", "--loader-workers", "1"]) == 0
    assert cli_main(["bench", "--preset", "imagenet", "--imagenet", str(tmp_path), "--imagenet-c",
                     str(tmp_path / "none"), "--models", "resnet50_bn", "--corruptions", "fog", "--db",
                     str(tmp_path / "r2.db"), "--no-progress"]) == 2


def test_imagenet_preset_is_the_papers_setting(capsys: pytest.CaptureFixture) -> None:
    from aqr.harness.presets import preset

    grid = preset("imagenet", imagenet_dir="in", imagenet_c="in-c")
    assert [m.model for m in grid.models] == ["timm:resnet50.tv_in1k", "timm:resnet50_gn.a1h_in1k",
                                             "timm:vit_base_patch16_224.augreg2_in21k_ft_in1k"]
    assert {m.name for m in grid.methods} >= {"source", "ttn", "tent", "sar", "aqr"}
    assert grid.severities == (1, 3, 5) and grid.batch_sizes == (64,) and len(grid.corruptions) == 19
    assert all(m.source_indices == "balanced~10000" and m.source_data == str(Path("in") / "train")
               for m in grid.models)
    assert cli_main(["bench", "--preset", "imagenet", "--imagenet", "in", "--n-images", "1000", "--image-size", "192",
                     "--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(grid) + 1 and lines[1].split("\t")[7] == "1000"
    # older cells keep their keys: unset preprocessing overrides are not part of a cell's dict
    cell = next(iter(grid.cells()))
    assert "image_size" not in cell.to_dict()["model"]


# ----------------------------------------------------------------------------- weights


def test_checkpoints_load_as_safetensors_or_weights_only_state_dicts(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    net = models.create("resnet20", num_classes=10, width=4)
    state = {k: v.contiguous() for k, v in net.model.state_dict().items()}
    save_file(state, tmp_path / "w.safetensors")
    torch.save({"state_dict": state}, tmp_path / "w.pt")
    x = torch.rand(2, 3, 32, 32)
    for file in ("w.safetensors", "w.pt"):
        loaded = models.load("resnet20", checkpoint=tmp_path / file, width=4)
        assert torch.equal(loaded(x), net.eval()(x))
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(models.CheckpointError, match="bad.safetensors"):
        models.load("resnet20", checkpoint=tmp_path / "bad.safetensors")


def test_external_names_need_weights_named_on_the_command_line(folder: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    out = str(tmp_path / "s.aqr.safetensors")
    assert cli_main(["calibrate", "timm:resnet50", "--data", str(folder), "--out", out]) == 2
    err = capsys.readouterr().err
    assert "needs weights: --pretrained" in err and "--checkpoint FILE" in err and len(err.splitlines()) == 1
    assert cli_main(["calibrate", "resnet20", "--pretrained", "--data", str(folder), "--out", out]) == 2
    assert "--pretrained applies to timm:/torchvision: names" in capsys.readouterr().err


def test_timm_checkpoint_preprocessing_and_missing_cache(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture) -> None:
    timm = require("timm")
    from safetensors.torch import save_file

    net = timm.create_model("resnet18", pretrained=False, num_classes=1000)
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, tmp_path / "r18.safetensors")
    model = models.load("timm:resnet18", checkpoint=tmp_path / "r18.safetensors")
    cfg = net.pretrained_cfg
    expected = Preprocess(cfg["input_size"][-1], int(cfg["input_size"][-1] / cfg["crop_pct"]), cfg["interpolation"])
    assert models.preprocessing(model) == expected
    x = torch.rand(1, 3, 64, 64)
    assert torch.equal(model(x), models.NormalizedModel(net.eval(), cfg["mean"], cfg["std"])(x))
    stats = str(tmp_path / "s.aqr.safetensors")
    assert cli_main(["calibrate", "timm:resnet18", "--checkpoint", str(tmp_path / "r18.safetensors"), "--data",
                     str(folder), "--image-size", "64", "--n-images", "6", "-K", "11", "--out", stats,
                     "--no-progress"]) == 0
    # no cache: a clear error, nothing downloaded
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    path, _ = models.pretrained.timm_cached_file("resnet18.a1_in1k")
    if path is not None:
        pytest.skip(f"resnet18.a1_in1k is cached on this machine ({path})")
    with pytest.raises(models.WeightsNotFound, match="does not download weights"):
        models.load("timm:resnet18.a1_in1k")


def test_torchvision_checkpoint_and_missing_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require("torchvision")
    net = models.create("torchvision:resnet18", num_classes=1000)
    torch.save(net.model.state_dict(), tmp_path / "r18.pth")
    loaded = models.load("torchvision:resnet18", checkpoint=tmp_path / "r18.pth")
    x = torch.rand(1, 3, 64, 64)
    assert torch.equal(loaded(x), net.eval()(x))
    assert models.preprocessing(loaded) == Preprocess(224, 256, "bilinear")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "empty"))
    with pytest.raises(models.WeightsNotFound, match="--checkpoint FILE"):
        models.load("torchvision:resnet18")


@pytest.mark.slow
def test_throughput_benchmark_runs_on_a_cpu(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "imagenet_throughput.py"
    out = tmp_path / "t.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--model", "resnet20", "--calib-images",
                           "48", "--eval-images", "32", "--image-size", "48", "--workers", "1", "--batch-size", "16",
                           "--calib-batch-size", "16", "--loader-images", "32", "--work", str(tmp_path / "w"),
                           "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["stages"]) == {"generate", "corrupt", "loader", "calibrate", "source", "aqr"}
    assert result["weights"] == "random" and result["stages"]["calibrate"]["images"] == 48
    for stage in ("calibrate", "source", "aqr"):
        numbers = result["stages"][stage]
        assert numbers["images_per_s"] > 0 and 0 <= numbers["loader_wait_fraction"] <= 1
        assert numbers["gpu_util_source"] is None                     # no GPU here: said, not invented
    assert len(list((tmp_path / "w" / "imagenet-c" / "gaussian_noise" / "5").rglob("*.JPEG"))) == 32
