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


def test_given_clusters_route_each_image_as_labelled_and_leave_the_centres() -> None:
    import aqr
    from tests.models_tiny import bn_cnn, images

    model = bn_cnn().eval()
    stats = aqr.calibrate(model, [images(32, seed=s) for s in range(2)], num_quantiles=21, compile=False,
                          descriptors=True)
    adapter = aqr.AQR(model, stats, target="mixed", components=3, compile=False)
    batch = {"labels": torch.tensor([0, 2, 2, 0])}
    recorded: dict[int, list[torch.Tensor]] = {}
    with script.given_clusters(batch), script.recorded_descriptors(recorded):
        adapter(images(4, seed=5))  # the shared states start: the clusters' start from them at the next batch
        adapter(images(4, seed=6))
        router = script.router_of(adapter)
        assert router._assignment is None  # the patched assignment is not stored: asked again per layer
        assert router.assignment().tolist() == [0, 2, 2, 0]
    started = [[part.started for part in m.streams[torch.device("cpu")].parts] for m in adapter._maps.values()]
    assert any(s == [True, False, True] for s in started)  # clusters 0 and 2 took images, 1 none
    assert not router.seeded  # the centres never moved
    assert len(recorded) == len(adapter._maps) and all(v[0].shape[0] == 4 for v in recorded.values())
    assert script.mixed.ComponentRouter.commit.__name__ == "commit"  # restored after the block


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


def test_the_clusters_figure_is_drawn_from_each_corruptions_shares(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    given = np.array([0, 1, 1, 2, 2, 2])
    domain = np.array([0, 0, 0, 1, 1, 1])
    path = tmp_path / "clusters.png"
    script.draw_clusters(given, domain, ["noise", "blur"], path, "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
