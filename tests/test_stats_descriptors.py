"""Source statistics of image descriptors: the descriptors, their whitening, calibrate(descriptors=True), files."""

import dataclasses
import json
import math

import pytest
import torch

import aqr
import aqr.core.calibrate as calibration
from aqr.core.descriptors import (
    MAX_DESCRIPTOR_WIDTH,
    STD_FLOOR,
    DescriptorStats,
    descriptor_layers,
    descriptor_stats,
    image_descriptors,
)
from aqr.core.layers import as_acb, norm_layers
from tests.models_tiny import bn_cnn, gn_cnn, images, tiny_vit


def hooked_descriptors(model, stats, x, batch=16):
    """The descriptors ``image_descriptors`` gives at the stats' descriptor layers, from the layers' outputs caught
    by plain forward hooks in the (A, C, B) layout, batch by batch, concatenated over the layers."""
    infos = {info.name: info for info in norm_layers(model)}
    modules = dict(model.named_modules())
    caught = {name: [] for name in stats.descriptors.layers}
    handles = [modules[name].register_forward_hook(lambda m, i, o, name=name: caught[name].append(o.detach()))
               for name in caught]
    model.eval()
    with torch.no_grad():
        for xb in x.split(batch):
            model(xb)
    for h in handles:
        h.remove()
    per_layer = []
    for name, outs in caught.items():
        rows = [image_descriptors(as_acb(o, infos[name].channel_dim), len(xb), None, stats.layers[name].quantiles)
                for o, xb in zip(outs, x.split(batch))]
        per_layer.append(torch.cat(rows))
    return torch.cat(per_layer, dim=1)


def whitened_covariance(d: DescriptorStats, rows: torch.Tensor) -> torch.Tensor:
    return torch.cov(d.whiten(rows.double()).T)


def assert_whitened(d: DescriptorStats, rows: torch.Tensor) -> None:
    """``d`` whitens ``rows``: their covariance becomes the identity, but in the directions flatter than the floor
    (a GroupNorm's channels of a group are tied), which it leaves flatter than 1."""
    values = torch.linalg.eigvalsh(torch.cov(rows.double().T))
    flat = int((values < 1e-3 * values.mean()).sum())
    whitened = torch.linalg.eigvalsh(whitened_covariance(d, rows))
    assert whitened.max() < 1 + 1e-3 and bool((whitened[flat:] > 1 - 1e-3).all()), (flat, whitened)


def test_image_descriptors_are_each_images_standardized_mean_and_log_std():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 3, 5, generator=g)  # 2 images of 3 rows, 3 channels, 5 positions
    source = torch.sort(torch.randn(3, 9, generator=g), dim=1).values
    d = image_descriptors(x, 2, None, source)
    assert d.shape == (2, 6) and d.dtype == torch.float32
    for i in range(2):
        for c in range(3):
            values = x[3 * i:3 * i + 3, c, :].flatten()
            iqr = source[c, 6] - source[c, 2]
            assert d[i, c] == pytest.approx(float((values.mean() - source[c, 4]) / iqr), abs=1e-5)
            std = values.std(correction=0)
            assert d[i, 3 + c] == pytest.approx(float(torch.log(std / iqr + STD_FLOOR)), abs=1e-5)
    pre = (torch.tensor([2.0, 0.5, -1.0]), torch.tensor([1.0, 0.0, 3.0]))
    read = x * pre[0].view(1, 3, 1) + pre[1].view(1, 3, 1)
    torch.testing.assert_close(image_descriptors(x, 2, pre, source), image_descriptors(read, 2, None, source))
    with pytest.raises(ValueError, match="6 rows cannot be split into 4 images"):
        image_descriptors(x, 4, None, source)


def test_descriptor_layers_take_the_first_third_within_the_width():
    names = [f"l{i}" for i in range(19)]
    assert descriptor_layers(names, [16] * 19) == names[:7]  # ceil(19 / 3)
    assert descriptor_layers(names[:3], [16] * 3) == names[:1]
    assert descriptor_layers(names[:4], [16] * 4) == names[:2]
    assert descriptor_layers(names, [192] * 19) == names[:2]  # 3 layers would be 1152 wide
    wide = MAX_DESCRIPTOR_WIDTH  # one layer wider than the limit on its own: still the first layer
    assert descriptor_layers(names, [wide] * 19) == names[:1]
    assert descriptor_layers(names[:9], [8, 600, 8] + [8] * 6) == names[:1]  # cut where the width is passed
    with pytest.raises(ValueError, match="one channel count per layer"):
        descriptor_layers(names, [16])
    with pytest.raises(ValueError, match="at least one layer"):
        descriptor_layers([], [])


