"""The step guard: a step that raised the exact energy is undone (best state back, rate halved), resumably."""

from __future__ import annotations

import json

import pytest
import torch

from seqlab.nnqs.ansatz import Wavefunction
from seqlab.nnqs.driver import run_vmc
from seqlab.nnqs.step_guard import StepGuard
from seqlab.nnqs.vmc import VMCConfig

# lr 0.05 without annealing from a random start overshoots; a tolerance of 1e-6 mHa makes every rise a rollback
JUMPY = dict(steps=24, lr=0.05, warmup=0, anneal=0.0, rollback_tol_mha=1e-6, rollback_after=0, checkpoint_every=1)


class _Crash(Exception):
    pass


def test_a_rise_restores_the_best_state_and_halves_the_rate(system, tmp_path):
    res = run_vmc(system("lih").hamiltonian, VMCConfig(**JUMPY), out=tmp_path)
    assert res.estimator == "exact-sum" and res.rollbacks, "lr 0.05 should overshoot at least once"
    energies = [r["energy"] for r in res.records]
    for k in res.rollbacks:
        best = res.records[k]["rolled_back_to"]
        assert energies[best] == min(energies[: k + 1]) < energies[k]
        if k + 1 < len(energies):  # the next step measures the restored parameters: the best energy, bit for bit
            assert energies[k + 1] == energies[best]
    state = json.loads((tmp_path / "checkpoints" / f"step_{JUMPY['steps']:08d}" / "state.json").read_text())
    scales = [g["lr_scale"] for g in state["optimizer"]["param_groups"]]
    assert scales == [0.5 ** len(res.rollbacks), 10.0 * 0.5 ** len(res.rollbacks)]
    assert state["guard"]["rollbacks"] == res.rollbacks


def test_a_resumed_run_takes_the_same_rollbacks(system, tmp_path):
    ham = system("lih").hamiltonian
    full = run_vmc(ham, VMCConfig(**JUMPY), out=tmp_path / "a")
    crash_at = full.rollbacks[0] + 2  # the checkpoint before it holds a best state and one rollback

    def crash(st):
        if st.step == crash_at:
            raise _Crash

    with pytest.raises(_Crash):
        run_vmc(ham, VMCConfig(**JUMPY), out=tmp_path / "b", callback=crash)
    resumed = run_vmc(ham, VMCConfig(**JUMPY), out=tmp_path / "b", resume=True)
    assert [r["energy"] for r in resumed.records] == [r["energy"] for r in full.records]
    assert resumed.rollbacks == full.rollbacks


def test_the_restored_state_measured_higher_on_a_grown_space_becomes_the_reference():
    """The selected sum's space grows between steps, so the best state measured again after a rollback can lie above
    the old best by more than tol: that measurement is the new reference, not a reason to roll back forever."""
    wf = Wavefunction(4, 2, 2)
    opt = torch.optim.AdamW(wf.parameters(), lr=1e-3)
    guard = StepGuard(tol_mha=1.0, after=0)
    ha = 1e-3  # 1 mHa
    for step, energy, rolled_back in ((0, -1.0, False), (1, -1.0 + 5 * ha, True), (2, -1.0 + 3 * ha, False),
                                      (3, -1.0 + 3.5 * ha, False), (4, -1.0 + 4.5 * ha, True)):
        guard.before_step(step, wf, opt)
        assert guard.after_step(step, energy, wf, opt) is rolled_back, step
    assert guard.rollbacks == [1, 4] and guard.best_step == 2 and guard.best_energy == -1.0 + 3 * ha


def test_the_guard_stays_off_for_sampled_or_annealed_runs(system):
    ham = system("lih").hamiltonian
    for extra in ({"estimator": "sampled", "samples": 2000}, {"anneal": 0.07}):
        res = run_vmc(ham, VMCConfig(**{**JUMPY, **extra, "checkpoint_every": 100}))
        assert res.rollbacks == [] and all("rolled_back_to" not in r for r in res.records)


def test_config_refuses_a_negative_tolerance():
    with pytest.raises(ValueError, match="rollback_tol_mha"):
        VMCConfig(rollback_tol_mha=-1.0)
