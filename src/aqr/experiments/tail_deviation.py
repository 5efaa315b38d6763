"""Paper Fig. 3: how far the tail percentiles of small batches stray from the source's (``aqr report
--tail-deviation``).

A model runs on small random batches of source images; the percentiles of one normalization
layer's output are compared with reference percentiles of many images, in units of the reference
standard deviation of each channel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from aqr.core.calibrate import calibrate
from aqr.core.hooks import instrumented
from aqr.core.layers import LayerError, LayerInfo, check_output, norm_layers
from aqr.core.qmap import channel_quantiles
from aqr.data.arrays import to_float
from aqr.util.plots import axes_row, save

TAIL_LEVELS = (0, 1, 5, 25, 50, 75, 95, 99, 100)


def tail_layer(model: nn.Module, layer: str | None = None) -> LayerInfo:
    """The :class:`aqr.LayerInfo` of ``layer``, or of the model's first normalization layer."""
    infos = norm_layers(model)
    if not infos:
        raise LayerError(f"{type(model).__name__} has no BatchNorm, GroupNorm or LayerNorm layer")
    if layer is None:
        return infos[0]
    for info in infos:
        if info.name == layer:
            return info
    raise LayerError(f"{layer!r} is not a normalization layer of this model; "
                     f"choose from {', '.join(i.name for i in infos)}")


def _as_batch(images: torch.Tensor | np.ndarray, index: Sequence[int] | slice) -> torch.Tensor:
    """Float NCHW [0, 1] batch from a float NCHW tensor or a uint8 NHWC array (its memory order kept)."""
    if isinstance(images, torch.Tensor):
        return images[index].float()
    return to_float(np.asarray(images[index]), channels_last=True)


def percentile_deviations(model: nn.Module, images: torch.Tensor | np.ndarray, layer: str | None = None,
                          n_batches: int = 20, batch_size: int = 128, reference: int = 10000,
                          levels: Sequence[int] = TAIL_LEVELS, seed: int = 0) -> dict[int, np.ndarray]:
    """Fig. 3: per level, the deviation of small-batch percentiles from reference percentiles.

    The reference percentiles of the normalization layer's output (``layer``, default the model's
    first one) come from the first ``reference`` images via :func:`aqr.calibrate` (p0/p100 exact,
    inner levels from a 10^6-value sample per channel, within 0.14 percentile points by DKW). Each of
    ``n_batches`` batches draws ``batch_size`` distinct images at random (``seed``) from all of
    ``images``. A deviation is ``(batch percentile - reference percentile) / reference std`` per
    channel, so channels and layers are comparable, averaged over the channels whose reference std
    is positive. Returns ``{level: array of n_batches deviations}``.
    """
    levels = [int(k) for k in levels]
    if any(not 0 <= k <= 100 for k in levels):
        raise ValueError(f"levels must be percentiles in 0..100, got {levels}")
    n = len(images)
    if reference > n or batch_size > n:
        raise ValueError(f"{n} images cannot give {reference} reference images and batches of {batch_size}")
    info = tail_layer(model, layer)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    chunks = (_as_batch(images, slice(i, min(i + 256, reference))) for i in range(0, reference, 256))
    ref = calibrate(model, chunks, layers=[info.name], num_quantiles=101, tail="standard",
                    max_samples=1_000_000, seed=seed, compile=False).layers[info.name]
    ref_q, ref_std = ref.quantiles.double(), ref.std.double()
    live = ref_std > 0  # a dead channel has no scale to express a deviation in
    rng = np.random.default_rng(seed)
    captured: list[torch.Tensor] = []
    deviations = np.empty((n_batches, len(levels)))
    with instrumented(model) as tools, torch.no_grad():
        tools.hook(info.name, lambda _m, _i, out: captured.append(check_output(info, out).detach()))
        for b in range(n_batches):
            captured.clear()
            model(_as_batch(images, np.sort(rng.choice(n, batch_size, replace=False))).to(device))
            q = channel_quantiles(captured[-1], 101, dim=info.channel_dim).double().cpu()
            dev = (q[:, levels] - ref_q[:, levels]) / ref_std[:, None]
            deviations[b] = dev[live].mean(dim=0).numpy()
    return {k: deviations[:, i] for i, k in enumerate(levels)}


def plot_tail_deviation(deviations: Mapping[int, Sequence[float]], path: str | Path,
                        title: str | None = None) -> list[Path]:
    """Fig. 3: one box per percentile level of the batch-minus-reference deviations; PNG and PDF."""
    levels = sorted(deviations)
    fig, (ax,) = axes_row(1, (6.0, 3.6))
    ax.boxplot([np.asarray(deviations[k], dtype=float) for k in levels])
    ax.set_xticks(range(1, len(levels) + 1))
    ax.set_xticklabels([f"p{k}" for k in levels])
    ax.axhline(0.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("percentile level")
    ax.set_ylabel("deviation from reference (reference std)")
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return save(fig, path, formats=("png", "pdf"), tight=True)
