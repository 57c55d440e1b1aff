"""Where a finished run's error lives: in the amplitude network, the phase network, or the two together.

A run that plateaus above chemical accuracy can be short of capacity in either network, and the lever differs (a wider
decoder, or a wider phase MLP). For each run folder this loads the last checkpoint, evaluates psi over the whole
(N_alpha, N_beta) sector, diagonalises H there, and swaps parts of the model's state for the exact ones:

- ``amplitude_error_mha``: the model's |psi| with FCI's signs; what is left once every sign is right;
- ``wrong_sign_*``: the configurations whose model phase is more than pi/2 off FCI's (relative to the overall phase),
  their number, their weight in the FCI state and in the model's;
- ``without_wrong_sign_configs_mha``: the FCI state with those configurations removed; what missing that region
  alone costs;
- ``exact_on_wrong_sign_configs_mha``: the model's amplitudes where its sign is right, FCI's amplitudes and signs on
  the wrong-sign configurations; what mending the phase network's mistakes (and the amplitudes they hold down)
  would buy;
- ``lost_*``: the configurations the model has all but dropped (FCI probability above 1e-8, the model's at most
  1e-3 of it), whatever their sign: their number, their FCI weight, and ``exact_on_lost_configs_mha``, the model with
  FCI's amplitudes and signs put back there. A configuration VMC let fall that far gets almost no gradient (~|psi|)
  and does not come back.

    python bench/nnqs_error_split.py runs/canon/c2s0 runs/canon/c2s1 --json bench/results/nnqs_error_split.json

A selected-sum run (past the sector fast path: H2O in 6-31G) is split on its own space S instead: the exact state is
H's ground state on S (its selected CI), every error is against that floor, and ``space_floor_mha`` says how far the
floor itself lies above FCI. Sectors (and spaces) up to ``sector_max`` (200 000 determinants) only: the state is held
as one dense vector.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from scipy.sparse.linalg import eigsh

from nnqs_runs import mha, write_json
from seqlab.nnqs.ansatz import AnsatzConfig, Wavefunction
from seqlab.nnqs.exact_sum import sector_log_psi
from seqlab.nnqs.local_energy import SectorHamiltonian
from seqlab.nnqs.molecules import get_molecule
from seqlab.nnqs.references import prepare
from seqlab.nnqs.selected_space import SelectedSpace
from seqlab.nnqs.vmc import HARTREE_TO_MHA
from seqlab.nnqs.vmc_checkpoint import check_orbitals, checkpoint_store


LOST_ABOVE, LOST_RATIO = 1e-8, 1e-3  # "lost": FCI probability above the first, the model's at most the second times it


def load_run(run: Path):
    """(result.json, the system rebuilt from it, the wavefunction at the run's last checkpoint)."""
    result = json.loads((run / "result.json").read_text())
    mol = get_molecule(atom=result["atom"], basis=result["basis"], charge=result["charge"], spin=result["spin"],
                       unit=result.get("unit"))
    system = prepare(mol, fci=False, cc=False)
    store = checkpoint_store(run, None)
    path = store.latest()
    if path is None:
        raise SystemExit(f"{run}: no checkpoint")
    tensors, state = store.load(path)
    check_orbitals(path, tensors.get("orbitals"), system.hamiltonian)
    wf = Wavefunction(state["n_orb"], state["n_alpha"], state["n_beta"], AnsatzConfig(**state["ansatz"]))
    wf.load_state_dict(tensors["model"])
    return result, system, wf, state["step"], tensors.get("selected")


def split(run: Path) -> dict:
    result, system, wf, step, selected = load_run(run)
    if selected is None:
        space = SectorHamiltonian(system.hamiltonian, progress=False)
        log_psi = sector_log_psi(wf, space)
    else:  # the run's own space S, restored with its H elements
        restored = SelectedSpace(system.hamiltonian)
        restored.load_state(selected)
        space = restored.hamiltonian()
        log_psi = wf.log_psi(space.tokens)
    h = space.matrix
    w, v = eigsh(h, k=1, which="SA", v0=np.ones(h.shape[0]))
    e0, exact = float(w[0]), v[:, 0]

    def error(x: np.ndarray) -> float:
        x = x / np.linalg.norm(x)
        return (float(np.real(np.vdot(x, h @ x))) - e0) * HARTREE_TO_MHA

    psi = torch.exp(log_psi - log_psi.real.max()).numpy()
    psi /= np.linalg.norm(psi)
    overlap = np.vdot(exact, psi)
    aligned = psi * np.conj(overlap) / abs(overlap) * np.sign(exact)  # real and positive where the model is right
    wrong = np.abs(np.angle(aligned)) > np.pi / 2
    amp, signs = np.abs(psi), np.sign(exact)
    lost = (exact**2 > LOST_ABOVE) & (amp**2 <= LOST_RATIO * exact**2)
    return {
        "run": str(run), "molecule": result["molecule"], "atom": result["atom"], "basis": result["basis"],
        "step": step, "ansatz": result["ansatz"], "n_configurations": len(exact),
        "space": "sector" if selected is None else "selected",
        "space_floor_mha": (e0 - result["e_fci"]) * HARTREE_TO_MHA if result.get("e_fci") is not None else None,
        "error_mha": error(psi), "fidelity": float(abs(overlap) ** 2),
        "amplitude_error_mha": error(amp * signs),
        "wrong_sign_configs": int(wrong.sum()),
        "wrong_sign_weight_fci": float((exact[wrong] ** 2).sum()),
        "wrong_sign_weight_model": float((amp[wrong] ** 2).sum()),
        "without_wrong_sign_configs_mha": error(exact * ~wrong),
        "exact_on_wrong_sign_configs_mha": error(np.where(wrong, np.abs(exact), amp) * signs),
        "lost_configs": int(lost.sum()),
        "lost_weight_fci": float((exact[lost] ** 2).sum()),
        "exact_on_lost_configs_mha": error(np.where(lost, np.abs(exact), amp) * signs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="folders of finished `seqlab nnqs` runs")
    ap.add_argument("--json", default="bench/results/nnqs_error_split.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [split(run) for run in args.runs]
    print(f"{'run':<32}{'error':>9}{'|psi|, FCI signs':>18}{'wrong-sign configs (FCI weight)':>34}"
          f"{'FCI minus them':>16}{'mended there':>14}{'lost configs (FCI weight)':>28}{'mended there':>14}"
          f"{'space floor':>13}")
    for r in rows:
        print(f"{r['run'][-32:]:<32}{mha(r['error_mha']):>9}{mha(r['amplitude_error_mha']):>18}"
              f"{r['wrong_sign_configs']:>20} ({r['wrong_sign_weight_fci']:.1e})"
              f"{mha(r['without_wrong_sign_configs_mha']):>16}{mha(r['exact_on_wrong_sign_configs_mha']):>14}"
              f"{r['lost_configs']:>16} ({r['lost_weight_fci']:.1e}){mha(r['exact_on_lost_configs_mha']):>14}"
              f"{mha(r['space_floor_mha']):>13}")
    print("errors against the exact ground state of each run's space (its sector, or its selected space S), mHa;",
          write_json(args.json, rows, threads=1, parallel=1))


if __name__ == "__main__":
    main()
