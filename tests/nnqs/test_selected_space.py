"""The selected space: H among the sampled configurations, built incrementally, and the selected-sum estimator."""

from __future__ import annotations

import copy
import numpy as np
import torch

from seqlab.nnqs.ansatz import AnsatzConfig, Wavefunction
from seqlab.nnqs.driver import run_vmc
from seqlab.nnqs.exact_sum import subspace_sum
from seqlab.nnqs.local_energy import SectorHamiltonian
from seqlab.nnqs.selected_space import SelectedSpace
from seqlab.nnqs.sign_fit import fit_signs, sign_targets
from seqlab.nnqs.space import all_configurations, tokens_to_keys
from seqlab.nnqs.sampler import sample
from seqlab.nnqs.vmc import (VMCConfig, build_selected, make_evaluator, refit_signs_and_sample, step_generators,
                             vmc_step)
from seqlab.nnqs.warm_start import WarmStartConfig, target_state
from seqlab.runtime.dist import DistInfo

TINY = AnsatzConfig(d_model=16, n_layers=1, n_heads=2, phase_hidden=16, phase_layers=1)


def _dense_block(ham, keys: torch.Tensor) -> np.ndarray:
    """H among ``keys``: the block of the whole sector's dense matrix (the independent Slater-Condon path)."""
    sector = tokens_to_keys(all_configurations(ham.n_orb, ham.n_alpha, ham.n_beta))
    at = torch.searchsorted(sector, keys).numpy()
    return ham.dense(sector)[np.ix_(at, at)]


def test_grown_in_pieces_and_pruned_it_equals_the_dense_block(system):
    """Three additions (with repeats and members among them) and one removal give exactly H restricted to S."""
    ham = system("h2o").hamiltonian
    keys = tokens_to_keys(all_configurations(ham.n_orb, ham.n_alpha, ham.n_beta))
    gen = torch.Generator().manual_seed(0)
    pick = keys[torch.randperm(len(keys), generator=gen)[:200]]
    space = SelectedSpace(ham, max_elements=4096)  # several chunks per addition
    assert space.add(pick[:50]) == 50
    assert space.add(torch.cat((pick[30:120], pick[30:40]))) == 70  # 20 members and 10 repeats ignored
    assert space.add(pick[120:]) == 80
    assert torch.equal(space.keys, torch.sort(pick).values)
    dense = _dense_block(ham, space.keys)
    np.testing.assert_allclose(space.hamiltonian().matrix.toarray(), dense, atol=1e-12)
    drop = torch.isin(space.keys, pick[::3])
    assert space.keep(~drop) == int(drop.sum())
    np.testing.assert_allclose(space.hamiltonian().matrix.toarray(), _dense_block(ham, space.keys), atol=1e-12)
    assert torch.equal(space.hamiltonian().tokens, all_configurations(ham.n_orb, ham.n_alpha, ham.n_beta)[
        torch.isin(keys, space.keys)])


