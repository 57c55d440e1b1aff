"""Chat conversations -> token ids with role boundaries, for SFT (assistant-only loss) and DPO (prompt/response).

A conversation (system / user / assistant / tool messages, assistant tool calls) is rendered by the tokenizer's chat
template in Jinja's *sandbox* (``seqlab.data.chat_template``: a template ships inside model files, so it must not be
able to touch Python). Assistant spans are found by rendering *incrementally*: for assistant message k,

    start = len(render(messages[:k], add_generation_prompt=True))   # everything up to "<|im_start|>assistant\\n"
    end   = len(render(messages[:k+1]))  cut right after the end-of-turn token

so the span is the assistant's content (and tool calls) plus its end-of-turn token, exactly what the model must
produce at inference, where the prompt is rendered with ``add_generation_prompt=True``. The text is then encoded
segment by segment at those boundaries, which is also where inference starts generating, so token boundaries
match. A template whose renders are not prefixes of each other cannot be split this way and raises.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

from seqlab.data.collate import IGNORE_INDEX
from seqlab.data.chat_template import render_chat_template


class ChatTemplateSpanError(ValueError):
    """The chat template does not render prefix-stably, so assistant spans cannot be located."""


def _special_str(tokenizer: Any, tid: int | None) -> str:
    if tid is None:
        return ""
    return next((s for s, i in tokenizer.special_tokens.items() if i == tid), "")


def _template_tokens(tokenizer: Any) -> dict[str, str]:
    """The special tokens a chat template may print, by the names transformers passes them."""
    return {"bos_token": _special_str(tokenizer, tokenizer.bos_id),
            "eos_token": _special_str(tokenizer, tokenizer.eos_id)}


def render_with_spans(tokenizer: Any, messages: Sequence[dict], template: str | None = None
                      ) -> tuple[str, list[tuple[int, int]]]:
    """-> (full text, [(start, end) character span of each assistant turn incl. its end-of-turn token])."""
    template = template or tokenizer.chat_template
    if not template:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name', '?')!r} has no chat template; pass one")
    extra = _template_tokens(tokenizer)
    render = lambda msgs, gen=False: render_chat_template(template, msgs, add_generation_prompt=gen, **extra)
    messages = list(messages)
    full = render(messages)
    eot = getattr(tokenizer, "eot_token", None)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = render(messages[:k], True)
        upto = render(messages[: k + 1])
        if not (upto.startswith(prefix) and full.startswith(upto)):
            raise ChatTemplateSpanError(
                f"chat template is not prefix-stable at message {k}: rendering the conversation up to the assistant "
                "turn is not a prefix of the full rendering, so the assistant span cannot be located")
        start, end = len(prefix), len(upto)
        if eot:
            j = full.rfind(eot, start, end)
            if j >= 0:
                end = j + len(eot)
        if m.get("tool_calls") and not full[start:end].replace(eot or "", "").strip():
            warnings.warn("the chat template renders nothing for an assistant turn's tool calls, so that turn trains "
                          "only its end of turn (the template has no tool_calls branch)", stacklevel=2)
        spans.append((start, end))
    return full, spans


def tokenize_chat(tokenizer: Any, messages: Sequence[dict], max_len: int | None = None,
                  template: str | None = None) -> dict[str, list[int]]:
    """-> ``{"input_ids", "labels"}`` with labels = ids on assistant spans, -100 elsewhere (unshifted)."""
    text, spans = render_with_spans(tokenizer, messages, template)
    ids: list[int] = []
    labels: list[int] = []
    pos = 0
    for start, end in spans + [(len(text), len(text))]:
        for seg, learn in ((text[pos:start], False), (text[start:end], True)):
            if seg:
                seg_ids = tokenizer.encode(seg)
                ids += seg_ids
                labels += seg_ids if learn else [IGNORE_INDEX] * len(seg_ids)
        pos = end
    if max_len is not None:
        ids, labels = ids[:max_len], labels[:max_len]
    return {"input_ids": ids, "labels": labels}


def tokenize_preference(tokenizer: Any, example: dict[str, Any], max_len: int | None = None,
                        template: str | None = None) -> dict[str, list[int]]:
    """``{"prompt", "chosen", "rejected"}`` -> ``{"prompt_ids", "chosen_ids", "rejected_ids"}``.

    With a chat template (as in SFT) the prompt is rendered as a user turn (or as the given message list) plus the
    generation prompt, and each response is the span the template renders for it as the next assistant turn, end of
    turn included (``render_with_spans``): Mistral's leading space and Gemma's ``<end_of_turn>`` are the template's,
    not the tokenizer's EOS (``_response_turn``: where the two renderings part, the response + end of turn). Without
    a template, BOS + the prompt text and responses + EOS. Over-long pairs lose prompt tokens from the left first,
    then response tokens from the right.
    """
    template = template or tokenizer.chat_template
    prompt = example["prompt"]
    if template:
        msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        prompt_text = render_chat_template(template, msgs, add_generation_prompt=True,  # what inference sees
                                           **_template_tokens(tokenizer))
        prompt_ids = tokenizer.encode(prompt_text)
        enc = lambda r: tokenizer.encode(_response_turn(tokenizer, msgs, r, template, prompt_text))
    else:
        if not isinstance(prompt, str):
            raise ValueError("a message-list prompt needs a chat template")
        # BOS first, as every document of a seqlab decoder begins (and its prompts at generation): without it an
        # empty prompt left the response's first token, often the only one where chosen and rejected differ, unscored
        bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
        prompt_ids = bos + tokenizer.encode(prompt)
        if not prompt_ids:
            raise ValueError("an empty prompt needs a BOS token before the responses, and this tokenizer has none")
        enc = lambda r: tokenizer.encode(r) + ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
    pair = {"prompt_ids": prompt_ids, "chosen_ids": enc(example["chosen"]), "rejected_ids": enc(example["rejected"])}
    return pair if max_len is None else cut_preference(pair, max_len)


def _response_turn(tokenizer: Any, msgs: list[dict], response: str, template: str, prompt_text: str) -> str:
    """The text of ``response`` as the assistant turn after ``prompt_text``: the template's own rendering of it where
    the conversation with it renders as the prompt + that turn, else the response + the end-of-turn token (Mistral
    v0.3 shows its system message only while the user turn is the last, so the two renderings part there)."""
    try:
        text, spans = render_with_spans(tokenizer, msgs + [{"role": "assistant", "content": response}], template)
    except ChatTemplateSpanError:
        text, spans = "", []
    if spans and text[: spans[-1][0]] == prompt_text:
        return text[spans[-1][0]: spans[-1][1]]
    return response + (getattr(tokenizer, "eot_token", None) or "")


def cut_preference(pair: dict[str, list[int]], max_len: int) -> dict[str, list[int]]:
    """A tokenized pair cut to ``max_len`` tokens of prompt + the longer response: prompt tokens go from the left
    first (down to half of ``max_len``), then response tokens from the right."""
    prompt_ids, chosen, rejected = pair["prompt_ids"], pair["chosen_ids"], pair["rejected_ids"]
    longest = max(len(chosen), len(rejected))
    keep_prompt = min(len(prompt_ids), max(max_len - longest, max_len // 2))
    prompt_ids = prompt_ids[len(prompt_ids) - keep_prompt:]
    room = max_len - len(prompt_ids)
    return {"prompt_ids": prompt_ids, "chosen_ids": chosen[:room], "rejected_ids": rejected[:room]}
