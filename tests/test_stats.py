"""Source statistics: calibration, bounded sampling, tails, files and model checks."""

import json
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import aqr
from aqr.core.calibrate import LayerCollector, average_sample_tails
from aqr.core.layers import LayerInfo
from tests.models_tiny import bn_cnn, gn_cnn, images, tiny_vit


def loader(x, batch=16, labels=True):
    for i in range(0, len(x), batch):
        xb = x[i : i + batch]
        yield (xb, torch.zeros(len(xb), dtype=torch.long)) if labels else xb


def outputs_of(model, name, x):
    store = []
    h = dict(model.named_modules())[name].register_forward_hook(lambda m, i, o: store.append(o.detach()))
    with torch.no_grad():
        model.eval()(x)
    h.remove()
    return torch.cat(store)


def test_calibrate_records_every_norm_layer_with_exact_moments_and_extremes():
    model, x = bn_cnn(), images(64)
    stats = aqr.calibrate(model, loader(x), num_quantiles=11)
    assert stats.layer_names == ["1", "4"]
    out = outputs_of(model, "1", x).transpose(0, 1).reshape(8, -1)
    layer = stats.layers["1"]
    assert layer.quantiles.shape == (8, 11)
    assert layer.num_values == out.shape[1] == layer.sample_size
    torch.testing.assert_close(layer.quantiles[:, 0], out.amin(1))
    torch.testing.assert_close(layer.quantiles[:, -1], out.amax(1))
    torch.testing.assert_close(layer.quantiles[:, 1:-1], aqr.channel_quantiles(out, 11)[:, 1:-1])
    torch.testing.assert_close(layer.mean, out.mean(1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.std, out.std(1, correction=0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer.affine_weight, model[1].weight.detach())


def test_plain_tensor_batches_work_and_calibration_is_deterministic():
    model, x = gn_cnn(), images(40)
    a = aqr.calibrate(model, loader(x, labels=False), max_samples=500, seed=3)
    b = aqr.calibrate(model, loader(x, labels=False), max_samples=500, seed=3)
    c = aqr.calibrate(model, loader(x, labels=False), max_samples=500, seed=4)
    for name in a.layer_names:
        assert torch.equal(a.layers[name].quantiles, b.layers[name].quantiles)
        assert torch.equal(a.layers[name].tail_low, b.layers[name].tail_low)
    assert not torch.equal(a.layers["1"].quantiles, c.layers["1"].quantiles)


def test_the_moments_are_compiled_by_default_on_a_gpu_only(monkeypatch):
    import aqr.core.calibrate as calibrate_module

    fused = []
    real = calibrate_module.run_compiled

    def spy(fn, enabled, *args):  # records whether the moments were to be compiled, runs them eagerly
        fused.append(enabled)
        return real(fn, False, *args)

    monkeypatch.setattr(calibrate_module, "run_compiled", spy)
    model = bn_cnn()
    x = images(32)
    default = aqr.calibrate(model, loader(x))
    assert fused and not any(fused)  # CPU: eager, no compile on first use
    fused.clear()
    asked = aqr.calibrate(model, loader(x), compile=True)
    assert fused and all(fused)
    for name, layer in default.layers.items():  # the same statistics either way (here both ran eagerly)
        assert torch.equal(layer.quantiles, asked.layers[name].quantiles) and torch.equal(layer.std, asked.layers[name].std)


def test_sample_is_bounded_and_within_the_dkw_bound():
    info = LayerInfo("x", "BatchNorm1d", 3, 1)
    col = LayerCollector(info, max_samples=5_000, generator_seed=0)
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(1000, 3, generator=g) ** 3 for _ in range(100)]  # 100k values / channel
    for chunk in chunks:
        col.update(chunk)
        assert col.values.shape[1] <= 5_000
    stats = col.finish(nn.BatchNorm1d(3), 101, 100, 1000)
    assert stats.sample_size == 5_000 and stats.num_values == 100_000
    full = torch.cat(chunks).T.contiguous()
    eps = aqr.dkw_epsilon(5_000, delta=1e-3)
    levels = torch.linspace(0, 1, 101)
    for c in range(3):
        cdf = torch.searchsorted(torch.sort(full[c]).values, stats.quantiles[c, 1:-1].contiguous()) / full.shape[1]
        assert (cdf - levels[1:-1]).abs().max() <= eps + 1e-3
    # the kept values are a uniform sample: their mean matches the full mean
    assert abs(float(col.values.mean() - full.mean())) < 0.2


def test_average_sample_tails_match_the_expected_min_and_max():
    u = torch.sort(torch.rand(2, 200_000, generator=torch.Generator().manual_seed(0)), dim=1).values
    low, high = average_sample_tails(u, tail_batch=100, tail_repeats=1000, seed=0)
    # uniform(0,1): E[min of 100] = 1/101, E[max] = 100/101; sd of the mean over 1000 draws ~3e-4
    assert torch.allclose(low, torch.full((2,), 1 / 101), atol=2e-3)
    assert torch.allclose(high, torch.full((2,), 100 / 101), atol=2e-3)


def test_average_tails_sit_inside_the_empirical_extremes():
    model, x = bn_cnn(), images(64)
    stats = aqr.calibrate(model, loader(x))
    for name in stats.layer_names:
        layer = stats.layers[name]
        q = stats.source_quantiles(name, "average")
        assert (layer.quantiles[:, 0] <= q[:, 0]).all() and (q[:, 0] <= q[:, 1]).all()
        assert (layer.quantiles[:, -1] >= q[:, -1]).all() and (q[:, -1] >= q[:, -2]).all()
        assert (layer.quantiles[:, 0] < layer.tail_low).any()
        assert torch.equal(stats.source_quantiles(name, "standard"), layer.quantiles)


def test_layer_selection_halves_follow_execution_order():
    model, x = tiny_vit(depth=2), images(8)
    full = aqr.calibrate(model, loader(x), layers="all")
    # registration order == execution order here: stem_norm, 2 x (norm1, norm2), norm
    assert full.layer_names == ["stem_norm", "blocks.0.norm1", "blocks.0.norm2", "blocks.1.norm1", "blocks.1.norm2", "norm"]
    top = aqr.calibrate(model, loader(x), layers="top-half")
    bottom = aqr.calibrate(model, loader(x), layers="bottom-half")
    assert top.layer_names == full.layer_names[3:]
    assert bottom.layer_names == full.layer_names[:3]
    some = aqr.calibrate(model, loader(x), layers=["norm", "blocks.0.norm1"])
    assert sorted(some.layer_names) == ["blocks.0.norm1", "norm"]


def test_layernorm_channels_are_last_and_layernorm2d_channels_first():
    model, x = tiny_vit(dim=16), images(8)
    stats = aqr.calibrate(model, loader(x))
    assert stats.layers["stem_norm"].info.channel_dim == 1
    assert stats.layers["norm"].info.channel_dim == -1
    tokens = outputs_of(model, "blocks.0.norm2", x).reshape(-1, 16).T
    torch.testing.assert_close(stats.layers["blocks.0.norm2"].quantiles[:, 50], aqr.channel_quantiles(tokens, 101)[:, 50])


def test_bad_layers_and_models_get_clear_errors():
    with pytest.raises(aqr.LayerError, match="'0' is a Conv2d"):
        aqr.calibrate(bn_cnn(), loader(images(8)), layers=["0"])
    with pytest.raises(aqr.LayerError, match="not a normalization layer of this model"):
        aqr.calibrate(bn_cnn(), loader(images(8)), layers=["nope"])
    with pytest.raises(aqr.LayerError, match="unknown layer selection"):
        aqr.calibrate(bn_cnn(), loader(images(8)), layers="middle")
    with pytest.raises(aqr.LayerError, match="no BatchNorm"):
        aqr.calibrate(nn.Linear(3, 2), [torch.zeros(2, 3)])
    two_dim = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm([2, 4]))
    with pytest.raises(aqr.LayerError, match="'1': LayerNorm over 2 dims"):
        aqr.calibrate(two_dim, [torch.zeros(3, 2, 4)], layers=["1"])
    with pytest.warns(UserWarning, match=r"skips 1 .*'1' \(LayerNorm over 2 dims\)"):
        with pytest.raises(aqr.LayerError, match="no normalization layer AQR can recalibrate"):
            aqr.calibrate(two_dim, [torch.zeros(3, 2, 4)])
    with pytest.raises(ValueError, match="no batch"):
        aqr.calibrate(bn_cnn(), [])


