"""The step guard: a step that raised the exact energy is undone (best state back, rate halved), resumably."""

from __future__ import annotations

import json

import pytest

from seqlab.nnqs.driver import run_vmc
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


def test_the_guard_stays_off_for_sampled_or_annealed_runs(system):
    ham = system("lih").hamiltonian
    for extra in ({"estimator": "sampled", "samples": 2000}, {"anneal": 0.07}):
        res = run_vmc(ham, VMCConfig(**{**JUMPY, **extra, "checkpoint_every": 100}))
        assert res.rollbacks == [] and all("rolled_back_to" not in r for r in res.records)


def test_config_refuses_a_negative_tolerance():
    with pytest.raises(ValueError, match="rollback_tol_mha"):
        VMCConfig(rollback_tol_mha=-1.0)
