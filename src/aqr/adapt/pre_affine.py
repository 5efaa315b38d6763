"""AQR's map before the affine step of each normalization layer, inside a model a gradient method trains.

:class:`PreAffineAQR` installs, on a private model copy (never the user's model), a forward on each
selected normalization layer that computes

    ``weight * map(x_hat) + bias``

with ``x_hat`` the layer's normalized values (:func:`aqr.core.points.normalized`; a BatchNorm on batch
statistics as the gradient methods set it), ``map`` AQR's quantile map onto the source quantiles of
``x_hat`` (statistics taken at ``point="pre-affine"``) and ``weight``/``bias`` the layer's own affine
parameters, which the gradient method trains. The quantile map of a batch does not change when each
channel's input is scaled and shifted (by a positive scale), so mapping ``x_hat`` from batch
statistics onto quantiles taken with the running ones is the same map; with the initial weights,
``weight * map(x_hat) + bias`` is what :class:`aqr.AQR` gives on the layer's output.

Gradients: the value of each map comes from AQR's own path (the C kernels on CPU, Triton on a GPU
when asked, the streaming kernels), computed without gradient. Where the input needs a gradient
(the layers after the first trained one), the map passes it on by its segment slopes with the knots
held constant (:mod:`aqr.core.qmap_grad`): the knots of the batch (``target="batch"``) or the
running knots committed before the batch (``"stream"``/``"robust"``; the batch's own before the
first). Where no gradient is needed (the scored forward pass of the episodic protocol, the first
layer), nothing but AQR's own map runs.

The streaming targets keep one running state per layer for the model: every forward pass of the
copy is one batch of the stream, committed once the logits are finite (with ``target="robust"``,
their argmax gives each image's class), unless :meth:`PreAffineAQR.frozen` holds it (a method's
auxiliary pass, e.g. ROID's augmented images).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from aqr.adapt.config import AQRConfig, SmallBatchWarning
from aqr.adapt.layer_maps import LayerMap
from aqr.adapt.model import build_layer_maps
from aqr.adapt.stream.build import component_router
from aqr.adapt.stream.saved import load_stream_record, stream_record
from aqr.adapt.stream.stream_maps import SharedStream, StreamLayerMap
from aqr.core.layers import NonFiniteActivationError, as_acb, check_named_layers, layer_info
from aqr.core.points import PRE_AFFINE, affine, normalized
from aqr.core.qmap import PARAMETRIC_TAILS, channel_quantiles, tail_lines, to_channel_rows
from aqr.core.qmap_grad import Lines, with_segment_slopes
from aqr.core.stats import SourceStats


class PreAffineForward:
    """The ``forward`` of one normalization layer of the copy: normalize, map, the layer's affine step."""

    def __init__(self, module: nn.Module, layer_map: LayerMap, owner: "PreAffineAQR") -> None:
        self.module = module
        self.layer_map = layer_map
        self.info = layer_map.info
        self.owner = owner

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x_hat = normalized(self.module, x, self.info)
        if self.owner.holding and self.owner.batch is None:  # a per-batch map keeps nothing to predict with
            return affine(self.module, x_hat, self.info)
        plain = x_hat.detach()
        with torch.no_grad():
            mapped = self.layer_map(self.module, (plain,), plain)
        if mapped is plain:  # on_nonfinite="skip" left this batch unmapped (or it was empty)
            mapped = x_hat
        elif x_hat.requires_grad and torch.is_grad_enabled():
            source_q, target_q, lines = slope_knots(self.layer_map, plain)
            dim = self.info.channel_dim % x_hat.ndim
            mapped = with_segment_slopes(x_hat, mapped, source_q, target_q, lines, dim)
        return affine(self.module, mapped, self.info)


def slope_knots(layer_map: LayerMap, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Lines | None]:
    """The source knots, target knots and tail lines whose segment slopes are the gradient of
    ``layer_map``'s map of ``x`` (see the module docs)."""
    source = layer_map.source_on(x.device)
    if isinstance(layer_map, StreamLayerMap):
        stream = layer_map.stream(x.device)
        source_q = stream.source.clone()  # copies: the commit after this pass updates the state in place
        if stream.started:
            return source_q, stream.knots.clone(), None
        return source_q, layer_map.batch_knots(as_acb(x, layer_map.info.channel_dim), None).knots, None
    dim = layer_map.info.channel_dim % x.ndim
    mean = std = None
    if layer_map.config.mode == "exact":
        target_q = channel_quantiles(x, source.num_quantiles, dim)
    else:
        targets = layer_map.backend(x.device).target_knots(as_acb(x, layer_map.info.channel_dim))
        target_q, mean, std = targets.knots, targets.mean, targets.std
    if layer_map.tail in ("standard", "average"):
        return source.knots, target_q, None
    if layer_map.tail in PARAMETRIC_TAILS and (mean is None or std is None):
        var, mean = torch.var_mean(to_channel_rows(x, dim).double(), dim=1, correction=0, keepdim=True)
        std = var.sqrt()
    sq = source.knots.to(target_q.dtype)
    moments = (None, None) if mean is None else (mean.to(sq), std.to(sq))  # type: ignore[union-attr]
    lines = tail_lines(sq, target_q, layer_map.tail, *moments, source.loc, source.scale, layer_map.config.gaussian_p,
                       source.z)
    return sq, target_q, lines


