"""The AQR wrapper on whole models: recalibration, no side effects, errors."""

import copy
import functools

import pytest
import torch
from torch import nn

import aqr
from tests.models_tiny import bn_cnn, gn_cnn, images, tiny_vit


@functools.lru_cache(maxsize=None)
def calibrated(make, n=1024):
    """One model and its statistics per factory, shared by the tests of this file (read-only)."""
    model = make()
    return model, aqr.calibrate(model, loader(images(n, seed=2), batch=256))


def loader(x, batch=32):
    for i in range(0, len(x), batch):
        yield x[i : i + batch], torch.zeros(len(x[i : i + batch]), dtype=torch.long)


class Probe(nn.Module):
    """A norm layer whose output is returned, to see exactly what AQR does to it."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(3, affine=False)  # eval mode: running mean 0, var 1 -> identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def test_recalibrates_a_nonaffine_shift_back_to_the_source():
    g = torch.Generator().manual_seed(0)
    model = Probe().eval()
    stats = aqr.calibrate(model, [torch.randn(20_000, 3, generator=g) for _ in range(5)], tail="standard", compile=False)
    clean = torch.randn(50_000, 3, generator=g)
    adapted = aqr.AQR(model, stats)(torch.exp(clean))
    assert float(((adapted - clean) ** 2).mean()) < 0.01
    shifted = torch.exp(clean)
    affine = (shifted - shifted.mean(0)) / shifted.std(0)
    assert float(((affine - clean) ** 2).mean()) > 0.2


@pytest.mark.parametrize("make", [bn_cnn, gn_cnn, tiny_vit])
def test_source_batches_pass_nearly_unchanged(make):
    model, stats = calibrated(make)
    x = images(512, seed=1)
    with torch.no_grad():
        plain = model.eval()(x)
    adapted = aqr.AQR(model, stats)(x)
    agree = (plain.argmax(1) == adapted.argmax(1)).float().mean()
    assert agree > 0.9
    assert (adapted - plain).abs().mean() < 0.1 * plain.abs().mean() + 1e-3


@pytest.mark.parametrize("make", [bn_cnn, gn_cnn, tiny_vit])
def test_adaptation_undoes_a_brightness_shift(make):
    model, stats = calibrated(make)
    x = images(512, seed=1)
    shifted = x * 0.4  # darker images: a shift every layer sees
    with torch.no_grad():
        clean = model.eval()(x)
        plain_err = (model(shifted) - clean).abs().mean()
    adapted_err = (aqr.AQR(model, stats)(shifted) - clean).abs().mean()
    assert adapted_err < 0.3 * plain_err


def test_model_is_exactly_as_before_after_use():
    model = bn_cnn().train()
    stats = aqr.calibrate(model, loader(images(64)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = images(16, seed=5)
    adapted = aqr.AQR(model, stats)
    assert adapted.model is model
    out = adapted(x)
    assert not out.requires_grad
    assert model.training and all(m.training for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not any(m._forward_hooks for m in model.modules())
    reference = bn_cnn()
    reference.load_state_dict(before)
    with torch.no_grad():
        assert torch.equal(model.eval()(x), reference.eval()(x))


def test_context_manager_matches_wrapper_and_cleans_up():
    model = gn_cnn()
    stats = aqr.calibrate(model, loader(images(64)))
    x = images(16, seed=5)
    with torch.no_grad():
        plain = model.eval()(x)
        with aqr.recalibrating(model, stats) as m:
            inside = m(x)
        after = model(x)
    torch.testing.assert_close(inside, aqr.AQR(model, stats)(x))
    assert not torch.allclose(inside, plain)
    torch.testing.assert_close(after, plain)
    assert not any(m._forward_hooks for m in model.modules())


def test_layer_subset_and_options():
    model = tiny_vit(depth=2)
    stats = aqr.calibrate(model, loader(images(64)))
    assert aqr.AQR(model, stats, layers="top-half").layer_names == stats.layer_names[3:]
    assert aqr.AQR(model, stats, layers=["norm"]).layer_names == ["norm"]
    x = images(16, seed=5)
    outs = {t: aqr.AQR(model, stats, tail=t)(x) for t in aqr.TAILS}
    for t, out in outs.items():
        assert torch.isfinite(out).all(), t
    assert not torch.allclose(outs["average"], outs["standard"])
    assert not torch.allclose(outs["none"], outs["clip"])
    with pytest.raises(ValueError, match="unknown tail"):
        aqr.AQR(model, stats, tail="bogus")
    with pytest.raises(aqr.LayerError, match="not a normalization layer"):
        aqr.AQR(model, stats, layers=["head"])
    with pytest.raises(TypeError):
        aqr.AQR(model, stats, nonsense=1)


def test_stats_subset_then_layer_halves_are_of_that_subset():
    model = tiny_vit(depth=2)
    stats = aqr.calibrate(model, loader(images(32)), layers="top-half")
    assert aqr.AQR(model, stats).layer_names == stats.layer_names
    assert aqr.AQR(model, stats, layers="top-half").layer_names == stats.layer_names[1:]


@pytest.mark.parametrize("gpu_like", [False, True])
def test_nan_activations_raise_naming_the_layer_or_are_skipped(gpu_like, monkeypatch):
    if gpu_like:  # the GPU path: no per-layer host reads, the logits are checked instead
        monkeypatch.setattr(aqr.adapt.layer_maps, "host_reads_are_cheap", lambda device: False)
    model = bn_cnn()
    stats = aqr.calibrate(model, loader(images(64)))
    x = images(8)
    x[0, :, 2, 2] = float("nan")
    with pytest.raises(aqr.NonFiniteActivationError, match="layer '1'"):
        aqr.AQR(model, stats)(x)
    out = aqr.AQR(model, stats, on_nonfinite="skip")(x)
    with torch.no_grad():
        assert torch.equal(out.isnan(), model.eval()(x).isnan())
    x[0, :, 2, 2] = float("inf")
    with pytest.raises(aqr.NonFiniteActivationError):
        aqr.AQR(model, stats)(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_activations(dtype):
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3))
    source = torch.randn(256, 6)
    stats = aqr.calibrate(model, [source])
    low = copy.deepcopy(model).to(dtype)
    x = torch.randn(64, 6).to(dtype)
    out = aqr.AQR(low, stats, compile=False)(x)  # (half precision takes the torch path; compiled or not alike)
    assert out.dtype == dtype and torch.isfinite(out).all()
    ref = aqr.AQR(model, stats)(x.float())
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=0.1)


def test_saved_stats_drive_the_same_adaptation(tmp_path):
    model = gn_cnn()
    stats = aqr.calibrate(model, loader(images(64)))
    back = aqr.SourceStats.load(stats.save(tmp_path / "m.aqr.safetensors"))
    x = images(16, seed=9)
    torch.testing.assert_close(aqr.AQR(model, stats)(x), aqr.AQR(model, back)(x))


def test_batches_are_independent():
    model = bn_cnn()
    stats = aqr.calibrate(model, loader(images(64)))
    adapted = aqr.AQR(model, stats)
    a, b = images(16, seed=1), images(16, seed=2)
    first = adapted(a)
    adapted(b * 0.1)
    torch.testing.assert_close(adapted(a), first)


# ---- fast path versus exact path ------------------------------------------------------------------
@pytest.mark.parametrize("make", [bn_cnn, gn_cnn, tiny_vit])
@pytest.mark.parametrize("tail", aqr.TAILS)
def test_fast_path_agrees_with_exact(make, tail):
    model, stats = calibrated(make)
    x = images(256, seed=1) * 0.5
    exact = aqr.AQR(model, stats, tail=tail, mode="exact")(x)
    # every position sampled: only the lookup grid differs from the exact map
    full = aqr.AQR(model, stats, tail=tail, compile=False, target_samples=10**6)(x)
    assert (full.argmax(1) == exact.argmax(1)).float().mean() > 0.95
    assert (full - exact).abs().mean() < 0.02 * exact.abs().mean() + 1e-4
    # default subsample: the target quantiles are estimates too
    fast = aqr.AQR(model, stats, tail=tail, compile=False)(x)
    assert (fast.argmax(1) == exact.argmax(1)).float().mean() > 0.9
    assert (fast - exact).abs().mean() < 0.1 * exact.abs().mean() + 1e-3


def test_fast_path_subsamples_and_compiled_kernel_matches_eager():
    model = bn_cnn()
    stats = aqr.calibrate(model, loader(images(256, seed=2)))
    x = images(64, seed=1) * 0.5
    eager = aqr.AQR(model, stats, target_samples=512, compile=False)(x)
    compiled = aqr.AQR(model, stats, target_samples=512, compile=True)(x)
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)
    exact = aqr.AQR(model, stats, mode="exact")(x)
    assert (eager.argmax(1) == exact.argmax(1)).float().mean() > 0.9


def test_fast_path_maps_a_constant_channel_to_the_source_median():
    model = Probe().eval()
    stats = aqr.calibrate(model, [torch.randn(4096, 3)], tail="standard")
    out = aqr.AQR(model, stats, compile=False)(torch.full((100, 3), 2.0))
    torch.testing.assert_close(out, stats.layers["norm"].quantiles[:, 50].expand(100, 3))


def test_bad_fast_options():
    stats = aqr.calibrate(Probe().eval(), [torch.randn(64, 3)])
    with pytest.raises(ValueError, match="mode"):
        aqr.AQR(Probe().eval(), stats, mode="turbo")
    with pytest.raises(ValueError, match="target_samples"):
        aqr.AQR(Probe().eval(), stats, target_samples=1)


# Compiled on CPU for a sample-based and a Gaussian tail only: each tail is a compile of its own (half a
# minute with a cold Inductor cache), and CPU code generation is not the GPU's, which the GPU runs check.
COMPILED_TAILS = ("average", "standard")


@pytest.mark.parametrize("tail", aqr.TAILS)
def test_gpu_path_matches_cpu_path(tail):
    """The GPU path (table and map in one compilable function, no host reads) is run here on CPU tensors."""
    from aqr.backends import LayerSource, SubsetCache, TorchBackend
    from aqr.backends.torch_backend import map_sample, resolve_marked

    g = torch.Generator().manual_seed(0)
    c, k = 6, 21
    sq = torch.randn(c, 4000, generator=g).sort(1).values[:, torch.linspace(0, 3999, k).long()]
    source = LayerSource.create(sq, tail, torch.zeros(c, 1), torch.ones(c, 1), 0.01, 64)
    x = torch.randn(8, c, 50, generator=g) * 2 + 1
    x[:, 0] = x[:, 0].round()  # tied target knots in channel 0
    x[:, 1] = 3.0  # a constant channel
    sample = x.transpose(0, 1).reshape(c, -1)
    every_position = SubsetCache(x.shape[0] * x.shape[2])
    want, ok = TorchBackend(source, every_position, compile=False).recalibrate(x)
    args = (sample, False, source.knots, tail, source.loc, source.scale, source.z, 64)

    def resolved(out):  # the values of marked cells (channel 0's tied knots) are mapped exactly
        y, finite, tq, mean, std = out
        return resolve_marked(x, y, tq, source.knots, tail, mean, std, source.loc, source.scale, source.z), finite

    got, finite = resolved(map_sample(x, *args))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert bool(ok) and bool(finite)
    if tail in COMPILED_TAILS:
        compiled = resolved(torch.compile(map_sample, dynamic=True)(x, *args))[0]
        torch.testing.assert_close(compiled, want, atol=1e-4, rtol=1e-4)
    x[3, 2, 17] = float("nan")  # outside the sample (the extremes are taken over every value)
    assert not bool(map_sample(x, *args)[1])


def test_folded_batchnorm_follows_updates_of_its_statistics():
    """The folded BatchNorm's (scale, shift) is kept between batches: an in-place update of its
    running statistics or weights, or a replaced buffer, must reach the next batch."""
    model = bn_cnn()  # its own copy: this test changes the model
    stats = aqr.calibrate(model, loader(images(512, seed=2), batch=256))
    x = images(64, seed=5)
    adapted = aqr.AQR(model, stats)
    adapted(x)
    bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    with torch.no_grad():
        bn.running_mean.add_(0.3)
        bn.weight.mul_(1.5)
    fresh = aqr.AQR(model, stats)  # nothing cached
    torch.testing.assert_close(adapted(x), fresh(x), rtol=0, atol=0)
    bn.running_var = bn.running_var * 2.0  # a new tensor, not an in-place update
    torch.testing.assert_close(adapted(x), aqr.AQR(model, stats)(x), rtol=0, atol=0)


class ImageNormNet(nn.Module):
    """A BatchNorm AQR can recalibrate and a LayerNorm over (C, H, W), which it cannot."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.ln = nn.LayerNorm([4, 8, 8])
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.bn(self.conv(x))).mean((2, 3)))


