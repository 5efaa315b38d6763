"""The stream package's contract with the config: the config imports nothing of it, the package builds its
own state from the config, each state class answers for its target, and a batch's values are fixed while
its layers record on it only through its methods."""

from __future__ import annotations

import ast
from dataclasses import FrozenInstanceError, fields
from pathlib import Path

import pytest
import torch

import aqr
from aqr.adapt.config import (BATCH, GROUP, MIXED, OPTION_GROUPS, ROBUST, STREAM, TARGET_KINDS, AQRConfig, options_of,
                              robust_options, stream_options)
from aqr.adapt.stream.batch import BatchCommit, BatchValues, StreamBatch
from aqr.adapt.stream.build import STREAM_CLASSES, layer_stream, stream_class
from aqr.adapt.stream.robust import MARGINAL_WINDOW, RobustLayerStream, RobustSettings
from aqr.adapt.stream.running import LayerStream, StreamSettings
from aqr.adapt.stream.stream_maps import SharedStream
from aqr.adapt.stream.torch_kernels import TorchStreamKernels
from tests.models_tiny import bn_cnn, images

CONFIG = Path(aqr.adapt.config.__file__)


def _imported(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return modules


def test_the_config_imports_nothing_of_the_stream_package() -> None:
    assert not [m for m in _imported(CONFIG) if m.startswith("aqr.adapt.stream")]


def test_every_option_is_declared_once_with_its_group() -> None:
    groups = {f.name: f.metadata.get(GROUP) for f in fields(AQRConfig)}
    assert groups.pop("target") is None and set(groups.values()) == {BATCH, STREAM, ROBUST, MIXED}
    for view in OPTION_GROUPS:  # the views are the config's fields of one group, with the config's defaults
        config_fields = {f.name: f for f in fields(AQRConfig)}
        assert all(f.default == config_fields[f.name].default and f.type == config_fields[f.name].type
                   for f in fields(view))
    assert [f.name for f in fields(OPTION_GROUPS[1])] == list(options_of(STREAM)) == list(stream_options())
    assert "passes" in options_of(ROBUST) and "passes" not in robust_options()


def test_the_settings_classes_take_the_configs_defaults_and_checks() -> None:
    assert StreamSettings.of(AQRConfig(), 100) == StreamSettings()
    assert RobustSettings.of(AQRConfig()) == RobustSettings()
    for option, setting in (({"horizon": 0.5}, {"horizon": 0.5}), ({"estimator": "x"}, {"estimator": "x"}),
                            ({"tail_window": 0}, {"tail_window": 0}), ({"stream_grid": 0}, {"grid": 0})):
        with pytest.raises(ValueError) as from_config:
            AQRConfig(target="stream", **option)
        with pytest.raises(ValueError) as from_settings:
            StreamSettings(**setting)
        assert str(from_config.value) == str(from_settings.value)
    for bad in ({"groups": 0}, {"class_horizon": 0.5}, {"balance": 2.0}, {"recent_horizon": True}):
        with pytest.raises(ValueError) as from_config:
            AQRConfig(target="robust", **bad)
        with pytest.raises(ValueError) as from_settings:
            RobustSettings(**bad)
        assert str(from_config.value) == str(from_settings.value)


def _no_knots(x: torch.Tensor, pre: object) -> None:
    raise AssertionError("a state's own knots are read only when a batch is stepped")


def test_the_package_builds_each_running_targets_state_from_the_config() -> None:
    running = {name for name, kind in TARGET_KINDS.items() if kind.keeps_state}
    assert set(STREAM_CLASSES) == running
    source = torch.linspace(-2, 2, 11).repeat(3, 1)
    for target, cls in (("stream", LayerStream), ("robust", RobustLayerStream)):
        config = AQRConfig(target=target, groups=4) if target == "robust" else AQRConfig(target=target)
        settings = StreamSettings.of(config, 100)
        stream = layer_stream(config, source, settings, TorchStreamKernels(), _no_knots)  # type: ignore[arg-type]
        assert type(stream) is cls and stream.settings == settings
    assert stream.robust == RobustSettings(groups=4)
    with pytest.raises(ValueError, match="keeps no running state"):
        stream_class(AQRConfig())


def test_the_shares_of_a_batch_are_the_state_classes() -> None:
    runs = [c for c in range(16) for _ in range(32)]  # runs of one class: no own share
    assert LayerStream.batch_shares(runs, AQRConfig(target="stream")) == (0.0, 1.0)
    assert RobustLayerStream.batch_shares(runs, AQRConfig(target="robust")) == (0.0, 1.0)
    mixed = list(torch.randint(0, 10, (MARGINAL_WINDOW,), generator=torch.Generator().manual_seed(0)).tolist())
    own, rest = RobustLayerStream.batch_shares(mixed, AQRConfig(target="robust"))
    assert own == 1.0 and rest == 0.0
    assert RobustLayerStream.batch_shares(mixed, AQRConfig(target="robust", own_batch=False)) == (0.0, 0.0)


def test_a_batch_keeps_its_values_and_records_only_through_its_methods() -> None:
    batch = StreamBatch(BatchValues(images=4, own=0.5, runs=0.25))
    with pytest.raises(FrozenInstanceError):
        batch.values.images = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        batch.images = 3  # type: ignore[misc]
    batch.stage("stream", "update")  # type: ignore[arg-type]
    batch.mark_nonfinite()
    assert batch.staged == (("stream", "update"),) and not batch.finite
    again = batch.again()
    assert again.values == batch.values and again.staged == () and again.finite
    held = StreamBatch(BatchValues(images=2, held=True))
    with pytest.raises(RuntimeError, match="held"):
        held.stage("stream", "update")  # type: ignore[arg-type]
    commit = BatchCommit(None, 1.0)
    assert commit.once("k", lambda: [1]) is commit.once("k", lambda: [2])


class _Recorder:
    """A stand-in state that records the commits it is given."""

    def __init__(self) -> None:
        self.commits: list[tuple[object, BatchCommit]] = []

    def commit_batch(self, staged: object, commit: BatchCommit) -> None:
        self.commits.append((staged, commit))


def test_the_shared_stream_owns_the_batch_in_flight() -> None:
    shared = SharedStream(AQRConfig(target="robust"))
    assert shared.current.images == 0 and not shared.current.held
    with shared.running(3, held=True) as batch:
        assert shared.current is batch and batch.held and batch.images == 3
    assert shared.current.images == 0 and not shared.current.held  # ended on the way out
    layer = _Recorder()
    batch = shared.begin(2)
    batch.stage(layer, "a")  # type: ignore[arg-type]
    labels = torch.tensor([3, 5])
    shared.commit(labels)
    (staged, commit), = layer.commits
    assert staged == "a" and commit.labels is labels and commit.runs == batch.values.runs
    assert shared.recent == [3, 5] and shared.current.staged == ()  # applied once
    shared.again().stage(layer, "b")  # type: ignore[arg-type]
    shared.end()
    assert len(layer.commits) == 1 and shared.current.staged == ()
    shared.reset()
    assert shared.recent == []


def test_a_held_forward_leaves_no_flag_and_no_batch_behind() -> None:
    model = bn_cnn()
    stats = aqr.calibrate(model, [images(16)], num_quantiles=11)
    adapted = aqr.AQR(model, stats, target="stream", compile=False)
    adapted(images(8))
    before = {name: m.streams[torch.device("cpu")].snapshot() for name, m in adapted._maps.items()}
    adapted.forward_held(images(2))
    assert adapted._batch.current.images == 0 and adapted._batch.current.staged == ()
    for name, m in adapted._maps.items():
        after = m.streams[torch.device("cpu")].snapshot()
        assert all(torch.equal(v, after[k]) if isinstance(v, torch.Tensor) else True for k, v in before[name].items())
