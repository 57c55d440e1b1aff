"""Render chat templates (Jinja) the way Hugging Face does, inside a sandbox.

Why a sandbox: a chat template is code that ships inside a model file (GGUF metadata, tokenizer_config.json). A
downloaded model must not be able to read files or call arbitrary Python, so templates run in Jinja's
``ImmutableSandboxedEnvironment`` (no attribute access to dunders, no mutation of the objects we hand in).

Why mirror HF exactly: the model was fine-tuned on the bytes the template produces; a single stray newline changes
what the model sees. We use the same environment options (``trim_blocks``, ``lstrip_blocks``, loop controls) and the
same helpers HF exposes to templates (``raise_exception``, ``tojson`` with ``ensure_ascii=False``, ``strftime_now``,
the ``{% generation %}`` block tag), so any template written for HF renders identically here.

Stable API (the SFT objective reads it)::

    render_chat_template(template, messages, add_generation_prompt=False, **extra) -> str
"""

from __future__ import annotations

import functools
import json
import math
from datetime import datetime
from typing import Any, Callable, Iterable, Mapping

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplateError", "render_chat_template", "compile_chat_template", "validate_messages"]


class ChatTemplateError(ValueError):
    """The template is invalid, or it refused the conversation (``raise_exception`` in the template)."""


def _raise_exception(message: str) -> None:
    # Templates call this to reject conversations they cannot format (e.g. roles out of order).
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's built-in tojson HTML-escapes '<', '>' and '&', which would corrupt prompts; HF overrides it likewise.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` for templates, without exposing the ``dict`` type itself (no attribute tricks on the class)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` that refuses underscore attributes (no route to CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types, so a template only ever sees str/int/float/bool/list/dict.

    Rich objects (numpy scalars, str subclasses, arbitrary classes) carry methods the sandbox does not know are
    dangerous; anything that is not plain data becomes an inert ``<TypeName>`` placeholder.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _plain(value.item())  # numpy / torch scalars
    return f"<{type(value).__name__}>"


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: HF uses it to mark assistant spans; here it renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


MAX_POWER_DIGITS = 10_000  # a ** b in a template: no result past this many digits (10 ** 10 ** 8 ran for ever)
MAX_REPEAT = 10_000_000  # 'ab' * n, [0] * n: no longer result ([0] * 10 ** 9 asked for 8 GB)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' names, in its order
MAX_OUTPUT = 10_000_000  # characters a template may render (nested loops printed 6 GB before anything stopped them)
_WIDTH_METHODS = frozenset({"ljust", "rjust", "center", "zfill"})


def _too_long(n: int, what: str) -> None:
    if n > MAX_REPEAT:
        raise jinja2.exceptions.SecurityError(f"{what} of {n} characters is past the {MAX_REPEAT} a chat template "
                                              "may build")


def _check_replace(text: str, old: str, new: str) -> None:
    grown = text.count(old) * max(len(new) - len(old), 0) if old else (len(text) + 1) * len(new)
    _too_long(len(text) + grown, "a replace() result")


def _bounded_replace(builtin: Callable) -> Callable:
    def bounded(eval_ctx: Any, value: Any, old: Any, new: Any, *args: Any) -> Any:
        if isinstance(value, str) and isinstance(old, str) and isinstance(new, str):
            _check_replace(value, old, new)
        return builtin(eval_ctx, value, old, new, *args)
    bounded.jinja_pass_arg = builtin.jinja_pass_arg  # (it takes the eval context first, as the builtin does)
    return bounded


def _bounded_width(name: str, builtin: Callable) -> Callable:
    """A width-taking filter (``center``, ``indent``) that refuses a width past ``MAX_REPEAT``."""
    def bounded(value: Any, width: Any = 80, *args: Any, **kwargs: Any) -> Any:
        if isinstance(width, int):
            _too_long(width, f"{name}({width})")
        return builtin(value, width, *args, **kwargs)
    return bounded


