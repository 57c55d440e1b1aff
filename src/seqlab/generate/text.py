"""Text on top of token ids: incremental detokenisation, stop strings and streaming.

The decode loops produce token ids only; they hand each step's tokens to a :class:`TextStream`, which says what
text each row gained and whether a stop string now occurs, and they yield :class:`StreamChunk` s that
:class:`Stream` passes on to the caller.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


def until_eos(tokens: list[int], eos) -> list[int]:
    """A row's tokens up to and including its first EOS: what follows is padding (an id that may well be text)."""
    return tokens[: next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))]


def read_on(tokenizer, context: list[int], ids: list[int], skip_special_tokens: bool = True) -> str:
    """The text of ``ids`` as it reads on from ``context`` (a prompt's last token): decoded behind it, which is cut
    off again. A SentencePiece decoder drops the space before a text's first word, so alone "▁be" read "be"."""
    decode = tokenizer.decode if skip_special_tokens else functools.partial(tokenizer.decode, skip_special_tokens=False)
    if context:
        before, whole = decode(list(context)), decode(list(context) + list(ids))
        if whole.startswith(before) and "\ufffd" not in before:
            return whole[len(before):]
    return decode(list(ids))


class TextTracker:
    """Incremental detokenisation per row, for streaming text and stop strings.

    Decodes the row's generated ids so far and emits what was added since last time; holds back text that
    ends in U+FFFD (an incomplete UTF-8 byte sequence that the next token will complete).

    ``context``: per row, the prompt's last token, which the new text reads on from (:func:`read_on`; "To be"
    continued by "▁be" read "To bebe" without it). Stop strings are looked for in the new tokens' text and in
    its spelling with special tokens (HF's stop strings match token strings: ``stop=["<|im_end|>"]`` stops there).
    """

    def __init__(self, tokenizer, batch_size: int, stop_strings: list[str], context: list[list[int]] | None = None):
        self.tokenizer = tokenizer
        self.ids: list[list[int]] = [[] for _ in range(batch_size)]
        self.emitted = [0] * batch_size
        self.stop_strings = stop_strings
        self.text = [""] * batch_size
        self.context = [list(c) for c in context] if context is not None else [[] for _ in range(batch_size)]
        # a tokenizer of the caller's may know no special tokens, and decode(ids) alone
        self.spells_specials = "skip_special_tokens" in inspect.signature(tokenizer.decode).parameters

    def _new_text(self, row: int, skip_special_tokens: bool = True) -> str:
        return read_on(self.tokenizer, self.context[row], self.ids[row], skip_special_tokens)

    def push(self, row: int, tokens: list[int]) -> tuple[str, bool]:
        """Append tokens to ``row``; return (new text piece, whether a stop string now occurs)."""
        self.ids[row].extend(tokens)
        text = self._new_text(row)
        self.text[row] = text
        stopped = any(s in text for s in self.stop_strings)
        if self.stop_strings and not stopped and self.spells_specials:
            spelled = self._new_text(row, skip_special_tokens=False)
            stopped = spelled != text and any(s in spelled for s in self.stop_strings)
        if text.endswith("\ufffd") and not stopped:
            return "", False
        piece = text[self.emitted[row]:]
        self.emitted[row] = len(text)
        return piece, stopped

    def rest(self, row: int) -> str:
        """What ``row``'s text holds that :meth:`push` has not handed out: at the end of generation, text that ends
        in U+FFFD is final (no next token will complete it)."""
        piece = self.text[row][self.emitted[row]:]
        self.emitted[row] = len(self.text[row])
        return piece

    def push_until_stop(self, row: int, tokens: list[int]) -> tuple[str, bool, int]:
        """:meth:`push` one token at a time, up to the one that completes a stop string: (text piece, stopped,
        tokens kept). A speculative round adds several tokens at once; those after the stop are not the output."""
        if not self.stop_strings:
            return *self.push(row, tokens), len(tokens)
        pieces = []
        for n, token in enumerate(tokens, start=1):
            piece, stopped = self.push(row, [token])
            pieces.append(piece)
            if stopped:
                return "".join(pieces), True, n
        return "".join(pieces), False, len(tokens)


class TextStream:
    """The text side of one request: a :class:`TextTracker` over the original rows of the batch."""

    def __init__(self, tokenizer, batch_size: int, stop_strings: list[str], context: list[list[int]] | None = None):
        self.batch_size = batch_size
        self.has_stop_strings = bool(stop_strings)
        self.tracker = TextTracker(tokenizer, batch_size, stop_strings, context)

    @classmethod
    def for_request(cls, tokenizer, batch_size: int, stop_strings: list[str], want_text: bool,
                    context: list[list[int]] | None = None) -> "TextStream | None":
        """A TextStream when text is wanted (streaming with a tokenizer) or needed (stop strings), else None.
        ``context``: each row's last prompt token (:class:`TextTracker`)."""
        if stop_strings and tokenizer is None:
            raise ValueError("GenerationConfig.stop_strings needs a tokenizer (pass tokenizer=...)")
        if tokenizer is None or not (want_text or stop_strings):
            return None
        return cls(tokenizer, batch_size, stop_strings, context)

    def push(self, rows: list[int], tokens: list[list[int]], live: list[bool] | None = None
             ) -> tuple[list[str], list[bool], list[int]]:
        """Add ``tokens[i]`` to original row ``rows[i]`` for each live i, up to the token that completes a stop
        string (:meth:`TextTracker.push_until_stop`).

        Returns the new text piece per original row ("" where nothing was added) and, per i, whether a stop
        string now occurs in that row's text and how many of ``tokens[i]`` were kept.
        """
        texts = [""] * self.batch_size
        stops, kept = [False] * len(rows), [len(t) for t in tokens]
        for i, (row, toks) in enumerate(zip(rows, tokens)):
            if live is not None and not live[i]:
                continue
            texts[row], stops[i], kept[i] = self.tracker.push_until_stop(row, toks)
        return texts, stops, kept

    def rest(self) -> list[str]:
        """Per row, the text held back until now (see :meth:`TextTracker.rest`)."""
        return [self.tracker.rest(row) for row in range(self.batch_size)]


@dataclass
class StreamChunk:
    """What one step (or speculative round) added: per original row, the new token ids and text piece."""

    step: int
    tokens: list[list[int]]
    texts: list[str] | None = None
    finished: list[bool] = field(default_factory=list)


def chunk_for(step: int, batch_size: int, rows: list[int], tokens: list[list[int]], finished: list[bool],
              texts: list[str] | None) -> StreamChunk:
    """A chunk over the original rows; rows no longer in the batch get no tokens and count as finished."""
    toks: list[list[int]] = [[] for _ in range(batch_size)]
    fin = [True] * batch_size
    for row, t, f in zip(rows, tokens, finished):
        toks[row], fin[row] = t, f
    return StreamChunk(step, toks, texts, fin)


class Stream:
    """Iterate to receive :class:`StreamChunk` s as they are produced; afterwards ``.output`` holds the result.

    >>> s = stream(model, ids, max_new_tokens=20, tokenizer=tok)
    >>> for chunk in s: print(chunk.texts[0], end="", flush=True)
    >>> s.output.metrics.ttft_s
    """

    def __init__(self, it: Iterator[StreamChunk]):
        self._it = it
        self.output: Any = None  # the GenerationOutput, once the iteration is over

    def __iter__(self) -> Iterator[StreamChunk]:
        if self.output is not None:
            raise RuntimeError("this Stream was already consumed; call stream(...) again")
        self.output = yield from self._it
        return self.output
