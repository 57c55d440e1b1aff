"""Tokenizers behind one small interface: bytes, a byte-level BPE we train ourselves, or any ``tokenizer.json``.

Everything downstream (objectives, eval, generation) only needs::

    tok.encode(text) -> list[int]          # no specials added; special-token *strings* in text are recognised
    tok.decode(ids, skip_special_tokens=True) -> str
    tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id, tok.special_ids
    tok.token_id("<|im_end|>")             # id of a special token string (chat templates)
    tok.byte_lengths() -> list[int]        # UTF-8 bytes each id stands for (0 for specials)

``byte_lengths`` is what makes *bits per byte* exact and tokenizer independent: the bytes covered by the scored
targets are the sum of their per-token byte lengths, so a BPE model and a byte model are judged on the same text.

Why our own special set (``SPECIAL_TOKENS``): objectives need PAD (ignored), BOS/EOS (teacher forcing, document
boundaries), MASK (MLM) and the ChatML turn markers (SFT), and they must be single ids so the loss can target the
end-of-turn token. Loaded ``tokenizer.json`` files keep their own specials; we find them by the usual names and by
``tokenizer_config.json`` when it sits next to the file.

BPE training is deterministic and cached by content hash: ``bpe-<vocab>-<sha>.json`` in ``cache_dir`` (normally the
run directory), so a resumed or repeated run reuses exactly the same merges.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

from seqlab.runtime import atomic_write_text

PAD, BOS, EOS, MASK = "<pad>", "<bos>", "<eos>", "<mask>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, MASK, IM_START, IM_END)

# ChatML with tool calls: the default template of the tokenizers built here. Newlines are emitted explicitly
# because the sandbox runs with trim_blocks/lstrip_blocks (as Hugging Face does).
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{% if call['function'] is defined %}{% set call = call['function'] %}{% endif %}"
    "{{ '<tool_call>' + ({'name': call['name'], 'arguments': call['arguments']} | tojson) + '</tool_call>' }}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TOKENIZER_FORMAT_VERSION = 1  # bump when the BPE recipe changes, so cached files are not reused across recipes


class Tokenizer:
    """Common interface. Subclasses set ``special_tokens`` (str -> id) and implement the encode/decode core."""

    name: str = "tokenizer"
    chat_template: str | None = CHATML_TEMPLATE
    eot_token: str | None = IM_END  # end-of-turn token of the chat template (loss target in SFT)

    def __init__(self, special_tokens: dict[str, int], pad: str | None, bos: str | None, eos: str | None,
                 mask: str | None):
        self.special_tokens = dict(special_tokens)
        self.pad_id = self.special_tokens.get(pad) if pad else None
        self.bos_id = self.special_tokens.get(bos) if bos else None
        self.eos_id = self.special_tokens.get(eos) if eos else None
        self.mask_id = self.special_tokens.get(mask) if mask else None

    # --- to implement ---------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def byte_lengths(self) -> list[int]:
        raise NotImplementedError

    def save(self, path: str | os.PathLike) -> None:
        raise NotImplementedError

    # --- shared --------------------------------------------------------------------------------------------
    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self.special_tokens.values())

    @property
    def eot_id(self) -> int | None:
        return self.special_tokens.get(self.eot_token) if self.eot_token else None

    def token_id(self, token: str) -> int:
        if token not in self.special_tokens:
            raise KeyError(f"{token!r} is not a special token of {self.name} (have {sorted(self.special_tokens)})")
        return self.special_tokens[token]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def count_bytes(self, ids: Iterable[int]) -> int:
        """UTF-8 bytes the ids stand for (specials count 0): the denominator of bits per byte."""
        table = self.byte_lengths()
        return sum(table[i] for i in ids)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """ids 0..255 are the raw UTF-8 bytes; the specials follow at 256.. . Lossless on any text, no training."""

    name = "byte"

    def __init__(self, specials: Sequence[str] = SPECIAL_TOKENS):
        super().__init__({s: 256 + i for i, s in enumerate(specials)}, PAD, BOS, EOS, MASK)
        self._special_re = re.compile("(" + "|".join(re.escape(s) for s in specials) + ")") if specials else None
        self._id_to_special = {v: k for k, v in self.special_tokens.items()}
        self._special_starts = {s[0] for s in specials}

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.special_tokens)

    def encode(self, text: str) -> list[int]:
        if self._special_re is None or not any(c in text for c in self._special_starts):  # fast path, no regex
            return list(text.encode("utf-8"))
        ids: list[int] = []
        for i, part in enumerate(self._special_re.split(text)):
            if i % 2:  # odd parts are the captured special-token strings
                ids.append(self.special_tokens[part])
            elif part:
                ids.extend(part.encode("utf-8"))
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
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

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_text(Path(path), json.dumps({"seqlab_byte_tokenizer": list(self.special_tokens)}))


@lru_cache(maxsize=1)
def _byte_level_decoder_table() -> dict[str, int]:
    """GPT-2's printable-unicode alias of every byte, inverted (char -> byte)."""
    from seqlab.io.tokenizer import _bytes_to_unicode

    return {c: b for b, c in _bytes_to_unicode().items()}