class _ChatEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with what builds a string or list of any size from two small numbers bounded: ``**``, ``*``,
    the width of ``ljust``/``rjust``/``center``/``zfill`` and of the ``center``/``indent`` filters, ``replace``'s
    result (method or filter), and the rendered text itself (``MAX_OUTPUT``). (A loop that prints nothing can still
    run long: loops are bounded by ``range``'s 100 000 and the messages.)"""

    intercepted_binops = frozenset({"**", "*"})

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's own signature)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            name = getattr(__obj, "__name__", "")
            if name in _WIDTH_METHODS and args and isinstance(args[0], int):
                _too_long(args[0], f"{name}({args[0]})")
            elif name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
                _check_replace(owner, args[0], args[1])
        return super().call(__context, __obj, *args, **kwargs)

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and (
                right * math.log10(abs(left)) > MAX_POWER_DIGITS):
            raise jinja2.exceptions.SecurityError(f"{left} ** {right} has more than {MAX_POWER_DIGITS} digits")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_REPEAT:
                    raise jinja2.exceptions.SecurityError(f"a repetition of {len(seq) * n} items is past the "
                                                          f"{MAX_REPEAT} a chat template may build")
        return super().call_binop(context, operator, left, right)


@functools.lru_cache(maxsize=32)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile once per distinct template string (chat loops render the same template every turn)."""
    env = _ChatEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    for name in ("center", "indent"):
        env.filters[name] = _bounded_width(name, env.filters[name])
    env.filters["replace"] = _bounded_replace(env.filters["replace"])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template line {e.lineno}: syntax error: {e.message}") from e


def validate_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check the ``[{"role": ..., "content": ...}, ...]`` shape and return plain dict copies."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ChatTemplateError(f"messages[{i}]: expected a mapping with 'role' and 'content', got {type(m).__name__}")
        if "role" not in m or not isinstance(m["role"], str):
            raise ChatTemplateError(f"messages[{i}]: missing string field 'role'")
        if "content" not in m and "tool_calls" not in m:
            raise ChatTemplateError(f"messages[{i}]: missing field 'content'")
        # keys whose value is None are dropped (as HF does): templates handle a missing key, not a None one
        message = _plain({k: v for k, v in m.items() if v is not None})
        # a message's reasoning under any of its names reaches a template under all of them, as in HF: a template
        # reads reasoning_content (or gpt-oss's thinking) and a client may send reasoning
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat_template(
    template: str,
    messages: Iterable[Mapping[str, Any]],
    add_generation_prompt: bool = False,
    **extra: Any,
) -> str:
    """Render ``messages`` with ``template``; ``extra`` becomes template variables (bos_token, eos_token, tools, documents...).

    ``add_generation_prompt=True`` appends the header that opens an assistant turn, so generation continues as the
    assistant. Errors raised by the template itself (``raise_exception``) come back as :class:`ChatTemplateError`.
    """
    if not isinstance(template, str) or not template:
        raise ChatTemplateError("no chat template: the model file does not define one (pass a template string)")
    compiled = compile_chat_template(template)
    variables = {"tools": None, "documents": None, **{k: _plain(v) for k, v in extra.items()}}
    messages = validate_messages(messages)
    try:
        pieces, size = [], 0
        for piece in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt, **variables):
            size += len(piece)
            if size > MAX_OUTPUT:
                raise jinja2.exceptions.SecurityError(f"the rendered text passed {MAX_OUTPUT} characters")
            pieces.append(piece)
        return "".join(pieces)
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"chat template tried an unsafe operation: {e}") from e
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from e
    except (MemoryError, RecursionError, OverflowError, TypeError, ValueError, ArithmeticError) as e:
        # what a template's own code can raise (a recursive macro, [0] * 10**9, an {% include %} with no loader to
        # read from): the template's fault, said as such, not a crash of whatever renders it
        raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
