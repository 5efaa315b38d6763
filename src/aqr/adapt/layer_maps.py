"""The recalibration of one layer: :class:`LayerMap` (AQR's quantile map) and :class:`MomentMap`
(the moment-matching control).

A map is called as the layer's forward hook (:func:`aqr.recalibrating`) or replaces a norm layer's
forward in :class:`aqr.AQR`'s twin, where an eval-mode BatchNorm is folded into it. The per-batch map
reads each batch's own quantiles; the streaming maps (:mod:`aqr.adapt.stream.stream_maps`) extend
:class:`LayerMap` with a running state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from aqr.adapt.config import AQRConfig
from aqr.backends import Affine, LayerBackend, LayerSource, SubsetCache, choose_backend
from aqr.core.layers import NonFiniteActivationError, check_output
from aqr.core.qmap import channel_quantiles, quantile_map
from aqr.core.stats import SourceStats


def host_reads_are_cheap(device: torch.device) -> bool:
    """Whether reading a flag from ``device`` costs nothing (CPU), or stalls a queue of kernels (GPU)."""
    return device.type == "cpu"


# BatchNorm classes whose running statistics and affine parameters sit in ``_buffers``/``_parameters``
# under their own names (a parametrized module is of a class made for it, and is not one of these)
PLAIN_BATCH_NORMS = frozenset({nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm})


def batch_norm_tensors(module: nn.modules.batchnorm._BatchNorm) -> tuple[torch.Tensor, torch.Tensor,
                                                                          torch.Tensor | None, torch.Tensor | None]:
    """``module``'s ``(running_var, running_mean, weight, bias)``, read from its dicts for the stock classes
    (what attribute access returns for them, without ``nn.Module.__getattr__``)."""
    if type(module) in PLAIN_BATCH_NORMS:
        buffers, params = module._buffers, module._parameters
        try:
            return (buffers["running_var"], buffers["running_mean"],  # type: ignore[return-value]
                    params["weight"], params["bias"])
        except KeyError:  # one was deleted: attribute access says what is there
            pass
    return module.running_var, module.running_mean, module.weight, module.bias


class LayerMap:
    """The recalibration of one layer: its source side, and the fast-path backend chosen per device.

    Called as a forward hook, it returns the layer's output recalibrated; :meth:`folded_forward`
    replaces an eval-mode BatchNorm's forward instead (in :class:`AQR`'s twin). One map serves any
    number of threads at once: it keeps no per-batch state, and its per-device caches are filled
    idempotently (a race builds an equal object twice and keeps the first).
    """

    def __init__(self, stats: SourceStats, name: str, config: AQRConfig, tail: str,
                 subsets: SubsetCache | None = None, logits_checked: bool = False) -> None:
        self.info = stats.layers[name].info
        self.tail = tail
        self.on_nonfinite = config.on_nonfinite
        loc, scale = stats.source_moments(name, config.source_moments)
        self.source = LayerSource.create(stats.source_quantiles(name, tail), tail, loc, scale, config.gaussian_p,
                                         config.grid)
        self._sources: dict[torch.device, LayerSource] = {}
        self._backends: dict[torch.device, LayerBackend] = {}
        self.config = config
        self.subsets = subsets or SubsetCache(config.target_samples, config.samples_per_row)
        self.logits_checked = logits_checked  # AQR's forward checks the logits for NaN/Inf
        # the last folded BatchNorm's tensors, eps, versions and addresses, and its affine (_affine_of)
        self._fold_cache: tuple[object, ...] | None = None

    def __getstate__(self) -> dict[str, object]:
        """A copy's state: the caches of backends (which hold ctypes handles and compiled kernels, neither
        of which can be copied) and of folded BatchNorms are left out and rebuilt on use, as is the subset
        cache (history-free; :class:`aqr.AQR` gives its copy's maps one shared cache again). Dicts another
        thread may be filling are copied first."""
        state = self.__dict__.copy()
        state["_backends"], state["_fold_cache"], state["subsets"] = {}, None, None
        for name, value in state.items():
            if isinstance(value, dict):
                state[name] = dict(value)
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._fold_cache = None
        if self.subsets is None:
            self.subsets = SubsetCache(self.config.target_samples, self.config.samples_per_row)

    def source_on(self, device: torch.device) -> LayerSource:
        """The layer's source side on ``device`` (moved once)."""
        source = self._sources.get(device)
        if source is None:
            source = self._sources.setdefault(device, self.source.to(device))
        return source

    def backend(self, device: torch.device) -> LayerBackend:
        """The fast-path backend for ``device``, chosen on first use."""
        backend = self._backends.get(device)
        if backend is None:
            # outside any graph torch.compile traces: choosing builds or loads kernels (file system,
            # ctypes). Wrapped here, not with a decorator: that would import torch._dynamo (and with
            # it triton) whenever aqr is imported
            backend = torch.compiler.disable(self._create_backend)(device)
        return backend

    def _create_backend(self, device: torch.device) -> LayerBackend:
        return self._backends.setdefault(device, choose_backend(
            self.source_on(device), self.subsets, native=self.config.native, triton=self.config.triton,
            compile=self.config.compile))

    def __call__(self, _module: nn.Module, _inputs: object, output: object) -> torch.Tensor:
        """Forward hook: the layer's output, recalibrated."""
        out = check_output(self.info, output)
        if out.numel() == 0:  # an empty batch: nothing to recalibrate
            return out
        if self.config.mode == "fast":
            return self._fast(out)
        source = self.source_on(out.device)
        dim = self.info.channel_dim % out.ndim
        tq = channel_quantiles(out, source.num_quantiles, dim)
        # NaN sorts last and +-Inf sit at the ends, so finite end knots mean finite activations.
        if not bool(torch.isfinite(tq[:, 0]).all() and torch.isfinite(tq[:, -1]).all()):
            return self._nonfinite(out)
        return quantile_map(out, source.knots, tq, self.tail, dim=dim, source_loc=source.loc,
                            source_scale=source.scale, gaussian_p=self.config.gaussian_p)

    def _fast(self, x: torch.Tensor, pre: Affine | None = None,
              unmapped: Callable[[], torch.Tensor] | None = None,
              backend: LayerBackend | None = None) -> torch.Tensor:
        """The fast map of the layer output ``x``; with ``pre``, of ``pre[0] * x + pre[1]`` per
        channel (a folded BatchNorm, whose own output ``unmapped()`` computes). ``backend``: the
        device's, where a caller has it."""
        backend = self.backend(x.device) if backend is None else backend
        y, finite = backend.recalibrate_output(x, self.info.channel_dim, pre)
        if self.logits_checked and not host_reads_are_cheap(x.device):
            # Reading ``finite`` would stall the GPU at every layer. A non-finite value makes its
            # channel's map NaN, which reaches the logits, and AQR.forward checks those once.
            # ("skip" is never folded here: it needs the unmapped output, see folded_forward.)
            if self.on_nonfinite != "skip":
                return y
            return torch.where(finite, y, x) if isinstance(finite, torch.Tensor) else (y if finite else x)
        if bool(finite):
            return y
        return self._nonfinite(x if unmapped is None else unmapped())

    def foldable(self, module: nn.Module) -> bool:
        """Whether this layer is a BatchNorm with running statistics that aqr's kernels (C on CPU,
        Triton on a GPU) can absorb into the map."""
        if not (self.config.mode == "fast" and (self.config.native or self.config.triton)
                and isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats):
            return False
        var, mean, _, _ = batch_norm_tensors(module)
        return var is not None and mean is not None

    def layer_forward(self, module: nn.Module, forward: Callable[[torch.Tensor], torch.Tensor],
                      x: torch.Tensor) -> torch.Tensor:
        """The recalibrated output of the norm layer ``module`` (whose own ``forward`` is ``forward``) on
        ``x``: folded into the map where :meth:`foldable`, else the layer's output mapped as a hook maps it."""
        if self.foldable(module):
            return self._folded(module, forward, x)
        return self(module, (x,), forward(x))

    def folded_forward(self, module: nn.modules.batchnorm._BatchNorm,
                       forward: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        """A replacement ``forward`` for an eval-mode BatchNorm: the map reads the BN's input and
        applies its affine step itself, which saves the BN's pass over the activations.

        Anything the backend cannot fold (training mode, GPU, float64, autograd, no C kernels) runs
        the BN's own ``forward`` and the hook's map instead.
        """
        return lambda x: self._folded(module, forward, x)

    def _folded(self, module: nn.modules.batchnorm._BatchNorm, forward: Callable[[torch.Tensor], torch.Tensor],
                x: torch.Tensor) -> torch.Tensor:
        """:meth:`folded_forward`'s call on ``x``."""
        if module.training or x.ndim < 2 or x.shape[1] != self.info.channels or x.numel() == 0:
            return self(module, (x,), forward(x))
        device = x.device
        backend = self.backend(device)
        if (not backend.folds(x)
                # on a GPU "skip" would need the unmapped output too (no host read of `finite`)
                or (self.on_nonfinite == "skip" and not host_reads_are_cheap(device))):
            return self(module, (x,), forward(x))
        return self._fast(x, self._folded_affine(module), lambda: forward(x), backend)

    def _folded_affine(self, module: nn.modules.batchnorm._BatchNorm) -> Affine:
        """The eval-mode BatchNorm as ``(scale, shift)`` per channel, as ATen's eval batch_norm computes it."""
        return self._affine_of(module, *batch_norm_tensors(module))

    def _affine_of(self, module: nn.modules.batchnorm._BatchNorm, var: torch.Tensor, mean: torch.Tensor,
                   weight: torch.Tensor | None, bias: torch.Tensor | None) -> Affine:
        """:meth:`_folded_affine` of ``module`` from its tensors (:func:`batch_norm_tensors`).

        Kept until one of them changes (replaced by another tensor, updated in place: its version
        moves, or given new memory through ``.data``), so a forward pass does not recompute it in a
        handful of small ops per layer. The cache holds the tensors it was computed from, so a
        replaced tensor's memory and identity cannot be taken over by a new one while it is compared.
        """
        eps = module.eps
        marks = (var._version, var.data_ptr(), mean._version, mean.data_ptr(),
                 None if weight is None else (weight._version, weight.data_ptr()),
                 None if bias is None else (bias._version, bias.data_ptr()))
        cached = self._fold_cache
        if (cached is not None and cached[0] is var and cached[1] is mean and cached[2] is weight
                and cached[3] is bias and cached[4] == eps and cached[5] == marks):
            return cached[6]
        alpha = 1.0 / torch.sqrt(var.float() + eps)
        if weight is not None:
            alpha = alpha * weight.float()
        beta = -mean.float() * alpha
        if bias is not None:
            beta = bias.float() + beta
        affine = (alpha.contiguous(), beta.contiguous())
        self._fold_cache = (var, mean, weight, bias, eps, marks, affine)  # one assignment: a racing thread sees either
        return affine

    def _nonfinite(self, out: torch.Tensor) -> torch.Tensor:
        if self.on_nonfinite == "skip":
            return out
        raise NonFiniteActivationError(
            f"layer {self.info.name!r} produced NaN or Inf activations on this batch; AQR cannot "
            "recalibrate them (pass on_nonfinite='skip' to leave such layers untouched)"
        )


class MomentMap(LayerMap):
    """The moment-matching control on one layer: each channel mapped affinely from the batch's mean
    and std onto the source's measured mean and std (``LayerStats.mean``/``std``, the same statistics
    file as AQR). AQR's layer selection, hooks and non-finite policy; no quantiles, no folding.

    ``y = m_src + (x - m_batch) * s_src / s_batch`` per channel, with the batch moments over every
    value of the channel (population std) in float32; a constant channel maps to ``m_src``.
    """

    def __init__(self, stats: SourceStats, name: str, config: AQRConfig, tail: str,
                 subsets: SubsetCache | None = None, logits_checked: bool = False) -> None:
        super().__init__(stats, name, config, tail, subsets, logits_checked)
        layer = stats.layers[name]
        self.target_moments = (layer.mean.float(), layer.std.float())
        self._moments_on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def foldable(self, module: nn.Module) -> bool:
        return False

    def __call__(self, _module: nn.Module, _inputs: object, output: object) -> torch.Tensor:
        """Forward hook: the layer's output with each channel's mean and std moved onto the source's."""
        out = check_output(self.info, output)
        if out.numel() == 0:  # an empty batch: nothing to map
            return out
        dim = self.info.channel_dim % out.ndim
        shape = [1] * out.ndim
        shape[dim] = out.shape[dim]
        reduce = [d for d in range(out.ndim) if d != dim]
        x = out.float()
        var, mean = torch.var_mean(x, dim=reduce, keepdim=True, correction=0)
        if not bool(torch.isfinite(mean).all() and torch.isfinite(var).all()):
            return self._nonfinite(out)
        src_mean, src_std = self.moments_on(out.device)
        std = var.sqrt()
        gain = torch.where(std > 0, src_std.reshape(shape) / std, torch.zeros_like(std))
        return torch.addcmul(src_mean.reshape(shape), x - mean, gain).to(out.dtype)

    def moments_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The source mean and std on ``device`` (moved once)."""
        moments = self._moments_on.get(device)
        if moments is None:  # a race moves them twice and keeps the first (as LayerMap.source_on)
            moments = self._moments_on.setdefault(device, tuple(t.to(device) for t in self.target_moments))  # type: ignore[arg-type]
        return moments


MAP_CLASSES: dict[str, type[LayerMap]] = {"quantiles": LayerMap, "moments": MomentMap}
