"""A user's first day (issue 59): the stumbles a new user met, each held here."""

from __future__ import annotations

import warnings

import pytest
import torch

import aqr
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
