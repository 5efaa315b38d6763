"""Set-up shared by ETA/EATA, ROID and DeYO: what they train, their optimizer and option sets, and how
images with non-finite values are kept out of adaptation.

All three follow the test-time-adaptation benchmark code (github.com/mariodoebler/test-time-adaptation):

* the private copy stays in eval mode (no dropout or stochastic depth) and every BatchNorm layer
  normalizes with the statistics of the current batch, in any mode, without running statistics;
* the affine weight and bias of every BatchNorm/GroupNorm/LayerNorm layer are trained (DeYO skips
  the top layers, see :mod:`aqr.methods.deyo`), everything else is frozen;
* the optimizer is the reference's ``OPTIM`` section (:class:`aqr.methods.options.OptimizerConfig`):
  Adam (``betas=(beta, 0.999)``) or SGD (``momentum``, dampening 0, Nesterov); neither scales the
  learning rate with the batch size.

``defaults=`` picks the option set that fills the options a caller does not give: ``"cifar10"`` (the
reference's ``cfgs/cifar10_c``: Adam, lr 1e-3) or ``"imagenet"`` (``cfgs/imagenet_c``: SGD with
Nesterov momentum 0.9, lr 2.5e-4), :data:`aqr.methods.options.OPTIMIZER_DEFAULTS`; each method adds its
own values.

Non-finite input: an image with a NaN or Inf pixel goes through the model apart from the others
(so, through batch statistics, it cannot turn their logits into NaN) and never enters a loss, a
filter, a weight or a moving average; a step whose loss is not finite is skipped, so the weights
stay finite.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .base import NotApplicable, TTAMethod
from .norm_layers import norm_affine_parameters
from .tent import configure_for_entropy_minimization

def finite_images(x: torch.Tensor) -> torch.Tensor:
    """Boolean mask over the batch: the samples of ``x`` all of whose values are finite."""
    return torch.isfinite(x.reshape(len(x), -1)).all(1)


class NormTrainingMethod(TTAMethod):
    """Base of ETA/EATA, ROID and DeYO: trains the norm layers' affine parameters (see the module docs).

    Subclasses declare their option sets with their registration (``@method(..., defaults=...)``) and
    implement :meth:`loss`; optional hooks: :meth:`frozen_modules`, :meth:`setup`,
    :meth:`after_step` and :meth:`postprocess`.
    """

    carried = ("skipped_steps",)

    # ---- hooks ------------------------------------------------------------------------
    def frozen_modules(self, model: nn.Module) -> frozenset[str]:
        """Names of modules whose norm layers are not trained (none by default)."""
        return frozenset()

    def setup(self, model: nn.Module) -> None:
        """Method-specific state, once the copy is configured and its trained parameters chosen."""

    def loss(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor | None:
        """The loss of one step on finite images ``x`` with logits ``logits``; ``None``: no update."""
        raise NotImplementedError

    def after_step(self) -> None:
        """Runs after every optimizer step (ROID's weight ensembling)."""

    def postprocess(self, logits: torch.Tensor) -> torch.Tensor:
        """The scored logits from the model's logits of a batch of finite images (ROID's prior correction)."""
        return logits

    def batch_statistics(self) -> bool:
        """Whether BatchNorm normalizes with each batch's statistics (the default) rather than its running ones."""
        return True

    # ---- TTAMethod --------------------------------------------------------------------
    def configure_model(self, model: nn.Module) -> nn.Module:
        model = configure_for_entropy_minimization(model, self.batch_statistics())
        trained = norm_affine_parameters(model, skip=self.frozen_modules(model))
        if not trained:
            raise NotApplicable(f"{self.name} needs trainable BatchNorm/GroupNorm/LayerNorm affine parameters")
        self.param_names = [name for name, _ in trained]
        self.trained = [p for _, p in trained]
        for p in self.trained:
            p.requires_grad_(True)
        self.skipped_steps = 0  # diagnostics: steps skipped because nothing was selected or the loss was not finite
        self.setup(model)
        return model

    def build_optimizer(self) -> torch.optim.Optimizer:
        return self.config.build(self.trained)

    def adapt(self, x: torch.Tensor) -> torch.Tensor:
        return self._split(x, self._adapt_finite)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self._split(x, lambda good: self.postprocess(self.model(good)))

    def predict_held(self, x: torch.Tensor) -> torch.Tensor:
        """The current weights, BatchNorm on the batch's statistics; no :meth:`postprocess` (ROID's prior
        correction is computed from each batch alone and carries nothing over)."""
        return self._split(x, self.model)

    # ---- internals --------------------------------------------------------------------
    def _adapt_finite(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        loss = self.loss(x, logits)
        self.optimizer.zero_grad(set_to_none=True)
        if loss is None or not bool(torch.isfinite(loss)):
            self.skipped_steps += 1
        else:
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.after_step()
        with torch.no_grad():
            return self.postprocess(logits.detach())

    def _split(self, x: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``run`` on the finite images of ``x``; the others go through the model on their own."""
        good = finite_images(x)
        if bool(good.all()):
            return run(x)
        parts = {}
        if bool(good.any()):
            parts[True] = run(x[good])
        with torch.no_grad():
            parts[False] = self.model(x[~good])
        first = next(iter(parts.values()))
        logits = first.new_empty((len(x), *first.shape[1:]))
        for key, value in parts.items():
            logits[good if key else ~good] = value.detach().to(logits.dtype)
        return logits
