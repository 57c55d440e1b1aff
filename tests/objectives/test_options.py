"""Objective options: every name, type and range is checked before an objective (or a run) exists, naming the
option; the constructors refuse the same values."""

import pytest
import torch

from seqlab.objectives import DPO, CausalLM, MaskedLM, build_objective, check_objective_options
from tests.objectives.helpers import TOK

BAD = [  # (objective, options, what the message must say)
    ("dpo", {"beta": "abc"}, "beta='abc' must be a number"),
    ("dpo", {"beta": True}, "beta=True must be a number"),
    ("dpo", {"beta": 0}, "beta=0 must be a positive finite number"),
    ("dpo", {"beta": float("nan")}, "beta=nan must be a positive finite number"),
    ("dpo", {"reference": 1}, "reference=1 must be a Module object or null"),
    ("dpo", {"max_len": "abc"}, "max_len='abc' must be an integer or null"),
    ("dpo", {"max_len": 0}, "max_len=0 must be a positive integer or null"),
    ("dpo", {"template": 3}, "template=3 must be a string or null"),
    ("mlm", {"mask_prob": "abc"}, "mask_prob='abc' must be a number"),
    ("mlm", {"mask_prob": 0}, "mask_prob=0 must be in (0, 1]"),
    ("mlm", {"random_frac": -0.1}, "random_frac=-0.1 must be in [0, 1]"),
    ("mlm", {"mask_frac": 0.95, "random_frac": 0.1}, "mask_frac=0.95 and random_frac=0.1 must add up to at most 1"),
    ("mlm", {"seed": 1.5}, "seed=1.5 must be an integer"),
    ("clm", {"padding_side": "middle"}, "padding_side='middle' must be one of ['right', 'left']"),
    ("sft", {"padding_side": "middle"}, "padding_side='middle' must be one of ['right', 'left']"),
    ("seq2seq", {"beta": 0.1}, "got unknown option(s) ['beta']"),
]


@pytest.mark.parametrize("name,options,expect", BAD, ids=[f"{n}-{'-'.join(o)}" for n, o, _ in BAD])
def test_bad_options_are_refused_naming_the_option(name, options, expect):
    with pytest.raises(ValueError) as info:
        check_objective_options(name, options)
    assert expect in str(info.value)
    with pytest.raises(ValueError, match="option"):  # the builder refuses them too, before the constructor runs
        build_objective(name, TOK, **options)


def test_good_options_pass_and_build():
    model = torch.nn.Linear(2, 2)
    for name, options in (("dpo", {"beta": 1, "max_len": None, "reference": model, "template": None}),
                          ("mlm", {"mask_prob": 1, "mask_frac": 0.5, "random_frac": 0.5, "seed": 3}),
                          ("clm", {"padding_side": "left"}), ("sft", {"padding_side": "right"}), ("seq2seq", {})):
        check_objective_options(name, options)
        assert build_objective(name, TOK, **options).name == name


def test_constructors_refuse_the_same_values():
    with pytest.raises(ValueError, match="beta=-1"):
        DPO(TOK, beta=-1)
    with pytest.raises(ValueError, match="mask_prob=2"):
        MaskedLM(TOK, mask_prob=2)
    with pytest.raises(ValueError, match="padding_side='up'"):
        CausalLM(TOK, padding_side="up")