class PreAffineAQR:
    """AQR's maps installed before the affine step of the selected layers of ``model`` (a private copy).

    ``config`` is AQR's (:class:`aqr.AQRConfig`; ``match="quantiles"``, one pass per batch), ``stats``
    taken at ``point="pre-affine"`` on the same model (see the module docs), which the caller checks
    (:meth:`aqr.SourceStats.check_model`) before it changes the model. The layers' forwards are
    replaced on ``model`` itself, which must be the caller's own copy.
    """

    def __init__(self, model: nn.Module, stats: SourceStats, config: AQRConfig) -> None:
        stats.check_point(PRE_AFFINE, "AQR before the affine step")
        if config.match != "quantiles":
            raise ValueError(f"match={config.match!r}: AQR before the affine step maps quantiles only")
        if config.passes != 1:
            raise ValueError(f"passes={config.passes}: AQR before the affine step maps each batch in one pass")
        check_named_layers(model, config.layers)
        self.config = config
        self.target = config.target_kind
        self.batch = SharedStream(config, component_router(config, stats)) if self.target.keeps_state else None
        # "raise" is checked at each layer (on a GPU too: the logits of a batch target are not checked);
        # "skip" leaves a non-finite channel unmapped without reading a flag back from a GPU
        self.maps = build_layer_maps(stats, config, logits_checked=config.on_nonfinite == "skip", batch=self.batch)
        if self.batch is not None and self.batch.router is not None:
            self.batch.router.check_layers(list(self.maps))
        modules = dict(model.named_modules())
        for name, layer_map in self.maps.items():
            module = modules[name]
            layer_info(name, module)
            module.forward = PreAffineForward(module, layer_map, self)  # type: ignore[method-assign]
        self._frozen = False
        self.holding = False
        self.small_batch_warned = False  # SmallBatchWarning is shown once per composition
        if self.batch is not None:
            model.register_forward_pre_hook(self._begin)
            model.register_forward_hook(self._commit)
        else:
            model.register_forward_pre_hook(self._warn_small_batch)

    @property
    def layer_names(self) -> list[str]:
        """The layers mapped, in forward execution order."""
        return list(self.maps)

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """Within the block, forward passes map with the running state but do not update it."""
        old, self._frozen = self._frozen, True
        try:
            yield
        finally:
            self._frozen = old

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Within the block, forward passes predict with what the maps hold from the adapted batches and
        leave it as it was: a streaming target maps with its committed running state (staging and
        committing nothing), a per-batch target does not map (it keeps nothing across batches)."""
        old, self.holding, self._frozen = (self.holding, self._frozen), True, True
        try:
            yield
        finally:
            self.holding, self._frozen = old

    def _warn_small_batch(self, _model: nn.Module, args: tuple) -> None:
        """Warn (once) that the per-batch target maps a batch too small for its quantiles; the partner's
        auxiliary passes (frozen: ROID's augmented subsets) and held batches are not the caller's batches."""
        x = args[0] if args else None
        if self.small_batch_warned or self._frozen or not isinstance(x, torch.Tensor) or not x.ndim:
            return
        message = self.target.small_batch_warning(int(x.shape[0]))
        if message is not None:
            self.small_batch_warned = True
            warnings.warn(f"AQR before the affine step: {message}", SmallBatchWarning, stacklevel=2)

    def _begin(self, _model: nn.Module, args: tuple) -> None:
        x = args[0] if args else None
        images = int(x.shape[0]) if isinstance(x, torch.Tensor) and x.ndim else 0
        self.batch.begin(images, held=self.holding)  # type: ignore[union-attr]

    def _commit(self, _model: nn.Module, _args: tuple, out: object) -> None:
        batch = self.batch.current  # type: ignore[union-attr]
        try:
            logits = out.detach() if isinstance(out, torch.Tensor) else None
            finite = batch.finite and (logits is None or bool(torch.isfinite(logits).all()))
            if finite and not self._frozen:
                labels = None
                if self.target.needs_classes:
                    if logits is None or logits.ndim != 2 or logits.shape[0] != batch.images:
                        shape = tuple(logits.shape) if logits is not None else type(out).__name__
                        raise ValueError(f"target={self.target.name!r} needs the model to return logits (N, classes), "
                                         f"got {shape}")
                    labels = logits.argmax(dim=1)
                self.batch.commit(labels)  # type: ignore[union-attr]
            elif not finite and self.config.on_nonfinite == "raise":
                raise NonFiniteActivationError("the logits are NaN or Inf on this batch; the stream's state is "
                                               "unchanged (on_nonfinite='skip' returns them)")
        finally:
            self.batch.end()  # type: ignore[union-attr]

    def running_record(self) -> dict[str, object] | None:
        """The running state of a streaming target with what identifies it (as :meth:`aqr.AQR.state_dict` saves
        it), ``None`` for a per-batch target; tensors are copies."""
        if self.batch is None:
            return None
        return stream_record(self.config, self.maps, self.batch)  # type: ignore[arg-type]

    def load_running_record(self, record: object) -> None:
        """Continue from :meth:`running_record`'s ``record``; ``ValueError`` (nothing changed) for one of another
        target, configuration or statistics."""
        if self.batch is None:
            if record is not None:
                raise ValueError("the saved state holds a running state, which a per-batch target does not keep")
            return
        load_stream_record(record, self.config, self.maps, self.batch)  # type: ignore[arg-type]

    def reset(self) -> None:
        """Every streaming layer back to its state before the first batch (nothing to do for batches)."""
        if self.batch is None:
            return
        for layer_map in self.maps.values():
            layer_map.reset()  # type: ignore[attr-defined]
        self.batch.reset()
