"""VMC end to end: chemical accuracy on H2 and LiH, files and resume, the CLI contract, and torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import asdict

import pytest
import torch

from seqlab.cli import nnqs as cli_nnqs
from seqlab.nnqs.molecules import BOHR_IN_ANGSTROM
from seqlab.nnqs.driver import run_vmc
from seqlab.nnqs.ansatz import AnsatzConfig, Wavefunction
from seqlab.nnqs.vmc import VMCConfig, lr_at, vmc_step
from seqlab.nnqs.warm_start import target_state
from seqlab.runtime.dist import DistInfo
from seqlab.runtime.errors import CheckpointError

CHEMICAL_ACCURACY_MHA = 1.6


def _cli(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser()
    cli_nnqs.register(parser.add_subparsers(dest="command"))
    return cli_nnqs.run(parser.parse_args(["nnqs", *argv]))


def test_vmc_h2_reaches_chemical_accuracy_and_writes_result(tmp_path, capsys):
    assert _cli(["--molecule", "h2", "--steps", "100", "--out", str(tmp_path), "--quiet", "--seed", "0"]) == 0
    r = json.loads((tmp_path / "result.json").read_text())
    for key in ("molecule", "n_spin_orbitals", "n_electrons", "energy", "energy_std", "e_hf", "e_ccsd", "e_ccsd_t",
                "e_fci", "error_mha", "steps", "wall_time_s"):
        assert key in r, key
    assert (r["molecule"], r["n_spin_orbitals"], r["n_electrons"], r["steps"]) == ("h2", 4, 2, 100)
    assert r["final_eval"] == "exact" and r["energy_std"] == 0.0
    # the defaults: a CCSD warm start (exact for two electrons) and the exact sum over the sector
    assert r["estimator"] == "exact-sum" and r["warm_start"]["method"] == "ccsd+pt" and r["anneal"] == 0.0
    assert (r["lr"], r["beta2"], r["phase_lr_scale"]) == (2e-3, 0.999, 10.0)
    assert (r["rollback_tol_mha"], r["rollback_after"], r["checkpoint_every"]) == (10.0, 200, 100)
    assert abs(r["error_mha"]) < CHEMICAL_ACCURACY_MHA
    assert r["energy"] >= r["e_fci"] - 1e-9  # an exact expectation value is variational
    lines = (tmp_path / "energies.jsonl").read_text().splitlines()
    assert len(lines) == 100 and json.loads(lines[-1])["step"] == 99
    assert (tmp_path / "convergence.png").stat().st_size > 1000
    assert (tmp_path / "error.png").stat().st_size > 1000
    assert (tmp_path / "checkpoints" / "step_00000100" / "model.safetensors").exists()
    assert (tmp_path / "checkpoints" / "step_00000100" / "optimizer.safetensors").exists()
    assert r["e_ccsd_t_error_mha"] == pytest.approx((r["e_ccsd_t"] - r["e_fci"]) * 1000, abs=1e-9)
    table = capsys.readouterr().out
    for name in ("HF", "CCSD", "CCSD(T)", "FCI", "NNQS", "wall time"):
        assert name in table


def steps_of(out) -> list[dict]:
    return [json.loads(line) for line in (out / "energies.jsonl").read_text().splitlines()]


def test_cli_takes_the_selected_sum_recipe_where_the_steps_take_the_selected_sum(tmp_path, monkeypatch):
    """--estimator selected-sum (what auto takes past the sector fast path) brings its own defaults: the recipe that
    keeps the fitted state, its run length and the larger fit; explicit flags still win; result.json has the
    space's own lowest energy between FCI and psi's."""
    argv = ["--molecule", "lih", "--estimator", "selected-sum", "--samples", "1000", "--warm-start-steps", "20",
            "--quiet", "--no-cc", "--seed", "0"]
    kept = []  # the run keeps freed pages for the next step (runtime.memory)
    monkeypatch.setattr(cli_nnqs, "keep_freed_blocks", lambda: kept.append(True) or True)
    assert _cli([*argv, "--steps", "2", "--out", str(tmp_path / "a")]) == 0 and kept
    r = json.loads((tmp_path / "a" / "result.json").read_text())
    assert r["estimator"] == "selected-sum"
    assert (r["lr"], r["phase_lr_scale"], r["rollback_tol_mha"], r["rollback_after"]) == (1e-3, 1.0, 2.0, 0)
    assert r["selected_expand"] == 0 and r["e_fci"] - 1e-9 < r["selected_ci_energy"] <= r["selected_energy"]
    # its steps are L-BFGS iterations, all of them, with the sign fit
    assert (r["selected_sign_fit"], r["lbfgs_steps"], r["lbfgs_iters"]) == (3000, 2, 20)
    assert r["checkpoint_every"] == 5  # a step costs ~35 s on H2O/6-31G
    rows = steps_of(tmp_path / "a")  # with what the space cannot see, and what joined it
    assert all(0 <= row["outside_mass"] < 1 and row["n_join_skipped"] == 0 for row in rows) and rows[0]["n_joined"] > 0
    assert all(0.05 < row["resident_gib"] < 64 and row["heap_trimmed"] in (False, True) for row in rows)  # resident memory
    assert _cli([*argv, "--steps", "2", "--checkpoint-every", "1", "--lr", "5e-4", "--rollback-after", "7",
                 "--selected-expand", "30", "--selected-sign-fit", "25", "--lbfgs-steps", "0", "--out", str(tmp_path / "b")]) == 0
    r = json.loads((tmp_path / "b" / "result.json").read_text())
    assert (r["lr"], r["rollback_after"], r["selected_expand"], r["selected_sign_fit"]) == (5e-4, 7, 30, 25)
    assert r["checkpoint_every"] == 1 and (tmp_path / "b" / "checkpoints" / "step_00000001").is_dir()
    assert r["lbfgs_steps"] == 0 and [row["lr"] for row in steps_of(tmp_path / "b")] != [1.0, 1.0]
    steps = steps_of(tmp_path / "b")
    assert steps[0]["t_sign_fit"] > 0 and steps[1]["t_sign_fit"] == 0  # every 50 steps, from step 0
    with pytest.raises(ValueError, match="--selected-expand must be >= 0"):
        _cli([*argv, "--selected-expand", "-1", "--out", str(tmp_path / "c")])
    with pytest.raises(ValueError, match="--selected-sign-fit must be >= 0"):
        _cli([*argv, "--selected-sign-fit", "-1", "--out", str(tmp_path / "c")])


def test_cli_reads_an_xyz_file_in_bohr_and_mirrors_to_tensorboard(tmp_path, system):
    """--xyz in Bohr is the built-in H2; --tensorboard holds the same per-step energies as energies.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    d = 0.734 / BOHR_IN_ANGSTROM
    (tmp_path / "h2.xyz").write_text(f"2\nH2 in Bohr\nH 0 0 0\nH 0 0 {d!r}\n")
    out, tb = tmp_path / "run", tmp_path / "tb"
    assert _cli(["--xyz", str(tmp_path / "h2.xyz"), "--unit", "bohr", "--steps", "3", "--out", str(out), "--quiet",
                 "--tensorboard", str(tb)]) == 0
    r = json.loads((out / "result.json").read_text())
    assert (r["molecule"], r["unit"], r["n_electrons"]) == ("H2", "bohr", 2)
    assert abs(r["e_hf"] - system("h2").references.e_hf) < 1e-9  # the built-in H2, given in Angstrom
    rows = [json.loads(x) for x in (out / "energies.jsonl").read_text().splitlines()]
    acc = EventAccumulator(str(tb))
    acc.Reload()
    events = acc.Scalars("energy")
    assert [e.step for e in events] == [0, 1, 2]
    assert [e.value for e in events] == pytest.approx([row["energy"] for row in rows], rel=1e-6)  # float32 there
    assert {"error_mha", "lr", "temperature"} <= set(acc.Tags()["scalars"])


