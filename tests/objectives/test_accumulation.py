"""Gradient accumulation: k micro-batches with different padding == one batch holding all of them.

The step loss is sum(token losses) / (valid targets of the whole step): every micro-batch backpropagates
``loss_sum / step_targets``. The naive mean of per-micro-batch means is checked to differ, so the test can fail.
"""

import pytest
import torch

from seqlab.objectives import build_objective
from tests.objectives.helpers import TOK, grads, tiny_model

TEXTS = ["Friends, Romans, countrymen,", "lend me", "your ears; I come to bury Caesar,", "not to praise him.",
         "The evil that men do lives after them;", "The good is oft", "interred with their bones."]


def _examples(name):
    if name == "clm":
        return [TOK.encode(t) for t in TEXTS]
    if name == "seq2seq":
        return [{"source_ids": TOK.encode(t) + [TOK.eos_id], "target_ids": TOK.encode(t.upper()[:12])} for t in TEXTS]
    if name == "mlm":
        return [[TOK.bos_id] + TOK.encode(t) + [TOK.eos_id] for t in TEXTS]
    if name == "sft":
        return [{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": t[::-1][:k + 3]}]}
                for k, t in enumerate(TEXTS)]
    return [{"prompt": t, "chosen": t[:5], "rejected": t[-7:]} for t in TEXTS]


ARCH = {"clm": "decoder", "sft": "decoder", "dpo": "decoder", "mlm": "encoder", "seq2seq": "encoder_decoder"}


@pytest.mark.parametrize("name", ["clm", "seq2seq", "mlm", "sft", "dpo"])
def test_micro_batches_equal_one_batch(name):
    exs = _examples(name)
    split = [exs[:2], exs[2:3], exs[3:]]  # different sizes, hence different padding
    obj = build_objective(name, TOK, **({"seed": 3} if name == "mlm" else {}))

    def collated(group):
        if name == "mlm":  # one mask for all: draw it on the full batch, then cut rows (padding differs per cut)
            full = obj.collate(exs, generator=torch.Generator().manual_seed(5))
            rows = [exs.index(e) for e in group]
            L = max(len(e) for e in group)
            return {k: v[rows, :L] for k, v in full.items()}
        return obj.collate(group)

    model = tiny_model(ARCH[name], seed=1)
    obj.setup(model)
    full = collated(exs)
    out = obj.loss(model, full)
    (out.loss_sum / out.n_targets).backward()
    g_full = grads(model)

    model.zero_grad()
    micro = [collated(g) for g in split]
    assert len({b["input_ids"].shape[1] for b in micro}) > 1 or name == "dpo"
    step_targets = sum(obj.num_targets(b) for b in micro)
    assert step_targets == out.n_targets
    for b in micro:
        o = obj.loss(model, b)
        assert o.n_targets == obj.num_targets(b)
        (o.loss_sum / step_targets).backward()
    g_acc = grads(model)
    worst = max((g_full[k] - g_acc[k]).abs().max().item() for k in g_full)
    assert worst < 1e-6, worst

    # the 2024 bug: averaging per-micro-batch means weights targets unequally, and the test notices
    model.zero_grad()
    for b in micro:
        o = obj.loss(model, b)
        (o.loss_sum / o.n_targets / len(micro)).backward()
    g_bad = grads(model)
    assert max((g_full[k] - g_bad[k]).abs().max().item() for k in g_full) > 1e-4
