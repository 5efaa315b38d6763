"""LAME (Laplacian-adjusted MLE on the classifier's features) and the feature-layer lookup."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from aqr.methods import create
from aqr.methods.lame import affinity_matrix, laplacian_optimization
from aqr.models.features import feature_layer, feature_layer_name
from tests.models_tiny import bn_cnn, gn_cnn, images, tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")


def net_and_features(n: int = 16, seed: int = 1) -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GroupNorm CNN whose logits are sharpened, a batch, its features and its logits."""
    net = gn_cnn().eval()
    with torch.no_grad():
        net[-1].weight.mul_(6.0)
        x = images(n, seed=seed)
        feats = net[:-1](x)
        logits = net[-1](feats)
    return net, x, feats, logits


def test_rbf_and_knn_affinities_by_hand() -> None:
    f = F.normalize(torch.randn(7, 4, generator=torch.Generator().manual_seed(0)), dim=1)
    d = torch.cdist(f, f)
    kth = torch.sort(d, dim=1).values[:, 4]  # the 5th nearest, counting the image itself
    sigma = kth.mean()
    assert torch.allclose(affinity_matrix(f, "rbf", 5), torch.exp(-d ** 2 / (2 * sigma ** 2)), atol=1e-5)
    w = affinity_matrix(f, "knn", 3)
    assert w.sum(1).tolist() == [3.0] * 7 and w.diag().abs().sum() == 0
    order = torch.sort(d + torch.eye(7) * 10, dim=1).indices[:, :3]
    assert all(set(torch.nonzero(w[i]).flatten().tolist()) == set(order[i].tolist()) for i in range(7))
    assert torch.allclose(affinity_matrix(f, "linear"), f @ f.t())
    one = affinity_matrix(f[:1], "rbf", 5)
    assert torch.isfinite(one).all() and one.item() == 1.0  # one image: no 0/0


def test_zero_affinity_returns_the_softmax() -> None:
    net, x, _, logits = net_and_features()
    out = create("lame", net, bound_lambda=0.0)(x)
    assert torch.allclose(out.softmax(1), logits.softmax(1), atol=1e-6)
    unary = -torch.log(logits.softmax(1) + 1e-10)
    y, exponent, _ = laplacian_optimization(unary, torch.zeros(16, 16))
    assert torch.allclose(y, logits.softmax(1), atol=1e-6) and torch.allclose(exponent.softmax(1), y)


def test_output_is_the_fixed_point_of_the_laplacian_update() -> None:
    net, x, feats, logits = net_and_features()
    m = create("lame", net, tol=0.0, max_steps=500)
    out = m(x)
    y = out.softmax(1)
    kernel = affinity_matrix(F.normalize(feats, dim=1), "rbf", 5)
    # the fixed-point equation: y = softmax(log(p + 1e-10) + lambda W y)
    assert torch.allclose(y, (torch.log(logits.softmax(1) + 1e-10) + kernel @ y).softmax(1), atol=1e-5)
    assert not torch.allclose(y, logits.softmax(1), atol=1e-2)  # the Laplacian term really moved it
    # with the default stopping rule: close to the fixed point, in no more steps
    default = create("lame", net)
    assert torch.allclose(default(x).softmax(1), y, atol=1e-3) and 3 <= default.iterations <= m.iterations


def test_lame_is_stateless_and_leaves_the_users_model_alone() -> None:
    net, x, _, _ = net_and_features()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    episodic, online = create("lame", net, protocol="episodic"), create("lame", net, protocol="online")
    first = episodic(x)
    for s in (2, 3):
        online(images(16, seed=s))
    assert torch.equal(online(x), first) and torch.equal(episodic(x), first)
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())
    assert all(not m._forward_pre_hooks for m in net.modules())  # the hook sits on the private copy
    online.reset()
    assert torch.equal(online(x), first)


def test_non_finite_images_keep_their_logits_and_stay_out_of_the_affinity() -> None:
    net, x, _, _ = net_and_features()
    bad = x.clone()
    bad[4] = float("nan")
    m = create("lame", net)
    out = m(bad)
    keep = [i for i in range(16) if i != 4]
    assert torch.isnan(out[4]).all() and torch.isfinite(out[keep]).all()
    assert torch.allclose(out[keep], m(x[keep]), atol=1e-6)


def test_lame_options_and_presets() -> None:
    net = gn_cnn()
    m = create("lame", net)
    assert (m.config.affinity, m.config.knn, m.config.bound_lambda, m.config.max_steps) == ("rbf", 5, 1.0, 100)
    assert create("lame", net, defaults="imagenet").config == m.config
    for bad in ({"affinity": "cosine"}, {"knn": 0}, {"max_steps": 0}, {"feature_layer": 3}):
        with pytest.raises(ValueError):
            create("lame", net, **bad)
    knn = create("lame", net, affinity="knn", knn=3, force_symmetry=True)
    assert knn(images(8)).shape == (8, 5)


class TimmLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(12, 6))
        self.last = nn.Linear(6, 3)

    def get_classifier(self) -> nn.Module:
        return self.last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.body(x))


def test_feature_layer_finds_the_classifier_of_each_kind_of_model() -> None:
    from aqr.models import create as create_model

    resnet = create_model("resnet20")
    assert feature_layer_name(resnet) == "model.linear" and feature_layer(resnet) is resnet.model.linear
    vit = create_model("vit", image_size=32, patch_size=8, dim=16, depth=1, heads=2)
    assert feature_layer_name(vit) == "model.head"
    assert feature_layer_name(TimmLike()) == "last"
    assert feature_layer_name(bn_cnn()) == "8" and feature_layer_name(tiny_vit()) == "head"
    assert feature_layer_name(bn_cnn(), "7") == "7"
    with pytest.raises(ValueError, match="names no module"):
        feature_layer_name(bn_cnn(), "classifier")
    with pytest.raises(ValueError, match="cannot find the classifier layer of Wrapped.*feature_layer="):
        class Wrapped(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.net = bn_cnn()

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.net(x)

        feature_layer_name(Wrapped())
    # an explicit layer: LAME on the features it names
    x = images(8, seed=2)
    assert torch.equal(create("lame", bn_cnn(), feature_layer="8")(x), create("lame", bn_cnn())(x))


def test_lame_on_a_zoo_resnet_uses_its_pooled_features() -> None:
    from aqr.models import create as create_model

    net = create_model("resnet20").eval()
    x = images(6, size=32, seed=3)
    m = create("lame", net, bound_lambda=0.0)
    assert m.feature_layer_name == "model.linear"
    assert torch.allclose(m(x).softmax(1), net(x).softmax(1), atol=1e-5)
    with pytest.raises(ValueError, match="logits of shape"):
        create("lame", nn.Sequential(nn.Linear(4, 3)))(torch.randn(2, 5, 4))
    with pytest.raises(ValueError, match="not one feature row per image"):
        create("lame", nn.Sequential(nn.Flatten(0), nn.Unflatten(0, (2, 4)), nn.Linear(4, 3)),
               feature_layer="1")(torch.randn(2, 4))