def test_cli_refuses_an_existing_run_unless_resumed_or_moved_aside(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--molecule", "h2", "--steps", "2", "--out", str(out), "--quiet", "--no-cc"]
    assert _cli(argv) == 0
    first = (out / "energies.jsonl").read_text()
    with pytest.raises(ValueError, match="already holds a run"):
        _cli(argv)
    assert _cli([*argv, "--overwrite"]) == 0
    (old,) = tmp_path.glob("run.old-*")
    assert (old / "energies.jsonl").read_text() == first and (old / "checkpoints" / "step_00000002").is_dir()
    assert len((out / "energies.jsonl").read_text().splitlines()) == 2
    assert "moved to" in capsys.readouterr().err


def test_a_resume_with_more_steps_does_not_heat_a_finished_annealing_again(tmp_path):
    """Annealing ran over the first half of the steps counted at each resume: 6 -> 20 steps set T > 0 again at steps
    6-9 of a run that had reached T = 0 at step 3 (on OH: from 1.9 to 814 mHa, ending at 4.0 against 1.9)."""
    out = tmp_path / "run"
    argv = ["--molecule", "h2", "--out", str(out), "--quiet", "--no-cc", "--warm-start", "none", "--estimator",
            "sampled", "--samples", "1000", "--anneal", "0.07"]
    assert _cli([*argv, "--steps", "6"]) == 0
    assert _cli([*argv, "--steps", "20", "--resume"]) == 0
    temps = [json.loads(line)["temperature"] for line in (out / "energies.jsonl").read_text().splitlines()]
    assert len(temps) == 20 and temps[0] > 0 and temps[3:] == [0.0] * 17


def test_a_resume_at_another_geometry_is_refused_for_its_orbitals_not_a_flag(tmp_path):
    """Another bond length changes the warm start's size too: the refusal blamed --warm-start-max-configs, a flag
    the user never gave, instead of saying the checkpoint was trained in other orbitals."""
    out = tmp_path / "run"
    argv = ["--out", str(out), "--quiet", "--no-cc", "--warm-start-steps", "20", "--steps", "2"]
    assert _cli(["--atom", "Li 0 0 0; H 0 0 1.548", *argv]) == 0
    with pytest.raises(CheckpointError, match="other molecular orbitals"):
        _cli(["--atom", "Li 0 0 0; H 0 0 1.6", *argv, "--resume"])


def test_vmc_time_leaves_out_the_warm_start_fit(tmp_path):
    """vmc_time_s and each step's wall_time_s started before the warm-start fit (H2O: 86 s of VMC time, 51 of
    them the fit, which warm_start.time_s also counts)."""
    out = tmp_path / "run"
    assert _cli(["--molecule", "h2", "--out", str(out), "--quiet", "--no-cc", "--warm-start-steps", "600",
                 "--steps", "2"]) == 0
    result = json.loads((out / "result.json").read_text())
    fit = result["warm_start"]["time_s"]
    first = json.loads((out / "energies.jsonl").read_text().splitlines()[0])
    assert fit > 0.2 and first["wall_time_s"] < fit and result["vmc_time_s"] + fit <= result["wall_time_s"] + 0.05


def test_an_empty_energy_log_is_no_run_and_does_not_block_the_same_command(tmp_path):
    """A run that failed or was stopped before step 0 leaves the log it opened, empty: that refused the corrected
    command as "already holds a run"."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "energies.jsonl").write_text("")
    assert _cli(["--molecule", "h2", "--steps", "2", "--out", str(out), "--quiet", "--no-cc"]) == 0
    assert len((out / "energies.jsonl").read_text().splitlines()) == 2


def test_cli_resume_refuses_another_recipe_and_reports_the_whole_run(tmp_path):
    """--resume with options that change the run is refused, every changed field named with old -> new and nothing
    written; more --steps, another --checkpoint-every and the output options are allowed. The resumed result.json
    keeps the warm start's record and its time fields cover both invocations (each up to its last checkpoint)."""
    out = tmp_path / "run"
    argv = ["--molecule", "h2", "--out", str(out), "--quiet", "--no-cc", "--warm-start-steps", "20"]
    assert _cli([*argv, "--steps", "2"]) == 0
    first = json.loads((out / "result.json").read_text())
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="cannot resume, the run's settings changed") as refused:
        _cli([*argv, "--resume", "--steps", "90", "--lr", "0.05", "--estimator", "sampled", "--samples", "1000",
              "--seed", "7", "--warm-start", "none"])
    said = str(refused.value)
    for change in ("--lr (lr): 0.002 -> 0.05", "--estimator (estimator): 'auto' -> 'sampled'",
                   "--samples (samples): 10000000000 -> 1000", "--seed (seed): 0 -> 7",
                   "--warm-start (warm_start.method): 'ccsd+pt' -> 'none'"):
        assert change in said, said
    assert "steps:" not in said.replace("warm_start.steps", "")  # more steps are allowed
    with pytest.raises(ValueError, match=r"--warm-start-steps \(warm_start.steps\): 20 -> 30\)"):
        _cli([*argv, "--resume", "--steps", "3", "--warm-start-steps", "30"])
    with pytest.raises(ValueError, match=r"--d-model \(ansatz.d_model\): 64 -> 32"):
        _cli([*argv, "--resume", "--steps", "3", "--d-model", "32"])
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
    elapsed = json.loads((out / "checkpoints" / "step_00000002" / "state.json").read_text())["elapsed"]
    clock, cpu = time.perf_counter(), time.process_time()
    assert _cli([*argv, "--resume", "--steps", "3", "--checkpoint-every", "7", "--tensorboard", str(tmp_path / "tb")]) == 0
    clock, cpu = time.perf_counter() - clock, time.process_time() - cpu
    r = json.loads((out / "result.json").read_text())
    assert r["warm_start"] == first["warm_start"] and r["warm_start"]["method"] == "ccsd+pt"
    assert (r["steps"], r["lr"], r["estimator"], r["seed"], r["checkpoint_every"]) == (3, 0.002, "exact-sum", 0, 7)
    assert clock < r["wall_time_s"] <= elapsed["wall_s"] + clock and elapsed["wall_s"] > 0
    assert cpu < r["cpu_time_s"] <= elapsed["cpu_s"] + cpu and elapsed["cpu_s"] > 0
    assert elapsed["vmc_s"] < r["vmc_time_s"] <= elapsed["vmc_s"] + clock
    rows = steps_of(out)
    assert [row["step"] for row in rows] == [0, 1, 2] and rows[2]["wall_time_s"] > rows[1]["wall_time_s"]


