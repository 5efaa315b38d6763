"""Calibration: one pass of a model over source data gives the :class:`aqr.SourceStats` AQR needs.

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

import math
import numbers
import warnings
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from aqr.core.descriptors import (
    MAX_DESCRIPTOR_IMAGES,
    MAX_DESCRIPTOR_WIDTH,
    DescriptorStats,
    descriptor_layers,
    descriptor_stats,
    image_moments,
    standardized_descriptors,
)
from aqr.core.hooks import instrumented
from aqr.core.layers import (
    LayerError,
    LayerInfo,
    NonFiniteActivationError,
    as_acb,
    check_named_layers,
    check_output,
    execution_order,
    is_norm,
    norm_layers,
    select_layers,
)
from aqr.core.points import OUTPUT, PRE_AFFINE, check_point, normalized
from aqr.core.qmap import check_num_quantiles, check_tail, sort_rows, sorted_quantiles
from aqr.core.stats import MAX_TAIL_DRAW, LayerStats, SourceStats, weights_summary
from aqr.core.tails import DEFAULT_TAIL_UNIT, TAIL_UNITS
from aqr.util.compiled import run_compiled
from aqr.util.memory import check_memory
from aqr.util.seeds import check_seed

TAIL_INPUTS_KEPT = 10_000  # inputs whose per-channel extremes are kept (a uniform sample beyond)


def dkw_epsilon(n: int, delta: float = 0.05) -> float:
    """The DKW bound on the sup-distance between a sample CDF of ``n`` values and the true CDF, holding
    with probability ``1 - delta``; ``ValueError`` unless ``n >= 1`` and ``0 < delta < 1``."""
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ValueError(f"dkw_epsilon needs a sample size n >= 1, got {n!r}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"dkw_epsilon needs a probability 0 < delta < 1, got {delta!r}")
    return math.sqrt(math.log(2.0 / delta) / (2.0 * n))


_SEED_SPACE = 2**64 - 8  # torch generators take seeds below 2**64; room for the +7 a collector adds


def _layer_seed(seed: int, layer: int, group: int = 0) -> int:
    """The generator seed of a layer's (and group's) collector: ``seed * 1_000_003 + layer + 7919 * group``,
    wrapped into what a torch generator takes (unchanged below 2**64 - 8, i.e. for every seed up to 1.8e13)."""
    return (seed * 1_000_003 + layer + 7919 * group) % _SEED_SPACE


def _moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel population variance, mean, min and max of ``x`` (A, C, B), in one fused pass."""
    var, mean = torch.var_mean(x, dim=(0, 2), correction=0)
    return var, mean, x.amin(dim=(0, 2)), x.amax(dim=(0, 2))


