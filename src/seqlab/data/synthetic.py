"""Small built-in tasks, generated on the fly from a seed, so every objective has data without a download.

- seq2seq: **date normalisation** — "Friday, March 5, 2021" / "5 Mar 2021" / "05.03.2021" ... -> "2021-03-05".
  Each example is a pure function of (seed, index); the validation split uses only dates whose day number is a
  multiple of 20 and training never does, so validation dates are truly unseen. The chats' and pairs' sums,
  differences, products and word lists are held out the same way (one in 20 by a key of their operands or words).
- SFT: short chats in ChatML roles — arithmetic, date normalisation, word reversal, and a calculator *tool call*
  round trip (assistant calls the tool, the tool answers, the assistant reports) — with an optional system prompt.
- DPO: the same kinds of prompts with a correct (chosen) and a plausibly wrong (rejected) answer.

Deterministic: ``random.Random`` seeded per example, no global state, so two processes (or two ranks) build the
same example for the same index.
"""

from __future__ import annotations

import datetime as _dt
import random
from typing import Any

MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_FIRST = _dt.date(1900, 1, 1).toordinal()
_LAST = _dt.date(2099, 12, 31).toordinal()
HOLDOUT_EVERY = 20


def _rng(seed: int, index: int, salt: int) -> random.Random:
    # A string seed hashes with sha512 inside random.seed: stable across processes (unlike hash()).
    return random.Random(f"{seed}/{salt}/{index}")


def _in_split(key: int, split: str) -> bool:
    """Every task's items are split by a key: one in ``HOLDOUT_EVERY`` is validation's and never training's."""
    return (key % HOLDOUT_EVERY == 0) == (split == "validation")


def _pick_day(rng: random.Random, split: str) -> _dt.date:
    while True:
        o = rng.randint(_FIRST, _LAST)
        if _in_split(o, split):
            return _dt.date.fromordinal(o)


def _pick_operands(rng: random.Random, split: str, low: int, ordered: bool = False) -> tuple[int, int]:
    """Two numbers in [low, 99] of the split's pairs. ``ordered`` (a subtraction): the larger first, and the pair's
    order is its own; otherwise 3 + 5 and 5 + 3 are one item, held out together. The key is mixed (Fibonacci
    hashing), so that validation is not simply "the second operand is a multiple of 20"."""
    while True:
        a, b = rng.randint(low, 99), rng.randint(low, 99)
        if ordered and b > a:
            a, b = b, a
        first, second = (a, b) if ordered else (min(a, b), max(a, b))
        if _in_split(((100 * first + second) * 0x9E3779B1 % 2**32) >> 16, split):
            return a, b


def format_date(d: _dt.date, style: int) -> str:
    m = MONTHS[d.month - 1]
    return [
        f"{m} {d.day}, {d.year}",
        f"{d.day} {m} {d.year}",
        f"{m[:3]} {d.day} {d.year}",
        f"{d.day:02d}.{d.month:02d}.{d.year}",
        f"{d.year}/{d.month:02d}/{d.day:02d}",
        f"{WEEKDAYS[d.weekday()]}, {m} {d.day}, {d.year}",
        f"the {d.day}{_ordinal_suffix(d.day)} of {m}, {d.year}",
        f"{m.upper()} {d.day} {d.year}",
    ][style]


N_DATE_STYLES = 8


def _ordinal_suffix(n: int) -> str:
    return "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


def date_example(seed: int, index: int, split: str = "train") -> dict[str, str]:
    rng = _rng(seed, index, 1)
    d = _pick_day(rng, split)
    return {"source": format_date(d, rng.randrange(N_DATE_STYLES)), "target": d.isoformat()}


def date_examples(n: int, seed: int = 0, split: str = "train") -> list[dict[str, str]]:
    return [date_example(seed, i, split) for i in range(n)]


# --- chats (SFT) and preference pairs (DPO) ---------------------------------------------------------------------

SYSTEM_PROMPTS = ["You are a concise assistant.", "Answer briefly and exactly.", "You are a helpful assistant."]
CALCULATOR_TOOL = "calculator"


WORDS = ["apple", "river", "stone", "cloud", "tiger", "maple", "ember", "ocean", "lemon", "pilot", "amber", "candle",
         "harbor", "violet"]


def _word_reverse(rng: random.Random, split: str) -> tuple[str, str, str]:
    while True:
        words = rng.sample(WORDS, k=rng.randint(2, 4))
        if _in_split(sum(WORDS.index(w) * len(WORDS) ** i for i, w in enumerate(words)), split):
            return "reverse", f"Reverse the order of these words: {' '.join(words)}", " ".join(reversed(words))


def _task(rng: random.Random, split: str) -> tuple[str, str, str, tuple[int, int, str] | None]:
    """(kind, question, answer, arithmetic operands or None)."""
    kind = rng.choice(["add", "sub", "date", "reverse"])
    if kind in ("add", "sub"):
        a, b = _pick_operands(rng, split, 2, ordered=kind == "sub")
        op = "+" if kind == "add" else "-"
        ans = a + b if kind == "add" else a - b
        return kind, f"What is {a} {op} {b}?", f"{a} {op} {b} = {ans}.", (a, b, op)
    if kind == "date":
        d = _pick_day(rng, split)
        return kind, f"Write {format_date(d, rng.randrange(N_DATE_STYLES))} in ISO format.", d.isoformat(), None
    k, q, a = _word_reverse(rng, split)
    return k, q, a, None


def chat_example(seed: int, index: int, split: str = "train") -> dict[str, Any]:
    """One conversation: optional system prompt, 1-2 user/assistant exchanges, sometimes a calculator tool call."""
    rng = _rng(seed, index, 2)
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    if rng.random() < 0.25:  # tool round trip: multiply with the calculator
        a, b = _pick_operands(rng, split, 11)
        messages += [
            {"role": "user", "content": f"Use the calculator: what is {a} times {b}?"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"name": CALCULATOR_TOOL, "arguments": {"expression": f"{a}*{b}"}}]},
            {"role": "tool", "content": str(a * b)},
            {"role": "assistant", "content": f"{a} times {b} is {a * b}."},
        ]
        return {"messages": messages}
    for _ in range(rng.randint(1, 2)):
        _, q, a, _ops = _task(rng, split)
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": messages}


def chat_examples(n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    return [chat_example(seed, i, split) for i in range(n)]


def preference_example(seed: int, index: int, split: str = "train") -> dict[str, str]:
    """A prompt with a correct answer (chosen) and a near miss (rejected): off-by-a-little sums, a shifted date,
    a partly reversed word list."""
    rng = _rng(seed, index, 3)
    kind, q, a, ops = _task(rng, split)
    if ops is not None:
        x, y, op = ops
        ans = x + y if op == "+" else x - y
        wrong = ans + rng.choice([-10, -2, -1, 1, 2, 10])
        rejected = f"{x} {op} {y} = {wrong}."
    elif kind == "date":
        d = _dt.date.fromisoformat(a)
        rejected = f"{d.year}-{d.day:02d}-{d.month:02d}" if d.day != d.month and d.day <= 12 else \
            (d + _dt.timedelta(days=rng.choice([-1, 1]))).isoformat()
    else:
        words = a.split()
        rejected = " ".join(reversed(words))  # the original order: not reversed at all
    return {"prompt": q, "chosen": a, "rejected": rejected}


def preference_examples(n: int, seed: int = 0, split: str = "train") -> list[dict[str, str]]:
    return [preference_example(seed, i, split) for i in range(n)]
