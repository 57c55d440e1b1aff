"""Does growing the selected space by perturbation theory, or fitting the phase network to the signs of the
space's own lowest state, help psi? Continue one selected-sum checkpoint with and without ``--selected-expand``
and ``--selected-sign-fit``, side by side, and compare psi's energy over its space with that space's own floor.

    seqlab nnqs --molecule h2o --basis 6-31g --out runs/h2o631     # ~73 min on 2 cores; any selected-sum run will do
    python bench/nnqs_expand.py --checkpoint runs/h2o631/checkpoints/step_00001500 --molecule h2o --basis 6-31g
    python bench/nnqs_expand.py --checkpoint ... --variants 0:0 0:3000 --steps 150 --json bench/results/nnqs_h2o_631g_sign_fit.json

Each variant starts from the same weights and space with a fresh AdamW (the checkpoint's rate has decayed) and runs
in its own process on one thread, all at once, so their step times compare. Every 50th step also diagonalises H on
the space (``SelectedSpace.ground_energy``): the best any state on it could do. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch
from safetensors.torch import load_file

from seqlab.nnqs.ansatz import AnsatzConfig, Wavefunction
from seqlab.nnqs.molecules import get_molecule
from seqlab.nnqs.references import prepare
from seqlab.nnqs.selected_space import SelectedSpace
from seqlab.nnqs.vmc import HARTREE_TO_MHA, VMCConfig, vmc_step
from seqlab.runtime.dist import DistInfo
from seqlab.runtime.memory import keep_freed_blocks


def continue_run(args: argparse.Namespace, variant: str) -> dict:
    """``args.steps`` selected-sum steps from the checkpoint; ``variant`` is "EXPAND:SIGN_FIT": expanding by EXPAND
    every 100 steps and fitting the signs for SIGN_FIT steps every 50 (0: never)."""
    expand, sign_fit = (int(v) for v in variant.split(":"))
    torch.set_num_threads(1)
    keep_freed_blocks()  # as `seqlab nnqs` does
    system = prepare(get_molecule(args.molecule, basis=args.basis), cc=False)
    ham, e_fci = system.hamiltonian, system.references.e_fci
    state = json.loads((args.checkpoint / "state.json").read_text())
    wf = Wavefunction(ham.n_orb, ham.n_alpha, ham.n_beta, AnsatzConfig(**state["ansatz"]))
    wf.load_state_dict(load_file(args.checkpoint / "model.safetensors"))
    space = SelectedSpace(ham)
    space.load_state(load_file(args.checkpoint / "selected.safetensors"))
    cfg = VMCConfig(steps=args.steps, samples=10**6, lr=args.lr, warmup=20, min_lr_ratio=0.1, anneal=0.0,
                    betas=(0.9, 0.999), estimator="selected-sum", selected_expand=expand, selected_sign_fit=sign_fit,
                    seed=args.seed)
    opt = torch.optim.AdamW(wf.parameters(), lr=args.lr, betas=cfg.betas, weight_decay=0.0)
    trace, start = [], time.perf_counter()
    for step in range(args.steps):
        st = vmc_step(wf, ham, opt, cfg, step, DistInfo(), selected=space)
        row = {"step": step, "error_mha": (st.energy - e_fci) * HARTREE_TO_MHA, "n_selected": st.n_selected,
               "pinned": len(space.pinned), "t_sign_fit": st.t_sign_fit, "wall_s": time.perf_counter() - start}
        if step % 50 == 49 or step == args.steps - 1:
            row["space_floor_mha"] = (space.ground_energy() - e_fci) * HARTREE_TO_MHA
        trace.append(row)
    return {"expand": expand, "sign_fit": sign_fit, "trace": trace}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="a selected-sum run's checkpoint folder")
    p.add_argument("--molecule", default="h2o")
    p.add_argument("--basis", default="6-31g")
    p.add_argument("--variants", nargs="+", default=["0:0", "5000:0"],
                   help="EXPAND:SIGN_FIT per variant: configurations per expansion, phase-fit steps per refit")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", type=Path, default=Path("bench/results/nnqs_h2o_631g_expand.json"))
    args = p.parse_args()
    for variant in args.variants:
        if len(variant.split(":")) != 2 or not all(v.isdigit() for v in variant.split(":")):
            p.error(f"--variants: {variant!r} is not EXPAND:SIGN_FIT (two integers >= 0)")
    with ProcessPoolExecutor(len(args.variants), mp_context=get_context("spawn")) as pool:
        runs = list(pool.map(continue_run, [args] * len(args.variants), args.variants))
    print(f"{'expand':>7} {'sign fit':>9} {'start mHa':>10} {'end mHa':>8} {'floor mHa':>10} {'|S| end':>8} "
          f"{'s/step':>7}")
    for run in runs:
        first, last = run["trace"][0], run["trace"][-1]
        print(f"{run['expand']:>7} {run['sign_fit']:>9} {first['error_mha']:>10.3f} {last['error_mha']:>8.3f} "
              f"{last['space_floor_mha']:>10.3f} {last['n_selected']:>8} {last['wall_s'] / len(run['trace']):>7.2f}")
    meta = {"checkpoint": str(args.checkpoint), "molecule": args.molecule, "basis": args.basis, "steps": args.steps,
            "lr": args.lr, "seed": args.seed, "threads_per_variant": 1, "torch": torch.__version__}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
