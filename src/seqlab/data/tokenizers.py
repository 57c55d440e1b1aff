"""Which tokenizer a run uses, from one spec string, and loading whatever a run saved.

    build_tokenizer("byte" | "bpe" | "bpe:4096" | "path/to/tokenizer.json", cache_dir=run_dir)
    load_tokenizer("run/tokenizer.json")

The class itself is :class:`seqlab.data.tokenizer.Tokenizer` (one for every layer); this module re-exports it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Sequence

from seqlab.data.bpe import train_bpe
from seqlab.data.byte_lengths import bytes_to_unicode
from seqlab.data.byte_tokenizer import ByteTokenizer, byte_specials
from seqlab.data.corpus import load_documents
from seqlab.data.tokenizer import CHATML_TEMPLATE, IM_END, IM_START, SPECIAL_TOKENS, Tokenizer, TokenizerError

__all__ = ["ByteTokenizer", "CHATML_TEMPLATE", "IM_END", "IM_START", "SPECIAL_TOKENS", "Tokenizer", "TokenizerError",
           "build_tokenizer", "bytes_to_unicode", "load_tokenizer", "train_bpe"]


def build_tokenizer(spec: str = "byte", *, train_texts: Sequence[str] | None = None,
                    cache_dir: str | os.PathLike | None = None) -> Tokenizer:
    """``"byte"`` | ``"bpe"`` / ``"bpe:<vocab>"`` (trained on ``train_texts``, default the embedded corpus's train
    split) | a path to a ``tokenizer.json`` (or to its directory)."""
    if spec == "byte":
        return ByteTokenizer()
    m = re.fullmatch(r"bpe(?::(\d+))?", spec)
    if m:
        if train_texts is None:
            train_texts = [d.text for d in load_documents("train")]
        return train_bpe(train_texts, int(m.group(1) or 4096), cache_dir=cache_dir)
    if Path(spec).exists():
        return load_tokenizer(spec)
    raise ValueError(f"--tokenizer {spec}: no such file (expected byte, bpe, bpe:<vocab_size> or the path of a "
                     "tokenizer.json)")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """What ``Tokenizer.save`` wrote: a standard ``tokenizer.json`` (a byte tokenizer comes back as
    :class:`ByteTokenizer`), or the ``{"seqlab_byte_tokenizer": [...]}`` stub of older checkpoints."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    legacy = _legacy_byte_specials(path)
    if legacy is not None:
        return ByteTokenizer(legacy)
    tok = Tokenizer.from_file(path)
    specials = byte_specials(tok.backend)
    if specials is None:
        return tok
    template = tok.chat_template if tok.chat_template != CHATML_TEMPLATE else None
    out = ByteTokenizer(specials, chat_template=template, eot_token=tok.eot_token)
    out.name, out.template_source = tok.name, tok.template_source
    if tok.add_bos_token or tok.add_eos_token:
        out.set_special_rule(tok.add_bos_token, tok.add_eos_token)
    return out


def _legacy_byte_specials(path: Path) -> list[str] | None:
    try:
        with open(path, "rb") as f:
            if b"seqlab_byte_tokenizer" not in f.read(64):
                return None
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    specials = doc.get("seqlab_byte_tokenizer") if isinstance(doc, dict) else None
    if not isinstance(specials, list) or not all(isinstance(s, str) for s in specials):
        raise TokenizerError(f"{path}: 'seqlab_byte_tokenizer' must be a list of special-token strings")
    return specials