def test_nan_during_calibration_names_the_layer():
    x = images(8)
    x[0, 0, 0, 0] = float("nan")
    with pytest.raises(aqr.NonFiniteActivationError, match="layer '1'"):
        aqr.calibrate(bn_cnn(), loader(x))


def test_calibration_leaves_the_model_untouched():
    model = bn_cnn().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    aqr.calibrate(model, loader(images(32)))
    assert model.training and all(m.training for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not any(m._forward_hooks for m in model.modules())


# ---- files ---------------------------------------------------------------------------------------
def test_round_trip_keeps_everything(tmp_path):
    model = tiny_vit()
    stats = aqr.calibrate(model, loader(images(16)), num_quantiles=21, tail="gaussian", max_samples=300, seed=7)
    path = stats.save(tmp_path / "s.aqr.safetensors")
    back = aqr.SourceStats.load(path)
    assert back.layer_names == stats.layer_names
    assert (back.num_quantiles, back.tail, back.max_samples, back.seed) == (21, "gaussian", 300, 7)
    assert back.model_layers == stats.model_layers
    for name, layer in stats.layers.items():
        other = back.layers[name]
        assert other.info == layer.info and other.num_values == layer.num_values
        for key in ("quantiles", "tail_low", "tail_high", "mean", "std", "affine_weight", "affine_bias"):
            assert torch.equal(getattr(other, key), getattr(layer, key)), (name, key)
    back.check_model(model)


def test_file_is_safetensors_with_metadata(tmp_path):
    from safetensors import safe_open

    path = aqr.calibrate(bn_cnn(), loader(images(16))).save(tmp_path / "s.safetensors")
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["aqr"])
    assert meta["format_version"] == 1 and meta["num_quantiles"] == 101 and meta["aqr_version"] == aqr.__version__
    assert [layer["channels"] for layer in meta["layers"]] == [8, 8]
    assert meta["tail"] == "average" and meta["tail_batch"] == 100 and meta["tail_repeats"] == 1000
    assert len(meta["model_fingerprint"]) == 16


