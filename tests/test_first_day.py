"""A user's first day (issue 59): the stumbles a new user met, each held here."""

from __future__ import annotations

import dataclasses
import re
import sys
import warnings

import pytest
import torch

import aqr
from aqr.core.calibrate import TENSOR_BATCH, ClassCoverageWarning
from aqr.harness.presets import preset
from aqr.methods import create
from tests.models_tiny import bn_cnn, gn_cnn, images

pytestmark = pytest.mark.usefixtures("one_thread")


def _stats(model: torch.nn.Module, point: str = "output") -> aqr.SourceStats:
    return aqr.calibrate(model, [images(64, seed=100)], num_quantiles=11, point=point)


# ---------------------------------------------------------------------------- the default protocol (item 2)
def test_create_adapts_across_batches_unless_episodic_is_asked_for() -> None:
    """TENT on a GN model: online by default it learns from the first batch, so the second batch's logits
    differ from a fresh method's; episodic, they are the same (and a method refusing episodic still does)."""
    model = gn_cnn()
    first, second = images(16, seed=1) * 0.5, images(16, seed=2) * 0.5
    online = create("tent", model, lr=0.05)
    assert online.protocol.protocol == "online"
    online(first)
    assert not torch.equal(online(second), create("tent", model, lr=0.05)(second))
    episodic = create("tent", model, lr=0.05, protocol="episodic")
    episodic(first)
    assert torch.equal(episodic(second), create("tent", model, lr=0.05, protocol="episodic")(second))
    with pytest.raises(ValueError, match="protocol='online'"):
        create("rbn", bn_cnn(), protocol="episodic")


@pytest.mark.parametrize("name", ["main", "tails", "granularity", "vit-blocks", "smoke", "imagenet"])
def test_the_papers_presets_say_episodic(name: str, tmp_path) -> None:
    grid = preset(name, data_dir=tmp_path, imagenet_dir=tmp_path)
    assert grid.protocol == "episodic" and all(cell.protocol == "episodic" for cell in grid.cells())


# ---------------------------------------------------------------------------- small batches (item 1)
def _caught(run) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [w for w in caught if issubclass(w.category, aqr.SmallBatchWarning)]


def test_a_per_batch_target_warns_once_of_a_batch_too_small_naming_the_stream_target() -> None:
    model = bn_cnn()
    stats = _stats(model)
    adapted = aqr.AQR(model, stats)
    caught = _caught(lambda: [adapted(images(1, seed=s)) for s in range(3)])
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "target='stream'" in message and "batch of 1 image" in message and "\n" not in message
    assert _caught(lambda: aqr.AQR(model, stats)(images(64))) == []  # enough images
    assert len(_caught(lambda: aqr.AQR(model, stats)(images(4)))) == 1  # another wrapper warns again
    assert _caught(lambda: aqr.AQR(model, stats, target="stream")(images(1))) == []  # the target for it


def test_the_methods_that_map_per_batch_warn_too() -> None:
    model = bn_cnn()
    method = create("aqr", model, stats=_stats(model))
    assert len(_caught(lambda: [method(images(2, seed=s)) for s in range(2)])) == 1
    composed = create("aqr+tent", model, stats=_stats(model, "pre-affine"), compile=False)
    caught = _caught(lambda: [composed(images(2, seed=s)) for s in range(2)])
    assert len(caught) == 1 and "target='stream'" in str(caught[0].message)
    streaming = create("aqr+tent", model, stats=_stats(model, "pre-affine"), target="stream", compile=False)
    assert _caught(lambda: streaming(images(2))) == []


def test_roids_auxiliary_passes_on_a_subset_do_not_warn() -> None:
    model = bn_cnn()
    method = create("aqr+roid", model, stats=_stats(model, "pre-affine"), compile=False)
    assert _caught(lambda: method(images(16, seed=6) * 0.5 + 0.5)) == []


# ---------------------------------------------------------------------------- torch.compile (item 4)
@pytest.mark.slow  # dynamo's first trace takes seconds
def test_torch_compile_of_a_streaming_target_runs_it_eagerly_with_the_same_outputs() -> None:
    model = bn_cnn()
    stats = _stats(model)
    compiled = torch.compile(aqr.AQR(model, stats, target="stream"), backend="eager")
    eager = aqr.AQR(model, stats, target="stream")
    for seed in (1, 2):  # the second batch is mapped with the state the first one left
        x = images(1, seed=seed)
        assert torch.equal(compiled(x), eager(x))


# ---------------------------------------------------------------------------- the Python API (item 5)
def test_calibrate_warns_when_the_labels_cover_some_classes_only() -> None:
    model = bn_cnn()  # five classes
    x = images(64, seed=4)
    with pytest.warns(ClassCoverageWarning, match="cover only 2 of the model's 5 classes"):
        aqr.calibrate(model, [(x, torch.arange(64) % 2)], num_quantiles=11)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ClassCoverageWarning)
        aqr.calibrate(model, [(x, torch.arange(64) % 5)], num_quantiles=11)
        aqr.calibrate(model, [x], num_quantiles=11)  # no labels: nothing to say


