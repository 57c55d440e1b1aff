"""How many UTF-8 bytes each token of a vocabulary stands for: the denominator of bits per byte.

Why its own module: the count depends on the kind of vocabulary (byte-level BPE spells bytes, SentencePiece and
WordPiece spell text), which is read from the tokenizer's decoder and pre-tokenizer, not guessed from a piece.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from tokenizers import Tokenizer as Backend


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values (the alphabet byte-level BPE vocabularies are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _names_type(node: Any, name: str) -> bool:
    """Whether a tokenizer.json component (or a Sequence of them) is, or holds, one of type ``name``."""
    if isinstance(node, dict):
        return node.get("type") == name or any(_names_type(v, name) for v in node.values())
    if isinstance(node, list):
        return any(_names_type(v, name) for v in node)
    return False


def _wordpiece_prefix(decoder: Any) -> str:
    """The continuation prefix ('##') of a WordPiece decoder; '' for any other."""
    if isinstance(decoder, dict) and decoder.get("type") == "WordPiece":
        return str(decoder.get("prefix", "##"))
    return ""


def piece_byte_lengths(backend: Backend, vocab_size: int, specials: frozenset[int]) -> list[int]:
    """UTF-8 bytes per id (0 for specials). Exact for byte-level BPE (each character of a piece stands for one
    byte). Otherwise (SentencePiece, WordPiece) a piece is its own text: '▁' counts as a space, ``<0xNN>``
    byte-fallback pieces as one byte, WordPiece's '##' as nothing and a WordPiece word's first piece as also
    standing for the space before it (as '▁' does; WordPiece splits on spaces and its decoder puts them back, so
    'hello world' counted 10 of its 11 bytes). Which kind a vocabulary is comes from its decoder and
    pre-tokenizer, never from a piece's characters: 'é' or 'ñ' alone is a SentencePiece piece of two bytes that
    happens to be spelled in GPT-2's byte alphabet. A text's first word counts one space too many."""
    spec = json.loads(backend.to_str())
    byte_level = any(_names_type(spec.get(part), "ByteLevel") for part in ("decoder", "pre_tokenizer"))
    prefix = _wordpiece_prefix(spec.get("decoder"))
    table = set(bytes_to_unicode().values())
    out = []
    for i in range(vocab_size):
        piece = backend.id_to_token(i)
        if piece is None or i in specials:
            out.append(0)
        elif byte_level and all(c in table for c in piece):
            out.append(len(piece))  # every char is one byte's alias
        elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            out.append(1)
        else:
            space = 0
            if prefix and piece.startswith(prefix) and len(piece) > len(prefix):
                piece = piece[len(prefix):]
            elif prefix and piece[:1].isalnum():  # a word's first piece (punctuation closes up on decode)
                space = 1
            out.append(space + len(piece.replace("\u2581", " ").encode("utf-8")))
    return out
