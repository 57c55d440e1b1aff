"""The byte tokenizer: ids 0..255 are the UTF-8 bytes, the specials follow. Lossless on any text, no training.

It is stored as a standard ``tokenizer.json`` (a BPE without merges over GPT-2's 256 byte aliases), so
``tokenizers`` and ``transformers.AutoTokenizer`` load what seqlab writes with the same ids.
"""

from __future__ import annotations

import json
import re
from typing import Iterable, Sequence

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from seqlab.data.byte_lengths import bytes_to_unicode
from seqlab.data.tokenizer import BOS, EOS, MASK, PAD, SPECIAL_TOKENS, Tokenizer, id_list


def byte_backend(specials: Sequence[str] = SPECIAL_TOKENS) -> Backend:
    """The byte tokenizer as a standard ``tokenizers`` model: ids 0..255 are the UTF-8 bytes (a merge-free BPE over
    GPT-2's byte aliases, so every HF tool reads it), the specials follow at 256.."""
    alias = bytes_to_unicode()
    backend = Backend(models.BPE(vocab={alias[b]: b for b in range(256)}, merges=[], fuse_unk=False,
                                 byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return backend


def byte_specials(backend: Backend) -> list[str] | None:
    """The specials if ``backend`` is a byte tokenizer (what :func:`byte_backend` builds), else None."""
    model = json.loads(backend.to_str())["model"]
    alias = bytes_to_unicode()
    if model.get("type") != "BPE" or model.get("merges") or model.get("vocab") != {alias[b]: b for b in range(256)}:
        return None
    added = sorted(backend.get_added_tokens_decoder().items())
    if [i for i, _ in added] != list(range(256, 256 + len(added))) or not all(t.special for _, t in added):
        return None
    return [t.content for _, t in added]


class ByteTokenizer(Tokenizer):
    """ids 0..255 are the raw UTF-8 bytes; the specials follow at 256.. . Lossless on any text, no training.

    Encoding and decoding run in Python (a split on the special strings, then ``str.encode``), which is faster than
    a round trip through the backend for this trivial mapping; the tests hold both to the same ids."""

    def __init__(self, specials: Sequence[str] = SPECIAL_TOKENS, chat_template: str | None = None,
                 eot_token: str | None = None):
        specials = list(specials)
        backend = byte_backend(specials)
        ids = {s: 256 + i for i, s in enumerate(specials)}
        super().__init__(backend, pad_id=ids.get(PAD), bos_id=ids.get(BOS), eos_id=ids.get(EOS),
                         mask_id=ids.get(MASK), chat_template=chat_template, eot_token=eot_token, name="byte")
        # longest first, as the backend matches: of "<s>" and "<s>x" the text "<s>x" is the second token
        longest_first = sorted(specials, key=len, reverse=True)
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in longest_first) + ")") if specials else None
        self._id_to_special = {v: k for k, v in ids.items()}
        self._special_starts = {s[0] for s in specials}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        if self._special_re is None or not any(c in text for c in self._special_starts):  # fast path, no regex
            ids = list(text.encode("utf-8"))
        else:
            ids = []
            for i, part in enumerate(self._special_re.split(text)):
                if i % 2:  # odd parts are the captured special-token strings
                    ids.append(self.special_tokens[part])
                elif part:
                    ids.extend(part.encode("utf-8"))
        if add_special_tokens:  # the file's rule, as the backend's post-processor applies it
            ids = [self.bos_id] * self.add_bos_token + ids + [self.eos_id] * self.add_eos_token
        return ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        for i in id_list(ids):
            if i < 256:
                buf.append(i)
                continue
            if not skip_special_tokens:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                out.append(self._id_to_special.get(i, ""))
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def byte_lengths(self) -> list[int]:
        return [1] * 256 + [0] * len(self.special_tokens)
