"""Crash safety of `seqlab nnqs`: kill -9 at random moments then --resume is bit-identical to an unbroken run; a
SIGTERM checkpoints the current step; stale temporary files are cleaned; two runs never share a folder."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from seqlab.nnqs.driver import run_vmc
from seqlab.nnqs.vmc import VMCConfig
from seqlab.nnqs.vmc_checkpoint import checkpoint_store
from seqlab.nnqs.warm_start import WarmStartConfig, target_state
from seqlab.runtime.signals import GracefulStop

# every field of a step row that is not a clock reading
DETERMINISTIC = ("step", "energy", "energy_imag", "energy_std", "variance", "n_unique", "lr", "temperature")
H2_RUN = ["nnqs", "--molecule", "h2", "--no-cc", "--no-fci", "--quiet", "--threads", "1", "--seed", "3"]


def _launch(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "seqlab", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _rows(out: Path) -> list[dict]:
    path = out / "energies.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line while the run is being killed
            pass
    return rows


def _wait_for_rows(proc: subprocess.Popen, out: Path, n: int, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while proc.poll() is None and len(_rows(out)) < n and time.monotonic() < end:
        time.sleep(0.005)


def _latest_step(out: Path) -> int:
    latest = checkpoint_store(out, None).latest()
    return 0 if latest is None else int(latest.name.removeprefix("step_"))


@pytest.mark.slow  # four launches of `seqlab nnqs` (about 8 s of CPU each, mostly imports and PySCF)
def test_kill9_at_random_moments_then_resume_is_bit_identical(tmp_path):
    steps = 20
    args = [*H2_RUN, "--steps", str(steps), "--checkpoint-every", "1"]
    ref = _launch([*args, "--out", str(tmp_path / "ref")], tmp_path)
    assert ref.wait(timeout=300) == 0, ref.stderr.read()

    out, rng = tmp_path / "killed", random.Random(12)
    resumed_from, kills = [], 0
    while True:
        proc = _launch([*args, "--out", str(out), *(["--resume"] if kills else [])], tmp_path)
        if kills < 2:
            _wait_for_rows(proc, out, rng.randint(3 + 8 * kills, 7 + 8 * kills))  # rows beyond the killed run's
            time.sleep(rng.uniform(0.0, 0.03))  # anywhere in a step: sampling, backward, or the checkpoint write
            if proc.poll() is None:
                proc.kill()  # SIGKILL: no handler runs
                proc.wait()
                kills += 1
                resumed_from.append(_latest_step(out))
                continue
        assert proc.wait(timeout=300) == 0, proc.stderr.read()
        break
    assert kills == 2 and any(0 < s < steps for s in resumed_from), resumed_from

    a, b = _rows(tmp_path / "ref"), _rows(out)
    assert [r["step"] for r in b] == list(range(steps))
    assert [[r[k] for k in DETERMINISTIC] for r in a] == [[r[k] for k in DETERMINISTIC] for r in b]
    for name in ("model", "optimizer"):
        ta = load_file(tmp_path / "ref" / "checkpoints" / f"step_{steps:08d}" / f"{name}.safetensors")
        tb = load_file(out / "checkpoints" / f"step_{steps:08d}" / f"{name}.safetensors")
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta), name
    ra, rb = (json.loads((d / "result.json").read_text()) for d in (tmp_path / "ref", out))
    assert (ra["energy"], ra["energy_variance"]) == (rb["energy"], rb["energy_variance"])


def test_sigterm_checkpoints_the_current_step_and_exits(tmp_path):
    out = tmp_path / "run"
    proc = _launch([*H2_RUN, "--steps", "100000", "--checkpoint-every", "50000", "--out", str(out)], tmp_path)
    _wait_for_rows(proc, out, 5)
    assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=120)
    err = proc.stderr.read()
    assert rc == 128 + signal.SIGTERM, err
    done = len(_rows(out))
    assert 5 <= done < 50000 and _latest_step(out) == done, (done, _latest_step(out))
    assert "--resume" in err and "Traceback" not in err
    assert not (out / "result.json").exists()


def test_stale_temporary_files_are_cleaned_at_start(tmp_path, system):
    out = tmp_path / "run"
    stale = [out / "checkpoints" / ".tmp-step_00000007-4242", out / ".energies.jsonl.k2j3.tmp",
             out / ".convergence.tmp-4242.png", out / ".result.json.x8.tmp"]
    stale[0].mkdir(parents=True)
    (stale[0] / "model.safetensors").write_bytes(b"half")
    for p in stale[1:]:
        p.write_bytes(b"half")
    keep = [out / "notes.txt", out / ".my-settings"]
    for p in keep:
        p.write_text("mine")
    run_vmc(system("h2").hamiltonian, VMCConfig(steps=1), out=out)
    assert not any(p.exists() for p in stale)
    assert all(p.read_text() == "mine" for p in keep)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000001"]


def test_a_new_run_never_mixes_with_an_old_one(tmp_path, system):
    ham, out = system("h2").hamiltonian, tmp_path / "run"
    run_vmc(ham, VMCConfig(steps=3, checkpoint_every=1), out=out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="already holds a run .*--resume .*--overwrite"):
        run_vmc(ham, VMCConfig(steps=2), out=out)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    res = run_vmc(ham, VMCConfig(steps=4, checkpoint_every=1), out=out, resume=True)  # --resume extends it
    assert [r["step"] for r in res.records] == [0, 1, 2, 3] and len(_rows(out)) == 4
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="already holds 4 steps"):  # fewer steps: refused, nothing rewritten
        run_vmc(ham, VMCConfig(steps=2, checkpoint_every=1), out=out, resume=True)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_first_sigint_checkpoints_the_step_and_a_second_one_leaves_at_once(tmp_path, system):
    """In-process, with the signal sent from inside step 2: one SIGINT ends the run after that step, checkpointed;
    two SIGINTs raise KeyboardInterrupt at once, without writing that step's checkpoint."""
    ham = system("h2").hamiltonian

    def send(times: int):
        def callback(st):
            if st.step == 2:
                for _ in range(times):
                    os.kill(os.getpid(), signal.SIGINT)
        return callback

    with GracefulStop() as stop:
        res = run_vmc(ham, VMCConfig(steps=50, checkpoint_every=40), out=tmp_path / "one", callback=send(1),
                      stop=stop)
    assert (res.stopped_at, res.final, stop.exit_code) == (3, None, 128 + signal.SIGINT)
    assert res.checkpoint == tmp_path / "one" / "checkpoints" / "step_00000003" and res.checkpoint.is_dir()
    assert len(_rows(tmp_path / "one")) == 3

    with GracefulStop() as stop, pytest.raises(KeyboardInterrupt):
        run_vmc(ham, VMCConfig(steps=50, checkpoint_every=40), out=tmp_path / "two", callback=send(2), stop=stop)
    assert _latest_step(tmp_path / "two") == 0


