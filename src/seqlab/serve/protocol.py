"""The OpenAI wire format: request bodies validated into plain dataclasses, errors as OpenAI-style JSON.

Why hand-written checks rather than a schema library's messages: a client must learn *which field* is wrong
(``param`` in the error body, and named in the message), in the same shape OpenAI's own API answers with, so the
official clients raise their usual ``BadRequestError`` with a readable message.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool", "developer")


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("rate_limit_error" if status == 429 else
                              "invalid_request_error" if 400 <= status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


@dataclass
class GenerationRequest:
    """Fields shared by /v1/chat/completions and /v1/completions, validated."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM's extension: sample from the k likeliest tokens (0, or vLLM's -1: all of them)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens even past end-of-text (load tests)
    messages: list[dict[str, str]] | None = None  # chat
    prompt: str | None = None  # completions


def _number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(name, f"must be a number, got {value!r}")
    if value < low or value > high or (low_open and value == low):
        raise bad(name, f"must be in {'(' if low_open else '['}{low}, {high}], got {value!r}")
    return float(value)


def _int(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"must be an integer, got {value!r}")
    if value < low:
        raise bad(name, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise bad(name, f"must be <= {high}, got {value}")
    return value


def _bool(body: dict, name: str, param: str | None = None) -> bool:
    """A true/false field (``param``: its name in errors); absent or null is false, as OpenAI reads it."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(param or name, f"must be true or false, got {value!r}")
    return value


# characters of one stop string: every generated token checks the reply's tail against each one's prefixes, on
# the engine thread every request shares (four of 100 000 characters cost 5.8 ms a token instead of 0.36)
STOP_MAX_CHARS = 1024


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value) or len(value) > 4:
        raise bad("stop", "must be a non-empty string or a list of at most 4 non-empty strings")
    if any(len(s) > STOP_MAX_CHARS for s in value):
        raise bad("stop", f"a stop string may hold at most {STOP_MAX_CHARS} characters")
    return value


# OpenAI fields this server does not implement, with the values that ask for nothing: any other value would
# change the reply if honoured, so it is refused rather than dropped without a word.
_NOT_IMPLEMENTED = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logit_bias": (None, {}), "suffix": (None, ""),
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
    "functions": (None, []), "function_call": (None, "none", "auto"), "modalities": (None, ["text"]),
    "audio": (None,), "reasoning_effort": (None,), "verbosity": (None,), "web_search_options": (None,),
    # vLLM's sampling extensions beyond top_k and ignore_eos, which a client of such a server sends
    "min_tokens": (None, 0), "min_p": (None, 0), "repetition_penalty": (None, 1), "stop_token_ids": (None, []),
    "length_penalty": (None, 1), "use_beam_search": (None, False), "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
}
# Fields read by _common and the two parsers, and fields that do not change a reply (who asked, how it is billed
# or stored): any other field is refused by name, since ignoring it could return a reply that looks like an
# answer to it and is not.
_READ = frozenset({"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                   "top_k", "seed", "stop", "stream", "stream_options", "n", "ignore_eos"})
_NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                        "safety_identifier", "prediction"})


def _neutral(value: Any, neutral: tuple) -> bool:
    """``value`` is one of ``neutral``, a bool only as a bool: in Python ``false == 0``, but a completion's
    ``logprobs: 0`` asks for the sampled tokens' log-probabilities, and ``top_logprobs: false`` is no number."""
    return any(value is n if isinstance(value, bool) or isinstance(n, bool) else value == n for n in neutral)


def _common(body: Any, text_field: str) -> GenerationRequest:
    """The fields both endpoints share; ``text_field`` is the endpoint's own input ("messages" or "prompt"), and
    the other endpoint's is refused like any unknown field (it would be ignored)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    known = (_READ - {"messages", "prompt"}) | {text_field} | _NO_EFFECT | _NOT_IMPLEMENTED.keys()
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise bad(unknown[0], "is not a field this server knows; it is refused rather than ignored")
    for name, neutral in _NOT_IMPLEMENTED.items():
        value = body.get(name)
        if not _neutral(value, neutral):
            raise bad(name, f"is not supported by this server (got {value!r})")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "is required (a model id from GET /v1/models)")
    n = body.get("n")
    if n is not None and (n != 1 or isinstance(n, bool)):
        raise bad("n", f"only n=1 is supported, got {n!r}")
    options = body.get("stream_options")
    if options is not None:  # as OpenAI's API: only with a stream, and include_usage is its one setting here
        if not isinstance(options, dict):
            raise bad("stream_options", "must be an object")
        if body.get("stream") is not True:
            raise bad("stream_options", "applies to streamed replies only: set stream to true, or drop it")
        obfuscation = options.get("include_obfuscation")  # padding against length side channels: none is added
        if obfuscation is not None and not isinstance(obfuscation, bool):
            raise bad("stream_options.include_obfuscation", "must be a boolean")
        for key in sorted(set(options) - {"include_usage", "include_obfuscation"}):
            raise bad(f"stream_options.{key}", "is not supported (read: include_usage; include_obfuscation has "
                                               "no effect)")
    options = options or {}
    max_tokens = _int(body, "max_completion_tokens", 1)
    max_tokens = _int(body, "max_tokens", 1) if max_tokens is None else max_tokens
    top_k = _int(body, "top_k", -1)
    return GenerationRequest(
        model=model, max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True), top_k=max(top_k or 0, 0),
        seed=_int(body, "seed", -(2**63), 2**64 - 1), stop=_stop(body), stream=_bool(body, "stream"),
        include_usage=_bool(options, "include_usage", "stream_options.include_usage"),
        ignore_eos=_bool(body, "ignore_eos"),
    )


def parse_chat(body: Any) -> GenerationRequest:
    req = _common(body, "messages")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "must be an object with role and content")
        extra = sorted(k for k, v in m.items() if k not in ("role", "content") and v not in (None, "", []))
        if extra:  # a tool call, its id or a speaker's name: the prompt would not say it, so refused, not dropped
            raise bad(f"messages[{i}].{extra[0]}", "is not supported by this server; it is refused rather than "
                                                   "left out of the prompt")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise bad(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role!r}")
        if isinstance(content, list):  # the content-parts form: text parts only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"messages[{i}].content", "only text content parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", "must be a string")
        clean.append({"role": "system" if role == "developer" else role, "content": content})
    req.messages = clean
    return req


def parse_completion(body: Any) -> GenerationRequest:
    req = _common(body, "prompt")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad("prompt", "must be a non-empty string (one prompt per request)")
    req.prompt = prompt
    return req


# ---------------------------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_response(rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                         "logprobs": None}],
            "usage": use}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}


def completion_response(rid: str, model: str, text: str, finish: str | None, use: dict | None) -> dict:
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
    if use is not None:
        body["usage"] = use
    return body


def usage_chunk(rid: str, model: str, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model, "choices": [], "usage": use}
