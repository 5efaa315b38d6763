"""Paper Fig. 3 (aqr.experiments.tail_deviation): small batches' tail percentiles against the source's."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
import torch

from tests import models_tiny
from aqr import cli
from aqr.experiments.tail_deviation import TAIL_LEVELS, percentile_deviations


def _main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


def test_small_batch_extremes_are_biased_inward() -> None:
    model = models_tiny.bn_cnn()
    images = models_tiny.images(300)
    dev = percentile_deviations(model, images, n_batches=12, batch_size=8, reference=200)
    assert list(dev) == list(TAIL_LEVELS)
    assert all(v.shape == (12,) and np.isfinite(v).all() for v in dev.values())
    # the paper's claim, true for any continuous distribution: min overestimates, max underestimates
    assert dev[0].mean() > 0 and dev[100].mean() < 0
    assert abs(dev[50].mean()) < dev[0].mean() and abs(dev[50].mean()) < -dev[100].mean()
    # uint8 NHWC input is the same images
    as_uint8 = (images * 255).round().byte().permute(0, 2, 3, 1).numpy()
    again = percentile_deviations(model, as_uint8, layer="4", n_batches=3, batch_size=8, reference=200,
                                  levels=(0, 100))
    assert list(again) == [0, 100] and again[0].mean() > 0
    with pytest.raises(ValueError, match="cannot give"):
        percentile_deviations(model, images, reference=1000)


def test_tail_deviation_cli_writes_figure(tmp_path) -> None:
    from aqr import models

    torch.manual_seed(0)
    ckpt = models.save_checkpoint(tmp_path / "r20.pt", models.create("resnet20", num_classes=10),
                                  {"name": "resnet20", "num_classes": 10})
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "src.npz", x=rng.integers(0, 256, (80, 32, 32, 3), dtype=np.uint8),
             y=rng.integers(0, 10, 80))
    out = tmp_path / "fig3"
    code, stdout, err = _main(["report", "--tail-deviation", str(ckpt), "--source-data", str(tmp_path / "src.npz"),
                               "--source-indices", "0:80", "--reference", "64", "--batches", "4",
                               "--batch-size", "16", "--out", str(out), "--json"])
    assert code == 0, err
    result = json.loads(stdout)
    assert result["layer"] and set(result["deviations"]) == {str(k) for k in TAIL_LEVELS}
    assert (out / "tail_deviation.png").stat().st_size > 5000 and (out / "tail_deviation.pdf").stat().st_size > 1000
    code, _, err = _main(["report", "--tail-deviation", str(ckpt), "--out", str(out)])
    assert code == 2 and "--source-data" in err
