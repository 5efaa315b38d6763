"""Tests of aqr.models: architectures, registry, checkpoint format, zoo, third-party weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import aqr.models as models
from aqr.models import CheckpointError, Normalize, NormalizedModel
from aqr.models.resnet_cifar import BasicBlock, CifarResNet, option_a_shortcut
from tests.optional_packages import require



# small keyword overrides so every registered architecture builds fast
SMALL = {"resnet18": {"width": 8}, "vit": {"dim": 32, "depth": 2, "heads": 2}}


@pytest.mark.parametrize("name", models.available())
def test_every_registered_model_maps_images_to_logits(name: str) -> None:
    torch.manual_seed(0)
    model = models.create(name, num_classes=7, **SMALL.get(name, {})).eval()
    assert isinstance(model, NormalizedModel)
    with torch.no_grad():
        out = model(torch.rand(2, 3, 32, 32))
    assert out.shape == (2, 7)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("norm,layer", [("bn", nn.BatchNorm2d), ("gn", nn.GroupNorm), ("ln", nn.GroupNorm)])
def test_resnet_norm_choice(norm: str, layer: type) -> None:
    model = models.create("resnet20", norm=norm)
    kinds = {type(m) for m in model.modules() if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm))}
    assert kinds == {layer}
    if norm == "gn":
        assert all(m.num_groups == 8 for m in model.modules() if isinstance(m, nn.GroupNorm))
    assert model(torch.rand(2, 3, 32, 32)).shape == (2, 10)


def test_resnet_depths_count_blocks() -> None:
    for depth in (20, 26, 32, 44, 56):
        net = models.create(f"resnet{depth}").model
        blocks = sum(isinstance(m, BasicBlock) for m in net.modules())
        assert blocks == 3 * (depth - 2) // 6
    with pytest.raises(ValueError, match="6n\\+2"):
        CifarResNet(depth=21)


def test_vit_uses_layernorm_only() -> None:
    model = models.create("vit", dim=32, depth=2, heads=2, pool="cls")
    norms = [m for m in model.modules() if isinstance(m, (nn.LayerNorm, nn.BatchNorm2d, nn.GroupNorm))]
    assert norms and all(isinstance(m, nn.LayerNorm) for m in norms)
    assert len(norms) == 2 * 2 + 1
    with pytest.raises(ValueError, match="norm"):
        models.create("vit", norm="bn")


def test_option_a_shortcut_subsamples_and_zero_pads() -> None:
    x = torch.randn(2, 16, 8, 8)
    out = option_a_shortcut(x, 32)
    assert out.shape == (2, 32, 4, 4)
    assert torch.equal(out[:, 8:24], x[:, :, ::2, ::2])
    assert not out[:, :8].any() and not out[:, 24:].any()
    block = BasicBlock(16, 32, stride=2, shortcut="A")
    assert not any("shortcut" in k for k in block.state_dict())  # parameter-free


def test_resnet20_matches_akamaster_layout() -> None:
    keys = set(models.create("resnet20").model.state_dict())
    expected = {"conv1.weight", "bn1.weight", "bn1.running_mean", "layer1.0.conv1.weight", "layer1.2.bn2.bias",
                "layer2.0.conv1.weight", "layer3.2.conv2.weight", "linear.weight", "linear.bias"}
    assert expected <= keys
    assert sum(p.numel() for p in models.create("resnet20").parameters()) == 269_722  # 0.27M, as published


def test_normalize_is_inside_the_model() -> None:
    model = models.create("resnet20")
    assert isinstance(model.normalize, Normalize)
    assert torch.allclose(model.normalize.mean.flatten(), torch.tensor([0.485, 0.456, 0.406]))
    assert "normalize.std" in model.state_dict()
    norm = Normalize((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    assert torch.allclose(norm(torch.full((1, 3, 2, 2), 0.75)), torch.ones(1, 3, 2, 2))
    assert models.create("vit", dim=32, depth=1, heads=2).normalize.mean.flatten().tolist() == [0.5] * 3


def test_unknown_names_raise_clear_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AQR_ZOO", str(tmp_path))
    with pytest.raises(KeyError, match="unknown model 'resnet7'"):
        models.create("resnet7")
    with pytest.raises(KeyError, match="unknown model 'nope'"):
        models.load("nope")
    with pytest.raises(ValueError, match="checkpoint="):
        models.load("resnet20")
    with pytest.raises(ValueError, match="norm"):
        models.create("resnet20", norm="batchnorm")


def _save_small(tmp_path: Path, name: str = "resnet20", norm: str = "gn") -> tuple[nn.Module, Path]:
    torch.manual_seed(1)
    model = models.create(name, num_classes=10, norm=norm)
    path = models.save_checkpoint(tmp_path / f"{name}_{norm}.pt", model,
                                  {"name": name, "num_classes": 10, "norm": norm, "kwargs": {}},
                                  {"epochs": 3, "seed": 1, "clean_accuracy": 12.5})
    return model, path


def test_checkpoint_round_trip_is_weights_only(tmp_path: Path) -> None:
    model, path = _save_small(tmp_path)
    raw = torch.load(path, weights_only=True, map_location="cpu")
    assert raw["format"] == "aqr-model" and raw["meta"]["epochs"] == 3
    loaded = models.load(path)
    assert not loaded.training
    x = torch.rand(3, 3, 32, 32)
    model.eval()
    with torch.no_grad():
        assert torch.allclose(loaded(x), model(x), atol=1e-6)
    assert models.load("resnet20", checkpoint=path)(x).shape == (3, 10)


def test_half_checkpoint_loads_as_float(tmp_path: Path) -> None:
    model = models.create("vit", dim=32, depth=1, heads=2)
    cfg = {"name": "vit", "num_classes": 10, "norm": None, "kwargs": {"dim": 32, "depth": 1, "heads": 2}}
    path = models.save_checkpoint(tmp_path / "v.pt", model, cfg, half=True)
    loaded = models.load(path)
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(loaded(x), model.eval()(x), atol=1e-2)


def test_wrong_architecture_names_the_file(tmp_path: Path) -> None:
    _, path = _save_small(tmp_path)
    with pytest.raises(CheckpointError, match="holds 'resnet20', not 'resnet32'"):
        models.load("resnet32", checkpoint=path)
    bare = tmp_path / "bare.th"
    torch.save({"state_dict": models.create("resnet20").model.state_dict()}, bare)
    with pytest.raises(CheckpointError, match=f"{bare}.*wrong architecture"):
        models.load("resnet32", checkpoint=bare)
    with pytest.raises(CheckpointError, match="wrong architecture"):  # BN statistics missing for GN
        models.load("resnet20", checkpoint=bare, norm="gn")
    # config that rebuilds a different architecture than the weights
    raw = torch.load(path, weights_only=True)
    raw["config"]["name"] = "resnet32"
    torch.save(raw, tmp_path / "lying.pt")
    with pytest.raises(CheckpointError, match="lying.pt"):
        models.load(tmp_path / "lying.pt")


def test_truncated_or_garbage_file_names_the_file(tmp_path: Path) -> None:
    _, path = _save_small(tmp_path)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="cut.pt.*(corrupted|truncated)"):
        models.load(cut)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="junk.pt"):
        models.load("resnet20", checkpoint=junk)
    with pytest.raises(CheckpointError, match="not found"):
        models.load("resnet20", checkpoint=tmp_path / "missing.pt")


def test_pickled_objects_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"state_dict": {}, "obj": Path("x")}, path)  # a non-allow-listed class
    with pytest.raises(CheckpointError, match="evil.pt"):
        models.load("resnet20", checkpoint=path)


def test_third_party_module_prefix_is_stripped(tmp_path: Path) -> None:
    net = models.create("resnet20").model
    path = tmp_path / "dp.th"
    torch.save({"state_dict": {f"module.{k}": v for k, v in net.state_dict().items()
                               if not k.endswith("num_batches_tracked")}, "best_prec1": 1.0}, path)
    loaded = models.load("resnet20", checkpoint=path)
    assert torch.equal(loaded.model.conv1.weight, net.conv1.weight)
    assert not loaded.training


def test_zoo_lists_checkpoints_and_loads_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = _save_small(tmp_path)
    (tmp_path / "MANIFEST.md").write_text("x")
    assert set(models.zoo(tmp_path)) == {"resnet20_gn"}
    monkeypatch.setenv("AQR_ZOO", str(tmp_path))
    assert models.zoo_dir() == tmp_path
    loaded = models.load("resnet20_gn")
    assert torch.equal(loaded.model.conv1.weight, model.model.conv1.weight)
    assert models.zoo(tmp_path / "absent") == {}


def test_default_zoo_is_the_package_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    monkeypatch.delenv("AQR_ZOO", raising=False)  # (aqr.models.zoo, the attribute, is the listing function)
    assert models.zoo_dir() == Path(importlib.import_module("aqr.models.zoo").__file__).parent
    assert set(models.zoo()) == {"resnet20_bn", "resnet20_gn", "vit_ln"}
    for name, path in models.zoo().items():  # committed checkpoints must load and stay small
        assert path.stat().st_size <= 5 * 1024 * 1024
        assert isinstance(models.load(name), NormalizedModel)


def test_external_names_need_their_packages() -> None:
    for package in ("timm", "torchvision"):
        try:
            __import__(package)
        except Exception:  # missing, or built for another torch (RuntimeError)
            with pytest.raises(ImportError, match=package):
                models.create(f"{package}:resnet18")


def test_timm_model_reads_its_normalization() -> None:
    require("timm")
    model = models.create("timm:vit_tiny_patch16_224", num_classes=10)
    assert model.normalize.mean.flatten().tolist() == pytest.approx([0.5, 0.5, 0.5])
    assert model(torch.rand(1, 3, 224, 224)).shape == (1, 10)


def test_torchvision_model_uses_imagenet_normalization() -> None:
    require("torchvision")
    model = models.create("torchvision:resnet18", num_classes=10)
    assert model.normalize.mean.flatten().tolist() == pytest.approx([0.485, 0.456, 0.406])
    assert model(torch.rand(1, 3, 64, 64)).shape == (1, 10)


def test_plain_metadata_only(tmp_path: Path) -> None:
    model = models.create("vit", dim=32, depth=1, heads=2)
    meta = {"torch": torch.__version__, "path": tmp_path, "pair": (1, 2.5), "n": np.int64(3)}
    path = models.save_checkpoint(tmp_path / "m.pt", model, {"name": "vit", "kwargs": {"dim": 32, "depth": 1,
                                                                                      "heads": 2}}, meta)
    raw = torch.load(path, weights_only=True)
    assert raw["meta"] == {"torch": str(torch.__version__), "path": str(tmp_path), "pair": [1, 2.5], "n": 3}
    with pytest.raises(TypeError, match="meta.bad"):
        models.save_checkpoint(tmp_path / "x.pt", model, {"name": "vit"}, {"bad": object()})


@pytest.mark.data
@pytest.mark.slow
def test_akamaster_resnet20_scores_91_73(data_dir: Path) -> None:
    ckpt = data_dir / "checkpoints" / "akamaster" / "resnet20-12fca82f.th"
    test = data_dir / "cifar10_test.npz"
    if not (ckpt.is_file() and test.is_file()):
        pytest.skip(f"the data folder lacks {ckpt} or {test}")
    model = models.load("resnet20", checkpoint=ckpt)
    with np.load(test) as d:
        x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
    from aqr.models.train import evaluate_accuracy
    assert evaluate_accuracy(model, x, y, batch_size=500) == pytest.approx(91.73, abs=1e-9)


def test_manifest_describes_each_checkpoint(tmp_path: Path) -> None:
    from aqr.models.zoo import describe, manifest_markdown

    _save_small(tmp_path)
    info = describe(tmp_path / "resnet20_gn.pt")
    assert info["epochs"] == 3 and info["config"]["norm"] == "gn"
    text = manifest_markdown(tmp_path)
    assert "| resnet20_gn | resnet20 norm=gn" in text and "12.50" in text


def test_committed_manifest_is_generated_and_names_no_machine_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    from aqr.models.zoo import manifest_markdown, portable_command

    monkeypatch.delenv("AQR_ZOO", raising=False)
    generated = manifest_markdown()
    committed = (models.zoo_dir() / "MANIFEST.md").read_text()
    assert committed.startswith(generated)  # hand-written notes may follow
    for machine_path in ("/tmp", "/root", "/work", "/home", ".gpu/"):
        assert machine_path not in committed
    assert portable_command("aqr train --data /a/b/x.npz --model-kwargs '{\"k\": 1}' --out ./o/") == (
        "aqr train --data x.npz --model-kwargs '{\"k\": 1}' --out o")
