"""Source statistics: what AQR remembers of the source domain, saved and loaded, and checked against a model.

:class:`SourceStats` holds, per calibrated normalization layer, a :class:`LayerStats`: the
per-channel source knots with their averaged small-sample extremes, moments and the layer's affine
parameters (and, when calibrated with ``groups``, the knots of each group of source classes). Files
are safetensors (no pickle). :func:`aqr.calibrate` (:mod:`aqr.core.calibrate`) computes them.

Everything is checked where it is built: a :class:`LayerStats` or :class:`SourceStats` with NaN/Inf
or decreasing knots, wrong shapes, negative counts or an unknown tail raises :class:`StatsError`
naming the layer and the field, and :meth:`SourceStats.load` checks the file's metadata (every key
present and of its type) before building them.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aqr._version import __version__
from aqr.core.descriptors import DescriptorStats
from aqr.core.layers import LayerInfo, fingerprint, norm_layers
from aqr.core.points import OUTPUT, POINTS
from aqr.core.tails import TAIL_UNITS, TAILS
from aqr.util.files import atomic_write

FORMAT = "aqr-source-stats"
FORMAT_VERSION = 1
SOURCE_MOMENTS = ("affine", "empirical")
WEIGHTS_KEY = "__model__/weights_summary"
DESCRIPTOR_KEYS = ("descriptors.mean", "descriptors.whitening")  # the tensors of SourceStats.descriptors
_MISSING = object()


class StatsError(ValueError):
    """Statistics that are unusable: a bad file, or statistics of another model."""


#: the largest tail_batch / tail_repeats a statistics file may hold (what the streaming targets accept)
MAX_TAIL_DRAW = 1 << 20


def _integer(value: object, where: str, key: str, minimum: int | None = None, maximum: int | None = None) -> int:
    if (not isinstance(value, int) or isinstance(value, bool) or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)):
        bound = "" if minimum is None else f" >= {minimum}"
        if maximum is not None:
            bound = f" in [{minimum}, {maximum}]"
        raise StatsError(f"{where}{key!r} must be an integer{bound}, got {value!r}")
    return value


def _choice(value: object, where: str, key: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise StatsError(f"{where}{key!r} must be one of {', '.join(allowed)}, got {value!r}")
    return value  # type: ignore[return-value]


def _text(value: object, where: str, key: str) -> str:
    if not isinstance(value, str):
        raise StatsError(f"{where}{key!r} must be a string, got {value!r}")
    return value


def _get(meta: Mapping[str, Any], key: str, where: str = "", default: object = _MISSING) -> Any:
    if key in meta:
        return meta[key]
    if default is _MISSING:
        raise StatsError(f"{where}{key!r} is missing")
    return default


def _check_info(info: LayerInfo, where: str) -> None:
    _text(info.name, where, "name")
    _text(info.kind, where, "kind")
    _integer(info.channels, where, "channels", 1)
    if info.channel_dim not in (1, -1) or isinstance(info.channel_dim, bool):
        raise StatsError(f"{where}'channel_dim' must be 1 or -1, got {info.channel_dim!r}")


def _info(entry: object, where: str) -> LayerInfo:
    """A :class:`LayerInfo` from a file's metadata entry, every field present and typed."""
    if not isinstance(entry, Mapping):
        raise StatsError(f"{where.rstrip(': ')} must be a mapping, got {entry!r}")
    name = _text(_get(entry, "name", where), where, "name")
    if where.startswith("layers["):
        where = f"layer {name!r}: "
    info = LayerInfo(name, _get(entry, "kind", where), _get(entry, "channels", where), _get(entry, "channel_dim", where))
    _check_info(info, where)
    return info