def test_expand_adds_and_pins_the_configurations_of_largest_second_order_energy(system):
    """From a third of H2O's sector (STO-3G) and the lowest state on it: the k keys added are the k outside ones of largest
    |<x|H|psi_S>|^2 / |H_xx - E| by the dense matrix, they survive a prune of everything, a checkpoint round trip
    keeps them pinned, and the space's own lowest energy drops."""
    ham = system("h2o").hamiltonian
    sector = tokens_to_keys(all_configurations(ham.n_orb, ham.n_alpha, ham.n_beta))
    space = SelectedSpace(ham, max_elements=4096)  # several chunks
    space.add(sector[::3])
    values, vectors = np.linalg.eigh(_dense_block(ham, space.keys))  # psi: the lowest state on S, as a run nears it
    c = torch.from_numpy(vectors[:, 0])
    log_psi = torch.complex(c.abs().log(), torch.where(c < 0, torch.pi, 0.0).double())
    energy = float(values[0])
    dense = ham.dense(sector)
    inside = torch.isin(sector, space.keys).numpy()
    psi = np.zeros(len(sector), dtype=np.complex128)
    psi[inside] = torch.exp(log_psi).numpy()
    psi /= np.linalg.norm(psi)
    gain = np.abs(dense @ psi) ** 2 / np.abs(np.diag(dense) - energy)
    gain[inside] = -1.0
    floor = space.ground_energy()
    summed = space.keys.clone()
    assert space.expand(summed, log_psi, energy, 20) == 20
    want = space.pinned.clone()
    picked = gain[torch.searchsorted(sector, want).numpy()]  # by gain: spin-flipped partners tie
    np.testing.assert_allclose(np.sort(picked), np.sort(gain)[-20:], rtol=1e-9)
    assert bool(space.contains(want).all()) and len(space) == len(summed) + 20
    np.testing.assert_allclose(space.hamiltonian().matrix.toarray(), _dense_block(ham, space.keys), atol=1e-12)
    assert space.ground_energy() < floor - 1e-6
    space.keep(torch.zeros(len(space), dtype=torch.bool))
    assert torch.equal(space.keys, want)
    again = SelectedSpace(ham)
    again.load_state(space.state())
    again.keep(torch.zeros(len(again), dtype=torch.bool))
    assert torch.equal(again.keys, want) and torch.equal(again.pinned, want)


def test_selected_steps_expand_the_space_every_so_many_steps_up_to_the_cap(system):
    """VMCConfig.selected_expand: k pinned a step (every=1) until selected_expand_max, then none."""
    ham = system("lih").hamiltonian
    torch.manual_seed(6)
    wf = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta, TINY)
    cfg = VMCConfig(steps=3, samples=50, warmup=0, anneal=0.0, estimator="selected-sum", selected_expand=10,
                    selected_expand_every=1, selected_expand_max=15)
    space = build_selected(ham, cfg)
    opt = torch.optim.SGD(wf.parameters(), lr=1e-3)
    pinned = []
    for step in range(3):
        vmc_step(wf, ham, opt, cfg, step, DistInfo(), selected=space)
        pinned.append(len(space.pinned))
    assert pinned == [10, 15, 15] and bool(space.contains(space.pinned).all())


def test_at_most_join_max_new_configurations_join_a_step_the_most_drawn_first(system):
    """VMCConfig.selected_join_max bounds what one step's samples add (a step that leaked psi's weight off S once
    brought in enough configurations to exhaust memory); those that join are the most often drawn, the rest are
    counted, and the outside mass is 1 - sum over S of P."""
    ham = system("lih").hamiltonian
    torch.manual_seed(6)
    wf = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta, TINY)
    free = VMCConfig(steps=1, samples=10**4, warmup=0, anneal=0.0, estimator="selected-sum")
    capped = VMCConfig(steps=1, samples=10**4, warmup=0, anneal=0.0, estimator="selected-sum", selected_join_max=7)
    _, joined, skipped = refit_signs_and_sample(wf, build_selected(ham, free), free, 0, DistInfo())
    assert joined > 7 and skipped == 0
    space = build_selected(ham, capped)
    _, joined, skipped = refit_signs_and_sample(wf, space, capped, 0, DistInfo())
    assert (joined, skipped) == (7, skipped) and joined + skipped > 7 and len(space) == 7
    drawn = sample(wf, capped.samples, step_generators(capped.seed, 0, 0)[0], capped.sampler)
    counts = dict(zip(tokens_to_keys(drawn.tokens).tolist(), drawn.counts.tolist()))
    assert min(counts[k] for k in space.keys.tolist()) >= max(c for k, c in counts.items() if k not in space.keys)
    before = copy.deepcopy(wf)  # the step's stats are psi's before its update
    st = vmc_step(wf, ham, torch.optim.SGD(wf.parameters(), lr=1e-3), capped, 0, DistInfo(), selected=space)
    assert st.n_joined == 7 and st.n_join_skipped > 0 and len(space) == st.n_selected == 14  # nothing pruned
    sector = SectorHamiltonian(ham, progress=False).keys
    outside = sector[~space.contains(sector)]
    assert abs(st.outside_mass - float(torch.exp(2 * make_evaluator(before)(outside).real).sum())) < 1e-7


