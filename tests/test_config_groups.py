"""AQRConfig's options grouped as batch / stream / robust: the groups cover the flat fields, read them,
build the same config, and leave the flat API (keywords, attributes, equality, hash) as it was."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields

import pytest

import aqr
from aqr.adapt import AQRConfig, BatchOptions, RobustOptions, StreamOptions
from aqr.adapt.config import OPTION_GROUPS
from aqr.methods import AQRMethodConfig
from tests.models_tiny import bn_cnn, images


def _names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def test_the_groups_split_every_option_but_target_once() -> None:
    grouped = [name for group in OPTION_GROUPS for name in _names(group)]
    assert len(grouped) == len(set(grouped))
    assert sorted(grouped + ["target"]) == sorted(_names(AQRConfig))


def test_group_defaults_are_the_configs() -> None:
    config = AQRConfig()
    assert config.batch == BatchOptions() and config.stream == StreamOptions() and config.robust == RobustOptions()


def test_groups_read_the_flat_fields() -> None:
    config = AQRConfig(target="robust", horizon=64.0, balance=0.5, groups=4, tail="standard", grid=256)
    assert config.stream.horizon == config.horizon == 64.0
    assert config.robust.balance == config.balance == 0.5 and config.robust.groups == 4
    assert config.batch.tail == "standard" and config.batch.grid == 256
    with pytest.raises(FrozenInstanceError):
        config.stream.horizon = 1.0  # type: ignore[misc]


def test_from_groups_equals_the_flat_keywords() -> None:
    flat = AQRConfig(target="robust", horizon=64.0, rebuild_every=4, balance=0.5, tail="average")
    grouped = AQRConfig.from_groups("robust", batch=BatchOptions(tail="average"),
                                    stream=StreamOptions(horizon=64.0, rebuild_every=4),
                                    robust=RobustOptions(balance=0.5))
    assert grouped == flat and hash(grouped) == hash(flat) and repr(grouped) == repr(flat)
    assert grouped != AQRConfig(target="robust", horizon=64.0, rebuild_every=4, balance=0.5)


def test_groups_check_their_options() -> None:
    with pytest.raises(ValueError, match="horizon"):
        StreamOptions(horizon=-1.0)
    with pytest.raises(ValueError, match="mode"):
        BatchOptions(mode="slow")
    with pytest.raises(ValueError, match="passes"):
        RobustOptions(passes=3)
    with pytest.raises(ValueError, match="exact"):  # a check across groups: the stream runs the fast path
        AQRConfig.from_groups("stream", batch=BatchOptions(mode="exact"))


def test_the_method_config_keeps_flat_options_and_gains_the_groups() -> None:
    config = AQRMethodConfig(target="stream", horizon=32.0)
    assert config.stream.horizon == 32.0
    assert config.aqr_config() == AQRConfig(target="stream", horizon=32.0)


def test_aqr_takes_flat_keywords_and_shows_the_groups() -> None:
    model = bn_cnn()
    stats = aqr.calibrate(model, [images(16)], num_quantiles=11)
    adapted = aqr.AQR(model, stats, target="stream", horizon=16.0, compile=False)
    assert adapted.config.stream.horizon == 16.0 and adapted.config.target == "stream"
    assert adapted(images(4)).shape[0] == 4
