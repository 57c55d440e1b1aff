"""Standard tokenizer files for exported models: ``tokenizer.json`` (a ``tokenizers`` model) and
``tokenizer_config.json`` (special tokens and the chat template), which ``AutoTokenizer`` reads.

:func:`tokenizer_backend` is the one place that turns a seqlab tokenizer into a ``tokenizers.Tokenizer``; the HF
and GGUF exporters both go through it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer as Backend, decoders, models, pre_tokenizers

from seqlab.data.tokenizers import ByteTokenizer, HFTokenizer
from seqlab.io.tokenizer import _bytes_to_unicode
from seqlab.runtime import atomic_write_text


def tokenizer_backend(tokenizer: Any) -> Backend:
    """The ``tokenizers`` model behind a seqlab tokenizer, with the same ids.

    A BPE tokenizer already is one. The byte tokenizer becomes a byte-level BPE without merges: id b is GPT-2's
    printable alias of byte b, and the specials follow at 256.. in their order, exactly as ``ByteTokenizer``
    numbers them.
    """
    if isinstance(tokenizer, HFTokenizer):
        return Backend.from_str(tokenizer._tok.to_str())  # a copy: the caller's tokenizer stays untouched
    if isinstance(tokenizer, ByteTokenizer):
        alias = _bytes_to_unicode()
        backend = Backend(models.BPE(vocab={alias[b]: b for b in range(256)}, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        specials = sorted(tokenizer.special_tokens.items(), key=lambda kv: kv[1])
        backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s, _ in specials])
        return backend
    raise ValueError(f"cannot export a {type(tokenizer).__name__}: expected a byte or tokenizer.json tokenizer")


def write_tokenizer_files(tokenizer: Any, out_dir: str | os.PathLike, max_length: int | None = None) -> None:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` (with the chat template) into ``out_dir``."""
    out = Path(out_dir)
    backend = tokenizer_backend(tokenizer)
    for i, token in ((tokenizer.bos_id, "bos"), (tokenizer.eos_id, "eos")):
        if i is not None and backend.id_to_token(i) is None:
            raise ValueError(f"tokenizer {token} id {i} is not in the exported vocabulary")
    atomic_write_text(out / "tokenizer.json", backend.to_str())
    name = {i: t for t, i in tokenizer.special_tokens.items()}
    cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    for kind in ("bos", "eos", "pad", "mask"):
        token = name.get(getattr(tokenizer, f"{kind}_id", None))
        if token is not None:
            cfg[f"{kind}_token"] = token
    if max_length:
        cfg["model_max_length"] = max_length
    if tokenizer.chat_template:
        cfg["chat_template"] = tokenizer.chat_template
    if tokenizer.eot_token:
        cfg["seqlab_eot_token"] = tokenizer.eot_token
    atomic_write_text(out / "tokenizer_config.json", json.dumps(cfg, indent=2) + "\n")
