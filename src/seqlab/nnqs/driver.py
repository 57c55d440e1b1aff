"""The VMC driver: build the wavefunction and optimizer, run the steps, log, checkpoint, resume, evaluate.

Writes (on rank 0, when ``out`` is given): energies.jsonl (one line per step), checkpoint/ every
``checkpoint_every`` steps and at the end, convergence.png.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib
import torch
from safetensors.torch import load_file, save_file

from seqlab.nnqs.ansatz import AnsatzConfig, Wavefunction
from seqlab.nnqs.distributed import Dist
from seqlab.nnqs.evaluate import evaluate_energy
from seqlab.nnqs.hamiltonian import Hamiltonian
from seqlab.nnqs.vmc import HARTREE_TO_MHA, VMCConfig, build_sector, initial_temperature, vmc_step
from seqlab.runtime import atomic_write_text

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)


def save_checkpoint(out: Path, wf: Wavefunction, opt: torch.optim.Optimizer, step: int, extra: dict) -> None:
    """model.safetensors + optimizer.pt (tensors only; loaded with weights_only=True) + state.json."""
    ck = out / "checkpoint"
    ck.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=ck, prefix=".model.")
    os.close(fd)
    save_file({k: v.contiguous() for k, v in wf.state_dict().items()}, tmp)
    os.replace(tmp, ck / "model.safetensors")
    fd, tmp = tempfile.mkstemp(dir=ck, prefix=".optimizer.")
    os.close(fd)
    torch.save(opt.state_dict(), tmp)
    os.replace(tmp, ck / "optimizer.pt")
    atomic_write_text(ck / "state.json", json.dumps({"step": step, **wf.config_dict(), **extra}, indent=2) + "\n")


def load_checkpoint(out: Path, wf: Wavefunction, opt: torch.optim.Optimizer) -> int:
    """Restore model and optimizer from ``out/checkpoint``; returns the number of completed steps."""
    ck = out / "checkpoint"
    state = json.loads((ck / "state.json").read_text())
    if (state["n_orb"], state["n_alpha"], state["n_beta"]) != (wf.n_orb, wf.n_alpha, wf.n_beta):
        raise ValueError(f"{ck / 'state.json'}: checkpoint is for a different molecule "
                         f"(n_orb, N_alpha, N_beta) = {(state['n_orb'], state['n_alpha'], state['n_beta'])}")
    if state["ansatz"] != asdict(wf.cfg):
        raise ValueError(f"{ck / 'state.json'}: checkpoint ansatz {state['ansatz']} != requested {asdict(wf.cfg)}")
    wf.load_state_dict(load_file(ck / "model.safetensors"))
    opt.load_state_dict(torch.load(ck / "optimizer.pt", weights_only=True))
    return int(state["step"])


def plot_convergence(path: Path, records: list[dict], e_fci: float | None, title: str) -> None:
    steps = [r["step"] for r in records]
    e = [r["energy"] for r in records]
    sd = [r["energy_std"] for r in records]
    fig, axes = plt.subplots(1, 2 if e_fci is not None else 1, figsize=(11 if e_fci is not None else 6, 4))
    ax = axes[0] if e_fci is not None else axes
    ax.errorbar(steps, e, yerr=sd, fmt=".", ms=2, lw=0.5, label="NNQS (step estimate)")
    if e_fci is not None:
        ax.axhline(e_fci, color="k", lw=1, label="FCI")
        lo = min(e_fci, min(e)) - 0.01
        ax.set_ylim(lo, max(e_fci + 0.2, lo + 0.05))
    ax.set_xlabel("step")
    ax.set_ylabel("energy (Ha)")
    ax.legend()
    if e_fci is not None:
        err = [max(abs(v - e_fci) * HARTREE_TO_MHA, 1e-3) for v in e]
        axes[1].semilogy(steps, err, ".", ms=2)
        axes[1].axhline(1.6, color="r", lw=1, label="chemical accuracy (1.6 mHa)")
        axes[1].set_xlabel("step")
        axes[1].set_ylabel("|E - E_FCI| (mHa)")
        axes[1].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.close(fd)
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


@dataclass
class RunResult:
    wavefunction: Wavefunction
    records: list[dict]
    final: dict
    wall_time_s: float


def run_vmc(ham: Hamiltonian, cfg: VMCConfig, ansatz: AnsatzConfig | None = None, out: str | Path | None = None,
            dist: Dist | None = None, e_ref: float | None = None, resume: bool = False, callback=None,
            title: str = "NNQS") -> RunResult:
    """Train a fresh (or resumed) wavefunction for ``cfg.steps`` steps, then evaluate its energy.

    Writes (on rank 0, when ``out`` is given): energies.jsonl (one line per step), checkpoint/ every
    ``checkpoint_every`` steps and at the end, convergence.png. ``callback(stats)`` is called after every step.
    """
    dist = dist or Dist()
    if cfg.sr and dist.world_size > 1:
        raise ValueError("VMCConfig.sr: stochastic reconfiguration is implemented for one process only")
    out = Path(out) if out is not None else None
    torch.manual_seed(cfg.seed)  # identical initial parameters on every rank
    wf = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta, ansatz)
    groups = [{"params": list(wf.decoder.parameters()), "lr_scale": 1.0},
              {"params": list(wf.phase_net.parameters()), "lr_scale": cfg.phase_lr_scale}]
    if cfg.sr:  # the natural-gradient direction is already preconditioned: plain steps along it
        opt = torch.optim.SGD(groups, lr=cfg.lr)
    else:
        opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    start_step, records = 0, []
    if resume and out is not None and (out / "checkpoint" / "state.json").exists():
        start_step = load_checkpoint(out, wf, opt)
        log = out / "energies.jsonl"
        if log.exists():
            records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()][:start_step]
    log_f = None
    if out is not None and dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "energies.jsonl", "".join(json.dumps(r) + "\n" for r in records))
        log_f = open(out / "energies.jsonl", "a")
    t_start = time.perf_counter()
    t0 = initial_temperature(wf, ham, cfg, dist) if start_step == 0 else float(_saved_t0(out))
    sector = build_sector(ham, cfg, dist)
    try:
        for step in range(start_step, cfg.steps):
            st = vmc_step(wf, ham, opt, cfg, step, dist, t0, sector)
            rec = asdict(st)
            rec["wall_time_s"] = time.perf_counter() - t_start
            if e_ref is not None:
                rec["error_mha"] = (st.energy - e_ref) * HARTREE_TO_MHA
            records.append(rec)
            if log_f is not None:
                log_f.write(json.dumps(rec) + "\n")
                log_f.flush()
            if callback is not None:
                callback(st)
            done = step + 1
            if out is not None and dist.is_main and (done % cfg.checkpoint_every == 0 or done == cfg.steps):
                save_checkpoint(out, wf, opt, done, {"vmc": _jsonable(asdict(cfg)), "t0": t0})
    finally:
        if log_f is not None:
            log_f.close()
    final = evaluate_energy(wf, ham, cfg, dist)
    wall = time.perf_counter() - t_start
    if out is not None and dist.is_main and records:
        plot_convergence(out / "convergence.png", records, e_ref, title)
    return RunResult(wf, records, final, wall)


def _saved_t0(out: Path) -> float:
    return json.loads((out / "checkpoint" / "state.json").read_text()).get("t0", 0.0)


def _jsonable(d: dict) -> dict:
    return json.loads(json.dumps(d, default=str))
