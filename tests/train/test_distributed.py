"""torchrun --nproc_per_node 2 (gloo) gives the same losses as one process with the same global batch, and its
checkpoints resume in one process (twice the gradient accumulation) onto the same losses; a seq2seq run (one
embedding under three names) resumes under FSDP2 onto its uninterrupted losses."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from seqlab.data import ByteTokenizer
from seqlab.runtime.dist import DistInfo
from seqlab.train.distributed import wrap_model
from tests.train.conftest import make_trainer, windows

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "train" / "ddp_worker.py"), str(tmp_path), "ddp,fsdp"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "losses.json").read_text())
    s2s = res["fsdp_seq2seq"]  # its step-3 loss again, from the step-2 checkpoint (the shared embedding loaded)
    assert len(s2s["losses"]) == 3 and len(s2s["resumed"]) == 1
    assert abs(s2s["resumed"][0] - s2s["losses"][2]) < 1e-6, s2s

    data = windows(ByteTokenizer(), ragged=True)  # ranks see different padding: normalisation must be global
    single = make_trainer(tmp_path, out="single", data=data, steps=3, batch_size=2, grad_accum=2).fit()
    for mode in ("ddp", "fsdp"):
        assert res[mode]["world"] == 2
        assert len(res[mode]["losses"]) == 3
        for a, b in zip(single.losses, res[mode]["losses"]):
            assert abs(a - b) < 1e-5, (mode, single.losses, res[mode]["losses"])
        assert Path(res[mode]["checkpoint"]).name == "step_00000003"  # rank 0 wrote the final checkpoint

        # the 2-process run's step-2 checkpoint, resumed in 1 process with grad_accum 2: the same global batch, so
        # the same data; the step-3 loss is the uninterrupted runs' (RNG streams are re-seeded, dropout is off)
        moved = tmp_path / f"{mode}_in_one"
        shutil.copytree(tmp_path / mode, moved)
        shutil.rmtree(moved / "checkpoints" / "step_00000003")
        with pytest.raises(ValueError, match="--grad-accum 2 keeps it with 1 process"):
            make_trainer(tmp_path, out=moved.name, data=data, steps=3, batch_size=2, grad_accum=1, parallel=mode,
                         resume=True)
        resumed = make_trainer(tmp_path, out=moved.name, data=data, steps=3, batch_size=2, grad_accum=2,
                               parallel=mode, resume=True)
        assert resumed.step == 2
        last = resumed.fit().losses
        assert len(last) == 1 and abs(last[0] - single.losses[2]) < 1e-5, (mode, last, single.losses)


@pytest.mark.distributed
@pytest.mark.slow
def test_ranks_agree_where_they_must_and_draw_their_own_dropout(tmp_path):
    """Two ranks: each draws its own dropout (one seed gave both ranks the same masks); DPO's metrics are logged,
    pooled (they were dropped); a StopTraining raised on rank 1 alone ends both (rank 0 waited in the next
    all-reduce for ever); when the loss turns NaN both ranks name the last checkpoint (rank 1 said none); and a tied
    head is stored once."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "tests" / "train" / "ddp_edges_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["draws"] != r1["draws"]
    assert {"reward_margin", "accuracy"} <= set(r0["dpo_logged"])
    assert r0["stopped_at"] == r1["stopped_at"] == 1
    assert r0["diverged"] == r1["diverged"] and "the last good checkpoint is" in r0["diverged"]
    # a tied head is stored once, as one process stores it (FSDP's gather gave it a copy of its own)
    single = make_trainer(tmp_path, out="single_tied", steps=1)
    single.fit()
    sizes = [(tmp_path / run / "checkpoints" / "step_00000001" / "model.safetensors").stat().st_size
             for run in ("fsdp_tied", "single_tied")]
    assert sizes[0] == sizes[1], sizes


def test_parallel_none_with_several_processes_is_refused():
    """`torchrun --nproc-per-node 2 ... --parallel none` sharded the data and pooled the losses but never the
    gradients: two replicas trained apart (grad_norm 1.54 where DDP and one process read 1.17), the validation
    loss mixed both models, and the checkpoint kept rank 0's. One process still runs unwrapped."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="--parallel none with 2 processes would train 2 unsynchronised copies"):
        wrap_model(model, "none", DistInfo(rank=0, world_size=2))
    assert wrap_model(model, "none", DistInfo()) is model and wrap_model(model, "ddp", DistInfo()) is model
