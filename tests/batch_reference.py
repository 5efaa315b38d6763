"""The batch mode's outputs on fixed inputs, stored in tests/data by the implementation before streaming
AQR existed, which tests/test_stream_aqr.py holds ``aqr.AQR`` to. A change meant to alter the batch
map rewrites them: ``python -m tests.batch_reference`` (from the repository root; say so in the commit)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

import aqr
from tests.models_tiny import bn_cnn, gn_cnn, images, tiny_vit

DATA = Path(__file__).parent / "data"
BUILDERS = {"bn": bn_cnn, "gn": gn_cnn, "vit": tiny_vit}
CONFIGS = {"fast": {}, "torch": {"native": False, "compile": False}, "exact": {"mode": "exact"},
           "gaussian": {"tail": "gaussian"}}


def inputs() -> torch.Tensor:
    return images(24, seed=7) * 1.5 + 0.2


def write() -> None:
    """Models, statistics, inputs and AQR's outputs under each of :data:`CONFIGS`, into tests/data."""
    torch.set_num_threads(1)
    out = {}
    for name, build in BUILDERS.items():
        model = build().eval()
        stats = aqr.calibrate(model, [images(64, seed=s) for s in range(2)], num_quantiles=21)
        stats.save(DATA / f"batch_reference_{name}.stats.safetensors")
        x = inputs()
        out[f"{name}/input"] = x
        for k, v in model.state_dict().items():
            out[f"{name}/weights/{k}"] = v.detach().clone().contiguous()
        for key, options in CONFIGS.items():
            out[f"{name}/{key}"] = aqr.AQR(model, stats, **options)(x).detach().contiguous()
    save_file(out, str(DATA / "batch_reference.safetensors"))


if __name__ == "__main__":
    write()
