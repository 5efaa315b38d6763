"""benchmarks/mixed_assignment.py's pieces that do not need data: the label assigner and the online clustering."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "mixed_assignment.py"
spec = importlib.util.spec_from_file_location("mixed_assignment", SCRIPT)
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)


def test_label_assigner_starts_one_component_per_batch_from_the_first() -> None:
    batch = {"labels": torch.tensor([3, 3, 5])}
    assigner = script.LabelAssigner(layer=2, from_layer=0, batch=batch)
    first = assigner.assign(torch.zeros(3, 4))
    assert first.of.tolist() == [3, 3, 3] and first.spawned == 3 and first.parent is None
    assigner.commit(first)
    batch["labels"] = torch.tensor([5, 7, 3])
    second = assigner.assign(torch.zeros(3, 4))
    # 5 starts (from 3's state); 7 is a second new label in the batch and waits in the first component
    assert second.of.tolist() == [5, 3, 3] and second.spawned == 5 and second.parent == 3
    assert assigner.assign(torch.zeros(3, 4), held=True).spawned is None
    early = script.LabelAssigner(layer=1, from_layer=2, batch=batch)
    assert early.assign(torch.zeros(3, 4)).of.tolist() == [0, 0, 0]


def test_online_labels_separate_two_far_domains_and_keep_one_together() -> None:
    rng = np.random.default_rng(0)
    one = rng.normal(size=(640, 6))
    assert set(script.online_labels(one, k=4, tau=6.0).tolist()) == {0}
    two = np.concatenate([one, rng.normal(size=(640, 6)) + 20.0])
    labels = script.online_labels(two, k=4, tau=6.0)
    assert len(set(labels[:640].tolist())) == 1 and len(set(labels[640:].tolist())) == 1
    assert labels[0] != labels[-1]


def test_content_whitening_makes_the_within_domain_spread_round() -> None:
    rng = np.random.default_rng(1)
    domain = np.repeat([0, 1, 2], 400)
    x = rng.normal(size=(1200, 3)) * np.array([3.0, 1.0, 0.5]) + np.array([[0, 0, 0], [5, 0, 0], [0, 0, 1]])[domain]
    y = script.content_whitened(x, x, domain)
    within = sum(np.cov(y[domain == d].T) for d in range(3)) / 3
    assert np.allclose(within, np.eye(3), atol=0.02)  # the floor moves the smallest by about 1 %
    blob = np.tile([0, 1], 256)  # every batch mixes two far domains
    labels = script.minibatch_labels(rng.normal(size=(512, 2)) + 30.0 * blob[:, None], k=2)
    assert labels[:64].tolist() == [0] * 64  # the first batch, before any centre
    later = labels[128:]
    assert (later == blob[128:]).all() or (later == 1 - blob[128:]).all()


def test_shared_blend_at_beta_0_is_the_stream_target_and_its_state_moves_with_every_batch() -> None:
    import aqr
    from tests.models_tiny import bn_cnn, images

    model = bn_cnn().eval()
    stats = aqr.calibrate(model, [images(32, seed=s) for s in range(2)], num_quantiles=21, compile=False)
    stream = aqr.AQR(model, stats, target="stream", compile=False)
    components = aqr.AQR(model, stats, target="mixed", components=3, spawn=1.0, compile=False)
    batches = [images(16, seed=10 + s) * (1 + 2 * (s % 2)) for s in range(6)]
    with script.SharedBlend(0.0).installed():
        blended = [components(x) for x in batches]
    expected = [stream(x) for x in batches]
    assert all(torch.equal(a, b) for a, b in zip(blended, expected))
    assert script.mixed.MixedLayerStream.batch_step is not None and "blended_step" not in \
        script.mixed.MixedLayerStream.batch_step.__qualname__  # restored after the block
    with script.SharedBlend(1.0).installed():
        alone = components(batches[0])
    assert alone.shape == expected[0].shape
    with pytest.raises(ValueError, match="beta"):
        script.SharedBlend(1.5)
