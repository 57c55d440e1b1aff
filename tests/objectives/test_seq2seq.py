"""Seq2seq teacher forcing: decoder input [BOS]+y, labels y+[EOS], padding masked everywhere."""


from seqlab.objectives import IGNORE_INDEX, Seq2Seq
from tests.objectives.helpers import TOK, tiny_model

BOS, EOS, PAD = TOK.bos_id, TOK.eos_id, TOK.pad_id


def _ex(src, tgt):
    return {"source_ids": TOK.encode(src) + [EOS], "target_ids": TOK.encode(tgt)}


def test_teacher_forcing_layout():
    obj = Seq2Seq(TOK)
    batch = obj.collate([_ex("5 Mar 2021", "2021-03-05"), _ex("May 1", "05-01")])
    y0, y1 = TOK.encode("2021-03-05"), TOK.encode("05-01")
    assert batch["decoder_input_ids"][0].tolist() == [BOS] + y0
    assert batch["labels"][0].tolist() == y0 + [EOS]
    pad = len(y0) - len(y1)
    assert batch["decoder_input_ids"][1].tolist() == [BOS] + y1 + [PAD] * pad
    assert batch["labels"][1].tolist() == y1 + [EOS] + [IGNORE_INDEX] * pad
    assert batch["decoder_attention_mask"][1].tolist() == [1] * (len(y1) + 1) + [0] * pad
    # the decoder input is the label sequence shifted right by one: no further shift anywhere
    assert batch["decoder_input_ids"][0, 1:].tolist() == batch["labels"][0, :-1].tolist()
    src1 = TOK.encode("May 1") + [EOS]
    assert batch["input_ids"][1, : len(src1)].tolist() == src1
    assert batch["attention_mask"][1].tolist() == [1] * len(src1) + [0] * (batch["input_ids"].shape[1] - len(src1))
    assert obj.num_targets(batch) == len(y0) + len(y1) + 2


def test_padding_in_encoder_and_decoder_does_not_change_the_loss():
    """Encoder padding is masked in self- and cross-attention, decoder padding in self-attention and loss."""
    model = tiny_model("encoder_decoder")
    obj = Seq2Seq(TOK)
    exs = [_ex("the 3rd of May, 1999", "1999-05-03"), _ex("1/2", "2"), _ex("Jan 9 2000", "2000-01-09")]
    joint = obj.loss(model, obj.collate(exs))
    alone = [obj.loss(model, obj.collate([e])) for e in exs]
    assert joint.n_targets == sum(a.n_targets for a in alone)
    assert abs(float(joint.loss_sum.detach()) - sum(float(a.loss_sum.detach()) for a in alone)) < 1e-4
