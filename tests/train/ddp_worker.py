"""Run under torchrun by test_distributed.py: a few steps with DDP, then FSDP2, then a seq2seq run under FSDP2
resumed from its step-2 checkpoint; rank 0 writes the losses."""

import json
import shutil
import sys
from pathlib import Path

import torch

from seqlab.data import ByteTokenizer
from seqlab.data.datasets import Examples
from seqlab.objectives import build_objective
from seqlab.runtime.dist import barrier
from seqlab.train import TrainConfig, Trainer
from tests.train.conftest import make_trainer, tiny_model, windows


def seq2seq_under_fsdp(name: str, resume: bool = False) -> Trainer:
    """seq2seq shares one embedding under three names (shared, encoder.embed.tok, decoder.embed.tok)."""
    tok = ByteTokenizer()
    pairs = Examples([{"source_ids": tok.encode(f"{i} Mar 2021"), "target_ids": tok.encode(f"2021-03-{i:02d}")}
                      for i in range(1, 29)])
    cfg = TrainConfig(objective="seq2seq", out_dir=str(out / name), max_steps=3, batch_size=2, seq_len=24, lr=3e-3,
                      warmup_steps=2, eval_interval=0, log_interval=1, ckpt_interval=2, progress=False, plot=False,
                      precision="fp32", device="cpu", seed=7, parallel="fsdp")
    model = tiny_model(tok, arch="encoder_decoder", bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    return Trainer(cfg, model, build_objective("seq2seq", tok), pairs, tokenizer=tok, resume=resume)


out = Path(sys.argv[1])
torch.set_num_threads(1)
data = windows(ByteTokenizer(), ragged=True)
res = {}
trainers = []
for mode in sys.argv[2].split(","):
    t = make_trainer(out, out=mode, data=data, steps=3, batch_size=2, grad_accum=1, parallel=mode, ckpt_interval=2)
    r = t.fit()
    res[mode] = {"losses": r.losses, "world": t.dist.world_size, "checkpoint": r.checkpoint}
    trainers.append(t)
whole = seq2seq_under_fsdp("s2s")
res["fsdp_seq2seq"] = {"losses": whole.fit().losses}
if whole.dist.is_main:
    shutil.copytree(out / "s2s", out / "s2s_resumed")
    shutil.rmtree(out / "s2s_resumed" / "checkpoints" / "step_00000003")
barrier(whole.dist)
res["fsdp_seq2seq"]["resumed"] = seq2seq_under_fsdp("s2s_resumed", resume=True).fit().losses
if trainers[0].dist.is_main:
    (out / "losses.json").write_text(json.dumps(res))
trainers[0].close()
