"""Run under torchrun by test_distributed.py: a few steps with DDP, then FSDP2; rank 0 writes the losses."""

import json
import sys
from pathlib import Path

import torch

from seqlab.data import ByteTokenizer
from tests.train.conftest import make_trainer, windows

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
if trainers[0].dist.is_main:
    (out / "losses.json").write_text(json.dumps(res))
trainers[0].close()