def test_selected_sum_over_the_whole_sector_is_the_exact_sum(system):
    """With every configuration selected, the selected sum is the exact sum (the same energy and local energies)."""
    ham = system("h2o").hamiltonian
    sector = SectorHamiltonian(ham, progress=False)
    space = SelectedSpace(ham)
    space.add(sector.keys.flip(0))
    torch.manual_seed(2)
    wf = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta)
    log_psi = make_evaluator(wf)(space.keys)
    a = subspace_sum(log_psi, space.hamiltonian(), 1e-6, 10**6)
    b = subspace_sum(log_psi, sector, 1e-6, 10**6)
    assert abs(a.energy - b.energy) < 1e-11 and torch.equal(a.tokens, b.tokens)
    assert (a.eloc - b.eloc).abs().max() < 1e-10


def test_selected_energy_is_the_rayleigh_quotient_of_the_truncated_state(system):
    """Over a part S of the sector: E = psi_S^T H_SS psi_S / |psi_S|^2 (dense), above the sector's lowest energy."""
    ham = system("h2o").hamiltonian
    sector = SectorHamiltonian(ham, progress=False)
    torch.manual_seed(3)
    wf = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta)
    space = SelectedSpace(ham)
    space.add(sector.keys[::2])
    log_psi = make_evaluator(wf)(space.keys)
    ex = subspace_sum(log_psi, space.hamiltonian(), 0.0, 10**6)
    psi = torch.exp(log_psi).numpy()
    h = _dense_block(ham, space.keys)
    rayleigh = (psi.conj() @ h @ psi / (np.abs(psi) ** 2).sum()).real
    assert abs(ex.energy.real - rayleigh) < 1e-10
    assert ex.energy.real > np.linalg.eigvalsh(ham.dense(sector.keys))[0]
    assert abs(float(ex.probabilities.sum()) - 1.0) < 1e-12 and len(ex.probabilities) == len(space)


def test_the_ground_energy_of_the_space_is_its_selected_ci(system):
    """Over half of H2O's sector: the lowest eigenvalue of the dense block, above FCI and below psi's energy on S;
    over the whole sector it is FCI; one or two configurations take the dense route."""
    s = system("h2o")
    ham, sector = s.hamiltonian, SectorHamiltonian(s.hamiltonian, progress=False)
    space = SelectedSpace(ham)
    space.add(sector.keys[::2])
    lowest = np.linalg.eigvalsh(_dense_block(ham, space.keys))[0]
    assert abs(space.ground_energy() - lowest) < 1e-9
    torch.manual_seed(3)
    psi_energy = subspace_sum(make_evaluator(Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta))(space.keys),
                              space.hamiltonian(), 0.0, 10**6).energy.real
    assert s.references.e_fci + 1e-6 < space.ground_energy() < psi_energy
    space.add(sector.keys)
    assert abs(space.ground_energy() - s.references.e_fci) < 1e-9
    few = SelectedSpace(ham)
    few.add(sector.keys[:2])
    assert abs(few.ground_energy() - np.linalg.eigvalsh(_dense_block(ham, few.keys))[0]) < 1e-12


