"""L-BFGS steps on a summed energy: the last ``VMCConfig.lbfgs_steps`` steps of an exact- or selected-sum run (all of
them in the selected sum's recipe).

Why: the summed estimators give the energy and its gradient with no sampling noise, a smooth deterministic function
of the parameters over a fixed space, which is what quasi-Newton methods are built for. AdamW's per-parameter scaling
does not see the curvature of a state fitted close to its target: from the final state of the H2O/6-31G selected-sum
run (docs/nnqs.md, run 5), where AdamW's last 500 steps gained 0.09 mHa, L-BFGS with a strong-Wolfe line search
descended at every evaluation, 0.13 mHa in its first 100 at the cost of an AdamW step each; from the fitted state
it matched AdamW's 1 500 steps in 51 steps of 20 iterations and 21 % less time. It is the natural-gradient
direction's curvature bought cheaply: no Jacobian, a history of gradient differences.

A step here samples into the selected space (as ``vmc_step`` does), refits the signs when the sign fit is due, then
takes ``lbfgs_iters`` L-BFGS iterations on the space as it stands, and prunes and expands the space from the
evaluation at the parameters the iterations end on (not the last one made, which can be a rejected trial point).
The history carries over between steps (the space gains a few improbable configurations per step, which barely
moves the objective) and is dropped when anything else moved the parameters or the objective: a sign fit, an
expansion, a step-guard rollback. It is checkpointed (``lbfgs_state``): a resume that started from an empty history
took other line searches than the unbroken run, so another last evaluation, another pruned space and final energy.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from seqlab.nnqs.ansatz import Wavefunction
from seqlab.nnqs.exact_sum import ExactSum, exact_sum, subspace_sum
from seqlab.nnqs.local_energy import SectorHamiltonian
from seqlab.nnqs.selected_space import SelectedSpace
from seqlab.nnqs.vmc import (StepStats, VMCConfig, backward_surrogate, make_evaluator, outside_mass, prune_and_expand,
                             reduce_gradients, refit_signs_and_sample)
from seqlab.runtime.dist import DistInfo


def build_lbfgs(wf: Wavefunction, cfg: VMCConfig) -> torch.optim.LBFGS:
    """The L-BFGS optimiser for ``lbfgs_step``: unit step length scaled by a strong-Wolfe line search; no tolerance
    stops it early (the run's step count does)."""
    return torch.optim.LBFGS(wf.parameters(), lr=1.0, max_iter=cfg.lbfgs_iters, history_size=cfg.lbfgs_history,
                             tolerance_grad=0.0, tolerance_change=0.0, line_search_fn="strong_wolfe")


def reset_history(opt: torch.optim.LBFGS) -> None:
    """Forget the curvature pairs: the parameters or the objective changed outside the optimiser."""
    opt.state.clear()


def lbfgs_state(opt: torch.optim.LBFGS) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The optimiser's history as (tensors, JSON-able rest) for a checkpoint: a tensor slot under its name, a list
    slot (the curvature pairs) as ``<slot>.<i>`` with its length, numbers as they are (JSON keeps a float exactly)."""
    tensors: dict[str, Tensor] = {}
    meta: dict[str, Any] = {"numbers": {}, "lists": {}}
    for slot, value in opt.state[opt.param_groups[0]["params"][0]].items():
        if isinstance(value, Tensor):
            tensors[slot] = value.detach().clone()
        elif isinstance(value, list):
            meta["lists"][slot] = [isinstance(v, Tensor) for v in value]  # the scratch ``al`` starts as Nones
            tensors.update({f"{slot}.{i}": v.detach().clone() for i, v in enumerate(value) if isinstance(v, Tensor)})
        else:
            meta["numbers"][slot] = value
    return tensors, meta


def load_lbfgs_state(opt: torch.optim.LBFGS, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    """Restore what ``lbfgs_state`` returned, so the next iteration continues the unbroken run's."""
    lists = meta.get("lists", {})
    state: dict[str, Any] = dict(meta.get("numbers", {}))
    state.update({name: t.clone() for name, t in tensors.items() if "." not in name})
    for slot, present in lists.items():
        state[slot] = [tensors[f"{slot}.{i}"].clone() if there else None for i, there in enumerate(present)]
    opt.state.clear()
    if state:
        opt.state[opt.param_groups[0]["params"][0]] = state


def _flat(wf: Wavefunction) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in wf.parameters()])