class LayerCollector:
    """Streaming per-channel statistics of one layer: moments, extremes and a bottom-k sample.

    :meth:`update` takes each output of the layer; :meth:`finish` turns what was seen into its
    :class:`LayerStats`.
    """

    def __init__(self, info: LayerInfo, max_samples: int, generator_seed: int, compile: bool | None = False,
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
        """Add one output of the layer; NaN or Inf raise :class:`aqr.NonFiniteActivationError`."""
        # Work on the (A, C, B) view of the output: reductions over dims (0, 2) and a gather of
        # the sampled positions avoid a transposed copy of every value.
        x = as_acb(output.detach(), self.info.channel_dim)
        if x.dtype not in (torch.float32, torch.float64):
            x = x.float()
        a, _, b = x.shape
        n = a * b
        if n == 0:
            return
        fuse = x.device.type == "cuda" if self.compile is None else self.compile
        b_var, b_mean, b_min, b_max = run_compiled(_moments, fuse, x)
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

    def _knots(self, num_quantiles: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kept sample sorted per channel, and ``num_quantiles`` knots whose ends are the exact extremes."""
        if self.values is None:
            raise LayerError(f"layer {self.info.name!r} was never called during calibration")
        ordered = sort_rows(self.values)
        q = sorted_quantiles(ordered, num_quantiles)
        q[:, 0], q[:, -1] = self.min, self.max
        return ordered, q

    def knots(self, num_quantiles: int) -> torch.Tensor:
        """``(C, K)`` knots of what was seen (ends: the exact extremes), on the CPU."""
        return self._knots(num_quantiles)[1].cpu()

    def finish(
        self, module: nn.Module, num_quantiles: int, tail_batch: int, tail_repeats: int, affine: bool = True
    ) -> LayerStats:
        """The layer's statistics: ``num_quantiles`` knots and Average Sample Tails over ``tail_batch``;
        the layer's affine parameters with them unless ``affine`` is false (values taken before them)."""
        ordered, q = self._knots(num_quantiles)
        if self.per_input:
            # min over 100 inputs = min of their per-input minima (a channel's draws are uniform
            # over inputs, so over ranks of the sorted minima: the same trick as for values)
            mins = sort_rows(self.input_min.t().contiguous())
            maxs = sort_rows(self.input_max.t().contiguous())
            low = average_sample_tails(mins, tail_batch, tail_repeats, self.seed)[0]
            high = average_sample_tails(maxs, tail_batch, tail_repeats, self.seed)[1]
        else:
            low, high = average_sample_tails(ordered, tail_batch, tail_repeats, self.seed)
        weight = getattr(module, "weight", None) if affine else None
        bias = getattr(module, "bias", None) if affine else None
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


def average_sample_tails(
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


class ClassCoverageWarning(UserWarning):
    """The source labels given to :func:`calibrate` cover only some of the model's classes."""


class ClassCoverage:
    """Which classes the source batches' labels cover, against the width of the model's logits."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.images = 0
        self.classes: int | None = None  # the logits' width; None: no labels or no logits, nothing to say

    def update(self, labels: torch.Tensor | None, x: torch.Tensor, out: object) -> None:
        """Count one batch's integer labels (one per input) and read the model's number of classes."""
        usable = (labels is not None and labels.ndim == 1 and x.ndim > 0 and len(labels) == x.shape[0]
                  and not labels.dtype.is_floating_point and labels.dtype != torch.bool)
        if not usable or not isinstance(out, torch.Tensor) or out.ndim != 2 or out.shape[0] != x.shape[0]:
            self.classes = -1  # one batch without labels or logits: no claim about the rest
            return
        if self.classes is None:
            self.classes = int(out.shape[1])
        self.seen.update(labels.unique().tolist())  # type: ignore[union-attr]
        self.images += int(x.shape[0])

    def warn(self) -> None:
        """Warn when the labels cover only some classes, over at least 10 images per class."""
        classes = self.classes
        if classes is None or classes < 2 or self.images < 10 * classes:
            return
        covered = len(self.seen & set(range(classes)))
        if covered < classes:
            warnings.warn(f"the source labels cover only {covered} of the model's {classes} classes; is the data "
                          "sorted by class? Statistics of some classes make AQR map every batch onto them: "
                          "shuffle it (DataLoader(..., shuffle=True)) or draw a class-balanced subset",
                          ClassCoverageWarning, stacklevel=3)


def _labels(batch: object) -> torch.Tensor | None:
    if isinstance(batch, (list, tuple)) and len(batch) >= 2 and isinstance(batch[1], torch.Tensor):
        return batch[1]
    if isinstance(batch, dict) and isinstance(batch.get("label", batch.get("target")), torch.Tensor):
        return batch.get("label", batch.get("target"))
    return None


#: inputs per batch when :func:`calibrate` is given one tensor (as the README's ``source.split(128)``).
TENSOR_BATCH = 128
#: ``K``, the knots per channel :func:`calibrate` stores by default (the percentiles p0..p100).
DEFAULT_NUM_QUANTILES = 101
#: the values per channel :func:`calibrate` keeps by default (the DKW bound in the module docs).
DEFAULT_MAX_SAMPLES = 100_000


def calibrate(
    model: nn.Module,
    source: Iterable[object],
    layers: str | Sequence[str] = "all",
    num_quantiles: int = DEFAULT_NUM_QUANTILES,
    tail: str = "average",
    *,
    tail_batch: int = 100,
    tail_repeats: int = 1000,
    tail_unit: str = DEFAULT_TAIL_UNIT,
    max_samples: int = DEFAULT_MAX_SAMPLES,
    max_batches: int | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
    progress: bool = False,
    compile: bool | None = None,
    groups: int | None = None,
    point: str = OUTPUT,
    descriptors: bool = False,
) -> SourceStats:
    """Run ``model`` over ``source`` once and return the statistics AQR needs.

    Args:
        model: any ``nn.Module``; its parameters, buffers and train/eval flags are left as found
            (it is run in eval mode).
        source: an iterable of input batches or ``(input, label)`` pairs, e.g. a DataLoader; a single
            tensor is read as its inputs along dim 0, in batches of :data:`TENSOR_BATCH` (not one input at
            a time, as iterating it would). With labels, a warning says when they cover only some of the
            model's classes (its logits' width): statistics of a few classes make AQR map every batch onto them.
        layers: ``"all"``, ``"top-half"``, ``"bottom-half"`` (forward execution order) or names.
        num_quantiles: ``K`` knots at levels ``j / (K - 1)``; 101 gives the percentiles p0..p100.
        tail: the default tail strategy stored with the statistics (all strategies stay usable).
        tail_batch: "Average Sample Tails": p0/p100 become the mean of the min/max
            of a batch of ``tail_batch`` drawn ``tail_repeats`` times.
        tail_repeats: how many such batches are drawn.
        tail_unit: what such a batch holds. ``"images"`` (default): whole inputs, so a draw's
            min is over every position of 100 inputs, as a test batch's is (keeps each input's
            per-channel min and max: 8 bytes per input and channel). ``"values"``: 100 activation
            values of the channel, our first reading of the paper's "batch of 100"; on CIFAR-10-C
            it ranks Average Sample Tails among the weakest tails, "images" among the best.
        max_samples: values kept per channel for the quantiles (see the module docstring for DKW).
        max_batches: stop after this many batches.
        seed: seeds the sample and the tail draws; same seed and data give identical statistics.
        device: run on this device (default: where the model's parameters are).
        progress: show a progress bar (off by default; ``aqr calibrate`` shows one).
        compile: fuse the per-batch moments with ``torch.compile`` (eager fallback with a warning);
            ``None`` (default): on a GPU only. On CPU the fused moments calibrated 5,000 CIFAR images in
            the time the eager ones took, and compiling costs about 8 s in every new process.
        groups: also keep class-conditional knots (``target="robust"`` maps each group of predicted
            classes onto them): source class ``y`` in group ``y % groups``, ``max_samples // groups``
            values per channel and group. Needs ``(input, label)`` batches of integer labels.
        point: where the values are read (:mod:`aqr.core.points`): ``"output"`` (default), each layer's
            output, which :class:`aqr.AQR` maps; ``"pre-affine"``, the normalized values before the
            layer's affine step, which the compositions with gradient methods map
            (:mod:`aqr.methods.compose`); the statistics then hold no affine parameters.
        descriptors: also keep how the images' descriptors spread over the source
            (:class:`aqr.core.descriptors.DescriptorStats`, ``SourceStats.descriptors``), what
            ``target="mixed"`` whitens them by: at the layers :func:`aqr.core.descriptors.descriptor_layers`
            picks, each of the first :data:`aqr.core.descriptors.MAX_DESCRIPTOR_IMAGES` source images'
            per-channel mean and standard deviation at ``point``, standardized by the layer's final knots as
            :func:`aqr.core.descriptors.image_descriptors` standardizes them. Needs at least 2 images.
    """
    check_tail(tail)
    check_point(point)
    num_quantiles = check_num_quantiles(num_quantiles)
    seed = check_seed(seed)
    if isinstance(max_samples, bool) or not isinstance(max_samples, numbers.Integral) or max_samples < 2:
        raise ValueError(f"max_samples must be an integer >= 2, got {max_samples!r}")
    if num_quantiles > max_samples:
        raise ValueError(f"num_quantiles ({num_quantiles}) must be at most max_samples ({max_samples}), "
                         "the values kept per channel that the knots are read from")
    for name, value in (("tail_batch", tail_batch), ("tail_repeats", tail_repeats)):
        if not 1 <= value <= MAX_TAIL_DRAW:
            raise ValueError(f"{name} must be in [1, {MAX_TAIL_DRAW}], got {value}")
    if tail_unit not in TAIL_UNITS:
        raise ValueError(f"tail_unit must be one of {TAIL_UNITS}, got {tail_unit!r}")
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be positive (or None), got {max_batches}")
    if not isinstance(descriptors, bool):
        raise ValueError(f"descriptors must be True or False, got {descriptors!r}")
    if groups is not None and (isinstance(groups, bool) or not isinstance(groups, int) or not 1 <= groups <= 4096):
        raise ValueError(f"groups must be an integer in [1, 4096] (or None), got {groups!r}")
    check_named_layers(model, layers)  # name what an explicitly listed module is
    all_infos = norm_layers(model)
    if not all_infos:
        if any(is_norm(m) for m in model.modules()):  # the warning named them
            raise LayerError(f"{type(model).__name__} has no normalization layer AQR can recalibrate")
        raise LayerError(f"{type(model).__name__} has no BatchNorm, GroupNorm or LayerNorm layer to calibrate")
    check_memory(calibration_bytes(all_infos, max_samples, num_quantiles, tail_unit == "images", groups,
                                   descriptors=descriptors),
                 f"calibrating {len(all_infos)} layers with max_samples={max_samples}")
    if isinstance(source, torch.Tensor):
        if source.ndim < 2:
            raise ValueError(f"source is a tensor of shape {tuple(source.shape)}: give a batch of inputs "
                             "(inputs along dim 0) or an iterable of batches, e.g. a DataLoader")
        source = source.split(TENSOR_BATCH)
    if device is None:
        param = next(model.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
    modules = dict(model.named_modules())
    collectors: dict[str, LayerCollector] = {}
    by_group: dict[str, list[LayerCollector]] = {}
    group_images = [0] * (groups or 0)
    current: dict[str, torch.Tensor] = {}  # the batch's group of each input, read by the hooks
    # descriptors: the layers read, each one's per-image (mean, std) of the first images, how many images kept
    moments: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    described = {"kept": 0, "take": 0, "images": 0}
    order: list[str] | None = None
    coverage = ClassCoverage()
    with instrumented(model) as tools:
        batches = tqdm(source, desc="calibrate", unit="batch", disable=not progress, total=max_batches)
        for b, batch in enumerate(batches):
            if max_batches is not None and b >= max_batches:
                break
            x = _inputs(batch).to(device)
            if x.ndim > 0 and x.shape[0] == 0:
                continue  # an empty batch adds nothing (and has no shape for the layers to report)
            if groups is not None:
                current["group"] = _batch_groups(_labels(batch), x, groups)
                for g, n in enumerate(torch.bincount(current["group"], minlength=groups).tolist()):
                    group_images[g] += n
                current["group"] = current["group"].to(device)
            if order is None:
                order = execution_order(model, all_infos, x)
                chosen = select_layers(all_infos, layers, order)
                if descriptors:
                    in_order = sorted(chosen, key=lambda i: order.index(i.name))  # an explicit list: any order
                    moments = {n: [] for n in descriptor_layers([i.name for i in in_order],
                                                                [i.channels for i in in_order])}
                for i, info in enumerate(chosen):
                    collectors[info.name] = LayerCollector(info, max_samples, _layer_seed(seed, i), compile,
                                                           per_input=tail_unit == "images")

                    if groups is not None:
                        by_group[info.name] = [LayerCollector(info, max(2, max_samples // groups),
                                                              _layer_seed(seed, i, g + 1))
                                               for g in range(groups)]

                    def hook(m: nn.Module, inputs: object, out: object, c: LayerCollector = collectors[info.name]) -> None:
                        out = check_output(c.info, out)
                        if point == PRE_AFFINE:  # the same values, before the layer's affine step
                            out = check_output(c.info, normalized(m, inputs[0], c.info))  # type: ignore[index]
                        c.update(out)
                        if c.info.name in moments and described["take"]:
                            _keep_moments(moments[c.info.name], c.info, out, described["images"], described["take"])
                        if groups is not None:
                            _update_groups(by_group[c.info.name], out, current["group"])

                    tools.hook(info.name, hook)
            described["images"] = int(x.shape[0]) if x.ndim > 0 else 1
            described["take"] = min(described["images"], MAX_DESCRIPTOR_IMAGES - described["kept"])
            with torch.no_grad():
                out = model(x)
            described["kept"] += described["take"]
            coverage.update(_labels(batch), x, out)
    if order is None:
        raise ValueError("the source data yielded no images (no batch, or only empty ones)")
    coverage.warn()
    stats = {
        name: c.finish(modules[name], num_quantiles, tail_batch, tail_repeats, affine=point == OUTPUT)
        for name, c in collectors.items()
    }
    if groups is not None:
        for name, layer in stats.items():
            # a group without source images maps onto the layer's knots
            layer.group_quantiles = torch.stack([c.knots(num_quantiles) if c.values is not None else layer.quantiles
                                                 for c in by_group[name]])
    return SourceStats(
        descriptors=_descriptor_stats(moments, stats) if descriptors else None,
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
        groups=groups,
        group_images=None if groups is None else tuple(group_images),
        point=point,
    )


def calibration_bytes(infos: Sequence[LayerInfo], max_samples: int, num_quantiles: int, per_input: bool,
                      groups: int | None, descriptors: bool = False) -> int:
    """An upper estimate of the memory :func:`calibrate` takes for these layers: per channel the kept
    sample (float32 values, their keys and the copy a merge or the final sort makes), the per-input
    extremes and the class groups' samples; with ``descriptors``, the source images' descriptors (float32
    moments, their concatenation and its float64 copy)."""
    channels = sum(info.channels for info in infos)
    per_channel = 3 * 4 * max_samples + 8 * num_quantiles
    if per_input:
        per_channel += 3 * 8 * TAIL_INPUTS_KEPT
    if groups is not None:
        per_channel += 3 * 4 * max(2, max_samples // groups) * groups
    described = (4 + 4 + 8) * MAX_DESCRIPTOR_IMAGES * MAX_DESCRIPTOR_WIDTH if descriptors else 0
    return channels * per_channel + described


def _batch_groups(labels: torch.Tensor | None, x: torch.Tensor, groups: int) -> torch.Tensor:
    """Each input's group ``label % groups`` (on the CPU); a batch without integer labels, one per input,
    raises ValueError."""
    if labels is None:
        raise ValueError("calibrate(groups=...) needs (input, label) batches: this one has no labels")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool or labels.ndim != 1 or len(labels) != len(x):
        raise ValueError(f"calibrate(groups=...) needs one integer label per input: labels {labels.dtype} "
                         f"{tuple(labels.shape)} for {len(x)} inputs")
    if bool((labels < 0).any()):
        raise ValueError(f"calibrate(groups=...): negative label {int(labels.min())}")
    return labels.cpu().long() % groups


def _update_groups(collectors: list[LayerCollector], out: torch.Tensor, group: torch.Tensor) -> None:
    """Each group's inputs of one layer output (inputs along dim 0) into its collector."""
    if out.ndim < 2 or out.shape[0] != group.shape[0]:
        raise LayerError(f"layer {collectors[0].info.name!r}: calibrate(groups=...) needs the inputs along the "
                         f"output's first dim, got {tuple(out.shape)} for {group.shape[0]} inputs")
    for g in torch.unique(group).tolist():
        collectors[g].update(out[group == g])


def _keep_moments(kept: list[tuple[torch.Tensor, torch.Tensor]], info: LayerInfo, out: torch.Tensor, images: int,
                  take: int) -> None:
    """Keep the per-channel mean and standard deviation of the first ``take`` of the batch's ``images`` images
    in the layer's values ``out`` (read in the (A, C, B) layout, as the maps read them), on the CPU."""
    x = as_acb(out.detach(), info.channel_dim)
    if x.shape[0] % images:
        raise LayerError(f"layer {info.name!r}: calibrate(descriptors=True) needs the layer's rows to be whole "
                         f"images, got {x.shape[0]} rows for {images} images ({tuple(out.shape)})")
    rows = x.shape[0] // images
    mean, std = image_moments(x[: take * rows], take)
    kept.append((mean.cpu(), std.cpu()))


def _descriptor_stats(moments: dict[str, list[tuple[torch.Tensor, torch.Tensor]]],
                      stats: dict[str, LayerStats]) -> DescriptorStats:
    """The source images' descriptors at each layer of ``moments`` (standardized by the layer's final knots),
    concatenated in that order, and their :class:`DescriptorStats`."""
    per_layer = []
    for name, kept in moments.items():
        mean = torch.cat([m for m, _ in kept])
        std = torch.cat([s for _, s in kept])
        if per_layer and len(mean) != len(per_layer[0]):
            raise LayerError(f"layer {name!r} saw {len(mean)} images, layer {next(iter(moments))!r} "
                             f"{len(per_layer[0])}: calibrate(descriptors=True) needs each layer called once a forward")
        per_layer.append(standardized_descriptors(mean, std, stats[name].quantiles))
    return descriptor_stats(torch.cat(per_layer, dim=1), list(moments))