def test_calibrate_reads_one_tensor_as_its_images_in_batches() -> None:
    model = bn_cnn()
    x = images(200, seed=5)
    from_tensor = aqr.calibrate(model, x, num_quantiles=11)
    from_batches = aqr.calibrate(model, x.split(TENSOR_BATCH), num_quantiles=11)
    for name in from_tensor.layer_names:
        assert torch.equal(from_tensor.source_quantiles(name), from_batches.source_quantiles(name))
    with pytest.raises(ValueError, match="shape \\(5,\\)"):
        aqr.calibrate(model, torch.rand(5), num_quantiles=11)


def test_an_option_typo_gets_the_closest_option() -> None:
    model = bn_cnn()
    stats = _stats(model)
    with pytest.raises(TypeError, match="aqr.AQR takes no option 'horizn' \\(did you mean 'horizon'\\?\\)"):
        aqr.AQR(model, stats, horizn=64)
    with pytest.raises(TypeError, match="did you mean 'tail'"):
        with aqr.recalibrating(model, stats, tial="gaussian"):
            pass


def test_a_state_of_another_target_is_refused_in_one_line_naming_both() -> None:
    model = bn_cnn()
    stats = _stats(model)
    stream = aqr.AQR(model, stats, target="stream")
    stream(images(4))
    cases = [(aqr.AQR(model, stats), stream.state_dict(), "'stream'", "'batch'"),
             (aqr.AQR(model, stats, target="stream"), aqr.AQR(model, stats).state_dict(), "'batch'", "'stream'"),
             (aqr.AQR(model, stats, target="robust"), stream.state_dict(), "'stream'", "'robust'")]
    for adapted, state, theirs, ours in cases:
        with pytest.raises(RuntimeError) as caught:
            adapted.load_state_dict(state)
        message = str(caught.value)
        assert "\n" not in message and f"target={theirs}" in message and f"has target={ours}" in message
    twin = aqr.AQR(model, stats, target="stream")
    twin.load_state_dict(stream.state_dict())  # the same target loads
    x = images(2, seed=8)
    assert torch.equal(twin(x), stream(x))


