"""Methods named as the bench spells them (``aqr:target=stream``): one parser for ``aqr.methods.create``,
``plan`` and ``aqr bench --methods``, and the recommended configuration per protocol."""

from __future__ import annotations

import pytest
import torch

import aqr
from aqr import methods
from aqr.harness.specs import MethodSpec
from aqr.methods.declaration import parse_spec
from tests.models_tiny import bn_cnn


def images(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def test_parse_spec_reads_names_numbers_and_flags() -> None:
    assert parse_spec("tent") == ("tent", {})
    assert parse_spec(" aqr : target=stream , K=11,horizon=2.5,compile=false ") == (
        "aqr", {"target": "stream", "K": 11, "horizon": 2.5, "compile": False})
    assert parse_spec("aqr+roid:target=robust") == ("aqr+roid", {"target": "robust"})
    with pytest.raises(ValueError, match="key=value, got 'tail'"):
        parse_spec("aqr:tail")
    with pytest.raises(ValueError, match="'target' is given twice"):
        parse_spec("aqr:target=stream,target=robust")


def test_the_bench_and_create_share_the_parser() -> None:
    for text in ("aqr:tail=clip,K=11", "roid:defaults=imagenet", "aqr+roid:target=robust,window=64", "source"):
        name, options = parse_spec(text)
        assert MethodSpec.parse(text) == MethodSpec(name, options)
    assert MethodSpec.parse("aqr:target=stream").label == "aqr:target=stream"


def test_plan_takes_a_spec_as_its_name() -> None:
    spec = methods.plan("aqr+roid:target=robust,protocol=episodic")
    assert spec.name == "aqr+roid" and spec.config.target == "robust" and spec.protocol.protocol == "episodic"
    assert methods.plan("aqr:target=stream", {"horizon": 64}).config == methods.plan(
        "aqr", {"target": "stream", "horizon": 64}).config
    assert methods.plan("aqr:").config == methods.plan("aqr").config


def test_an_option_set_in_the_spec_and_as_a_keyword_is_refused_by_name() -> None:
    with pytest.raises(TypeError, match="option 'target' is set both in the spec and as a keyword") as err:
        methods.create("aqr:target=stream", bn_cnn(), target="robust")
    assert "\n" not in str(err.value)
    with pytest.raises(TypeError, match="takes no option 'targt'"):
        methods.plan("aqr:targt=stream")
    with pytest.raises(KeyError, match="unknown method 'aqx'"):
        methods.plan("aqx:target=stream")
    with pytest.raises(ValueError, match="target"):
        methods.plan("aqr:target=everywhere")


def test_create_from_a_spec_is_the_method_with_those_options() -> None:
    model = bn_cnn()
    stats = aqr.calibrate(model, [images(32, s) for s in range(2)])
    x = images(8, 5)
    from_spec = methods.create("aqr:target=stream,horizon=64", model, stats=stats)
    from_keywords = methods.create("aqr", model, stats=stats, target="stream", horizon=64)
    assert from_spec.config == from_keywords.config and from_spec.config.target == "stream"
    for _ in range(2):  # the running target carries over: the second batch is mapped with the first one's state
        assert torch.equal(from_spec(x), from_keywords(x))


@pytest.mark.parametrize("protocol", ["offline", "realtime"])
def test_recommended_specs_build_a_method(protocol: str) -> None:
    assert set(methods.RECOMMENDED) == {"offline", "realtime"}
    spec = methods.RECOMMENDED[protocol]
    plan = methods.plan(spec)
    model = bn_cnn()
    stats = aqr.calibrate(model, [images(32, s) for s in range(2)], point=plan.stats_point or "output",
                          descriptors=plan.stats_descriptors)
    logits = methods.create(spec, model, stats=stats)(images(8, 3))
    assert logits.shape == (8, 5) and torch.isfinite(logits).all()
    with pytest.raises(TypeError):
        methods.RECOMMENDED["offline"] = "tent"  # frozen: read-only


def test_a_plan_says_when_its_statistics_need_the_images_descriptors() -> None:
    assert methods.plan("aqr:target=mixed").stats_descriptors
    assert methods.plan("aqr+roid:target=mixed").stats_descriptors
    assert not any(methods.plan(spec).stats_descriptors for spec in ("aqr", "aqr:target=robust", "aqr+roid", "tent"))
