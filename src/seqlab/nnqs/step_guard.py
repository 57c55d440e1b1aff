"""Reject a VMC step that threw the energy far above the best seen: restore the best state, halve the learning rate.

With the exact-sum estimator the energy of every step is exact (no sampling noise), so once the warm-start
transient is over, E rising by more than ``tol`` above the lowest energy seen can only mean the optimizer left the
basin it was descending in. On N2 that happens rarely but for good: one AdamW update at the peak rate (seed 2,
step 586) threw the state from 4.7 to 104 mHa, and the cosine's later, smaller steps never recovered the lost
ground (docs/nnqs.md). Restoring the parameters *and* AdamW's moments of the best step (the moments carry the
blow-up) and going on at half the rate costs one step; every rank decides alike, because the energy is
all-reduced.

The energy of step k is measured at the parameters before update k, so the state worth keeping is the one taken
just before the step that measured the new best: the guard copies it before every step (a few MB, against a step
of a second). Checkpoints hold the best state too, so a resumed run takes the same decisions as an unbroken one.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch

from seqlab.nnqs.ansatz import Wavefunction
from seqlab.nnqs.vmc import HARTREE_TO_MHA


@dataclass
class GuardedState:
    """Parameters and optimizer state at one moment (detached copies)."""
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any]

    @classmethod
    def take(cls, wf: Wavefunction, opt: torch.optim.Optimizer) -> GuardedState:
        return cls({k: v.detach().clone() for k, v in wf.state_dict().items()}, copy.deepcopy(opt.state_dict()))

    def restore(self, wf: Wavefunction, opt: torch.optim.Optimizer) -> None:
        wf.load_state_dict(self.model)
        opt.load_state_dict(copy.deepcopy(self.optimizer))


@dataclass
class StepGuard:
    """Watches the exact energy of each step from ``after`` on; ``tol_mha`` <= 0 (or ``active=False``) disables it."""
    tol_mha: float
    after: int
    active: bool = True
    best_energy: float = float("inf")
    best_step: int | None = None
    best: GuardedState | None = None
    rollbacks: list[int] = field(default_factory=list)
    _before: GuardedState | None = None
    # set by a rollback: the next step measures the best state again. With the exact sum that is the best energy bit
    # for bit; with the selected sum the space has grown since, and the best state's energy over the new space may
    # lie above the old best by more than tol (H2O/6-31G: +2.9 mHa as S grew from 2 900 to 8 900 configurations):
    # compared with the old value it would be rolled back at every step, at an ever smaller rate, for good
    _remeasure: bool = False

    @property
    def enabled(self) -> bool:
        return self.active and self.tol_mha > 0

    def before_step(self, step: int, wf: Wavefunction, opt: torch.optim.Optimizer) -> None:
        if self.enabled and step >= self.after:
            self._before = GuardedState.take(wf, opt)

    def after_step(self, step: int, energy: float, wf: Wavefunction, opt: torch.optim.Optimizer) -> bool:
        """Record step ``step``'s energy; roll back and return True when it lies ``tol`` above the best."""
        if not self.enabled or step < self.after:
            return False
        if self._remeasure:  # this step measured the restored best state: its energy is the reference from now on
            self._remeasure = False
            self.best_energy, self.best_step, self.best = energy, step, self._before
            return False
        if energy < self.best_energy:
            self.best_energy, self.best_step, self.best = energy, step, self._before
            return False
        if self.best is None or (energy - self.best_energy) * HARTREE_TO_MHA <= self.tol_mha:
            return False
        self.best.restore(wf, opt)
        for group in opt.param_groups:  # after the restore, which brought back the best step's groups
            group["lr_scale"] = group.get("lr_scale", 1.0) * 0.5
        self.best.optimizer = copy.deepcopy(opt.state_dict())  # a second rollback keeps the halved rate
        self.rollbacks.append(step)
        self._remeasure = True
        return True

    # --- checkpoints: the best state as two extra tensor groups, the scalars in state.json -----------------------

    def state(self) -> dict[str, Any]:
        return {"best_energy": self.best_energy if self.best is not None else None, "best_step": self.best_step,
                "rollbacks": list(self.rollbacks), "remeasure": self._remeasure}

    def load_state(self, state: dict[str, Any] | None, best: GuardedState | None) -> None:
        if not state:
            return
        self.rollbacks = list(state.get("rollbacks", []))
        self._remeasure = bool(state.get("remeasure", False))
        if best is not None and state.get("best_energy") is not None:
            self.best_energy, self.best_step, self.best = float(state["best_energy"]), state.get("best_step"), best