def test_whitening_gives_identity_covariance_and_does_not_blow_up_a_flat_direction():
    g = torch.Generator().manual_seed(1)
    mixing = torch.randn(5, 5, generator=g, dtype=torch.float64)
    rows = torch.randn(400, 5, generator=g, dtype=torch.float64) @ mixing + 3.0
    d = descriptor_stats(rows, ["a"])
    assert d.images == 400 and d.mean.dtype == d.whitening.dtype == torch.float32
    torch.testing.assert_close(d.mean.double(), rows.mean(0), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(whitened_covariance(d, rows), torch.eye(5, dtype=torch.float64), atol=1e-4, rtol=0)
    # a direction whose variance is 1e-12 of the others' is scaled as if it had 1e-3 of their mean
    flat = torch.cat([rows, 2.0 + 1e-6 * torch.randn(400, 1, generator=g, dtype=torch.float64)], dim=1)
    cov = whitened_covariance(descriptor_stats(flat, ["a"]), flat)
    values = torch.linalg.eigvalsh(cov)
    assert values.max() == pytest.approx(1.0, abs=1e-3) and values.min() < 1e-6
    with pytest.raises(ValueError, match="at least 2 source images, got 1"):
        descriptor_stats(rows[:1], ["a"])
    with pytest.raises(ValueError, match="do not vary"):
        descriptor_stats(torch.ones(10, 4), ["a"])
    with pytest.raises(ValueError, match="NaN or Inf"):
        descriptor_stats(torch.full((3, 2), math.nan), ["a"])


def test_descriptor_stats_check_their_fields():
    good = {"layers": ("a",), "mean": torch.zeros(4), "whitening": torch.eye(4), "images": 10}
    DescriptorStats(**good)
    cases = {
        "whitening has shape \\(3, 4\\), expected \\(4, 4\\)": {"whitening": torch.zeros(3, 4)},
        "mean must be float32, got torch.float64": {"mean": torch.zeros(4, dtype=torch.float64)},
        "whitening holds NaN or Inf": {"whitening": torch.full((4, 4), math.inf)},
        "'images' must be an integer >= 2": {"images": 1},
        "'layers' must be a non-empty tuple": {"layers": ["a"]},
        "names a layer twice": {"layers": ("a", "a")},
    }
    for match, change in cases.items():
        with pytest.raises(ValueError, match=match):
            DescriptorStats(**{**good, **change})


@pytest.mark.parametrize("make", [bn_cnn, gn_cnn, tiny_vit], ids=["bn", "gn", "ln"])
def test_calibrated_descriptors_are_what_image_descriptors_gives_on_the_layers_outputs(make):
    model, x = make(), images(48)
    stats = aqr.calibrate(model, x.split(16), num_quantiles=21, descriptors=True)
    d = stats.descriptors
    order = stats.layer_names
    assert list(d.layers) == descriptor_layers(order, [stats.layers[n].info.channels for n in order])
    rows = hooked_descriptors(model, stats, x)
    assert d.images == 48 and rows.shape == (48, d.width)
    torch.testing.assert_close(d.mean, rows.mean(0), atol=1e-5, rtol=1e-5)
    assert_whitened(d, rows)


def test_pre_affine_descriptors_read_the_values_before_the_affine_step():
    model, x = bn_cnn(), images(40)
    stats = aqr.calibrate(model, x.split(16), num_quantiles=21, point="pre-affine", descriptors=True)
    (name,) = stats.descriptors.layers
    bn = dict(model.named_modules())[name]
    with torch.no_grad():
        bn.weight.copy_(torch.linspace(0.5, 2.0, bn.num_features))  # the affine step, not the identity
        bn.bias.copy_(torch.linspace(-1.0, 1.0, bn.num_features))
    stats = aqr.calibrate(model, x.split(16), num_quantiles=21, point="pre-affine", descriptors=True)
    out = []
    h = bn.register_forward_hook(lambda m, i, o: out.append(o.detach()))
    with torch.no_grad():
        model.eval()(x)
    h.remove()
    pre = (1 / bn.weight.detach(), -bn.bias.detach() / bn.weight.detach())  # output -> before the affine step
    rows = image_descriptors(as_acb(out[0], 1), 40, pre, stats.layers[name].quantiles)
    torch.testing.assert_close(stats.descriptors.mean, rows.mean(0), atol=1e-5, rtol=1e-5)


def test_only_the_first_images_are_kept_and_the_other_statistics_do_not_change(monkeypatch):
    model, x = gn_cnn(), images(40)
    plain = aqr.calibrate(model, x.split(16), num_quantiles=21)
    assert plain.descriptors is None
    monkeypatch.setattr(calibration, "MAX_DESCRIPTOR_IMAGES", 20)  # 16 of the first batch, 4 of the second
    stats = aqr.calibrate(model, x.split(16), num_quantiles=21, descriptors=True)
    assert stats.descriptors.images == 20
    rows = hooked_descriptors(model, stats, x)[:20]
    torch.testing.assert_close(stats.descriptors.mean, rows.mean(0), atol=1e-5, rtol=1e-5)
    for name, layer in plain.layers.items():
        assert torch.equal(layer.quantiles, stats.layers[name].quantiles)


def test_descriptor_layers_follow_execution_order_whatever_the_order_named():
    model, x = tiny_vit(), images(24)
    stats = aqr.calibrate(model, x.split(8), num_quantiles=11, descriptors=True)
    backwards = aqr.calibrate(model, x.split(8), num_quantiles=11, layers=stats.layer_names[::-1], descriptors=True)
    assert backwards.descriptors.layers == stats.descriptors.layers
    with pytest.raises(ValueError, match="at least 2 source images, got 1"):
        aqr.calibrate(model, x[:1], descriptors=True)
    with pytest.raises(ValueError, match="descriptors must be True or False"):
        aqr.calibrate(model, x, descriptors="yes")


def test_the_source_stats_check_the_descriptors_against_their_layers():
    stats = aqr.calibrate(bn_cnn(), images(24).split(8), num_quantiles=11, descriptors=True)
    d = stats.descriptors
    assert "descriptors of 1 layer" in repr(stats)
    with pytest.raises(aqr.StatsError, match="layer 'nope' is not among the statistics' layers"):
        dataclasses.replace(stats, descriptors=dataclasses.replace(d, layers=("nope",)))
    with pytest.raises(aqr.StatsError, match=r"mean has shape \(16,\), expected \(32,\)"):
        dataclasses.replace(stats, descriptors=dataclasses.replace(d, layers=("1", "4")))
    with pytest.raises(aqr.StatsError, match="must be a DescriptorStats"):
        dataclasses.replace(stats, descriptors={"layers": ("1",)})


def test_round_trip_keeps_the_descriptors_and_a_file_without_them_is_unchanged(tmp_path):
    from safetensors import safe_open

    model, x = tiny_vit(), images(24)
    stats = aqr.calibrate(model, x.split(8), num_quantiles=11, descriptors=True)
    back = aqr.SourceStats.load(stats.save(tmp_path / "d.safetensors"))
    assert back.descriptors.layers == stats.descriptors.layers and back.descriptors.images == 24
    assert torch.equal(back.descriptors.mean, stats.descriptors.mean)
    assert torch.equal(back.descriptors.whitening, stats.descriptors.whitening)
    plain = aqr.calibrate(model, x.split(8), num_quantiles=11)
    without = dataclasses.replace(stats, descriptors=None).save(tmp_path / "without.safetensors")
    assert without.read_bytes() == plain.save(tmp_path / "plain.safetensors").read_bytes()
    with safe_open(str(without), "pt") as f:
        assert "descriptors" not in json.loads(f.metadata()["aqr"]) and not any("descriptors" in k for k in f.keys())
    assert aqr.SourceStats.load(without).descriptors is None


def _rewrite(path, edit):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["aqr"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(meta, tensors)
    save_file(tensors, str(path), metadata={"aqr": json.dumps(meta)})


DAMAGE = {
    "whitening shape": (lambda m, t: t.__setitem__("descriptors.whitening", torch.zeros(16, 15)),
                        r"descriptors: whitening has shape \(16, 15\), expected \(16, 16\)"),
    "mean shape": (lambda m, t: t.__setitem__("descriptors.mean", torch.zeros(8)),
                   r"descriptors: whitening has shape \(16, 16\), expected \(8, 8\)"),
    "width of the layers": (lambda m, t: m["descriptors"].__setitem__("layers", ["1", "4"]),
                            r"descriptors: mean has shape \(16,\), expected \(32,\)"),
    "unknown layer": (lambda m, t: m["descriptors"].__setitem__("layers", ["9"]), r"layer '9' is not among"),
    "NaN": (lambda m, t: t["descriptors.mean"].__setitem__(3, math.nan), r"descriptors: mean holds NaN or Inf"),
    "images": (lambda m, t: m["descriptors"].__setitem__("images", "many"), r"descriptors: 'images' must be"),
    "no tensors": (lambda m, t: t.pop("descriptors.mean"), r"tensor 'descriptors.mean' is missing"),
    "no metadata": (lambda m, t: m.pop("descriptors"), r"'descriptors' metadata is not"),
    "layers typed": (lambda m, t: m["descriptors"].__setitem__("layers", "1"), r"'layers' must be a list"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_descriptors_are_refused_at_load(tmp_path, case):
    edit, match = DAMAGE[case]
    path = aqr.calibrate(bn_cnn(), images(24).split(8), num_quantiles=11, descriptors=True).save(tmp_path / "s.st")
    _rewrite(path, edit)
    with pytest.raises(aqr.StatsError, match=match):
        aqr.SourceStats.load(path)


def _cell(method="aqr", options=(), model=None):
    from aqr.harness.presets import preset

    cell = next(iter(preset("smoke", data_dir="aqr-data").cells()))
    return dataclasses.replace(cell, method=method, options=options, **({"model": model} if model else {}))


def test_only_mixed_target_cells_get_statistics_with_descriptors_in_their_own_file(monkeypatch):
    import aqr.harness.source_stats as source_stats

    monkeypatch.setattr(source_stats, "fingerprints", lambda cell: {"weights": "w", "source": "s"})
    stream, mixed = _cell(options=(("target", "stream"),)), _cell(options=(("target", "mixed"),))
    # the name the stream cell's file had before descriptors existed: its cache is not recomputed
    frozen = "resnet20-K101-3d16cbf98c33f22a2d4f.aqr.safetensors"
    assert source_stats.stats_path(stream, "cache").name == frozen
    assert source_stats.stats_path(_cell(), "cache").name == frozen
    assert source_stats.stats_path(mixed, "cache").name != frozen
    assert "descriptors" not in source_stats.stats_options(stream)
    assert source_stats.stats_options(mixed)["descriptors"] is True


def test_the_harness_and_the_cli_calibrate_descriptors_when_asked(tmp_path):
    from aqr.cli import main
    from aqr.harness.cells import ModelSpec
    from aqr.harness.source_stats import compute_stats
    from tests.models_tiny import tiny_checkpoint_and_images

    ckpt, npz, _ = tiny_checkpoint_and_images(tmp_path, 24)
    model = ModelSpec("tiny", str(ckpt), None, str(npz), "0:24")
    stats = compute_stats(_cell(options=(("target", "mixed"),), model=model), threads=1)
    assert stats.descriptors is not None and stats.descriptors.images == 24
    assert compute_stats(_cell(options=(("target", "stream"),), model=model), threads=1).descriptors is None
    out = tmp_path / "cli.safetensors"
    argv = ["calibrate", str(ckpt), "--data", str(npz), "--out", str(out), "-K", "11", "--no-progress"]
    assert main([*argv, "--descriptors"]) == 0
    described = aqr.SourceStats.load(out).descriptors
    assert described is not None and described.images == 24
    assert described.layers == stats.descriptors.layers
    assert main(argv) == 0
    assert aqr.SourceStats.load(out).descriptors is None