def test_stop_during_the_warm_start_fit_leaves_nothing_to_resume(tmp_path, system):
    """A stop requested while the warm start is being fitted ends the run before any VMC step, without a checkpoint of
    the half-fitted state; the same command then starts afresh in the same directory."""
    s = system("lih")
    ham = s.hamiltonian
    target = target_state("ccsd", s.mf, ham.n_orb, ham.n_alpha, ham.n_beta)
    stop = GracefulStop()
    stop.requested = True
    res = run_vmc(ham, VMCConfig(steps=3), out=tmp_path / "run", stop=stop, warm_start=target,
                  warm_start_cfg=WarmStartConfig(steps=200))
    assert (res.stopped_at, res.final, res.checkpoint, res.records) == (0, None, None, [])
    assert not [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    res = run_vmc(ham, VMCConfig(steps=3, anneal=0.0), out=tmp_path / "run", warm_start=target,
                  warm_start_cfg=WarmStartConfig(steps=20))
    assert res.final is not None and res.warm_start["steps"] == 20 and res.warm_start["time_s"] > 0


def test_selected_sum_lbfgs_resume_with_sign_fit_is_bit_identical(tmp_path, system):
    """The selected sum's recipe (L-BFGS steps, the sign fit at step 4: the space is empty at step 0), stopped after step 2 and resumed,
    takes the same iterations as an unbroken run: the L-BFGS history is part of the checkpoint (an empty one after
    the resume took other line searches, a different last evaluation, so another pruned space and final energy)."""
    ham = system("lih").hamiltonian
    cfg = VMCConfig(steps=6, samples=2000, estimator="selected-sum", anneal=0.0, lbfgs_steps=6, lbfgs_iters=6,
                    selected_sign_fit=30, selected_sign_fit_every=4, checkpoint_every=3)
    ref = run_vmc(ham, cfg, out=tmp_path / "ref")

    def stop_after_step_2(st):
        stop.requested = st.step == 2

    stop = GracefulStop()
    part = run_vmc(ham, cfg, out=tmp_path / "run", callback=stop_after_step_2, stop=stop)
    assert part.stopped_at == 3
    res = run_vmc(ham, cfg, out=tmp_path / "run", resume=True)
    fields = (*DETERMINISTIC, "n_selected", "n_evaluations", "n_joined", "t_sign_fit")
    rows = [[r[k] if k != "t_sign_fit" else r[k] > 0 for k in fields] for r in _rows(tmp_path / "run")]
    assert rows == [[r[k] if k != "t_sign_fit" else r[k] > 0 for k in fields] for r in ref.records]
    assert [r[-1] for r in rows] == [False, False, False, False, True, False]  # the fit ran after the resume
    assert all(torch.equal(a, b) for a, b in zip(ref.wavefunction.parameters(), res.wavefunction.parameters()))
    assert (ref.final["energy"], ref.final["selected_size"]) == (res.final["energy"], res.final["selected_size"])