_SPECIAL_NAMES = {
    "pad": ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>"),
    "bos": ("<bos>", "<s>", "[CLS]", "<|begin_of_text|>", "<|startoftext|>", "<|endoftext|>"),
    "eos": ("<eos>", "</s>", "[SEP]", "<|end_of_text|>", "<|endoftext|>", "<|im_end|>"),
    "mask": ("<mask>", "[MASK]"),
}


class HFTokenizer(Tokenizer):
    """Any Hugging Face ``tokenizers`` tokenizer (a ``tokenizer.json``), ours or a downloaded model's."""

    def __init__(self, tok, name: str = "hf", pad: str | None = None, bos: str | None = None, eos: str | None = None,
                 mask: str | None = None, chat_template: str | None = None, eot_token: str | None = None):
        # A tokenizer.json may carry padding/truncation settings (e.g. pad every encode to 128): batching is the
        # collator's job here, so switch them off as transformers does.
        tok.no_padding()
        tok.no_truncation()
        self._tok = tok
        self.name = name
        specials = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        def pick(want: str | None, kind: str) -> str | None:
            if want in specials:
                return want
            return next((n for n in _SPECIAL_NAMES[kind] if n in specials), None)

        eos_token = pick(eos, "eos")
        super().__init__(specials, pick(pad, "pad"), pick(bos, "bos"), eos_token, pick(mask, "mask"))
        if chat_template is not None:
            self.chat_template = chat_template
        elif IM_START not in specials:
            self.chat_template = None  # ChatML needs its markers as single tokens; do not guess another format
        if eot_token is not None:
            self.eot_token = eot_token
        elif IM_END not in specials:
            self.eot_token = eos_token  # most templates end an assistant turn with the EOS token
        self._byte_lengths: list[int] | None = None

    @classmethod
    def from_file(cls, path: str | os.PathLike, **overrides) -> "HFTokenizer":
        """Load ``tokenizer.json`` (or a directory holding it); ``tokenizer_config.json`` beside it names specials."""
        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json here")
        try:
            tok = _Tok.from_file(str(path))
        except Exception as e:  # the Rust error text is specific but names no file
            raise ValueError(f"{path}: not a valid tokenizer.json: {e}") from e
        kw: dict = {}
        cfg_path = path.with_name("tokenizer_config.json")
        if cfg_path.is_file():
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            for key in ("pad", "bos", "eos", "mask"):
                val = cfg.get(f"{key}_token")
                kw[key] = val.get("content") if isinstance(val, dict) else val
            if isinstance(cfg.get("chat_template"), str):
                kw["chat_template"] = cfg["chat_template"]
            if isinstance(cfg.get("seqlab_eot_token"), str):
                kw["eot_token"] = cfg["seqlab_eot_token"]
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(tok, name=str(path), **kw)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def byte_lengths(self) -> list[int]:
        """Exact for byte-level BPE (GPT-2 alphabet); for SentencePiece-style vocabularies '▁' counts as a space
        and ``<0xNN>`` byte-fallback pieces as one byte."""
        if self._byte_lengths is None:
            table = _byte_level_decoder_table()
            specials = self.special_ids
            out = []
            for i in range(self.vocab_size):
                piece = self._tok.id_to_token(i)
                if piece is None or i in specials:
                    out.append(0)
                elif all(c in table for c in piece):
                    out.append(len(piece))  # every char is one byte's alias
                elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
                    out.append(1)
                else:
                    out.append(len(piece.replace("\u2581", " ").encode("utf-8")))
            self._byte_lengths = out
        return self._byte_lengths

    def save(self, path: str | os.PathLike) -> None:
        """Write ``tokenizer.json``; when the file is named so, also ``tokenizer_config.json`` beside it with the
        special tokens and chat template, so a reload (e.g. on resume) gets the same specials and template."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.close(fd)
        self._tok.save(tmp)
        os.replace(tmp, path)
        if path.name == "tokenizer.json":
            name = {i: t for t, i in self.special_tokens.items()}
            cfg = {f"{k}_token": name.get(getattr(self, f"{k}_id")) for k in ("pad", "bos", "eos", "mask")}
            cfg.update(chat_template=self.chat_template, seqlab_eot_token=self.eot_token)
            atomic_write_text(path.with_name("tokenizer_config.json"), json.dumps(cfg, indent=2))


def bpe_cache_key(texts: Sequence[str], vocab_size: int, specials: Sequence[str] = SPECIAL_TOKENS) -> str:
    import tokenizers

    h = hashlib.sha256()
    h.update(json.dumps([TOKENIZER_FORMAT_VERSION, vocab_size, list(specials), tokenizers.__version__]).encode())
    for t in texts:
        h.update(hashlib.sha256(t.encode("utf-8")).digest())
    return h.hexdigest()[:16]


def train_bpe(texts: Sequence[str], vocab_size: int = 4096, cache_dir: str | os.PathLike | None = None,
              specials: Sequence[str] = SPECIAL_TOKENS) -> HFTokenizer:
    """Byte-level BPE (GPT-2 pre-tokenisation, no prefix space), specials at ids 0..len(specials)-1.

    With ``cache_dir`` the trained file is stored as ``bpe-<vocab>-<sha16>.json`` and reused when the texts, size,
    specials and ``tokenizers`` version hash to the same key.
    """
    from tokenizers import Tokenizer as _Tok, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(specials):
        raise ValueError(f"bpe vocab_size={vocab_size} must be >= 256 + {len(specials)} specials")
    cache_file = None
    if cache_dir is not None:
        cache_file = Path(cache_dir) / f"bpe-{vocab_size}-{bpe_cache_key(texts, vocab_size, specials)}.json"
        if cache_file.is_file():
            return HFTokenizer.from_file(cache_file, pad=PAD, bos=BOS, eos=EOS, mask=MASK)
    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2, show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    out = HFTokenizer(tok, name=f"bpe-{vocab_size}", pad=PAD, bos=BOS, eos=EOS, mask=MASK)
    if cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        out.save(cache_file)
        out.name = str(cache_file)
    return out


def build_tokenizer(spec: str = "byte", *, train_texts: Sequence[str] | None = None,
                    cache_dir: str | os.PathLike | None = None) -> Tokenizer:
    """``"byte"`` | ``"bpe"`` / ``"bpe:<vocab>"`` (trained on ``train_texts``, default the embedded corpus's train
    split) | a path to a ``tokenizer.json`` (or to its directory)."""
    if spec == "byte":
        return ByteTokenizer()
    m = re.fullmatch(r"bpe(?::(\d+))?", spec)
    if m:
        if train_texts is None:
            from seqlab.data.corpus import load_documents

            train_texts = [d.text for d in load_documents("train")]
        return train_bpe(train_texts, int(m.group(1) or 4096), cache_dir=cache_dir)
    path = Path(spec)
    if path.exists():
        if path.is_file() and path.suffix == ".json" and _is_byte_tokenizer_file(path):
            return ByteTokenizer(json.loads(path.read_text())["seqlab_byte_tokenizer"])
        return HFTokenizer.from_file(path)
    raise ValueError(f"tokenizer {spec!r}: expected 'byte', 'bpe', 'bpe:<vocab_size>' or a path to tokenizer.json")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load what ``Tokenizer.save`` wrote (a byte tokenizer's JSON stub or any tokenizer.json)."""
    return build_tokenizer(str(path))


def _is_byte_tokenizer_file(path: Path) -> bool:
    try:
        return "seqlab_byte_tokenizer" in json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        return False


def as_tokenizer(tok: Any) -> Tokenizer:
    """Adapt ``seqlab.io.tokenizer.Tokenizer`` (what model loaders return: a ``tokenizers`` backend + HF-style
    special names and the model's chat template) to this interface; a data Tokenizer is returned unchanged."""
    if isinstance(tok, Tokenizer):
        return tok
    backend = getattr(tok, "backend", None)
    if backend is None:
        raise TypeError(f"cannot use {type(tok).__name__} as a tokenizer: no 'backend' tokenizers.Tokenizer")
    from tokenizers import Tokenizer as _Tok

    backend = _Tok.from_str(backend.to_str())  # a copy: HFTokenizer switches padding off, leave theirs alone
    return HFTokenizer(backend, name=str(getattr(tok, "source", "model")), pad=getattr(tok, "pad_token", None),
                       bos=getattr(tok, "bos_token", None), eos=getattr(tok, "eos_token", None),
                       chat_template=getattr(tok, "chat_template", None))
