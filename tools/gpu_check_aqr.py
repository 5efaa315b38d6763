"""On a GPU: does fast AQR there give what it gives on CPU, does NaN handling still name the layer,
and where does its time go? Prints a few lines; run from the repository root with src on PYTHONPATH.

    AQR_SHARED_DATA=.gpu python tools/gpu_check_aqr.py
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch

import aqr
from aqr import models

shared = Path(os.environ.get("AQR_SHARED_DATA", "../shared/data"))
dev = os.environ.get("AQR_DEVICE", "cuda")
sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
model = models.load("resnet20", checkpoint=shared / "checkpoints/akamaster/resnet20-12fca82f.th").eval()
with np.load(shared / "cifar10_test.npz") as clean:
    x_all = torch.from_numpy(clean["x"]).permute(0, 3, 1, 2).float().div(255)
    y_all = torch.from_numpy(clean["y"])
stats = aqr.calibrate(model, x_all[:2000].split(500))
g = torch.Generator().manual_seed(0)
x = (x_all[5000:5512] + 0.08 * torch.randn(512, 3, 32, 32, generator=g)).clamp(0, 1)
y = y_all[5000:5512]

cpu = {mode: torch.cat([aqr.AQR(model, stats, mode=mode)(b) for b in x.split(128)]) for mode in ("fast", "exact")}
gmodel = models.load("resnet20", checkpoint=shared / "checkpoints/akamaster/resnet20-12fca82f.th").eval().to(dev)
gpu = torch.cat([aqr.AQR(gmodel, stats)(b.to(dev)).cpu() for b in x.split(128)])
for name, out in (("cpu fast", cpu["fast"]), ("cpu exact", cpu["exact"]), ("gpu fast", gpu)):
    print(f"{name:9s} accuracy {100 * (out.argmax(1) == y).float().mean():.2f} %")
print(f"gpu fast vs cpu fast: same prediction {100 * (gpu.argmax(1) == cpu['fast'].argmax(1)).float().mean():.2f} %, "
      f"max |logit diff| {(gpu - cpu['fast']).abs().max():.2e}")

bad = x[:16].clone().to(dev)
bad[0, :, 2, 2] = float("nan")
try:
    aqr.AQR(gmodel, stats)(bad)
    print("NaN: NOT raised")
except aqr.NonFiniteActivationError as err:
    print(f"NaN raises: {err}"[:160])
skipped = aqr.AQR(gmodel, stats, on_nonfinite="skip")(bad)
with torch.no_grad():
    print("NaN skip: NaN pattern as unadapted:", bool(torch.equal(skipped.isnan(), gmodel(bad).isnan())))

# where the time goes, batch 128
xb = x[:128].to(dev)
for label, runner in (("plain", lambda b: gmodel(b)), ("aqr", aqr.AQR(gmodel, stats)), ("aqr eager", aqr.AQR(gmodel, stats, compile=False))):
    with torch.no_grad():
        for _ in range(3):
            runner(xb)
        sync()
        t = time.perf_counter()
        for _ in range(20):
            runner(xb)
        sync()
    print(f"{label:10s} {1e3 * (time.perf_counter() - t) / 20:.2f} ms/batch")
from torch.profiler import ProfilerActivity, profile

adapted = aqr.AQR(gmodel, stats)
with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev != "cpu" else [])) as prof:
    for _ in range(5):
        adapted(xb)
    sync()
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=40))
