"""Gradient accumulation at trainer level: k micro-batches with different padding == one batch holding them all."""

import torch

from seqlab import ModelConfig
from seqlab.data import ByteTokenizer
from seqlab.data.datasets import Examples
from seqlab.objectives import build_objective
from seqlab.train.config import TrainConfig
from seqlab.train.trainer import Trainer
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


class _RightOnShortRows(torch.nn.Module):
    """A seq2seq 'model' that predicts every target of a row whose source starts with S and none elsewhere."""

    def __init__(self, tok: ByteTokenizer):
        super().__init__()
        self.tok, self.bias = tok, torch.nn.Parameter(torch.zeros(()))
        self.config = ModelConfig(arch="encoder_decoder", vocab_size=tok.vocab_size, d_model=8, n_layers=1, n_heads=1)

    def forward(self, input_ids, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None):
        following = torch.cat([decoder_input_ids[:, 1:], torch.full_like(decoder_input_ids[:, :1], self.tok.pad_id)], 1)
        lengths = decoder_attention_mask.sum(1)
        following[torch.arange(len(lengths)), lengths - 1] = self.tok.eos_id
        right = (input_ids[:, 0] == ord("S"))[:, None]
        guess = torch.where(right, following, torch.zeros_like(following))
        return torch.nn.functional.one_hot(guess, self.tok.vocab_size).float() * 10 + self.bias


def test_per_sequence_metrics_do_not_depend_on_the_micro_batches(tmp_path):
    """sequence_accuracy is a mean over rows: 4 short rows right and 4 long ones wrong read 0.5 whether the step is
    one batch of 8 or two of 4 (short rows first), where weighting it by target tokens read 0.07; token_accuracy
    stays a mean over targets."""
    tok = ByteTokenizer()
    rows = ([{"source_ids": [ord("S"), tok.eos_id], "target_ids": tok.encode("ab")}] * 4
            + [{"source_ids": [ord("L"), tok.eos_id], "target_ids": tok.encode("x" * 40)}] * 4)
    for batch_size, grad_accum in ((8, 1), (4, 2)):
        cfg = TrainConfig(objective="seq2seq", out_dir=str(tmp_path / f"{batch_size}x{grad_accum}"), max_steps=1,
                          batch_size=batch_size, grad_accum=grad_accum, device="cpu", precision="fp32",
                          progress=False, plot=False, eval_interval=0, ckpt_interval=0, warmup_steps=0)
        trainer = Trainer(cfg, _RightOnShortRows(tok), build_objective("seq2seq", tok), Examples(rows))
        trainer.sampler.shuffle = False
        record = trainer.train_step()
        assert record["sequence_accuracy"] == 0.5
        assert abs(record["token_accuracy"] - 3 * 4 / (3 * 4 + 41 * 4)) < 1e-9
