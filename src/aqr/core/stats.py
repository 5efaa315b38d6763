"""Source statistics: what AQR remembers of the source domain, how it is computed, saved and loaded.

Memory stays bounded: for each layer, a uniform random sample of at most ``max_samples`` positions
(a bottom-k sketch: every pooled position gets a random key, the ``max_samples`` smallest keys are
kept) holds the values of every channel at those positions. The inner quantiles come from that
sample; the exact per-channel minimum, maximum, mean and standard deviation come from every value.

Accuracy of the sample (Dvoretzky-Kiefer-Wolfowitz): with ``n`` sampled values, the sample CDF is
within ``eps = sqrt(ln(2 / delta) / (2 n))`` of the CDF of all pooled source values, with probability
``1 - delta`` (sampling without replacement from a finite pool is at least this concentrated). The
default ``n = 100_000`` gives ``eps = 0.0043`` at ``delta = 0.05``: every stored percentile is within
0.43 percentile points of the exact one. The sample costs ``4 * n`` bytes per channel.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from aqr import __version__
from aqr.core.layers import (
    LayerError,
    LayerInfo,
    check_output,
    execution_order,
    fingerprint,
    layer_info,
    norm_layers,
    select_layers,
)
from aqr.backends.torch_backend import as_acb, run_compiled
from aqr.core.qmap import TAILS, sort_rows, sorted_quantiles

TAIL_UNITS = ("values", "images")  # what one "batch of 100" of Average Sample Tails holds
DEFAULT_TAIL_UNIT = "images"
TAIL_INPUTS_KEPT = 10_000  # inputs whose per-channel extremes are kept (a uniform sample beyond)

FORMAT = "aqr-source-stats"
FORMAT_VERSION = 1
SOURCE_MOMENTS = ("affine", "empirical")
WEIGHTS_KEY = "__model__/weights_summary"


class StatsError(ValueError):
    """Statistics that are unusable: a bad file, or statistics of another model."""


class NonFiniteActivationError(ValueError):
    """A normalization layer produced NaN or Inf."""


def dkw_epsilon(n: int, delta: float = 0.05) -> float:
    """The DKW bound on the sup-distance between a sample CDF of ``n`` values and the true CDF."""
    return math.sqrt(math.log(2.0 / delta) / (2.0 * n))


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
        """Write the statistics to a safetensors file (no pickle); returns the path."""
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
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"aqr": json.dumps(meta)})
        tmp.replace(path)  # never leave a half-written file under the final name
        return path

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


def _moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel population variance, mean, min and max of ``x`` (A, C, B), in one fused pass."""
    var, mean = torch.var_mean(x, dim=(0, 2), correction=0)
    return var, mean, x.amin(dim=(0, 2)), x.amax(dim=(0, 2))