def test_a_resume_with_other_flags_is_refused_before_the_references(tmp_path, monkeypatch):
    """The flags are compared with the checkpoint before the SCF, CCSD and FCI (minutes on the larger molecules),
    each named with its flag; so are the orbital count and an estimator that cannot take the local energy given."""
    out = tmp_path / "run"
    argv = ["--molecule", "h2", "--out", str(out), "--quiet", "--no-cc", "--warm-start-steps", "5"]
    assert _cli([*argv, "--steps", "2"]) == 0

    def no_references(*args, **kwargs):
        raise AssertionError("the references were computed before the refusal")

    monkeypatch.setattr(cli_nnqs, "prepare", no_references)
    for flags, said in ((["--beta2", "0.9"], "--beta2 (betas): [0.9, 0.999] -> [0.9, 0.9]"),
                        (["--layers", "1"], "--layers (ansatz.n_layers): 2 -> 1"),
                        (["--no-cache"], "--no-cache (sampler.use_cache): True -> False"),
                        (["--basis", "6-31g"], "another molecule or basis: (orbitals, N_alpha, N_beta) = (2, 1, 1)"),
                        (["--estimator", "exact-sum", "--local-energy", "sample-space"],
                         "--estimator exact-sum sums H psi exactly: it takes --local-energy exact")):
        with pytest.raises(ValueError) as refused:
            _cli([*argv, "--resume", "--steps", "3", *flags])
        assert said in str(refused.value), str(refused.value)
    with pytest.raises(AssertionError, match="references were computed"):  # the same flags pass on to the SCF
        _cli([*argv, "--resume", "--steps", "3"])


