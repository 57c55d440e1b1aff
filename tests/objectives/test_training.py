"""Each objective, on its default built-in data, trains a tiny model for a few steps and its loss goes down."""

import pytest
import torch

from seqlab.data import build_dataset
from seqlab.objectives import build_objective
from tests.objectives.helpers import TOK, tiny_model

STEPS = {"clm": 40, "mlm": 40, "seq2seq": 40, "sft": 40, "dpo": 15}


@pytest.mark.parametrize("name", ["clm", "mlm", "seq2seq", "sft", "dpo"])
def test_loss_goes_down(name):
    torch.manual_seed(0)
    ds = build_dataset(name, None, TOK, seq_len=64, split="train", seed=0)
    obj = build_objective(name, TOK)
    model = tiny_model(obj.arch, seed=0, d_model=64)
    obj.setup(model)
    batches = [obj.collate([ds[i] for i in range(k * 8, k * 8 + 8)]) for k in range(4)]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3 if name != "dpo" else 1e-3)

    def mean_loss():
        with torch.no_grad():
            outs = [obj.loss(model, b) for b in batches]
        return sum(float(o.loss_sum) for o in outs) / sum(o.n_targets for o in outs)

    before = mean_loss()
    for step in range(STEPS[name]):
        b = batches[step % len(batches)]
        out = obj.loss(model, b)
        opt.zero_grad()
        (out.loss_sum / out.n_targets).backward()
        opt.step()
    after = mean_loss()
    assert after < before * (0.85 if name != "dpo" else 0.9), (before, after)
    if name == "dpo":
        assert out.metrics["accuracy"] > 0.5 and out.metrics["reward_margin"] > 0