def test_a_selected_step_that_samples_the_whole_sector_is_the_exact_sum_step(system):
    """N_s = 1e12 draws every configuration of LiH's 225 a random start weighs: the selected-sum step then takes
    the exact-sum step (the same energy and the same parameters after it)."""
    ham = system("lih").hamiltonian
    sector = SectorHamiltonian(ham, progress=False)
    steps = {}
    for name in ("exact-sum", "selected-sum"):
        torch.manual_seed(4)
        wf = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta, TINY)
        cfg = VMCConfig(steps=1, samples=10**12, warmup=0, grad_clip=None, anneal=0.0, estimator=name)
        space = build_selected(ham, cfg)
        opt = torch.optim.SGD(wf.parameters(), lr=1e-3)
        st = vmc_step(wf, ham, opt, cfg, 0, DistInfo(), sector=None if space else sector, selected=space)
        steps[name] = st, torch.cat([p.detach().flatten() for p in wf.parameters()])
        if space is not None:
            assert len(space) == len(sector) and st.n_selected == len(sector)
    (a, pa), (b, pb) = steps["exact-sum"], steps["selected-sum"]
    assert abs(a.energy - b.energy) < 1e-10 and a.n_unique == b.n_unique
    assert (pa - pb).abs().max() < 1e-6


def test_auto_takes_the_selected_sum_past_the_sector_fast_path(system):
    """LiH with ``sector_max`` below its 225 configurations: ``auto`` sums over the sampled space; the final
    evaluation samples N_s (not 100 N_s) and reports that space's energy, above FCI; with the fast path disabled (0)
    it samples as before."""
    s = system("lih")
    res = run_vmc(s.hamiltonian, VMCConfig(steps=3, samples=10**4, sector_max=100, eval_exact_max=100, seed=1), TINY)
    assert res.estimator == "selected-sum" and all(r["n_selected"] > 0 for r in res.records)
    assert res.final["selected_energy"] > s.references.e_fci and 0 < res.final["selected_size"] <= 225
    assert s.references.e_fci - 1e-9 < res.final["selected_ci_energy"] <= res.final["selected_energy"]
    assert res.final["final_eval"] == "sampled" and res.final["final_eval_samples"] == 10**4
    assert run_vmc(s.hamiltonian, VMCConfig(steps=1, sector_max=0, seed=1), TINY).estimator == "sampled"


def test_the_space_starts_with_the_warm_start_support(system):
    """After a warm start the first step already sums over the fitted state's configurations, sampled or not."""
    s = system("lih")
    ham = s.hamiltonian
    target = target_state("ccsd", s.mf, ham.n_orb, ham.n_alpha, ham.n_beta)
    res = run_vmc(ham, VMCConfig(steps=1, samples=10, estimator="selected-sum", seed=1), TINY, warm_start=target,
                  warm_start_cfg=WarmStartConfig(steps=5))
    assert len(target.keys) > 10 and res.records[0]["n_selected"] >= len(target.keys)


def test_the_warm_start_support_stays_in_the_space_when_pinned(system):
    """VMCConfig.selected_pin_warm_start: with a prune that keeps only configurations of P >= 0.5 the fitted
    state's support leaves the space after the first step, unless it is pinned."""
    s = system("lih")
    ham = s.hamiltonian
    target = target_state("ccsd", s.mf, ham.n_orb, ham.n_alpha, ham.n_beta)
    sizes = {}
    for pin in (False, True):
        cfg = VMCConfig(steps=2, samples=10, estimator="selected-sum", seed=1, selected_min_prob=0.5,
                        selected_pin_warm_start=pin)
        res = run_vmc(ham, cfg, TINY, warm_start=target, warm_start_cfg=WarmStartConfig(steps=5))
        sizes[pin] = [r["n_selected"] for r in res.records]
    assert sizes[True][1] >= len(target.keys) > 10 > sizes[False][1]


def test_pinned_configurations_survive_the_prune_and_a_checkpoint(system):
    ham = system("lih").hamiltonian
    keys = tokens_to_keys(all_configurations(ham.n_orb, ham.n_alpha, ham.n_beta))
    space = SelectedSpace(ham)
    space.add(keys[:30])
    assert space.pin(keys[20:40]) == 10 and space.n_expanded == 0
    assert space.keep(torch.zeros(len(space), dtype=torch.bool)) == 20
    assert torch.equal(space.keys, keys[20:40]) and torch.equal(space.pinned, keys[20:40])
    again = SelectedSpace(ham)
    again.load_state(space.state())
    assert torch.equal(again.pinned, keys[20:40]) and again.n_expanded == 0


