"""Source statistics: what AQR remembers of the source domain, saved and loaded, and checked against a model.

:class:`SourceStats` holds, per calibrated normalization layer, a :class:`LayerStats`: the
per-channel source knots with their averaged small-sample extremes, moments and the layer's affine
parameters. Files are safetensors (no pickle). :func:`aqr.calibrate` (:mod:`aqr.core.calibrate`)
computes them.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from aqr import __version__
from aqr.core.layers import LayerInfo, fingerprint, norm_layers
from aqr.util.files import atomic_write

FORMAT = "aqr-source-stats"
FORMAT_VERSION = 1
SOURCE_MOMENTS = ("affine", "empirical")
WEIGHTS_KEY = "__model__/weights_summary"


class StatsError(ValueError):
    """Statistics that are unusable: a bad file, or statistics of another model."""


@dataclass
class LayerStats:
    """Per-channel statistics of one normalization layer's output on source data."""

    info: LayerInfo
    quantiles: torch.Tensor  # (C, K); column 0 / K-1 are the exact min / max over all values
    tail_low: torch.Tensor  # (C,) mean of the min of `tail_batch` values, "Average Sample Tails"
    tail_high: torch.Tensor  # (C,) mean of the max
    mean: torch.Tensor  # (C,) over all values
    std: torch.Tensor  # (C,) over all values (population)
    affine_weight: torch.Tensor | None  # gamma of the layer, when it has one
    affine_bias: torch.Tensor | None  # beta
    num_values: int  # values per channel seen
    sample_size: int  # values per channel kept for the quantiles