def test_tent_on_a_model_with_attention_names_the_layer_not_a_vit() -> None:
    class Attending(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.norm = torch.nn.Conv2d(3, 8, 3), torch.nn.GroupNorm(2, 8)
            self.mix = torch.nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = torch.nn.Linear(8, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(self.conv(x)).flatten(2).transpose(1, 2)
            return self.head(self.mix(h, h, h)[0].mean(1))

    with pytest.raises(ValueError) as caught:
        create("tent", Attending())
    assert "ViT" not in str(caught.value) and "mix (MultiheadAttention)" in str(caught.value)
    assert create("tent", Attending(), batch_size=64) is not None


def test_evaluate_shows_progress_on_a_terminal_only(capsys, monkeypatch, tmp_path) -> None:
    from aqr.cli import main
    from tests.models_tiny import tiny_checkpoint_and_images

    ckpt, npz, _ = tiny_checkpoint_and_images(tmp_path, 16)
    argv = ["evaluate", str(ckpt), "--data", str(npz), "--methods", "source", "--batch-size", "8"]
    bar = re.compile(r"source: .*\d/2 \[")  # tqdm's bar over the 2 batches, labelled with the method
    assert main(argv) == 0
    assert not bar.search(capsys.readouterr().err)  # not a terminal: no bar
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert main(argv) == 0
    assert bar.search(capsys.readouterr().err)
    assert main([*argv, "--no-progress"]) == 0
    assert not bar.search(capsys.readouterr().err)


# ---------------------------------------------------------------------------- the CLI checks first (item 6)
def test_evaluate_refuses_statistics_of_another_model_before_any_accuracy(capsys, tmp_path) -> None:
    from aqr.models import create as create_model
    from tests.cli_lines import one_error_line
    from tests.models_tiny import tiny_checkpoint_and_images

    ckpt, npz, _ = tiny_checkpoint_and_images(tmp_path, 16)  # a BN ResNet-20
    torch.manual_seed(0)
    gn = create_model("resnet20", num_classes=10, width=4, norm="gn").eval()
    gn_stats = aqr.calibrate(gn, [torch.rand(16, 3, 32, 32)], num_quantiles=11).save(tmp_path / "gn.safetensors")
    line = one_error_line(capsys, ["evaluate", str(ckpt), "--stats", str(gn_stats), "--data", str(npz),
                                   "--methods", "source,aqr", "--batch-size", "8"], 1, "another model")
    assert "%" not in line  # no method ran: Source's accuracy is not printed first


def test_a_dry_run_says_what_the_first_run_generates_and_writes_nothing(capsys, tmp_path) -> None:
    import numpy as np

    from aqr.cli import main

    data = tmp_path / "data"
    data.mkdir()
    np.savez(data / "cifar10_test.npz", x=np.zeros((20, 32, 32, 3), np.uint8), y=np.arange(20) % 10)
    cifar_c = tmp_path / "cache" / "cifar10c"
    assert main(["bench", "--preset", "smoke", "--limit", "2", "--dry-run", "--data-dir", str(data),
                 "--cifar-c", str(cifar_c), "--db", str(tmp_path / "r.db"), "--cache", str(tmp_path / "cache")]) == 0
    err = capsys.readouterr().err
    assert "generates 200 images (2 corruption(s) x 5 severities x 20 clean images)" in err
    assert "about 1 MB" in err and "--limit 2" in err  # 200 x 3,072 bytes
    assert not (tmp_path / "cache").exists() and not (tmp_path / "r.db").exists()


def test_relative_data_names_and_frost_are_found_in_the_data_folder(monkeypatch, tmp_path) -> None:
    from aqr.cli import build_parser
    from aqr.data.location import default_frost_dir, resolve_data_file

    data, here = tmp_path / "data", tmp_path / "here"
    (data / "frost").mkdir(parents=True)
    here.mkdir()
    (data / "clean.npz").write_bytes(b"")
    monkeypatch.chdir(here)
    monkeypatch.delenv("AQR_DATA_DIR", raising=False)
    assert resolve_data_file("clean.npz") == "clean.npz" and default_frost_dir() is None
    monkeypatch.setenv("AQR_DATA_DIR", str(data))
    assert resolve_data_file("clean.npz") == str(data / "clean.npz")
    assert resolve_data_file("other.npz") == "other.npz"  # missing in both: as given, for the not-found error
    assert default_frost_dir() == str(data / "frost")
    (here / "clean.npz").write_bytes(b"")
    assert resolve_data_file("clean.npz") == "clean.npz"  # a file where the user is wins
    parsed = build_parser().parse_args(["corrupt", "--data", "x.npz", "--out", "o", "--frost-dir", "frost"])
    assert parsed.frost_dir == str(data / "frost")


# ---------------------------------------------------------------------------- the report (item 7)
def test_thirty_methods_are_told_apart_by_colour_and_marker() -> None:
    pytest.importorskip("matplotlib")
    from aqr.util.plots import styles

    names = [f"method{i}" for i in range(30)]
    drawn = styles(names)
    pairs = [(tuple(drawn[n].color), drawn[n].marker) for n in names]
    assert len(set(pairs)) == len(names)
    for a, b in zip(names, names[1:]):  # neighbours in the legend differ in both
        assert tuple(drawn[a].color) != tuple(drawn[b].color) and drawn[a].marker != drawn[b].marker
    assert len({tuple(s.color) for s in drawn.values()}) >= 20 and len({s.marker for s in drawn.values()}) >= 9


def test_the_report_index_starts_with_a_summary_and_explains_its_models() -> None:
    from aqr.harness.report import summary_lines
    from aqr.harness.results import Row

    def row(model: str, method: str, accuracy: float) -> Row:
        return Row(f"{model}{method}", model, method, method, "cifar10-c", "fog", 5, 64, 0, "episodic", "ok",
                   accuracy, 100, 1.0, None, {}, {}, 0.0)

    rows = [row("resnet20_trainstats", "source", 50.0), row("resnet20_trainstats", "aqr", 70.0),
            row("resnet20_trainstats", "tent", 60.0), row("mine", "source", 40.0), row("mine", "tent", 45.0)]
    for speed, accuracies in ((1000, (40.0, 62.0)), (400, (44.0, 58.0))):  # each CCC stream a run of its own
        for method, accuracy in zip(("source", "eta"), accuracies):
            ccc = row("resnet20_trainstats", method, accuracy)
            rows.append(dataclasses.replace(ccc, key=f"{ccc.key}{speed}", protocol="online",
                                            corruption=f"ccc:baseline=40,speed={speed},images=100000"))
    text = "\n".join(summary_lines(rows))
    assert "| resnet20_trainstats | ccc:baseline=40,speed=1000,images=100000 | online | 64 | ETA | 62.00 | 40.00 | 2 |" in text
    assert "| resnet20_trainstats | ccc:baseline=40,speed=400,images=100000 | online | 64 | ETA | 58.00 | 44.00 | 2 |" in text
    assert text.startswith("## Summary")
    assert "| resnet20_trainstats | per corruption | episodic | 64 | AQR | 70.00 | 50.00 | 3 |" in text
    assert "| mine | per corruption | episodic | 64 | TENT | 45.00 | 40.00 | 2 |" in text
    assert "`resnet20_trainstats`: the third-party (akamaster)" in text and "JPEG" in text
    assert "`mine`:" not in text  # a model of the user's own has no note
