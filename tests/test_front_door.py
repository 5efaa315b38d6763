"""What a newcomer meets first: help texts that show defaults and read as plain text, errors worded for
the command line, short reprs."""

from __future__ import annotations

import argparse

import pytest

import aqr
from aqr.cli import build_parser, main
from tests.models_tiny import bn_cnn, images


def _help(command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command].format_help()


def test_every_command_shows_its_defaults() -> None:
    assert "(default: 101)" in _help("calibrate")
    assert "(default: 128)" in _help("evaluate")
    assert "(default: 30)" in _help("train")


def test_help_texts_are_plain_text_and_every_train_option_has_help() -> None:
    text = _help("corrupt")
    assert "``" not in text and ":mod:" not in text and ":func:" not in text
    assert "the model's" not in text  # corrupt takes no model
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in sub.choices["train"]._actions:
        assert action.help, action.option_strings


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as stop:
        return int(stop.code)


def test_a_misspelt_corruption_names_the_valid_ones(tmp_path, capsys) -> None:
    code = _run(["evaluate", "resnet20_bn", "--cifar-c", str(tmp_path), "--corruption", "fgo", "--methods", "source"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "unknown corruption 'fgo'" in err and "did you mean 'fog'" in err and "gaussian_noise" in err


def test_an_architecture_without_weights_is_worded_for_the_command_line(tmp_path, capsys) -> None:
    code = _run(["calibrate", "resnet20", "--data", str(tmp_path / "x.npz"), "--out", str(tmp_path / "s")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "--checkpoint FILE" in err and "checkpoint=<" not in err and "resnet20_bn" in err


@pytest.mark.parametrize("target", ["stream", "robust"])
def test_a_streaming_target_in_the_episodic_protocol_is_refused(tmp_path, capsys, target) -> None:
    code = _run(["evaluate", "resnet20_bn", "--cifar-c", str(tmp_path), "--corruption", "fog",
                 "--methods", f"aqr:target={target}", "--stats", str(tmp_path / "missing.safetensors")])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and "--protocol online" in err


def test_statistics_print_short() -> None:
    stats = aqr.calibrate(bn_cnn(), [images(8)], num_quantiles=11)
    text = repr(stats)
    assert len(text) < 200 and "2 layers" in text and "K=11" in text
    layer = repr(next(iter(stats.layers.values())))
    assert len(layer) < 120 and "BatchNorm2d" in layer and "tensor" not in layer


def test_the_library_warns_of_a_streaming_target_in_the_episodic_protocol() -> None:
    from aqr.methods import create

    net = bn_cnn()
    stats = aqr.calibrate(net, [images(16)], num_quantiles=11)
    with pytest.warns(UserWarning, match="protocol='online'"):
        create("aqr", net, stats=stats, target="stream", protocol="episodic")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        create("aqr", net, stats=stats, target="stream", protocol="online")
        create("aqr", net, stats=stats, target="stream")  # online by default
        create("aqr", net, stats=stats)