def test_unsupported_layers_that_are_not_selected_are_skipped_with_one_warning():
    """A LayerNorm over several dims that no selected layer needs is skipped with one warning, so it
    cannot block the rest of the model."""
    import warnings

    model = ImageNormNet().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stats = aqr.calibrate(model, [images(32)])
    skipped = [w for w in caught if "cannot recalibrate" in str(w.message)]
    assert len(skipped) == 1 and "'ln' (LayerNorm over 3 dims)" in str(skipped[0].message)
    assert stats.layer_names == ["bn"]
    with pytest.warns(UserWarning, match="'ln'"):
        out = aqr.AQR(model, stats)(images(8, seed=4))
    assert out.shape == (8, 2) and torch.isfinite(out).all()
    chosen = aqr.calibrate(model, [images(32)], layers=["bn"])  # the case: excluded, yet it was fatal
    assert chosen.layer_names == ["bn"]
    assert torch.isfinite(aqr.AQR(model, chosen, layers=["bn"])(images(8, seed=4))).all()
    with pytest.raises(aqr.LayerError, match="'ln'.*LayerNorm over 3 dims"):
        aqr.calibrate(model, [images(32)], layers=["ln"])
    with pytest.raises(aqr.LayerError, match="'ln'.*LayerNorm over 3 dims"):
        aqr.AQR(model, stats, layers=["ln"])
    with pytest.raises(aqr.LayerError, match="'head' is a Linear"):
        aqr.AQR(model, stats, layers=["head"])


def test_an_empty_batch_passes_through():
    model, stats = calibrated(bn_cnn)
    out = aqr.AQR(model, stats)(images(8)[:0])
    assert out.shape == (0, 5)