def test_ansatz_flags_shape_the_wavefunction_and_are_recorded(tmp_path):
    """--d-model/--layers/--heads/--phase-hidden/--phase-layers build that network, and result.json says so."""
    out = tmp_path / "run"
    flags = {"--d-model": 32, "--layers": 1, "--heads": 2, "--phase-hidden": 24, "--phase-layers": 3}
    argv = ["--molecule", "h2", "--steps", "2", "--out", str(out), "--quiet", "--no-cc", "--warm-start-steps", "2"]
    assert _cli([*argv, *(str(x) for kv in flags.items() for x in kv)]) == 0
    r = json.loads((out / "result.json").read_text())
    want = AnsatzConfig(d_model=32, n_layers=1, n_heads=2, phase_hidden=24, phase_layers=3)
    assert r["ansatz"] == asdict(want)
    wf = Wavefunction(2, 1, 1, want)
    assert r["n_parameters"] == sum(p.numel() for p in wf.parameters())
    hidden = [m for m in wf.phase_net if isinstance(m, torch.nn.Linear)]
    assert [m.out_features for m in hidden] == [24, 24, 24, 1]


def test_warm_start_pt_is_the_default_fits_the_perturbed_state_and_records_it(tmp_path, system, capsys):
    out = tmp_path / "run"
    argv = ["--molecule", "lih", "--steps", "2", "--out", str(out), "--quiet", "--no-cc", "--warm-start-steps", "2"]
    assert _cli([*argv, "--no-warm-start-pt"]) == 0
    assert "warm start" not in capsys.readouterr().err  # --quiet: no progress bar, the fit's neither
    assert json.loads((out / "result.json").read_text())["warm_start"]["method"] == "ccsd"
    assert _cli([*argv, "--overwrite"]) == 0  # the default
    warm = json.loads((out / "result.json").read_text())["warm_start"]
    s = system("lih")
    ccsd = target_state("ccsd", s.mf, s.hamiltonian.n_orb, s.hamiltonian.n_alpha, s.hamiltonian.n_beta)
    assert warm["method"] == "ccsd+pt" and warm["target_energy"] == pytest.approx(ccsd.energy, abs=1e-9)
    assert s.references.e_fci < warm["target_variational_energy"] < ccsd.variational_energy
    assert warm["phase_weight"] == "amplitude"
    assert _cli([*argv, "--overwrite", "--warm-start-phase-weight", "probability"]) == 0
    assert json.loads((out / "result.json").read_text())["warm_start"]["phase_weight"] == "probability"
    assert warm["n_configs"] > 5  # LiH's CCSD+pt state, above |c|^2 = 1e-8; the cap keeps its largest
    assert _cli([*argv, "--overwrite", "--warm-start-max-configs", "5"]) == 0
    assert json.loads((out / "result.json").read_text())["warm_start"]["n_configs"] == 5