def test_the_ground_state_of_the_space_is_the_dense_blocks_lowest_eigenvector(system):
    ham = system("h2o").hamiltonian
    space = SelectedSpace(ham)
    space.add(SectorHamiltonian(ham, progress=False).keys[::3])
    energy, vector = space.ground_state()
    values, vectors = np.linalg.eigh(_dense_block(ham, space.keys))
    assert abs(energy - values[0]) < 1e-9 and abs(abs(vector @ vectors[:, 0]) - 1) < 1e-8


def _sign_agreement(wf, tokens, coeffs) -> float:
    """The sqrt|c|-weighted share of configurations whose phase (relative to psi's global one) has c's sign."""
    want, weight = sign_targets(wf, tokens, coeffs)
    with torch.no_grad():
        return float((weight * (torch.cos(wf.phase(tokens) - want) > 0)).sum())


def test_the_sign_fit_turns_the_phase_network_towards_the_space_ground_state_and_nothing_else(system):
    """fit_signs moves only the phase MLP, and afterwards psi carries the signs of H's lowest state on S (weighted
    agreement up from under 0.8 at a random start to over 0.9), which lowers psi's energy over S."""
    ham = system("h2o").hamiltonian
    space = SelectedSpace(ham)
    space.add(SectorHamiltonian(ham, progress=False).keys)
    _, coeffs = space.ground_state()
    tokens = space.hamiltonian().tokens
    torch.manual_seed(4)
    wf = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta, TINY)
    decoder = {k: v.clone() for k, v in wf.decoder.state_dict().items()}
    energy = lambda: subspace_sum(make_evaluator(wf)(space.keys), space.hamiltonian(), 0.0, 10**6).energy.real
    before, e_before = _sign_agreement(wf, tokens, coeffs), energy()
    fit_signs(wf, tokens, coeffs, steps=300)
    after, e_after = _sign_agreement(wf, tokens, coeffs), energy()
    assert before < 0.8 < 0.9 < after and e_after < e_before - 1e-3, (before, after, e_before, e_after)
    assert all(torch.equal(v, wf.decoder.state_dict()[k]) for k, v in decoder.items())


def test_selected_steps_fit_the_signs_every_so_many_steps(system):
    """VMCConfig.selected_sign_fit: a fit before the step's sum at steps 0, 2, 4 (every=2), timed apart."""
    ham = system("lih").hamiltonian
    torch.manual_seed(6)
    wf = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta, TINY)
    cfg = VMCConfig(steps=3, samples=50, warmup=0, anneal=0.0, estimator="selected-sum", selected_sign_fit=10,
                    selected_sign_fit_every=2)
    space = build_selected(ham, cfg)
    space.add(tokens_to_keys(all_configurations(ham.n_orb, ham.n_alpha, ham.n_beta))[:5])
    opt = torch.optim.SGD(wf.parameters(), lr=1e-3)
    fitted = [vmc_step(wf, ham, opt, cfg, step, DistInfo(), selected=space).t_sign_fit > 0 for step in range(3)]
    assert fitted == [True, False, True]


def test_a_final_evaluation_past_the_samplers_bound_draws_the_bound(system):
    """`--samples 1e14`: the final evaluation drew 100 x that, past the sampler's 2^53, and the run died after
    training (no result.json) with an error naming `n_samples`. It now draws 2^53."""
    s = system("lih")
    res = run_vmc(s.hamiltonian, VMCConfig(steps=1, estimator="sampled", samples=10**14, eval_exact_max=100,
                                           seed=1), TINY)
    assert res.final["final_eval"] == "sampled" and res.final["final_eval_samples"] == 2**53
    assert abs(res.final["energy"] - res.records[-1]["energy"]) < 0.05
