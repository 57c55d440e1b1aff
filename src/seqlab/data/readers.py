"""File readers for every objective. Bad input fails once, early, with the file and line in the message.

Formats (JSONL = one JSON object per line; blank lines are skipped):

- plain text ``*.txt`` (CLM/MLM): the whole file is one document; or JSONL ``{"text": ...}``, one document a line
- seq2seq: ``{"source": str, "target": str}``
- SFT: ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": str, "tool_calls": [...]}, ...]}``
  (``tool_calls`` entries are ``{"name", "arguments"}`` or OpenAI's ``{"type": "function", "function": {...}}``)
- DPO: ``{"prompt": str | messages, "chosen": str, "rejected": str}``

Why strict: a silently skipped line or a half-decoded file trains a different model than the user thinks, and the
failure shows up hours later as a bad loss instead of now as a line number.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


# the key under which read_sft / read_preferences keep each example's line: a chat template that refuses a
# conversation (roles that do not alternate) is found only when it is tokenized, and must still name the line
LINE = "line"


class DataError(ValueError):
    """Malformed training data. ``path`` and ``line`` (1-based, None for whole-file problems) say where."""

    def __init__(self, path: str | os.PathLike, line: int | None, message: str):
        where = f"{path}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {message}")
        self.path, self.line = str(path), line


def read_text_file(path: str | os.PathLike) -> str:
    """UTF-8 text of a file; empty files and undecodable bytes are DataErrors naming the line."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(path, None, "file not found") from None
    except IsADirectoryError:
        raise DataError(path, None, "is a directory, expected a file") from None
    bom = 3 if raw.startswith(b"\xef\xbb\xbf") else 0  # a UTF-8 byte-order mark is valid UTF-8, not content
    raw = raw[bom:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        column = e.start - raw.rfind(b"\n", 0, e.start)  # 1-based, in bytes: where an editor's hex view finds it
        raise DataError(path, line, f"not valid UTF-8 (byte 0x{raw[e.start]:02x} in column {column}, at byte "
                                    f"{e.start + bom} of the file); "
                                    "re-encode the file as UTF-8") from None
    if not text.strip():
        raise DataError(path, None, "file is empty (no text or examples)")
    return text


def read_jsonl(path: str | os.PathLike) -> list[tuple[int, dict[str, Any]]]:
    """``(line_number, object)`` for every non-blank line; each line must be a JSON object. Lines end at ``\n``
    only (a CRLF's ``\r`` is JSON whitespace): ``str.splitlines`` would also cut at U+2028, U+2029 and U+0085, which
    JSON strings may hold raw, as ``json.dumps(..., ensure_ascii=False)`` writes them."""
    out = []
    for lineno, line in enumerate(read_text_file(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            array = not out and line.strip().startswith("[")  # a pretty-printed JSON array, not one object a line
            hint = "; this looks like a JSON array: write one object per line (JSONL)" if array else ""
            raise DataError(path, lineno, f"invalid JSON: {e.msg} (column {e.colno}){hint}") from None
        if not isinstance(obj, dict):
            raise DataError(path, lineno, f"expected a JSON object (one per line, JSONL), got {type(obj).__name__}")
        if "\\ud" in line.lower():  # a \ud800-\udfff escape may decode to a lone surrogate, which is no text
            _check_no_lone_surrogate(obj, path, lineno)
        out.append((lineno, obj))
    if not out:
        raise DataError(path, None, "file is empty (no text or examples)")
    return out


def _check_no_lone_surrogate(obj: dict, path, lineno: int) -> None:
    """A tokenizer cannot encode a lone UTF-16 surrogate: refused here, with its file and line, not mid-run."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(path, lineno, f"holds a lone UTF-16 surrogate ({e.object[e.start:e.end]!a}), which is not "
                                      "a character; write the text as valid Unicode") from None


def _require(obj: dict, key: str, path, lineno: int) -> Any:
    if key not in obj:
        raise DataError(path, lineno, f"missing field {key!r} (have {sorted(obj)})")
    return obj[key]


def _require_str(obj: dict, key: str, path, lineno: int, allow_empty: bool = False) -> str:
    val = _require(obj, key, path, lineno)
    if not isinstance(val, str):
        raise DataError(path, lineno, f"field {key!r} must be a string, got {type(val).__name__}")
    if not allow_empty and not val:
        raise DataError(path, lineno, f"field {key!r} is empty")
    return val


def is_jsonl(path: str | os.PathLike) -> bool:
    return Path(path).suffix.lower() in (".jsonl", ".json", ".ndjson")


def read_documents(path: str | os.PathLike) -> list[str]:
    """Plain-text documents for CLM/MLM: a text file is one document; a JSONL file holds ``{"text"}`` lines."""
    if not is_jsonl(path):
        return [read_text_file(path)]
    return [_require_str(obj, "text", path, n) for n, obj in read_jsonl(path)]


def read_seq2seq(path: str | os.PathLike) -> list[dict[str, str]]:
    return [{"source": _require_str(o, "source", path, n), "target": _require_str(o, "target", path, n)}
            for n, o in read_jsonl(path)]


def validate_messages(messages: Any, path, lineno: int, field: str = "messages",
                      need_assistant: bool = True) -> list[dict[str, Any]]:
    """Check one conversation; returns plain dicts. ``need_assistant``: SFT needs something to learn from."""
    if not isinstance(messages, list) or not messages:
        raise DataError(path, lineno, f"field {field!r} must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise DataError(path, lineno, f"{where} must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise DataError(path, lineno, f"{where}.role is {role!r}; expected one of {ROLES}")
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise DataError(path, lineno, f"{where}.tool_calls must be a list on an assistant message")
            for j, c in enumerate(calls):
                fn = c.get("function", c) if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or "arguments" not in fn:
                    raise DataError(path, lineno, f"{where}.tool_calls[{j}] needs 'name' and 'arguments'")
        content = m.get("content")
        if content is None and calls is None:
            raise DataError(path, lineno, f"{where} is missing field 'content'")
        if content is not None and not isinstance(content, str):
            raise DataError(path, lineno, f"{where}.content must be a string, got {type(content).__name__}")
        out.append(dict(m))
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise DataError(path, lineno, f"{field!r} has no assistant message (nothing to learn)")
    return out


def read_sft(path: str | os.PathLike) -> list[dict[str, Any]]:
    out = []
    for n, o in read_jsonl(path):
        out.append({"messages": validate_messages(_require(o, "messages", path, n), path, n), LINE: n})
    return out


def read_preferences(path: str | os.PathLike) -> list[dict[str, Any]]:
    out = []
    for n, o in read_jsonl(path):
        prompt = _require(o, "prompt", path, n)
        if isinstance(prompt, list):
            prompt = validate_messages(prompt, path, n, field="prompt", need_assistant=False)
        else:
            prompt = _require_str(o, "prompt", path, n)
        out.append({"prompt": prompt, "chosen": _require_str(o, "chosen", path, n),
                    "rejected": _require_str(o, "rejected", path, n), LINE: n})
    return out