def test_resume_without_steps_keeps_the_run_length_it_started_with(tmp_path):
    """--steps left out on --resume takes the checkpoint's run length, not the sector's default (400 for H2)."""
    out = tmp_path / "run"
    argv = ["--molecule", "h2", "--out", str(out), "--quiet", "--no-cc", "--warm-start-steps", "5"]
    assert _cli([*argv, "--steps", "3"]) == 0
    assert _cli([*argv, "--resume"]) == 0
    assert json.loads((out / "result.json").read_text())["steps"] == 3
    assert len((out / "energies.jsonl").read_text().splitlines()) == 3


def test_a_resumed_run_counts_its_progress_on_from_the_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--molecule", "h2", "--out", str(out), "--no-cc", "--warm-start-steps", "5"]
    assert _cli([*argv, "--steps", "3", "--quiet"]) == 0
    capsys.readouterr()
    assert _cli([*argv, "--resume", "--steps", "5"]) == 0
    bar = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert any("5/5" in line for line in bar) and not any("2/5" in line for line in bar)


@pytest.mark.slow
def test_vmc_lih_reaches_chemical_accuracy(system):
    s = system("lih")
    res = run_vmc(s.hamiltonian, VMCConfig(steps=300, seed=0), e_ref=s.references.e_fci)
    err = (res.final["energy"] - s.references.e_fci) * 1000
    assert res.final["final_eval"] == "exact"
    assert 0 <= err + 1e-6 and err < CHEMICAL_ACCURACY_MHA, err