class _Collector:
    """Streaming per-channel statistics of one layer: moments, extremes and a bottom-k sample."""

    def __init__(self, info: LayerInfo, max_samples: int, generator_seed: int, compile: bool = False,
                 per_input: bool = False) -> None:
        self.info = info
        self.per_input = per_input  # keep each input's per-channel min and max ("images" tails)
        self.input_min: torch.Tensor | None = None  # (n, C) per-input minima of the kept inputs
        self.input_max: torch.Tensor | None = None
        self.input_keys: torch.Tensor | None = None  # (n,) random keys: the smallest are kept
        self._inputs_gen = torch.Generator().manual_seed(generator_seed + 7)
        self.compile = compile
        self.max_samples = max_samples
        self.seed = generator_seed
        self.generator: torch.Generator | None = None
        self.count = 0
        self.mean: torch.Tensor | None = None  # float64 running mean
        self.m2: torch.Tensor | None = None  # float64 running sum of squared deviations
        self.min: torch.Tensor | None = None
        self.max: torch.Tensor | None = None
        self.values: torch.Tensor | None = None  # (C, k) kept sample
        self.keys: torch.Tensor | None = None  # (k,) their random keys

    def update(self, output: torch.Tensor) -> None:
        # Work on the (A, C, B) view of the output: reductions over dims (0, 2) and a gather of
        # the sampled positions avoid a transposed copy of every value.
        x = as_acb(output.detach(), self.info.channel_dim)
        if x.dtype not in (torch.float32, torch.float64):
            x = x.float()
        a, _, b = x.shape
        n = a * b
        if n == 0:
            return
        b_var, b_mean, b_min, b_max = run_compiled(_moments, self.compile, x)
        # NaN propagates into the mean, min and max and +-Inf into min/max: no separate scan needed.
        if not bool(torch.isfinite(torch.stack([b_mean, b_min, b_max])).all()):
            raise NonFiniteActivationError(
                f"layer {self.info.name!r} produced NaN or Inf activations during calibration; "
                "check the source data and the model"
            )
        b_mean, b_m2 = b_mean.double(), b_var.double() * n
        if self.mean is None:
            self.mean, self.m2, self.min, self.max = b_mean, b_m2, b_min, b_max
        else:  # Chan et al. parallel update, in float64
            total = self.count + n
            delta = b_mean - self.mean
            self.mean = self.mean + delta * (n / total)
            self.m2 = self.m2 + b_m2 + delta**2 * (self.count * n / total)
            self.min = torch.minimum(self.min, b_min)
            self.max = torch.maximum(self.max, b_max)
        self.count += n
        self._sample(x)
        if self.per_input:
            self._input_extremes(output.detach())

    def _input_extremes(self, output: torch.Tensor) -> None:
        dim = self.info.channel_dim % output.ndim
        # inputs along dim 0 (batch first); a layer without a batch dim counts as one input
        if dim > 0:
            per = output.movedim(dim, 1).reshape(output.shape[0], output.shape[dim], -1)
        else:
            per = output.reshape(1, output.shape[0], -1)
        lo, hi = per.amin(dim=2).float().cpu(), per.amax(dim=2).float().cpu()
        keys = torch.rand(lo.shape[0], generator=self._inputs_gen)
        if self.input_min is not None:
            lo, hi = torch.cat([self.input_min, lo]), torch.cat([self.input_max, hi])
            keys = torch.cat([self.input_keys, keys])
        if len(keys) > TAIL_INPUTS_KEPT:  # bounded memory: a uniform sample of the inputs
            keep = torch.topk(keys, TAIL_INPUTS_KEPT, largest=False).indices
            lo, hi, keys = lo[keep], hi[keep], keys[keep]
        self.input_min, self.input_max, self.input_keys = lo, hi, keys

    def _sample(self, x: torch.Tensor) -> None:
        a, c, b = x.shape
        if self.generator is None or self.generator.device != x.device:
            self.generator = torch.Generator(device=x.device).manual_seed(self.seed)
        keys = torch.rand(a * b, generator=self.generator, device=x.device)
        pos = torch.arange(a * b, device=x.device)
        old = 0 if self.keys is None else self.keys.numel()
        if old >= self.max_samples:  # only keys below the current k-th smallest can enter
            pos = (keys < self.keys.max()).nonzero().squeeze(1)
            keys = keys[pos]
        if old + keys.numel() > self.max_samples:
            # Decide on the keys first, then gather only the values of the winners.
            merged = keys if self.keys is None else torch.cat([self.keys, keys])
            merged, idx = torch.topk(merged, self.max_samples, largest=False, sorted=False)
            kept_old, new = idx[idx < old], idx[idx >= old] - old
            pos = pos[new]
            rows = x[pos // b, :, pos % b].t()
            values = rows if self.values is None else torch.cat([self.values[:, kept_old], rows], dim=1)
            keys = merged if self.keys is None else torch.cat([self.keys[kept_old], keys[new]])
        else:
            rows = x[pos // b, :, pos % b].t()
            values = rows if self.values is None else torch.cat([self.values, rows], dim=1)
            keys = keys if self.keys is None else torch.cat([self.keys, keys])
        self.values, self.keys = values.contiguous(), keys

    def finish(
        self, module: nn.Module, num_quantiles: int, tail_batch: int, tail_repeats: int
    ) -> LayerStats:
        if self.values is None:
            raise LayerError(f"layer {self.info.name!r} was never called during calibration")
        ordered = sort_rows(self.values)
        q = sorted_quantiles(ordered, num_quantiles)
        q[:, 0], q[:, -1] = self.min, self.max
        if self.per_input:
            # min over 100 inputs = min of their per-input minima (a channel's draws are uniform
            # over inputs, so over ranks of the sorted minima: the same trick as for values)
            mins = sort_rows(self.input_min.t().contiguous())
            maxs = sort_rows(self.input_max.t().contiguous())
            low = _average_sample_tails(mins, tail_batch, tail_repeats, self.seed)[0]
            high = _average_sample_tails(maxs, tail_batch, tail_repeats, self.seed)[1]
        else:
            low, high = _average_sample_tails(ordered, tail_batch, tail_repeats, self.seed)
        weight = getattr(module, "weight", None)
        bias = getattr(module, "bias", None)
        return LayerStats(
            info=self.info,
            quantiles=q.cpu(),
            tail_low=low.cpu(),
            tail_high=high.cpu(),
            mean=self.mean.float().cpu(),
            std=(self.m2 / self.count).sqrt().float().cpu(),
            affine_weight=weight.detach().float().cpu() if isinstance(weight, torch.Tensor) else None,
            affine_bias=bias.detach().float().cpu() if isinstance(bias, torch.Tensor) else None,
            num_values=self.count,
            sample_size=ordered.shape[1],
        )


def _average_sample_tails(
    ordered: torch.Tensor, tail_batch: int, tail_repeats: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over ``tail_repeats`` draws of the min / max of ``tail_batch`` values, per channel.

    Draws are with replacement from the kept sample (``n >> tail_batch``). Because each row is sorted,
    the min of the values at random positions is the value at the smallest position: one index draw
    ``(repeats, batch)`` serves every channel, and no ``(C, repeats, batch)`` tensor is built.
    """
    n = ordered.shape[1]
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    draws = torch.randint(0, n, (tail_repeats, min(tail_batch, n)), generator=g).to(ordered.device)
    low = ordered[:, draws.amin(dim=1)].double().mean(dim=1).float()
    high = ordered[:, draws.amax(dim=1)].double().mean(dim=1).float()
    return low, high


def _inputs(batch: object) -> torch.Tensor:
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], torch.Tensor):
        return batch[0]
    if isinstance(batch, dict) and isinstance(batch.get("input", batch.get("image")), torch.Tensor):
        return batch.get("input", batch.get("image"))
    raise TypeError(
        f"source batches must be tensors or (input, label) pairs, got {type(batch).__name__}"
    )


def calibrate(
    model: nn.Module,
    source: Iterable[object],
    layers: str | Sequence[str] = "all",
    num_quantiles: int = 101,
    tail: str = "average",
    *,
    tail_batch: int = 100,
    tail_repeats: int = 1000,
    tail_unit: str = DEFAULT_TAIL_UNIT,
    max_samples: int = 100_000,
    max_batches: int | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
    progress: bool = False,
    compile: bool = True,
) -> SourceStats:
    """Run ``model`` over ``source`` once and return the statistics AQR needs.

    Args:
        model: any ``nn.Module``; its parameters, buffers and train/eval flags are left as found
            (it is run in eval mode).
        source: an iterable of input batches or ``(input, label)`` pairs, e.g. a DataLoader.
        layers: ``"all"``, ``"top-half"``, ``"bottom-half"`` (forward execution order) or names.
        num_quantiles: ``K`` knots at levels ``j / (K - 1)``; 101 gives the percentiles p0..p100.
        tail: the default tail strategy stored with the statistics (all strategies stay usable).
        tail_batch, tail_repeats: "Average Sample Tails": p0/p100 become the mean of the min/max
            of a batch of ``tail_batch`` drawn ``tail_repeats`` times.
        tail_unit: what such a batch holds. ``"images"`` (default): whole inputs, so a draw's
            min is over every position of 100 inputs, as a test batch's is (keeps each input's
            per-channel min and max: 8 bytes per input and channel). ``"values"``: 100 activation
            values of the channel, our first reading of the paper's "batch of 100"; on CIFAR-10-C
            it ranks Average Sample Tails among the weakest tails, "images" among the best.
        max_samples: values kept per channel for the quantiles (see the module docstring for DKW).
        max_batches: stop after this many batches.
        seed: seeds the sample and the tail draws; same seed and data give identical statistics.
        device: run on this device (default: where the model's parameters are).
        progress: show a progress bar.
        compile: fuse the per-batch moments with ``torch.compile`` (eager fallback with a warning).
    """
    if tail not in TAILS:
        raise ValueError(f"unknown tail strategy {tail!r}; expected one of {', '.join(TAILS)}")
    if num_quantiles < 3:
        raise ValueError(f"num_quantiles must be >= 3, got {num_quantiles}")
    if max_samples < 2:
        raise ValueError(f"max_samples must be >= 2, got {max_samples}")
    if tail_batch < 1 or tail_repeats < 1:
        raise ValueError("tail_batch and tail_repeats must be positive")
    if tail_unit not in TAIL_UNITS:
        raise ValueError(f"tail_unit must be one of {TAIL_UNITS}, got {tail_unit!r}")
    all_infos = norm_layers(model)
    if not all_infos:
        raise LayerError(f"{type(model).__name__} has no BatchNorm, GroupNorm or LayerNorm layer to calibrate")
    if device is None:
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
    modules = dict(model.named_modules())
    if not isinstance(layers, str):
        for name in layers:  # name what an explicitly listed non-norm module is
            if name in modules:
                layer_info(name, modules[name])
    flags = {m: m.training for m in model.modules()}
    model.eval()
    collectors: dict[str, _Collector] = {}
    handles = []
    order: list[str] | None = None
    try:
        batches = tqdm(source, desc="calibrate", unit="batch", disable=not progress, total=max_batches)
        for b, batch in enumerate(batches):
            if max_batches is not None and b >= max_batches:
                break
            x = _inputs(batch).to(device)
            if order is None:
                order = execution_order(model, all_infos, x)
                chosen = select_layers(all_infos, layers, order)
                for i, info in enumerate(chosen):
                    collectors[info.name] = _Collector(info, max_samples, seed * 1_000_003 + i, compile,
                                                       per_input=tail_unit == "images")

                    def hook(_m: nn.Module, _i: object, out: object, c: _Collector = collectors[info.name]) -> None:
                        c.update(check_output(c.info, out))

                    handles.append(modules[info.name].register_forward_hook(hook))
            with torch.no_grad():
                model(x)
    finally:
        for h in handles:
            h.remove()
        for m, flag in flags.items():
            m.train(flag)
    if order is None:
        raise ValueError("the source data yielded no batch")
    stats = {
        name: c.finish(modules[name], num_quantiles, tail_batch, tail_repeats) for name, c in collectors.items()
    }
    return SourceStats(
        layers=stats,
        num_quantiles=num_quantiles,
        tail=tail,
        tail_batch=tail_batch,
        tail_repeats=tail_repeats,
        tail_unit=tail_unit,
        max_samples=max_samples,
        seed=seed,
        model_layers=all_infos,
        weights_summary=weights_summary(model),
    )