def test_truncated_and_foreign_files_raise(tmp_path):
    from safetensors.torch import save_file

    path = aqr.calibrate(bn_cnn(), loader(images(16))).save(tmp_path / "s.safetensors")
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(aqr.StatsError, match="truncated or corrupted"):
        aqr.SourceStats.load(cut)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x80\x04\x95 this is a pickle, not statistics")
    with pytest.raises(aqr.StatsError, match="truncated or corrupted"):
        aqr.SourceStats.load(junk)
    other = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(other))
    with pytest.raises(aqr.StatsError, match="not AQR statistics"):
        aqr.SourceStats.load(other)
    with pytest.raises(FileNotFoundError, match="no statistics file"):
        aqr.SourceStats.load(tmp_path / "missing.safetensors")


def test_stats_of_another_model_name_the_first_mismatch():
    stats = aqr.calibrate(bn_cnn(), loader(images(16)))
    wider = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.BatchNorm2d(16))
    with pytest.raises(aqr.StatsError, match="'4' \\(BatchNorm2d, 16 channels\\)"):
        aqr.AQR(wider, stats)
    with pytest.raises(aqr.StatsError, match="'1' \\(GroupNorm, 8 channels\\)"):
        aqr.AQR(gn_cnn(), stats)
    shorter = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8))
    with pytest.raises(aqr.StatsError, match="2 normalization layers, this model has 1"):
        aqr.AQR(shorter, stats)


def test_same_architecture_other_weights_warns():
    stats = aqr.calibrate(bn_cnn(seed=0), loader(images(16)))
    with pytest.warns(UserWarning, match="weights differ"):
        aqr.AQR(bn_cnn(seed=1), stats)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        aqr.AQR(bn_cnn(seed=0), stats)


