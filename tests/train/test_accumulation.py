"""Gradient accumulation at trainer level: k micro-batches with different padding == one batch holding them all."""

import torch

from seqlab.data import ByteTokenizer
from seqlab.objectives import build_objective
from tests.train.conftest import make_trainer, windows


def test_accumulated_steps_equal_one_big_batch(tmp_path):
    """In exact arithmetic the two runs are identical. The weights are float64 so rounding cannot hide a real
    difference: AdamW divides by sqrt(v), which turns fp32 rounding in a near-zero gradient into a visible weight
    difference after a few steps (and how much depends on the CPU's vector width); in float64 that noise stays
    near 1e-15 while a wrong normalisation moves weights by far more than 1e-9 (the control test below)."""
    data = windows(ByteTokenizer(), ragged=True)  # rows of different lengths: every micro-batch pads differently
    big = make_trainer(tmp_path, out="big", data=data, steps=3, batch_size=4, grad_accum=1, dtype=torch.float64)
    acc = make_trainer(tmp_path, out="acc", data=data, steps=3, batch_size=2, grad_accum=2, dtype=torch.float64)
    r_big, r_acc = big.fit(), acc.fit()
    for a, b in zip(r_big.losses, r_acc.losses):
        assert abs(a - b) < 1e-6  # the loss itself is computed in fp32 (token_cross_entropy upcasts to fp32)
    for (n, p), (_, q) in zip(big.raw_model.named_parameters(), acc.raw_model.named_parameters()):
        assert p.dtype == torch.float64
        torch.testing.assert_close(p, q, rtol=0, atol=1e-9, msg=n)


def test_mean_of_micro_batch_means_would_differ(tmp_path):
    """The control: the naive normalisation gives a different loss on the same data, so the test above can fail."""
    tok = ByteTokenizer()
    data = windows(tok, ragged=True)
    obj = build_objective("clm", tok)
    model = make_trainer(tmp_path, data=data, steps=1).raw_model
    rows = data[:4]
    parts = [obj.collate(rows[:2]), obj.collate(rows[2:])]
    outs = [obj.loss(model, b) for b in parts]
    right = sum(o.loss_sum.item() for o in outs) / sum(o.n_targets for o in outs)
    naive = sum(o.loss_sum.item() / o.n_targets for o in outs) / 2
    whole = obj.loss(model, obj.collate(rows))
    assert abs(right - whole.loss_sum.item() / whole.n_targets) < 1e-6
    assert abs(naive - right) > 1e-4
