"""Built-in tasks: deterministic, correct, and with a validation split that never overlaps training."""

import datetime as dt
import re

from seqlab.data import build_dataset
from seqlab.data.synthetic import (HOLDOUT_EVERY, MONTHS, chat_examples, date_example, date_examples,
                                   preference_examples)
from tests.objectives.helpers import TOK


def _parse(source: str) -> dt.date:
    """An independent parser of every format the generator writes."""
    s = source.lower().replace(",", "")
    s = re.sub(r"^(monday|tuesday|wednesday|thursday|friday|saturday|sunday) ", "", s)
    s = re.sub(r"^the (\d+)(st|nd|rd|th) of ", r"\1 ", s)
    months = {m.lower(): i + 1 for i, m in enumerate(MONTHS)} | {m.lower()[:3]: i + 1 for i, m in enumerate(MONTHS)}
    if m := re.fullmatch(r"(\d{2})\.(\d{2})\.(\d{4})", s):
        return dt.date(int(m[3]), int(m[2]), int(m[1]))
    if m := re.fullmatch(r"(\d{4})/(\d{2})/(\d{2})", s):
        return dt.date(int(m[1]), int(m[2]), int(m[3]))
    if m := re.fullmatch(r"([a-z]+) (\d+) (\d{4})", s):
        return dt.date(int(m[3]), months[m[1]], int(m[2]))
    if m := re.fullmatch(r"(\d+) ([a-z]+) (\d{4})", s):
        return dt.date(int(m[3]), months[m[2]], int(m[1]))
    raise AssertionError(f"unparsed: {source!r}")


def test_dates_are_correct_deterministic_and_split():
    train = date_examples(500, seed=3)
    assert train == date_examples(500, seed=3) and train != date_examples(500, seed=4)
    for ex in train:
        assert _parse(ex["source"]).isoformat() == ex["target"]
        assert dt.date.fromisoformat(ex["target"]).toordinal() % HOLDOUT_EVERY != 0
    val = date_examples(200, seed=3, split="validation")
    assert all(dt.date.fromisoformat(e["target"]).toordinal() % HOLDOUT_EVERY == 0 for e in val)
    assert len({e["source"] for e in train}) > 490
    assert date_example(3, 7) == train[7]  # each example is a pure function of (seed, index)


def test_chats_and_preferences_are_real_and_deterministic():
    chats = chat_examples(200, seed=1)
    assert chats == chat_examples(200, seed=1)
    roles = {m["role"] for c in chats for m in c["messages"]}
    assert roles == {"system", "user", "assistant", "tool"}
    for c in chats:
        for m in c["messages"]:
            if m["role"] == "user" and (q := re.fullmatch(r"What is (\d+) ([+-]) (\d+)\?", m["content"])):
                a, op, b = int(q[1]), q[2], int(q[3])
                nxt = c["messages"][c["messages"].index(m) + 1]["content"]
                assert nxt == f"{a} {op} {b} = {a + b if op == '+' else a - b}."
        if any(m.get("tool_calls") for m in c["messages"]):
            call = next(m for m in c["messages"] if m.get("tool_calls"))["tool_calls"][0]
            tool = next(m for m in c["messages"] if m["role"] == "tool")
            a, b = map(int, call["arguments"]["expression"].split("*"))
            assert str(a * b) == tool["content"]
    prefs = preference_examples(200, seed=1)
    assert prefs == preference_examples(200, seed=1)
    assert all(p["chosen"] != p["rejected"] for p in prefs)


def test_default_datasets_cover_the_stream_once():
    """CLM windows share one token, so every token after the first is a target exactly once."""
    seq = 50
    ds = build_dataset("clm", None, TOK, seq, "validation")
    n = ds.info["n_tokens"]
    targets = sum(len(ds[i]) - 1 for i in range(len(ds)))
    assert targets == n - 1
    assert ds[0][-1] == ds[1][0] and len(ds[0]) == seq
    mlm = build_dataset("mlm", None, TOK, seq, "validation")
    assert all(len(mlm[i]) <= seq and mlm[i][0] == TOK.bos_id and mlm[i][-1] == TOK.eos_id for i in (0, len(mlm) - 1))
    s2s = build_dataset("seq2seq", None, TOK, 32, "validation", seed=0)
    assert len(s2s) == 500 and s2s[5] == build_dataset("seq2seq", None, TOK, 32, "validation", seed=0)[5]


def test_validation_chats_and_pairs_are_unseen_in_training():
    """Only the dates were held out: 22 of 200 validation pairs and 3 of 200 validation chats were training
    examples word for word, so DPO's validation accuracy was partly measured on what it trained on."""
    asked = lambda chats: {m["content"] for c in chats for m in c["messages"] if m["role"] == "user"}
    train_q, val_q = asked(chat_examples(3000, seed=0)), asked(chat_examples(300, seed=0, split="validation"))
    assert len(val_q) > 250 and not train_q & val_q
    swapped = lambda q: re.sub(r"(\d+) (\+|times) (\d+)", r"\3 \2 \1", q)  # 3 + 5 is 5 + 3 seen
    assert not {swapped(q) for q in val_q} & train_q
    train_p = {p["prompt"] for p in preference_examples(3000, seed=0)}
    val_p = {p["prompt"] for p in preference_examples(300, seed=0, split="validation")}
    assert len(val_p) > 250 and not train_p & val_p
