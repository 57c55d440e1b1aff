"""The final energy of a trained wavefunction: an exact sum over a small space, else a large independent sample."""

from __future__ import annotations

import math

import torch

from seqlab.nnqs.ansatz import Wavefunction
from seqlab.nnqs.hamiltonian import Hamiltonian
from seqlab.nnqs.exact_sum import subspace_sum
from seqlab.nnqs.local_energy import PsiTable, local_energy
from seqlab.nnqs.sampler import sample
from seqlab.nnqs.selected_space import SelectedSpace
from seqlab.nnqs.space import all_configurations, n_configurations, tokens_to_keys
from seqlab.nnqs.vmc import VMCConfig, make_evaluator, samples_at, step_generators
from seqlab.runtime.dist import DistInfo, all_reduce_sum


@torch.no_grad()
def evaluate_energy(wf: Wavefunction, ham: Hamiltonian, cfg: VMCConfig, dist: DistInfo, seed: int = 12345,
                    selected: SelectedSpace | None = None) -> dict:
    """Final energy: exact sum over the whole space when it is small, else a large sample (exact local energies).

    Deliberately on the per-sample enumeration path, not the sector fast path used in training: the reported
    energy is then an independent check of it (and the one-off cost is small). After a selected-sum run
    (``selected``: its space) the sample is N_s of the last step, not 100x: each unique sample costs an exact local
    energy over its ~10^3 connected configurations; ``selected_energy`` is the exact energy of psi restricted to the
    space of the last step (variational; what the training minimised), and ``selected_ci_energy`` the lowest energy
    of any state on that space.
    """
    n_conf = n_configurations(ham.n_orb, ham.n_alpha, ham.n_beta)
    evaluate = make_evaluator(wf)
    extra = {}
    if selected is not None:  # the space of the last step (the same on every rank)
        ex = subspace_sum(evaluate(selected.keys), selected.hamiltonian(), 0.0, 1)
        extra = {"selected_energy": ex.energy.real, "selected_size": len(selected),
                 "selected_ci_energy": selected.ground_energy()}
    if n_conf <= cfg.eval_exact_max:
        tokens = all_configurations(ham.n_orb, ham.n_alpha, ham.n_beta)
        keys = tokens_to_keys(tokens)
        log_psi = wf.log_psi(tokens)
        table = PsiTable(keys, log_psi)
        mine = torch.arange(dist.rank, len(keys), dist.world_size)
        p = torch.exp(2 * log_psi.real[mine])
        eloc = local_energy(ham, keys[mine], log_psi[mine], table, evaluate, "exact")
        sums = torch.stack(((p * eloc.real).sum(), (p * eloc.abs() ** 2).sum(), p.sum()))
        all_reduce_sum(sums, dist)
        e, e2, psum = (float(v) for v in sums)
        e, e2 = e / psum, e2 / psum  # psum == 1 up to float32 round-off of log P; normalising removes it
        return {"energy": e, "energy_std": 0.0, "variance": max(e2 - e * e, 0.0), "final_eval": "exact",
                "final_eval_samples": None, "n_configurations": n_conf, "prob_sum": psum} | extra
    # 100x the last step's samples, within the sampler's 2^53 (counts are exact integers in a float64 below it)
    n_s = cfg.eval_samples or min((1 if selected is not None else 100) * samples_at(cfg, cfg.steps - 1), 2**53)
    shared, local = step_generators(seed, 0, dist.rank)
    s = sample(wf, n_s, shared, cfg.sampler, dist.rank, dist.world_size, local)
    keys = tokens_to_keys(s.tokens)
    log_psi = wf.log_psi(s.tokens)
    eloc = (local_energy(ham, keys, log_psi, PsiTable(keys, log_psi), evaluate, "exact") if len(keys)
            else torch.zeros(0, dtype=torch.complex128))
    w = s.counts.double() / n_s
    sums = torch.stack(((w * eloc.real).sum(), (w * eloc.abs() ** 2).sum()))
    all_reduce_sum(sums, dist)
    e, e2 = (float(v) for v in sums)
    var = max(e2 - e * e, 0.0)
    return {"energy": e, "energy_std": math.sqrt(var / n_s), "variance": var, "final_eval": "sampled",
            "final_eval_samples": n_s, "n_configurations": n_conf, "prob_sum": None} | extra
