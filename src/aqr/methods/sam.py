"""Sharpness-aware minimization (Foret et al., ICLR 2021) around any base optimizer.

Used by SAR. One SAM update is: gradients at ``w`` -> :meth:`SAM.perturb` moves to
``w + rho * g / ||g||`` -> gradients there -> :meth:`SAM.unperturb_and_step` moves back to ``w``
and lets the base optimizer step with the gradients taken at the perturbed point.
"""

from __future__ import annotations

from typing import Any

import torch


class SAM:
    """SAM over the parameters of ``base`` (all its param groups), radius ``rho`` (L2, non-adaptive).

    Its state is the base optimizer's state; the perturbation lives only between the two calls.
    """

    def __init__(self, base: torch.optim.Optimizer, rho: float = 0.05) -> None:
        if rho < 0:
            raise ValueError(f"rho must be non-negative, got {rho}")
        self.base = base
        self.rho = rho
        self._origin: dict[torch.Tensor, torch.Tensor] = {}

    def _params_with_grad(self) -> list[torch.Tensor]:
        return [p for group in self.base.param_groups for p in group["params"] if p.grad is not None]

    @torch.no_grad()
    def perturb(self) -> None:
        """Move every parameter that has a gradient to ``p + rho * grad / (||grad||_2 + 1e-12)``,
        the norm taken over all of them together, and clear the gradients."""
        params = self._params_with_grad()
        if params:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
            scale = self.rho / (norm + 1e-12)
            for p in params:
                self._origin[p] = p.detach().clone()
                p.add_(p.grad * scale.to(p))
        self.zero_grad()

    @torch.no_grad()
    def unperturb_and_step(self) -> None:
        """Restore the parameters saved by :meth:`perturb` exactly, then step the base optimizer
        with the current gradients (taken at the perturbed point) and clear them."""
        for p, origin in self._origin.items():
            p.copy_(origin)
        self._origin.clear()
        self.base.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        self.base.zero_grad(set_to_none=True)

    def state_dict(self) -> dict[str, Any]:
        return self.base.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._origin.clear()
        self.base.load_state_dict(state)