def _check_tensor(t: object, where: str, key: str, shape: tuple[int, ...], finite: bool = True) -> None:
    if not isinstance(t, torch.Tensor):
        raise StatsError(f"{where}{key} must be a tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise StatsError(f"{where}{key} must be floating point, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise StatsError(f"{where}{key} has shape {tuple(t.shape)}, expected {shape}")
    if finite and not bool(torch.isfinite(t).all()):
        raise StatsError(f"{where}{key} holds NaN or Inf")


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
    # (G, C, K): the knots of each group of source classes (class y in group y % G); a group without
    # source images holds the layer's quantiles. None unless calibrated with groups.
    group_quantiles: torch.Tensor | None = None

    def __repr__(self) -> str:
        groups = "" if self.group_quantiles is None else f", {self.group_quantiles.shape[0]} groups"
        return (f"LayerStats({self.info.name!r}, {self.info.kind}, {self.info.channels} channels, "
                f"K={self.quantiles.shape[1]}, {self.sample_size} of {self.num_values} values kept{groups})")

    def __post_init__(self) -> None:
        """Raise :class:`StatsError` naming the layer and the field that is unusable."""
        where = f"layer {self.info.name!r}: "
        _check_info(self.info, where)
        c = self.info.channels
        if not isinstance(self.quantiles, torch.Tensor) or self.quantiles.ndim != 2:
            raise StatsError(f"{where}quantiles must be a (channels, K) tensor")
        _check_tensor(self.quantiles, where, "quantiles", (c, self.quantiles.shape[1]))
        if self.quantiles.shape[1] < 3:
            raise StatsError(f"{where}quantiles has {self.quantiles.shape[1]} knots per channel, at least 3 needed")
        if not bool((self.quantiles[:, 1:] >= self.quantiles[:, :-1]).all()):
            bad = int((self.quantiles[:, 1:] < self.quantiles[:, :-1]).any(dim=1).nonzero()[0])
            raise StatsError(f"{where}quantiles decrease along the knots (channel {bad})")
        for key in ("tail_low", "tail_high", "mean", "std"):
            _check_tensor(getattr(self, key), where, key, (c,))
        if bool((self.std < 0).any()):
            raise StatsError(f"{where}std has negative values")
        for key in ("affine_weight", "affine_bias"):
            if getattr(self, key) is not None:
                _check_tensor(getattr(self, key), where, key, (c,))
        _integer(self.num_values, where, "num_values", 1)
        _integer(self.sample_size, where, "sample_size", 1)
        if self.sample_size > self.num_values:
            raise StatsError(f"{where}'sample_size' ({self.sample_size}) exceeds 'num_values' ({self.num_values})")
        g = self.group_quantiles
        if g is not None:
            k = self.quantiles.shape[1]
            if not isinstance(g, torch.Tensor) or g.ndim != 3 or g.shape[0] < 1:
                raise StatsError(f"{where}group_quantiles must be a (groups, channels, K) tensor")
            _check_tensor(g, where, "group_quantiles", (g.shape[0], c, k))
            if not bool((g[..., 1:] >= g[..., :-1]).all()):
                raise StatsError(f"{where}group_quantiles decrease along the knots")


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
    # class-conditional knots (calibrate(groups=G)): source class y in group y % groups, and the source
    # images each group had; every layer then has its group_quantiles. None: no class information.
    groups: int | None = None
    group_images: tuple[int, ...] | None = None
    # where the values were read (aqr.core.points): "output" (what aqr.AQR maps) or "pre-affine"
    point: str = OUTPUT
    # how the images' descriptors spread over the source (calibrate(descriptors=True)), what target="mixed"
    # whitens them by; None: not calibrated
    descriptors: DescriptorStats | None = None

    def __post_init__(self) -> None:
        """Raise :class:`StatsError` naming what is unusable (each layer checked itself)."""
        k = _integer(self.num_quantiles, "", "num_quantiles", 3)
        _choice(self.point, "", "point", POINTS)
        _choice(self.tail, "", "tail", TAILS)
        _choice(self.tail_unit, "", "tail_unit", TAIL_UNITS)
        _integer(self.tail_batch, "", "tail_batch", 1, MAX_TAIL_DRAW)
        _integer(self.tail_repeats, "", "tail_repeats", 1, MAX_TAIL_DRAW)
        _integer(self.max_samples, "", "max_samples", 2)
        _integer(self.seed, "", "seed")
        _text(self.aqr_version, "", "aqr_version")
        for name, layer in self.layers.items():
            if not isinstance(layer, LayerStats) or layer.info.name != name:
                raise StatsError(f"layer {name!r}: its entry must be the LayerStats of layer {name!r}")
            if layer.quantiles.shape[1] != k:
                raise StatsError(f"layer {name!r}: quantiles has shape {tuple(layer.quantiles.shape)}, expected "
                                 f"{(layer.info.channels, k)}")
            have = None if layer.group_quantiles is None else layer.group_quantiles.shape[0]
            if have != self.groups:
                raise StatsError(f"layer {name!r}: has {'no' if have is None else have} group_quantiles groups, "
                                 f"the statistics {'none' if self.groups is None else self.groups}")
        if self.groups is not None:
            _integer(self.groups, "", "groups", 1)
            images = self.group_images
            if (not isinstance(images, tuple) or len(images) != self.groups
                    or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in images) or sum(images) < 1):
                raise StatsError(f"group_images must be {self.groups} counts of source images (>= 0, not all 0), "
                                 f"got {images!r}")
        elif self.group_images is not None:
            raise StatsError("group_images is set but groups is not")
        for i, info in enumerate(self.model_layers):
            if not isinstance(info, LayerInfo):
                raise StatsError(f"model_layers[{i}] must be a LayerInfo")
            _check_info(info, f"model_layers[{i}]: ")
        t = self.weights_summary
        if t is not None:
            if not isinstance(t, torch.Tensor) or t.ndim != 2 or t.shape[1] != 2:
                raise StatsError(f"weights_summary has shape {tuple(getattr(t, 'shape', ()))}, expected (T, 2)")
            _check_tensor(t, "", "weights_summary", tuple(t.shape))
        if self.descriptors is not None:
            self._check_descriptors(self.descriptors)

    def _check_descriptors(self, d: object) -> None:
        """Raise :class:`StatsError` unless ``d`` describes layers of these statistics, at their width."""
        if not isinstance(d, DescriptorStats):
            raise StatsError(f"descriptors must be a DescriptorStats, got {type(d).__name__}")
        missing = [name for name in d.layers if name not in self.layers]
        if missing:
            raise StatsError(f"descriptors: layer {missing[0]!r} is not among the statistics' layers")
        width = 2 * sum(self.layers[name].info.channels for name in d.layers)
        if d.width != width:
            raise StatsError(f"descriptors: mean has shape {(d.width,)}, expected ({width},) (2 x the channels of "
                             f"layers {', '.join(d.layers)})")

    def __repr__(self) -> str:
        channels = sum(layer.info.channels for layer in self.layers.values())
        groups = "" if self.groups is None else f", groups={self.groups}"
        groups += "" if self.point == OUTPUT else f", point={self.point!r}"
        if self.descriptors is not None:
            n = len(self.descriptors.layers)
            groups += f", descriptors of {n} layer{'s' if n > 1 else ''}"
        return (f"SourceStats({len(self.layers)} layers, {channels} channels, K={self.num_quantiles}, "
                f"tail={self.tail!r}, tail_unit={self.tail_unit!r}, max_samples={self.max_samples}{groups}, "
                f"aqr {self.aqr_version})")

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

    def check_point(self, point: str, user: str) -> None:
        """Raise :class:`StatsError` unless the values were read at ``point`` (``user`` names who maps them)."""
        if self.point != point:
            raise StatsError(f"{user} maps the values at point={point!r}, these statistics were taken at "
                             f"point={self.point!r}: calibrate with point={point!r}")

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
            if layer.group_quantiles is not None:
                tensors[f"{name}/group_quantiles"] = layer.group_quantiles
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
        if self.groups is not None:
            meta["groups"], meta["group_images"] = self.groups, list(self.group_images or ())
        if self.point != OUTPUT:  # only then: files of the output point keep their bytes
            meta["point"] = self.point
        if self.weights_summary is not None:
            tensors[WEIGHTS_KEY] = self.weights_summary
        if self.descriptors is not None:  # only then: files without them keep their bytes
            meta["descriptors"] = {"layers": list(self.descriptors.layers), "images": self.descriptors.images}
            tensors[DESCRIPTOR_KEYS[0]] = self.descriptors.mean
            tensors[DESCRIPTOR_KEYS[1]] = self.descriptors.whitening
        tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()}
        # never a half-written file under the final name, even with several processes saving at once
        return atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"aqr": json.dumps(meta)}))

    @classmethod
    def load(cls, path: str | Path) -> SourceStats:
        """Read statistics written by :meth:`save`; a truncated, corrupted, foreign or edited file
        raises :class:`StatsError` naming the file, and the layer and field at fault."""
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
        except (ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError; deep nesting recurses
            raise StatsError(f"{path}: the AQR metadata is not valid JSON: {str(err)[:200]}") from None
        try:
            return cls._from_file(meta, tensors)
        except StatsError as err:
            raise StatsError(f"{path}: {err}") from None

    @classmethod
    def _from_file(cls, meta: object, tensors: dict[str, torch.Tensor]) -> SourceStats:
        """Statistics from a file's parsed metadata and tensors, every field checked."""
        if not isinstance(meta, dict):
            raise StatsError(f"the AQR metadata must be a JSON object, got {type(meta).__name__}")
        if meta.get("format") != FORMAT:
            raise StatsError(f"format is {meta.get('format')!r}, expected {FORMAT!r}")
        version = _integer(_get(meta, "format_version"), "", "format_version", 1)
        if version > FORMAT_VERSION:
            raise StatsError(f"format version {version} is newer than this aqr ({__version__}) reads "
                             f"({FORMAT_VERSION}); upgrade aqr")
        k = _integer(_get(meta, "num_quantiles"), "", "num_quantiles", 3)
        entries = _get(meta, "layers")
        if not isinstance(entries, list):
            raise StatsError(f"'layers' must be a list, got {type(entries).__name__}")
        layers: dict[str, LayerStats] = {}
        for i, entry in enumerate(entries):
            info = _info(entry, f"layers[{i}]: ")
            where = f"layer {info.name!r}: "
            if info.name in layers:
                raise StatsError(f"layer {info.name!r} is listed twice")

            def get(key: str, optional: bool = False) -> torch.Tensor | None:
                full = f"{info.name}/{key}"
                if full not in tensors:
                    if optional:
                        return None
                    raise StatsError(f"{where}tensor {full!r} is missing")
                t = tensors[full]
                if t.dtype.is_floating_point:
                    t = t.float()
                return t

            layers[info.name] = LayerStats(
                info=info, quantiles=get("quantiles"), tail_low=get("tail_low"), tail_high=get("tail_high"),
                mean=get("mean"), std=get("std"), affine_weight=get("affine_weight", True),
                affine_bias=get("affine_bias", True), group_quantiles=get("group_quantiles", True),
                num_values=_integer(_get(entry, "num_values", where), where, "num_values", 1),
                sample_size=_integer(_get(entry, "sample_size", where), where, "sample_size", 1),
            )
        model_entries = _get(meta, "model_layers", default=[])
        if not isinstance(model_entries, list):
            raise StatsError(f"'model_layers' must be a list, got {type(model_entries).__name__}")
        model_layers = [_info(d, f"model_layers[{i}]: ") for i, d in enumerate(model_entries)]
        if model_layers and fingerprint(model_layers) != meta.get("model_fingerprint"):
            raise StatsError("the model fingerprint does not match its layer list (edited file?)")
        return cls(
            layers=layers,
            num_quantiles=k,
            tail=_choice(_get(meta, "tail"), "", "tail", TAILS),
            tail_batch=_get(meta, "tail_batch"),
            tail_repeats=_get(meta, "tail_repeats"),
            tail_unit=_get(meta, "tail_unit", default="values"),  # files written before the option: values
            max_samples=_get(meta, "max_samples"),
            seed=_get(meta, "seed"),
            model_layers=model_layers,
            weights_summary=tensors.get(WEIGHTS_KEY),
            aqr_version=_get(meta, "aqr_version", default="?"),
            groups=_get(meta, "groups", default=None),
            group_images=_group_images(_get(meta, "group_images", default=None)),
            point=_get(meta, "point", default=OUTPUT),
            descriptors=_descriptors(_get(meta, "descriptors", default=None), tensors),
        )


def _group_images(value: object) -> tuple[int, ...] | None:
    """The file's ``group_images`` list as a tuple (checked by :class:`SourceStats`)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise StatsError(f"'group_images' must be a list, got {type(value).__name__}")
    return tuple(value)


def _descriptors(entry: object, tensors: dict[str, torch.Tensor]) -> DescriptorStats | None:
    """The file's descriptor statistics (``None`` where it has none), their metadata and tensors checked."""
    if entry is None:
        present = [key for key in DESCRIPTOR_KEYS if key in tensors]
        if present:
            raise StatsError(f"tensor {present[0]!r} is there but the 'descriptors' metadata is not")
        return None
    if not isinstance(entry, Mapping):
        raise StatsError(f"'descriptors' must be a mapping, got {entry!r}")
    layers = _get(entry, "layers", "descriptors: ")
    if not isinstance(layers, list) or not all(isinstance(n, str) for n in layers):
        raise StatsError(f"descriptors: 'layers' must be a list of layer names, got {layers!r}")
    images = _integer(_get(entry, "images", "descriptors: "), "descriptors: ", "images", 2)
    mean, whitening = (tensors.get(key) for key in DESCRIPTOR_KEYS)
    for key, t in zip(DESCRIPTOR_KEYS, (mean, whitening)):
        if t is None:
            raise StatsError(f"descriptors: tensor {key!r} is missing")
    try:
        return DescriptorStats(layers=tuple(layers), images=images,
                               mean=mean.float() if mean.dtype.is_floating_point else mean,
                               whitening=whitening.float() if whitening.dtype.is_floating_point else whitening)
    except ValueError as err:
        raise StatsError(str(err)) from None


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