def test_sample_space_mode_runs_and_is_documented_biased(system):
    """The sample-space estimator of a step differs from the exact one on the same samples (that is its bias)."""
    s = system("lih")
    a = run_vmc(s.hamiltonian, VMCConfig(steps=2, local_energy="exact", seed=1), e_ref=s.references.e_fci)
    b = run_vmc(s.hamiltonian, VMCConfig(steps=2, local_energy="sample-space", samples=300, seed=1),
                e_ref=s.references.e_fci)
    assert a.records[0]["energy"] != b.records[0]["energy"]
    assert all(torch.isfinite(torch.tensor(r["energy"])) for r in b.records)


@pytest.mark.parametrize("phase_too", [False, True])
def test_chunked_gradient_of_many_samples_equals_one_pass(system, phase_too):
    """Past ``grad_chunk`` unique samples the gradient is re-evaluated chunk by chunk (bounded memory): the same
    step, energy and gradient as one pass over all samples, on the per-sample local-energy path."""
    s = system("lih")
    grads = []
    for chunk in (10**6, 7):
        torch.manual_seed(0)
        wf = Wavefunction(s.hamiltonian.n_orb, s.hamiltonian.n_alpha, s.hamiltonian.n_beta)
        cfg = VMCConfig(samples=2000, estimator="sampled", sector_max=0, grad_chunk=chunk, grad_clip=None,
                        anneal=0.07 if phase_too else 0.0)
        opt = torch.optim.SGD(wf.parameters(), lr=0.0)
        stats = vmc_step(wf, s.hamiltonian, opt, cfg, 0, DistInfo(), t0=0.5 if phase_too else 0.0)
        assert stats.n_unique > 7  # several chunks
        grads.append((stats.energy, torch.cat([p.grad.flatten() for p in wf.parameters()])))
    (e1, g1), (e2, g2) = grads
    assert abs(e1 - e2) < 1e-9
    assert g1.abs().max() > 0 and torch.allclose(g1, g2, rtol=1e-4, atol=1e-6)


class _Crash(Exception):
    pass


