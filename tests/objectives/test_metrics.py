"""Perplexity and bits per byte from pooled sums: batches combine exactly; bytes are counted exactly."""

import math


from seqlab.data import build_dataset
from seqlab.eval.metrics import bits_per_byte, evaluate, perplexity
from seqlab.objectives import CausalLM
from tests.objectives.helpers import TOK, tiny_model


def test_formulas():
    assert math.isclose(perplexity(10 * math.log(7), 10), 7.0)
    assert math.isclose(bits_per_byte(100 * math.log(2), 50), 2.0)  # 100 bits over 50 bytes


def test_evaluate_pools_batches_exactly_and_counts_bytes():
    model = tiny_model(seed=3)
    obj = CausalLM(TOK)
    ds = build_dataset("clm", None, TOK, 48, "validation")
    exs = [ds[i] for i in range(7)] + [ds[len(ds) - 1]]  # the last window is shorter: uneven batches
    one = evaluate(model, obj, [obj.collate(exs)])
    many = evaluate(model, obj, [obj.collate(exs[:3]), obj.collate(exs[3:4]), obj.collate(exs[4:])])
    assert many["n_targets"] == one["n_targets"] == sum(len(e) - 1 for e in exs)
    assert math.isclose(many["loss"], one["loss"], rel_tol=1e-6)
    assert math.isclose(many["perplexity"], math.exp(one["loss"]), rel_tol=1e-6)
    # byte tokenizer: bytes = targets that are not specials (EOS is a special and spells no byte)
    n_special = sum(sum(t in TOK.special_ids for t in e[1:]) for e in exs)
    assert one["n_bytes"] == one["n_targets"] - n_special
    assert math.isclose(one["bits_per_byte"], one["loss"] * one["n_targets"] / (one["n_bytes"] * math.log(2)))
    assert model.training  # evaluate restores the mode