def test_edited_metadata_is_rejected(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = aqr.calibrate(bn_cnn(), loader(images(16))).save(tmp_path / "s.safetensors")
    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["aqr"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta["model_layers"][0]["channels"] = 9
    save_file(tensors, str(path), metadata={"aqr": json.dumps(meta)})
    with pytest.raises(aqr.StatsError, match="fingerprint"):
        aqr.SourceStats.load(path)
    meta["model_layers"][0]["channels"] = 8
    meta["layers"][0]["channels"] = 9
    save_file(tensors, str(path), metadata={"aqr": json.dumps(meta)})
    with pytest.raises(aqr.StatsError, match="shape"):
        aqr.SourceStats.load(path)


def test_dkw_epsilon_value():
    assert aqr.dkw_epsilon(100_000) == pytest.approx(np.sqrt(np.log(40) / 200_000))


def test_image_tails_average_the_extremes_of_whole_inputs(tmp_path):
    # An eval-mode BatchNorm with unit statistics passes its input through (up to eps), so each
    # input's per-channel min is known: with tail_batch=1 the "images" tail is their mean.
    model = nn.Sequential(nn.BatchNorm2d(2, eps=0.0)).eval()
    x = torch.randn(400, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    per_min, per_max = x.amin(dim=(2, 3)), x.amax(dim=(2, 3))  # (400, 2)
    one = aqr.calibrate(model, [x], tail_batch=1, tail_repeats=20_000, tail_unit="images").layers["0"]
    se = per_min.std(dim=0) / 20_000**0.5
    assert ((one.tail_low - per_min.mean(dim=0)).abs() < 4 * se + 1e-6).all()
    assert ((one.tail_high - per_max.mean(dim=0)).abs() < 4 * per_max.std(dim=0) / 20_000**0.5 + 1e-6).all()
    # a batch of 100 images holds 1,600 values per channel: its extremes lie further out than 100 values'
    images_ = aqr.calibrate(model, [x], tail_unit="images")
    values_ = aqr.calibrate(model, [x], tail_unit="values")
    assert (images_.layers["0"].tail_low < values_.layers["0"].tail_low).all()
    assert (images_.layers["0"].tail_high > values_.layers["0"].tail_high).all()
    back = aqr.SourceStats.load(images_.save(tmp_path / "s.aqr.safetensors"))
    assert back.tail_unit == "images" and torch.equal(back.layers["0"].tail_low, images_.layers["0"].tail_low)
    with pytest.raises(ValueError, match="tail_unit"):
        aqr.calibrate(model, [x], tail_unit="pixels")


def test_image_tails_group_tokens_by_input_for_layernorm():
    model = tiny_vit(depth=1)
    x = images(24)
    stats = aqr.calibrate(model, loader(x, batch=8), tail_unit="images", tail_batch=4)
    name = "blocks.0.norm1"  # a LayerNorm over (N, T, D)
    out = outputs_of(model, name, x)
    assert out.ndim == 3 and out.shape[0] == 24
    per_min = out.amin(dim=1)  # each input's min over its tokens, per channel
    layer = stats.layers[name]
    assert (layer.tail_low >= per_min.min(dim=0).values - 1e-5).all()
    assert (layer.tail_low <= per_min.median(dim=0).values).all()


def test_image_tails_keep_a_bounded_uniform_sample_of_inputs(monkeypatch):
    import aqr.core.calibrate as calibrate_module

    monkeypatch.setattr(calibrate_module, "TAIL_INPUTS_KEPT", 50)
    info = LayerInfo(name="n", kind="BatchNorm2d", channels=3, channel_dim=1)
    col = LayerCollector(info, 1000, 0, per_input=True)
    x = torch.arange(200, dtype=torch.float32)[:, None, None, None].expand(200, 3, 2, 2).contiguous()
    for xb in x.split(40):
        col.update(xb)
    assert col.input_min.shape == (50, 3) and len(set(col.input_min[:, 0].tolist())) == 50
    assert col.input_min[:, 0].mean() > 50  # drawn from all 200 inputs, not the first 50


def _rewrite(path, edit):
    """Rewrite a statistics file after ``edit(meta, tensors)`` changed its metadata or tensors."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), "pt") as f:
        meta = json.loads(f.metadata()["aqr"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    raw = edit(meta, tensors)  # ("raw", text): metadata text instead of the edited meta
    text = raw[1] if isinstance(raw, tuple) and raw[:1] == ("raw",) else json.dumps(meta)
    save_file(tensors, str(path), metadata={"aqr": text})


def _set(obj, key, value):
    obj[key] = value


NAN = float("nan")
EDITS = {  # how a file is broken -> what the error must name
    "NaN quantile": (lambda m, t: t["1/quantiles"].__setitem__((0, 5), NAN), r"layer '1': quantiles.*NaN or Inf"),
    "Inf tail": (lambda m, t: t["4/tail_low"].__setitem__(2, float("inf")), r"layer '4': tail_low.*NaN or Inf"),
    "decreasing knots": (lambda m, t: t.__setitem__("1/quantiles", t["1/quantiles"].flip(1).contiguous()),
                         r"layer '1': quantiles decrease"),
    "K < 3": (lambda m, t: [_set(m, "num_quantiles", 2)] + [t.__setitem__(k, v[:, :2].contiguous())
                                                             for k, v in list(t.items()) if k.endswith("quantiles")],
              r"'num_quantiles' must be an integer >= 3, got 2"),
    "unknown tail": (lambda m, t: _set(m, "tail", "bogus"), r"'tail' must be one of .*got 'bogus'"),
    "unknown tail_unit": (lambda m, t: _set(m, "tail_unit", "pixels"), r"'tail_unit' must be one of .*got 'pixels'"),
    "missing key": (lambda m, t: m.pop("tail_batch"), r"'tail_batch' is missing"),
    "string for int": (lambda m, t: _set(m, "num_quantiles", "101"), r"'num_quantiles' must be an integer"),
    "bool for int": (lambda m, t: _set(m, "tail_repeats", True), r"'tail_repeats' must be an integer"),
    "layers not a list": (lambda m, t: _set(m, "layers", {"1": 1}), r"'layers' must be a list"),
    "layer not a mapping": (lambda m, t: m["layers"].__setitem__(0, 5), r"layers\[0\] must be a mapping"),
    "layer field typed": (lambda m, t: _set(m["layers"][0], "channels", "8"), r"layer '1': 'channels' must be an integer"),
    "layer field missing": (lambda m, t: m["layers"][1].pop("kind"), r"layer '4': 'kind' is missing"),
    "channel dim": (lambda m, t: _set(m["layers"][0], "channel_dim", 3), r"layer '1': 'channel_dim' must be 1 or -1"),
    "negative count": (lambda m, t: _set(m["layers"][1], "num_values", -5), r"layer '4': 'num_values' must be .*got -5"),
    "zero sample": (lambda m, t: _set(m["layers"][0], "sample_size", 0), r"layer '1': 'sample_size' must be .*got 0"),
    "duplicate layer": (lambda m, t: m["layers"].__setitem__(1, dict(m["layers"][0])), r"layer '1' is listed twice"),
    "shape": (lambda m, t: t.__setitem__("4/mean", torch.zeros(7)), r"layer '4': mean has shape \(7,\), expected \(8,\)"),
    "negative std": (lambda m, t: t["1/std"].__setitem__(0, -1.0), r"layer '1': std .*negative"),
    "integer tensor": (lambda m, t: t.__setitem__("1/mean", torch.zeros(8, dtype=torch.int64)),
                       r"layer '1': mean must be floating point"),
    "weights summary": (lambda m, t: t.__setitem__("__model__/weights_summary", torch.zeros(3, 3)),
                        r"weights_summary has shape \(3, 3\), expected \(T, 2\)"),
    "model layer typed": (lambda m, t: _set(m["model_layers"][0], "channels", None), r"model_layers\[0\]: 'channels'"),
    "deep JSON": (lambda m, t: ("raw", "[" * 100_000 + "]" * 100_000), r"not valid JSON"),
    "not a mapping": (lambda m, t: ("raw", "[1, 2]"), r"metadata must be a JSON object"),
}


@pytest.mark.parametrize("case", list(EDITS))
def test_every_field_is_validated_at_load_naming_the_layer_and_field(tmp_path, case):
    """Each damaged field is refused when the file is loaded, naming the layer and the field, rather
    than failing later as IndexError, KeyError, AttributeError, RecursionError or a NaN error blamed
    on the wrong layer."""
    edit, match = EDITS[case]
    path = aqr.calibrate(bn_cnn(), loader(images(16))).save(tmp_path / "s.safetensors")
    _rewrite(path, edit)
    with pytest.raises(aqr.StatsError, match=match):
        aqr.SourceStats.load(path)


def test_statistics_built_in_memory_are_validated_too():
    stats = aqr.calibrate(bn_cnn(), loader(images(16)))
    layer = stats.layers["1"]
    bad = layer.quantiles.clone()
    bad[3, 7] = NAN
    with pytest.raises(aqr.StatsError, match="layer '1': quantiles.*NaN or Inf"):
        aqr.LayerStats(**{**vars(layer), "quantiles": bad})
    with pytest.raises(aqr.StatsError, match="layer '1': std has shape"):
        aqr.LayerStats(**{**vars(layer), "std": layer.std[:3]})
    with pytest.raises(aqr.StatsError, match="'tail' must be one of"):
        aqr.SourceStats(stats.layers, stats.num_quantiles, tail="bogus")
    with pytest.raises(aqr.StatsError, match="layer '1': quantiles has shape \\(8, 101\\), expected \\(8, 11\\)"):
        aqr.SourceStats(stats.layers, 11)


def test_saved_statistics_get_the_usual_permissions_not_private_ones(tmp_path):
    # a service running as another user reads the statistics a training job wrote (umask applied, 0o022 here)
    import os
    import stat

    old = os.umask(0o022)
    try:
        model = bn_cnn().eval()
        stats = aqr.calibrate(model, [images(16)])
        path = stats.save(tmp_path / "bn.aqr.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