@pytest.mark.parametrize("molecule, estimator", [("h2", "auto"), ("lih", "selected-sum")])
def test_resume_after_crash_matches_uninterrupted_run(tmp_path, system, molecule, estimator):
    """Kill a run after step 3 (checkpoint at 3), resume it: the energies equal an uninterrupted run's, bit for bit.
    The selected sum's space, grown by small samples and pruned at 1e-4, comes back from the checkpoint too."""
    ham = system(molecule).hamiltonian
    cfg = VMCConfig(steps=6, checkpoint_every=3, estimator=estimator,
                    **({"samples": 300, "selected_min_prob": 1e-4} if estimator == "selected-sum" else {}))
    full = run_vmc(ham, cfg, out=tmp_path / "a")

    def crash(st):
        if st.step == 4:
            raise _Crash

    with pytest.raises(_Crash):
        run_vmc(ham, cfg, out=tmp_path / "b", callback=crash)
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == ["step_00000003"]
    assert json.loads((tmp_path / "b" / "checkpoints" / "step_00000003" / "state.json").read_text())["step"] == 3
    resumed = run_vmc(ham, cfg, out=tmp_path / "b", resume=True)
    assert [r["energy"] for r in resumed.records] == [r["energy"] for r in full.records]
    lines = (tmp_path / "b" / "energies.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(6))
    assert resumed.final["energy"] == full.final["energy"]


def test_lr_schedule_warms_up_then_decays():
    cfg = VMCConfig(steps=100, lr=1e-2, warmup=10, min_lr_ratio=0.1)
    lrs = [lr_at(cfg, s) for s in range(100)]
    assert lrs[0] < lrs[5] < lrs[9] and abs(max(lrs) - 1e-2) < 1e-12
    assert abs(lrs[-1] - 1e-3) < 1e-12 and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


@pytest.mark.parametrize(
    "argv,msg",
    [
        (["--molecule", "benzene"], "known molecules: h2, lih, h2o, nh3, n2, c2"),
        (["--atom", "H 0 0 0; H 0 0"], "atom 2 'H 0 0' must be 'Element x y z'"),
        (["--molecule", "h2", "--spin", "1"], "2S must be even"),
        (["--molecule", "h2", "--phase-hidden", "0"], "--phase-hidden must be >= 1, got 0"),
        (["--molecule", "h2", "--layers", "0"], "--layers must be >= 1, got 0"),
        (["--molecule", "h2", "--warm-start-max-configs", "0"], "--warm-start-max-configs must be >= 1, got 0"),
    ],
)
def test_cli_rejects_bad_input_with_clear_errors(argv, msg, capsys):
    from seqlab.cli import main

    assert main(["nnqs", *argv, "--out", os.devnull]) == 2
    assert msg in capsys.readouterr().err


def test_an_unknown_basis_is_one_clear_error_without_pyscfs_install_hint(tmp_path, capsys):
    from seqlab.cli import main

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert main(["nnqs", "--molecule", "h2", "--basis", "nope", "--steps", "1", "--out", str(tmp_path / "r")]) == 2
    assert "PySCF rejected h2 (basis 'nope')" in capsys.readouterr().err
    assert not [str(w.message) for w in said if "basis" in str(w.message)]


def test_exact_sum_past_the_sector_fast_path_is_refused_before_any_scf(tmp_path, monkeypatch, capsys):
    """H2O/6-31G has 1 656 369 determinants: --estimator exact-sum is refused from the molecule and basis alone, before
    the SCF and the references (which took 47 s before it failed), naming the estimators that do fit; the same
    sector with the default auto gets as far as the SCF."""
    from seqlab.cli import main

    def no_scf(*args, **kwargs):
        raise RuntimeError("the SCF ran")

    monkeypatch.setattr(cli_nnqs, "prepare", no_scf)
    argv = ["nnqs", "--molecule", "h2o", "--basis", "6-31g", "--no-fci", "--no-cc", "--steps", "2", "--quiet"]
    assert main([*argv, "--estimator", "exact-sum", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "--estimator: 'exact-sum' needs the sector fast path" in err and "this one has 1656369" in err
    assert "use 'selected-sum', 'sampled' or 'auto'" in err and not (tmp_path / "r").exists()
    with pytest.raises(RuntimeError, match="the SCF ran"):
        main([*argv, "--out", str(tmp_path / "auto"), "--debug"])


def _torchrun(nproc: int, out, steps: int, extra: tuple[str, ...] = ()) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "seqlab.cli.nnqs", "--molecule", "h2", "--steps", str(steps), "--out", str(out), "--quiet",
           "--threads", "1", "--no-cc", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads((out / "result.json").read_text())


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_two_processes_match_one(tmp_path):
    """2 ranks (gloo) vs 1 process with the same seed and total N_s (the 1-process run goes through the same CLI)."""
    assert _cli(["--molecule", "h2", "--steps", "60", "--out", str(tmp_path / "one"), "--quiet", "--no-cc"]) == 0
    one = json.loads((tmp_path / "one" / "result.json").read_text())
    two = _torchrun(2, tmp_path / "two", 60)
    assert two["world_size"] == 2 and one["world_size"] == 1
    e1 = [json.loads(x) for x in (tmp_path / "one" / "energies.jsonl").read_text().splitlines()]
    e2 = [json.loads(x) for x in (tmp_path / "two" / "energies.jsonl").read_text().splitlines()]
    assert len(e1) == len(e2) == 60
    # step 0: same parameters and N_s; the ranks finish the sample tree with their own random streams, so the
    # estimates agree within the statistical error (not bit for bit)
    sigma = (e1[0]["energy_std"] ** 2 + e2[0]["energy_std"] ** 2) ** 0.5
    assert abs(e1[0]["energy"] - e2[0]["energy"]) < 5 * sigma + 1e-9
    # the trained wavefunctions agree within chemical accuracy, both close to FCI
    assert abs(one["energy"] - two["energy"]) * 1000 < CHEMICAL_ACCURACY_MHA
    assert abs(two["error_mha"]) < CHEMICAL_ACCURACY_MHA


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_sample_space_keeps_every_ranks_samples(tmp_path):
    """The sample-space estimator truncates H to the sampled configurations: all of them, not each rank's share.
    With every H2 configuration sampled (N_s = 1e10), 2 ranks give 1 process's first energy within 5 sigma of the
    sampling noise; with per-rank tables each rank lost the x' the other one drew (6.8 mHa apart, sigma ~1e-5)."""
    flags = ("--estimator", "sampled", "--local-energy", "sample-space", "--samples", "1e10", "--warm-start", "none")
    _torchrun(1, tmp_path / "one", 1, flags)
    _torchrun(2, tmp_path / "two", 1, flags)
    (one,), (two,) = ([json.loads(x) for x in (tmp_path / run / "energies.jsonl").read_text().splitlines()]
                      for run in ("one", "two"))
    sigma = (one["energy_std"] ** 2 + two["energy_std"] ** 2) ** 0.5
    print(f"1 process {one['energy']:.8f}, 2 ranks {two['energy']:.8f}, sigma {sigma:.2e}")
    assert abs(one["energy"] - two["energy"]) < 5 * sigma + 1e-9 and sigma < 1e-4


@pytest.mark.slow
@pytest.mark.distributed
def test_torchrun_selected_sum_takes_the_same_steps_as_one_process(tmp_path):
    """The selected sum on 2 ranks: both draw the same sample tree (the same space) and split its gradient set, so
    the energies step by step are those of 1 process up to the float32 round-off of the summation order. The first
    6 steps are AdamW's; in the last 6 (L-BFGS) every rank holds the same energy and all-reduced gradient, so the
    same line search. (A short warm start: the steps match whatever state both runs start from.)"""
    flags = ("--estimator", "selected-sum", "--samples", "1e6", "--lbfgs-steps", "6", "--warm-start-steps", "20")
    _torchrun(1, tmp_path / "one", 12, flags)
    two = _torchrun(2, tmp_path / "two", 12, flags)
    assert two["estimator"] == "selected-sum" and two["world_size"] == 2
    e1 = [json.loads(x)["energy"] for x in (tmp_path / "one" / "energies.jsonl").read_text().splitlines()]
    e2 = [json.loads(x)["energy"] for x in (tmp_path / "two" / "energies.jsonl").read_text().splitlines()]
    assert len(e1) == len(e2) == 12 and e1[0] == pytest.approx(e2[0], abs=1e-12)
    assert max(abs(a - b) for a, b in zip(e1, e2)) < 1e-6
