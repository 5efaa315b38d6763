"""Tests of aqr.models.train and the ``aqr train`` command on tiny synthetic data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import aqr.models as models
from aqr.models.checkpoint import CheckpointError
from aqr.cli import main
from aqr.models.train import (TrainConfig, augment_batch, evaluate_accuracy, export_state, load_tensors, lr_factor,
                       resume_path, train)


def make_npz(path: Path, n: int, seed: int) -> Path:
    """Two easy classes: vertical stripes (label 0) and horizontal stripes (label 1), random phase, noise.

    (Spatial, so per-sample normalization such as GroupNorm cannot erase the class.)
    """
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    phase = rng.integers(0, 8, n)
    pos = np.arange(32)
    stripes = ((pos[None, :] + phase[:, None]) // 4) % 2  # n x 32
    pattern = np.where(y[:, None, None] == 0, stripes[:, None, :], stripes[:, :, None])  # n x 32 x 32
    x = np.clip(60 + 120 * pattern[..., None] + rng.normal(0, 25, (n, 32, 32, 3)), 0, 255).astype(np.uint8)
    np.savez(path, x=x, y=y.astype(np.int64))
    return path


@pytest.fixture()
def data(tmp_path: Path) -> tuple[Path, Path]:
    return make_npz(tmp_path / "train.npz", 256, 0), make_npz(tmp_path / "test.npz", 200, 1)


def small_config(data: tuple[Path, Path], tmp_path: Path, **kw: object) -> TrainConfig:
    base = dict(model="resnet20", norm="bn", model_kwargs={"width": 8}, data=str(data[0]),
                test=str(data[1]), epochs=1, batch_size=16, lr=0.05, warmup_epochs=0.0, threads=1,
                work_dir=str(tmp_path / "work"), out=str(tmp_path / "out.pt"))
    base.update(kw)
    return TrainConfig(**base)  # type: ignore[arg-type]


def test_augment_batch_crops_and_flips_uint8() -> None:
    x = torch.arange(2 * 8 * 8 * 3, dtype=torch.int64).remainder(251).to(torch.uint8).view(2, 8, 8, 3)
    gen = torch.Generator().manual_seed(0)
    out = augment_batch(x, gen, pad=2)
    assert out.shape == x.shape and out.dtype == torch.uint8
    # every output is a (possibly flipped) window of the zero-padded input
    padded = torch.nn.functional.pad(x, (0, 0, 2, 2, 2, 2))
    for i in range(2):
        found = any(torch.equal(out[i], w) or torch.equal(out[i], w.flip(1))
                    for oy in range(5) for ox in range(5) for w in [padded[i, oy:oy + 8, ox:ox + 8]])
        assert found
    assert torch.equal(augment_batch(x, torch.Generator().manual_seed(3), pad=0)[:, :, :, :].sum(), x.sum())


def test_lr_schedule_warms_up_then_decays() -> None:
    values = [lr_factor(s, 100, 10, 0.0) for s in range(100)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(values[10:], values[11:]))
    assert lr_factor(100, 100, 10, 0.01) == pytest.approx(0.01)


@pytest.mark.slow
def test_one_epoch_learns_an_easy_task(data: tuple[Path, Path], tmp_path: Path) -> None:
    torch.manual_seed(0)
    x, y = load_tensors(data[1])
    result = train(small_config(data, tmp_path))
    assert len(result["history"]) == 1
    assert result["test_acc"] > 75.0
    assert evaluate_accuracy(result["model"], x, y) == pytest.approx(result["test_acc"])
    # the final checkpoint is small, weights-only and reloads with its provenance
    raw = torch.load(result["out"], weights_only=True, map_location="cpu")
    assert raw["meta"]["epochs"] == 1 and raw["meta"]["clean_accuracy"] == result["test_acc"]
    assert len(raw["meta"]["data_sha256"]) == 64 and raw["meta"]["partial"] is False
    assert evaluate_accuracy(models.load(result["out"]), x, y) == pytest.approx(result["test_acc"])


TINY_VIT = dict(model="vit", norm=None, model_kwargs={"dim": 32, "depth": 1, "heads": 2}, optimizer="adamw",
                lr=3e-3, label_smoothing=0.1, warmup_epochs=0.5)


@pytest.mark.slow
def test_resume_continues_exactly(data: tuple[Path, Path], tmp_path: Path) -> None:
    straight = train(small_config(data, tmp_path / "a", epochs=2, out=None, **TINY_VIT))
    cfg = small_config(data, tmp_path / "b", epochs=2, stop_after=1, **TINY_VIT)
    first = train(cfg)
    assert [h["epoch"] for h in first["history"]] == [1]
    assert resume_path(cfg.work_dir).is_file()
    partial = export_state(cfg.work_dir, tmp_path / "partial.pt")
    assert torch.load(partial, weights_only=True)["meta"]["partial"] is True
    cfg.stop_after = None
    resumed = train(cfg, resume=True)
    assert [h["epoch"] for h in resumed["history"]] == [1, 2]
    for a, b in zip(straight["model"].state_dict().values(), resumed["model"].state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_resume_without_state_or_with_other_data_fails(data: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no training state"):
        train(small_config(data, tmp_path, **TINY_VIT), resume=True)
    train(small_config(data, tmp_path, epochs=2, stop_after=1, out=None, limit_train=32, **TINY_VIT))
    other = make_npz(tmp_path / "other.npz", 64, 5)
    with pytest.raises(ValueError, match="not the file"):
        train(small_config((other, data[1]), tmp_path, epochs=2, out=None, **TINY_VIT), resume=True)


@pytest.mark.slow
def test_groupnorm_resnet_trains(data: tuple[Path, Path], tmp_path: Path) -> None:
    result = train(small_config(data, tmp_path, norm="gn", model_kwargs={"width": 4, "groups": 2}, out=None,
                                limit_train=64))
    assert np.isfinite(result["history"][0]["loss"])
    assert all(isinstance(m, torch.nn.GroupNorm) for m in result["model"].modules()
               if isinstance(m, (torch.nn.GroupNorm, torch.nn.BatchNorm2d)))


@pytest.mark.slow
def test_cli_trains_a_vit_with_adamw(data: tuple[Path, Path], tmp_path: Path) -> None:
    out = tmp_path / "vit.pt"
    code = main(["train", "--model", "vit", "--model-kwargs", '{"dim": 32, "depth": 1, "heads": 2}',
                 "--optimizer", "adamw", "--lr", "1e-3", "--label-smoothing", "0.1", "--data", str(data[0]),
                 "--test", str(data[1]), "--epochs", "1", "--batch-size", "64", "--threads", "1",
                 "--out", str(out), "--work-dir", str(tmp_path / "w")])
    assert code == 0
    model = models.load(out)
    assert isinstance(model.model, models.registry.ViT)
    assert main(["train", "--export", "--work-dir",
                 str(tmp_path / "w"), "--out", str(tmp_path / "again.pt")]) == 0
    assert models.load(tmp_path / "again.pt")(torch.rand(1, 3, 32, 32)).shape == (1, 2)


def test_bad_npz_is_rejected(tmp_path: Path) -> None:
    np.savez(tmp_path / "bad.npz", x=np.zeros((4, 32, 32, 3), np.float32), y=np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="uint8"):
        load_tensors(tmp_path / "bad.npz")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_device_without_a_gpu_is_a_clear_error(tmp_path: Path) -> None:
    data = make_npz(tmp_path / "d.npz", 32, seed=0)
    cfg = TrainConfig(model="resnet20", data=str(data), model_kwargs={"width": 4}, epochs=1, device="cuda")
    with pytest.raises(RuntimeError, match="sees no CUDA GPU"):
        train(cfg)


def test_init_starts_from_a_checkpoint_and_records_it(data: tuple[Path, Path], tmp_path: Path) -> None:
    tiny = dict(model_kwargs={"width": 4}, limit_train=32, out=None)
    base = train(small_config(data, tmp_path / "a", **{**tiny, "out": str(tmp_path / "base.pt")}))
    start = {k: v.clone() for k, v in base["model"].state_dict().items()}
    # lr 0: the fine-tune's weights are the init's (BatchNorm running statistics still move)
    cfg = small_config(data, tmp_path / "b", **{**tiny, "lr": 0.0, "init": str(base["out"]),
                                                  "out": str(tmp_path / "tuned.pt")})
    tuned = train(cfg)
    for name, value in tuned["model"].state_dict().items():
        if "running" not in name and "num_batches" not in name:
            assert torch.equal(value, start[name]), name
    meta = torch.load(tuned["out"], weights_only=True)["meta"]
    assert meta["init"]["file"] == "base.pt" and len(meta["init"]["sha256"]) == 64
    assert meta["init"]["test_acc_by_epoch"] == [h["test_acc"] for h in base["history"]]
    # another architecture is refused with a one-line error naming the file
    other = small_config(data, tmp_path / "c", **{**tiny, "model_kwargs": {"width": 8}, "init": str(base["out"])})
    with pytest.raises(CheckpointError, match="do not fit this model"):
        train(other)