@dataclass
class SourceStats:
    """Per-layer, per-channel source statistics of a model's normalization layers.

    ``layers`` is in forward execution order. ``model_layers`` describes every normalization layer of
    the model the statistics belong to, in registration order, so loading them into another model
    fails with the first layer that differs.
    """

    layers: dict[str, LayerStats]
    num_quantiles: int
    tail: str = "average"
    tail_batch: int = 100
    tail_repeats: int = 1000
    tail_unit: str = "values"
    max_samples: int = 100_000
    seed: int = 0
    model_layers: list[LayerInfo] = field(default_factory=list)
    weights_summary: torch.Tensor | None = None  # see weights_summary()
    aqr_version: str = __version__

    # ---- access -------------------------------------------------------------------------------
    @property
    def layer_names(self) -> list[str]:
        """Names of the calibrated layers, in forward execution order."""
        return list(self.layers)

    def source_quantiles(self, name: str, tail: str | None = None) -> torch.Tensor:
        """The ``(C, K)`` source knots to map onto under ``tail`` (``"average"`` swaps in p0/p100)."""
        tail = tail or self.tail
        layer = self.layers[name]
        if tail != "average":
            return layer.quantiles
        q = layer.quantiles.clone()
        q[:, 0] = torch.minimum(layer.tail_low, q[:, 1])
        q[:, -1] = torch.maximum(layer.tail_high, q[:, -2])
        return q

    def source_moments(self, name: str, kind: str = "affine") -> tuple[torch.Tensor, torch.Tensor]:
        """``(loc, scale)`` of the source channel: the layer's (beta, gamma), or the measured mean/std.

        ``"affine"`` is the paper's choice for the Gaussian and interval tails; it falls back to the
        measured moments for a layer without affine parameters.
        """
        if kind not in SOURCE_MOMENTS:
            raise ValueError(f"source moments must be one of {SOURCE_MOMENTS}, got {kind!r}")
        layer = self.layers[name]
        if kind == "affine" and layer.affine_weight is not None and layer.affine_bias is not None:
            return layer.affine_bias, layer.affine_weight.abs()
        return layer.mean, layer.std

    # ---- model checks -------------------------------------------------------------------------
    def check_model(self, model: nn.Module) -> None:
        """Raise :class:`StatsError` naming the first normalization layer where ``model`` differs."""
        current = norm_layers(model)
        if self.model_layers:
            for i, (want, have) in enumerate(zip(self.model_layers, current)):
                if want != have:
                    raise StatsError(
                        f"these statistics belong to another model: normalization layer #{i} is "
                        f"{_describe(have)} in this model but {_describe(want)} in the statistics"
                    )
            if len(self.model_layers) != len(current):
                i = min(len(self.model_layers), len(current))
                extra = current[i] if len(current) > i else self.model_layers[i]
                raise StatsError(
                    f"these statistics belong to another model: it has {len(self.model_layers)} "
                    f"normalization layers, this model has {len(current)}; first unmatched: {_describe(extra)}"
                )
        by_name = {i.name: i for i in current}
        for name, layer in self.layers.items():
            if by_name.get(name) != layer.info:
                raise StatsError(
                    f"layer {name!r}: statistics are for {_describe(layer.info)}, model has "
                    f"{_describe(by_name[name]) if name in by_name else 'no such normalization layer'}"
                )
        if not self.computed_with(model):
            warnings.warn(
                "the model's weights differ from those the statistics were computed with (same "
                "architecture, other checkpoint?); recalibrate if this is unintended",
                stacklevel=3,
            )

    def computed_with(self, model: nn.Module) -> bool:
        """Whether ``model``'s weights are those the statistics were computed with (True if unrecorded)."""
        return self.weights_summary is None or same_weights(self.weights_summary, weights_summary(model))

    # ---- files --------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the statistics to a safetensors file (no pickle, atomically); returns the path."""
        from safetensors.torch import save_file

        path = Path(path)
        tensors: dict[str, torch.Tensor] = {}
        layers_meta = []
        for name, layer in self.layers.items():
            tensors[f"{name}/quantiles"] = layer.quantiles
            tensors[f"{name}/tail_low"] = layer.tail_low
            tensors[f"{name}/tail_high"] = layer.tail_high
            tensors[f"{name}/mean"] = layer.mean
            tensors[f"{name}/std"] = layer.std
            if layer.affine_weight is not None:
                tensors[f"{name}/affine_weight"] = layer.affine_weight
            if layer.affine_bias is not None:
                tensors[f"{name}/affine_bias"] = layer.affine_bias
            layers_meta.append(
                {**asdict(layer.info), "num_values": layer.num_values, "sample_size": layer.sample_size}
            )
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "aqr_version": self.aqr_version,
            "num_quantiles": self.num_quantiles,
            "tail": self.tail,
            "tail_batch": self.tail_batch,
            "tail_repeats": self.tail_repeats,
            "tail_unit": self.tail_unit,
            "max_samples": self.max_samples,
            "seed": self.seed,
            "layers": layers_meta,
            "model_layers": [asdict(i) for i in self.model_layers],
            "model_fingerprint": fingerprint(self.model_layers),
        }
        if self.weights_summary is not None:
            tensors[WEIGHTS_KEY] = self.weights_summary
        tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}
        # never a half-written file under the final name, even with several processes saving at once
        return atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"aqr": json.dumps(meta)}))

    @classmethod
    def load(cls, path: str | Path) -> SourceStats:
        """Read statistics written by :meth:`save`; a truncated, corrupted or foreign file raises."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no statistics file at {path}")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                raw_meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as err:  # safetensors raises its own error types for bad headers/lengths
            raise StatsError(f"{path} is not a readable safetensors file (truncated or corrupted?): {err}") from err
        if "aqr" not in raw_meta:
            raise StatsError(f"{path} is a safetensors file but not AQR statistics (no 'aqr' metadata)")
        try:
            meta = json.loads(raw_meta["aqr"])
        except json.JSONDecodeError as err:
            raise StatsError(f"{path}: the AQR metadata is not valid JSON: {err}") from err
        if meta.get("format") != FORMAT:
            raise StatsError(f"{path}: format is {meta.get('format')!r}, expected {FORMAT!r}")
        if int(meta.get("format_version", -1)) > FORMAT_VERSION:
            raise StatsError(
                f"{path}: format version {meta['format_version']} is newer than this aqr "
                f"({__version__}) reads ({FORMAT_VERSION}); upgrade aqr"
            )
        k = int(meta["num_quantiles"])
        layers: dict[str, LayerStats] = {}
        for entry in meta["layers"]:
            info = LayerInfo(entry["name"], entry["kind"], int(entry["channels"]), int(entry["channel_dim"]))
            c = info.channels

            def get(key: str, shape: tuple[int, ...], optional: bool = False) -> torch.Tensor | None:
                full = f"{info.name}/{key}"
                if full not in tensors:
                    if optional:
                        return None
                    raise StatsError(f"{path}: tensor {full!r} is missing")
                t = tensors[full]
                if tuple(t.shape) != shape:
                    raise StatsError(f"{path}: tensor {full!r} has shape {tuple(t.shape)}, expected {shape}")
                return t

            layers[info.name] = LayerStats(
                info=info,
                quantiles=get("quantiles", (c, k)),
                tail_low=get("tail_low", (c,)),
                tail_high=get("tail_high", (c,)),
                mean=get("mean", (c,)),
                std=get("std", (c,)),
                affine_weight=get("affine_weight", (c,), optional=True),
                affine_bias=get("affine_bias", (c,), optional=True),
                num_values=int(entry["num_values"]),
                sample_size=int(entry["sample_size"]),
            )
        model_layers = [LayerInfo(**d) for d in meta.get("model_layers", [])]
        if model_layers and fingerprint(model_layers) != meta.get("model_fingerprint"):
            raise StatsError(f"{path}: the model fingerprint does not match its layer list (edited file?)")
        return cls(
            layers=layers,
            num_quantiles=k,
            tail=meta["tail"],
            tail_batch=int(meta["tail_batch"]),
            tail_repeats=int(meta["tail_repeats"]),
            tail_unit=str(meta.get("tail_unit", "values")),  # files written before the option: values
            max_samples=int(meta["max_samples"]),
            seed=int(meta["seed"]),
            model_layers=model_layers,
            weights_summary=tensors.get(WEIGHTS_KEY),
            aqr_version=meta.get("aqr_version", "?"),
        )


def _describe(info: LayerInfo) -> str:
    return f"{info.name!r} ({info.kind}, {info.channels} channels)"


def weights_summary(model: nn.Module) -> torch.Tensor:
    """``(T, 2)``: mean and root-mean-square of each floating-point tensor of the state dict.

    Compared with a tolerance, it tells another checkpoint of the same architecture apart while a
    cast of the same weights to fp16/bf16 still matches (a hash would not).
    """
    rows = [
        (t.detach().double().mean().item(), t.detach().double().pow(2).mean().sqrt().item())
        for t in model.state_dict().values()
        if isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.numel()
    ]
    return torch.tensor(rows, dtype=torch.float32).reshape(-1, 2)


def same_weights(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two :func:`weights_summary` results describe the same weights (up to a cast)."""
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-2, atol=1e-4))
