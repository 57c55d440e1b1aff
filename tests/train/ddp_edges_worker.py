"""Run under torchrun by test_distributed.py: what ranks must agree on, or must not share. Each rank writes
``rank<R>.json`` under ``argv[1]``: its first dropout draws, DPO's logged metrics, what a StopTraining raised on
rank 1 alone did, and the message each rank gives when the loss turns NaN after a checkpoint; and a tied model's
FSDP checkpoint in ``fsdp_tied``."""

import json
import sys
from pathlib import Path

import torch

from seqlab.data import ByteTokenizer, build_dataset
from seqlab.train.outcome import StopTraining, TrainingDiverged
from tests.train.conftest import make_trainer

out = Path(sys.argv[1])
torch.set_num_threads(1)
res: dict = {}

t = make_trainer(out, out="dropout", steps=1, dropout=0.5, parallel="ddp")
res["draws"] = torch.rand(6).tolist()  # the stream dropout reads, from where the trainer leaves it
rank = t.dist.rank

tok = ByteTokenizer()
examples = build_dataset("dpo", None, tok, 64, "train", size=16)
prefs = [examples[i] for i in range(len(examples))]
dpo = make_trainer(out, out="dpo", objective="dpo", data=prefs, steps=1, batch_size=2, parallel="ddp")
dpo.fit()
if rank == 0:
    res["dpo_logged"] = json.loads((out / "dpo" / "metrics.jsonl").read_text().splitlines()[0])


def stop_on_rank_1(trainer, record):
    if trainer.dist.rank == 1 and trainer.step == 1:
        raise StopTraining


res["stopped_at"] = make_trainer(out, out="stop", steps=4, callbacks=[stop_on_rank_1], parallel="ddp").fit().step

try:
    make_trainer(out, out="nan", steps=4, lr=1e18, ckpt_interval=1, parallel="ddp").fit()
    res["diverged"] = None
except TrainingDiverged as e:
    res["diverged"] = str(e)

make_trainer(out, out="fsdp_tied", steps=1, parallel="fsdp").fit()  # tiny_model ties its head to the embedding

(out / f"rank{rank}.json").write_text(json.dumps(res))
t.close()
