"""Causal LM: the one shift, padding never scored, document boundaries never crossed."""

import math

import torch

from seqlab.objectives import CausalLM, IGNORE_INDEX, causal_lm_loss, next_token_labels
from seqlab.data.tokenizers import ByteTokenizer
from tests.objectives.helpers import TOK, tiny_model


class PositionOracle(torch.nn.Module):
    """A 'model' over a toy where position i holds token i (one vocabulary entry per position).

    It puts all its mass on token ``i + shift`` at position i. With the correct next-token shift, only
    ``shift=1`` has (near) zero loss; every other alignment is heavily penalised.
    """

    def __init__(self, vocab: int, shift: int):
        super().__init__()
        self.vocab, self.shift = vocab, shift

    def forward(self, input_ids, attention_mask=None, document_ids=None):
        B, T = input_ids.shape
        target = (input_ids + self.shift).clamp(0, self.vocab - 1)
        return torch.nn.functional.one_hot(target, self.vocab).float() * 100.0


def test_position_i_is_scored_on_token_i_plus_1():
    T = 12
    obj = CausalLM(TOK)
    batch = obj.collate([list(range(T))])
    assert obj.num_targets(batch) == T - 1  # the last position has nothing to predict
    losses = {s: obj.loss(PositionOracle(T + 2, s), batch) for s in (0, 1, 2)}
    assert losses[1].n_targets == T - 1
    assert float(losses[1].loss_sum.detach()) < 1e-6
    assert float(losses[0].loss.detach()) > 50 and float(losses[2].loss.detach()) > 50


def test_gradient_reaches_logit_of_next_token_only():
    """d loss / d logits[i] = softmax - onehot(token i+1): the target of position i is exactly token i+1."""
    T, V = 6, 10
    ids = torch.tensor([[3, 1, 4, 1, 5, 9]])
    logits = torch.zeros(1, T, V, requires_grad=True)
    loss_sum, n = causal_lm_loss(logits, ids)
    loss_sum.backward()
    expected = torch.full((T, V), 1.0 / V)
    for i in range(T - 1):
        expected[i, ids[0, i + 1]] -= 1.0
    expected[T - 1] = 0.0
    assert n == T - 1
    torch.testing.assert_close(logits.grad[0], expected)
    assert math.isclose(float(loss_sum.detach()), (T - 1) * math.log(V), rel_tol=1e-6)


def test_padding_is_never_a_target_and_does_not_change_the_loss():
    model = tiny_model()
    obj = CausalLM(TOK)
    seqs = [TOK.encode("To be, or not to be"), TOK.encode("that is"), TOK.encode("the question:")]
    batch = obj.collate(seqs)
    assert (batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all()
    out = obj.loss(model, batch)
    assert out.n_targets == sum(len(s) - 1 for s in seqs)
    single = sum(float(obj.loss(model, obj.collate([s])).loss_sum.detach()) for s in seqs)
    assert abs(float(out.loss_sum.detach()) - single) < 1e-4
    assert out.n_bytes == out.n_targets  # byte tokenizer: one byte per target


def test_left_padding_gives_the_same_loss():
    model = tiny_model()
    seqs = [TOK.encode("Now is the winter"), TOK.encode("of our")]
    right = CausalLM(TOK).loss(model, CausalLM(TOK).collate(seqs))
    left_obj = CausalLM(TOK, padding_side="left")
    left = left_obj.loss(model, left_obj.collate(seqs))
    assert right.n_targets == left.n_targets
    assert abs(float(right.loss_sum.detach()) - float(left.loss_sum.detach())) < 1e-4


def test_document_boundary_target_is_dropped():
    labels = torch.tensor([[10, 11, 12, 20, 21, 0]])
    docs = torch.tensor([[0, 0, 0, 1, 1, -1]])
    labels = labels.masked_fill(docs < 0, IGNORE_INDEX)
    t = next_token_labels(labels, docs)
    assert t.tolist() == [[11, 12, IGNORE_INDEX, 21, IGNORE_INDEX]]


def test_bos_after_a_document_is_no_target_unless_it_is_also_eos():
    """A CLM stream is BOS text EOS BOS text EOS...: predicting the next BOS after an EOS is no skill (--pack and
    perplexity never score it), so it is dropped. A tokenizer whose BOS is its EOS (GPT-2's <|endoftext|>) keeps it:
    the model must still learn to stop."""
    bos, eos = TOK.bos_id, TOK.eos_id
    row = [bos, 65, 66, eos, bos, 67, eos]
    batch = CausalLM(TOK).collate([row])
    assert CausalLM(TOK).targets(batch).tolist() == [[65, 66, eos, IGNORE_INDEX, 67, eos]]
    same = ByteTokenizer()
    same.bos_id = same.eos_id
    row = [eos, 65, 66, eos, 67, eos]
    assert CausalLM(same).targets(CausalLM(same).collate([row])).tolist() == [[65, 66, eos, 67, eos]]


def test_bos_inside_a_text_is_an_ordinary_target():
    """SmolLM2's BOS is ChatML's <|im_start|>, which opens every turn of a chat transcript: continued CLM training
    on such text must score it there, as ``seqlab perplexity`` does (every BOS target used to be dropped). Only the
    BOS after an EOS, or at the start of a left-padded row, opens a document."""
    bos, eos, pad = TOK.bos_id, TOK.eos_id, TOK.pad_id
    row = [bos, 65, bos, 66, eos, bos, 67]
    assert CausalLM(TOK).targets(CausalLM(TOK).collate([row])).tolist() == [[65, bos, 66, eos, IGNORE_INDEX, 67]]
    left = CausalLM(TOK, padding_side="left")
    batch = left.collate([[bos, 65, bos], [bos, 66, 67, bos, 68]])
    assert batch["input_ids"][0].tolist() == [pad, pad, bos, 65, bos]
    assert left.targets(batch).tolist() == [[IGNORE_INDEX, IGNORE_INDEX, 65, bos], [66, 67, bos, 68]]
