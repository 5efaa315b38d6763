"""``aqr demo``: the digits path end to end (quick) and resumed, the digits loader, the CIFAR path, the CLI."""

from __future__ import annotations

import itertools
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")
pytest.importorskip("PIL")
pytest.importorskip("scipy")

from aqr.cli import main  # noqa: E402
from aqr.data.cifar_c import GenerationConfig, generate_cifar_c  # noqa: E402
from aqr.experiments.demo import (DIGITS_MODELS, QUICK_SEVERITIES, DemoConfig, load_digits_rgb32,  # noqa: E402
                                  run_demo, split_digits)
from aqr.harness.presets import BASELINES  # noqa: E402
from aqr.harness.results import ResultsDB  # noqa: E402
from aqr.models import create, save_checkpoint  # noqa: E402


# One corruption keeps the shared quick run short; the quick default has two.
CORRUPTIONS = ("contrast",)


def _quiet(message: str) -> None:
    pass


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One quick digits run (trains three tiny models), shared by the tests that inspect it."""
    config = DemoConfig(out=str(tmp_path_factory.mktemp("demo")), quick=True, n_images=100, corruptions=CORRUPTIONS)
    return config, run_demo(config, log=_quiet)


@pytest.mark.slow
def test_quick_demo_fills_one_row_per_cell(quick):
    config, result = quick
    models = tuple(m.name for m in DIGITS_MODELS)
    assert result.models == models and result.methods == BASELINES
    expected = set(itertools.product(models, BASELINES, CORRUPTIONS, QUICK_SEVERITIES))
    with ResultsDB(result.db) as db:
        rows = db.rows(experiment="demo")
    assert len(rows) == len(expected)
    assert {(r.model, r.method, r.corruption, r.severity) for r in rows} == expected
    assert all(r.n_images == 100 or r.status == "n/a" for r in rows)
    assert [r for r in rows if r.status == "error"] == []
    for r in rows:
        if r.status == "ok":
            assert 0.0 <= r.accuracy <= 100.0


@pytest.mark.slow
def test_quick_demo_models_learn_and_ttn_needs_batchnorm(quick):
    _, result = quick
    for model in result.models:
        assert result.clean[model] > 50.0, (model, result.clean)  # chance is 10 %
    assert result.accuracy["ttn"]["resnet20_gn"] is None
    assert result.accuracy["ttn"]["vit_ln"] is None
    with ResultsDB(result.db) as db:
        ttn_gn = db.rows(experiment="demo", model="resnet20_gn", method="ttn")
    assert ttn_gn and all(r.status == "n/a" for r in ttn_gn)
    table = result.format_table()
    assert "n/a" in table and "clean" in table and all(m in table for m in result.models)
    for method in BASELINES:
        for model in result.models:
            value = result.accuracy[method][model]
            assert value is None or 0.0 <= value <= 100.0


@pytest.mark.slow
def test_quick_demo_writes_a_figure(quick):
    _, result = quick
    assert result.figure is not None and result.figure.is_file()
    assert result.figure.stat().st_size > 1000


@pytest.mark.slow
def test_second_run_reuses_models_data_and_cells(quick):
    config, first = quick
    second = run_demo(config, log=_quiet)
    assert second.trained == ()
    assert second.summary.ran == 0 and second.summary.skipped == second.summary.total == 3 * len(BASELINES) * len(CORRUPTIONS)
    assert second.accuracy == first.accuracy and second.clean == first.clean


def test_digits_loader_shapes_and_disjoint_split():
    images, labels = load_digits_rgb32()
    assert images.shape == (1797, 32, 32, 3) and images.dtype == np.uint8
    assert labels.shape == (1797,) and labels.dtype == np.int64 and set(labels) == set(range(10))
    assert np.array_equal(images[..., 0], images[..., 2])  # gray in all three channels
    assert images.max() == 255 and images.min() == 0
    ids = np.arange(len(labels))
    splits = split_digits(ids, labels, seed=0, n_source=200, n_test=600)
    train, source, test = (set(part[0]) for part in (splits.train, splits.source, splits.test))
    assert (len(train), len(source), len(test)) == (997, 200, 600)
    assert not (train & source or train & test or source & test)
    assert train | source | test == set(ids)
    assert np.array_equal(split_digits(ids, labels, seed=0).test[0], splits.test[0])
    assert not np.array_equal(split_digits(ids, labels, seed=1).test[0], splits.test[0])
    with pytest.raises(ValueError, match="training images"):
        split_digits(ids, labels, n_source=1000, n_test=900)


@pytest.fixture
def tiny_cifar(tmp_path):
    """A 64-image CIFAR-style npz, its generated CIFAR-C folder and a small aqr checkpoint."""
    rng = np.random.default_rng(0)
    labels = np.arange(64) % 10
    images = (rng.random((64, 32, 32, 3)) * 64 + labels[:, None, None, None] * 19).astype(np.uint8)
    npz = tmp_path / "tiny.npz"
    np.savez(npz, x=images, y=labels)
    folder = tmp_path / "tiny-c"
    generate_cifar_c(images, labels, folder, GenerationConfig(corruptions=("gaussian_noise", "contrast"),
                                                              severities=(3, 5)), progress=False)
    torch.manual_seed(0)
    model = create("resnet20", num_classes=10, norm="bn", width=4)
    checkpoint = save_checkpoint(tmp_path / "tiny_bn.pt", model,
                                 {"name": "resnet20", "num_classes": 10, "norm": "bn", "kwargs": {"width": 4}})
    return npz, folder, checkpoint


@pytest.mark.slow
def test_cifar_path_with_an_aqr_checkpoint(tiny_cifar, tmp_path):
    npz, folder, checkpoint = tiny_cifar
    config = DemoConfig(out=str(tmp_path / "out"), data=str(npz), cifar_c=str(folder), checkpoint=str(checkpoint),
                        model_name="tiny")
    result = run_demo(config, log=_quiet)
    assert result.trained == () and result.models == ("tiny",)
    assert result.severities == (3, 5) and set(result.corruptions) == {"gaussian_noise", "contrast"}
    with ResultsDB(result.db) as db:
        rows = db.rows(experiment="demo-cifar")
    assert len(rows) == len(BASELINES) * 2 * 2 and all(r.status == "ok" for r in rows)
    assert all(r.n_images == 32 for r in rows)  # the folder's second half
    assert all(r.config["model"]["source_indices"] == "0:32" for r in rows)  # the npz's first half
    assert result.clean["tiny"] is not None  # the npz is the folder's clean source
    assert result.figure is not None and result.figure.is_file()


@pytest.mark.slow
def test_cifar_path_with_third_party_weights(tiny_cifar, tmp_path):
    npz, folder, _ = tiny_cifar
    weights = tmp_path / "resnet20.th"
    torch.save({"state_dict": {f"module.{k}": v for k, v in create("resnet20").model.state_dict().items()}}, weights)
    config = DemoConfig(out=str(tmp_path / "out"), data=str(npz), cifar_c=str(folder), checkpoint=str(weights),
                        arch="resnet20", quick=True, figure=False)
    result = run_demo(config, log=_quiet)
    assert result.models == ("resnet20",) and result.figure is None
    assert result.severities == (5,) and result.summary.errors == 0
    assert result.summary.ran == len(BASELINES) * 2


@pytest.mark.slow
def test_cli_demo_on_cifar_prints_the_table(tiny_cifar, tmp_path, capsys):
    npz, folder, checkpoint = tiny_cifar
    code = main(["demo", "--data", str(npz), "--cifar-c", str(folder), "--checkpoint", str(checkpoint),
                 "--out", str(tmp_path / "cli"), "--no-progress", "--no-figure", "--corruptions", "contrast",
                 "--severities", "5"])
    out = capsys.readouterr().out
    assert code == 0
    assert "method" in out and "aqr" in out and "checkpoint" not in out.splitlines()[0]
    assert f"{len(BASELINES)} cells run" in out and "moments" in out


def test_cli_demo_needs_all_cifar_flags(tmp_path, capsys):
    assert main(["demo", "--data", "x.npz", "--out", str(tmp_path)]) == 2
    assert "needs all of" in capsys.readouterr().err


def test_missing_scikit_learn_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # makes `import sklearn` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'aqr\[demo\]'"):
        run_demo(DemoConfig(out=str(tmp_path)), log=_quiet)