def lbfgs_step(wf: Wavefunction, opt: torch.optim.LBFGS, cfg: VMCConfig, step: int, dist: DistInfo,
               sector: SectorHamiltonian | None = None, selected: SelectedSpace | None = None) -> StepStats:
    """One run step of ``cfg.lbfgs_iters`` L-BFGS iterations on the exact sum (``sector``) or the selected sum
    (``selected``); the stats are those of the step's first evaluation, before any update, as in ``vmc_step``."""
    if (sector is None) == (selected is None):
        raise ValueError("lbfgs_step: needs exactly one of sector (exact sum) and selected (selected sum)")
    t_0 = time.perf_counter()
    t_sign_fit, joined, skipped = 0.0, 0, 0
    if selected is not None:
        t_sign_fit, joined, skipped = refit_signs_and_sample(wf, selected, cfg, step, dist)
        if t_sign_fit:
            reset_history(opt)
    t1 = time.perf_counter()
    summed = selected.keys if selected is not None else None  # the space stays as it is until the iterations end
    # each evaluation with the parameters it saw (selected sum only: what the space is pruned from, below)
    evaluations: list[tuple[ExactSum, torch.Tensor | None, torch.Tensor | None]] = []
    t_backward = [0.0]

    def summed_energy() -> tuple[ExactSum, torch.Tensor | None]:
        with torch.no_grad():
            if selected is not None:
                log_psi = make_evaluator(wf)(summed)
                return subspace_sum(log_psi, selected.hamiltonian(), cfg.exact_tail, cfg.exact_max_configs, dist.rank,
                                    dist.world_size), log_psi
            return exact_sum(wf, sector, cfg.exact_tail, cfg.exact_max_configs, dist.rank, dist.world_size), None

    def closure() -> torch.Tensor:
        ex, log_psi = summed_energy()
        evaluations.append((ex, log_psi, _flat(wf) if selected is not None else None))
        t_grad = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if len(ex.tokens):
            logp, phase = wf(ex.tokens)
            de = ex.eloc - ex.energy
            backward_surrogate(wf, ex.tokens, logp, phase, ex.weights * de.real, ex.weights * 2 * de.imag,
                               cfg.grad_chunk)
        reduce_gradients(wf, dist)  # every rank holds the same energy and gradient: the same L-BFGS steps
        t_backward[0] += time.perf_counter() - t_grad
        return torch.tensor(ex.energy.real)

    opt.step(closure)
    first = evaluations[0][0]
    if selected is not None:
        # the space is pruned from the parameters the step ends at: the last evaluation can be a trial point the
        # line search rejected (its zoom ends on the better end of the bracket), so find the accepted one
        end = _flat(wf)
        last, last_log_psi = next(((ex, log_psi) for ex, log_psi, at in reversed(evaluations) if torch.equal(at, end)),
                                  (None, None))
        if last is None:  # not seen among the evaluations (never observed): evaluate it
            last, last_log_psi = summed_energy()
        if prune_and_expand(selected, cfg, step, summed, last_log_psi, last):
            reset_history(opt)
    t2 = time.perf_counter()
    energy = first.energy  # t_local_energy: the evaluations' sums (and pruning); t_backward: their gradients
    n_selected = len(first.probabilities) if selected is not None else 0
    outside = outside_mass(evaluations[0][1]) if selected is not None else 0.0
    return StepStats(step, energy.real, energy.imag, 0.0, first.variance, first.n_kept, 1.0, t1 - t_0 - t_sign_fit,
                     t2 - t1 - t_backward[0], t_backward[0], 0.0, first.tail_mass, n_selected, t_sign_fit, joined,
                     skipped, outside, len(evaluations))
