"""A small Tokenizer: a Hugging Face ``tokenizers`` object plus the special ids and the chat template.

Why wrap ``tokenizers`` instead of writing BPE: it is the reference implementation of byte-level BPE, it is fast
(Rust), and a tokenizer built here can be saved as a standard ``tokenizer.json`` that every other tool reads.
What the wrapper adds is what a model file carries beside the vocabulary: BOS/EOS/PAD, whether BOS is prepended,
and the chat template (rendered in a sandbox, see :mod:`seqlab.io.chat_template`).

Two ways in:

- :meth:`Tokenizer.from_gguf_metadata`: the vocabulary, merges and token types stored in a GGUF file are turned
  into a byte-level BPE ``tokenizers.Tokenizer`` with the pre-tokenizer named by ``tokenizer.ggml.pre``.
- :meth:`Tokenizer.from_pretrained`: a Hugging Face folder with ``tokenizer.json`` (+ ``tokenizer_config.json``).

The interface mirrors HF's where it overlaps: ``encode``, ``decode``, ``apply_chat_template``.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from seqlab.io.chat_template import render_chat_template

__all__ = ["Tokenizer", "TokenizerError", "GGUF_PRE_TOKENIZERS"]

# GGUF token types (llama.cpp's llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's split regexes, by ``tokenizer.ggml.pre``. Byte-level BPE merges were learned on these pieces, so
# splitting differently would produce valid but different (worse) tokenizations.
_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_pre():
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_pre():
    # SmolLM / StarCoder: every digit is its own piece, then GPT-2's split (the original tokenizer.json says
    # Sequence[Digits(individual_digits=True), ByteLevel]; llama.cpp spells it as the regex "\p{N}" first).
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_pre()])


def _regex_pre(pattern: str):
    return lambda: pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


GGUF_PRE_TOKENIZERS = {
    "default": _gpt2_pre,
    "gpt2": _gpt2_pre,
    "gpt-2": _gpt2_pre,
    "smollm": _digits_then_gpt2_pre,
    "starcoder": _digits_then_gpt2_pre,
    "refact": _digits_then_gpt2_pre,
    "codeshell": _digits_then_gpt2_pre,
    "llama3": _regex_pre(_LLAMA3_SPLIT),
    "llama-v3": _regex_pre(_LLAMA3_SPLIT),
    "llama-bpe": _regex_pre(_LLAMA3_SPLIT),
    "smaug-bpe": _regex_pre(_LLAMA3_SPLIT),
    "qwen2": _regex_pre(_QWEN2_SPLIT),
}


class TokenizerError(ValueError):
    """The tokenizer description is missing or inconsistent (names the file and key)."""


def _bytes_to_unicode() -> dict[int, str]:
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


class Tokenizer:
    """Text <-> ids, with special ids and a chat template.

    ``encode`` adds BOS only when the model file asks for it (``add_bos_token``); special-token strings inside the
    text (``<|im_start|>``) become their single ids, as in HF, so a rendered chat template encodes correctly.
    """

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        chat_template: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        source: str = "<memory>",
    ):
        self.backend = backend
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        self.pad_token_id, self.unk_token_id = pad_token_id, unk_token_id
        self.chat_template = chat_template
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self.source = source
        n = backend.get_vocab_size(with_added_tokens=True)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < n:
                raise TokenizerError(f"{source}: {name}={value} is outside the vocabulary [0, {n})")

    # ------------------------------------------------------------------------------------------ construction
    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], source: str = "<gguf>") -> "Tokenizer":
        """Build from GGUF ``tokenizer.ggml.*`` metadata (byte-level BPE, ``tokenizer.ggml.model == "gpt2"``)."""
        kind = metadata.get("tokenizer.ggml.model")
        if kind is None:
            raise TokenizerError(f"{source}: metadata key 'tokenizer.ggml.model' is missing (no tokenizer in the file)")
        if kind != "gpt2":
            raise TokenizerError(
                f"{source}: GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2' byte-level BPE)"
            )
        tokens = list(metadata.get("tokenizer.ggml.tokens") or [])
        merges = list(metadata.get("tokenizer.ggml.merges") or [])
        if not tokens:  # merges may be empty: a byte-level vocabulary without merges (seqlab's byte tokenizer)
            raise TokenizerError(f"{source}: 'tokenizer.ggml.tokens' is missing or empty")
        types = list(metadata.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
        if len(types) != len(tokens):
            raise TokenizerError(f"{source}: {len(types)} token types for {len(tokens)} tokens")

        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        # A token outside the byte alphabet (rare mislabelled files) is respelled byte by byte, as HF does.
        spelled = [t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")) for t in tokens]
        vocab: dict[str, int] = {}
        for i, t in enumerate(spelled):
            vocab.setdefault(t, i)
        pairs = []
        for j, m in enumerate(merges):
            parts = m.split(" ")
            if len(parts) != 2:
                raise TokenizerError(f"{source}: tokenizer.ggml.merges[{j}] = {m!r} is not 'left right'")
            pairs.append((parts[0], parts[1]))
        backend = _HFTokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
        pre = metadata.get("tokenizer.ggml.pre", "default")
        if pre not in GGUF_PRE_TOKENIZERS:
            warnings.warn(f"{source}: unknown GGUF pre-tokenizer {pre!r}; using GPT-2's split", stacklevel=2)
            pre = "default"
        backend.pre_tokenizer = GGUF_PRE_TOKENIZERS[pre]()
        backend.decoder = decoders.ByteLevel()
        # Control tokens (<|im_start|>, <|endoftext|>) are matched whole and are "special" (skippable on decode);
        # user-defined ones are matched whole but kept as text.
        control = [AddedToken(t, normalized=False, special=True) for t, ty in zip(spelled, types) if ty == _CONTROL]
        user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(spelled, types) if ty == _USER_DEFINED]
        if control:
            backend.add_special_tokens(control)
        if user:
            backend.add_tokens(user)

        def tid(key: str) -> int | None:
            v = metadata.get(f"tokenizer.ggml.{key}")
            return int(v) if v is not None else None

        bos, eos = tid("bos_token_id"), tid("eos_token_id")
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        cls._set_post_processor(backend, spelled, bos if add_bos else None, eos if add_eos else None)
        return cls(
            backend, bos_token_id=bos, eos_token_id=eos, pad_token_id=tid("padding_token_id"),
            unk_token_id=tid("unknown_token_id"), chat_template=metadata.get("tokenizer.chat_template"),
            add_bos_token=add_bos, add_eos_token=add_eos, source=source,
        )

    @staticmethod
    def _set_post_processor(backend: _HFTokenizer, tokens: Sequence[str], bos: int | None, eos: int | None) -> None:
        if bos is None and eos is None:
            backend.post_processor = processors.ByteLevel(trim_offsets=False)
            return
        b = [f"{tokens[bos]}:0"] if bos is not None else []
        e = [f"{tokens[eos]}:0"] if eos is not None else []
        special = [(tokens[i], i) for i in {x for x in (bos, eos) if x is not None}]
        backend.post_processor = processors.TemplateProcessing(
            single=" ".join(b + ["$A:0"] + e), pair=" ".join(b + ["$A:0"] + e + b + ["$B:1"] + e), special_tokens=special
        )

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "Tokenizer":
        """Load a Hugging Face tokenizer folder: ``tokenizer.json`` and, if present, ``tokenizer_config.json``."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{folder}: no tokenizer.json")
        try:
            backend = _HFTokenizer.from_file(str(path))
        except Exception as e:
            raise TokenizerError(f"{path}: unreadable tokenizer.json ({e})") from e
        # tokenizer.json may pin padding/truncation (MiniLM's pads every text to 128); callers choose those per call
        backend.no_padding()
        backend.no_truncation()
        config: dict[str, Any] = {}
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                config = json.loads(cfg_path.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise TokenizerError(f"{cfg_path}: line {e.lineno}: invalid JSON ({e.msg})") from e

        def tid(name: str) -> int | None:
            tok = config.get(name)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return backend.token_to_id(tok) if isinstance(tok, str) else None

        template = config.get("chat_template")
        if isinstance(template, list):  # HF allows named templates; "default" is the chat one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(
            backend, bos_token_id=tid("bos_token") if tid("bos_token") is not None else tid("cls_token"),
            eos_token_id=tid("eos_token") if tid("eos_token") is not None else tid("sep_token"),
            pad_token_id=tid("pad_token"), unk_token_id=tid("unk_token"), chat_template=template,
            add_bos_token=bool(config.get("add_bos_token", False)), add_eos_token=bool(config.get("add_eos_token", False)),
            source=str(folder),
        )

    def save(self, folder: str | os.PathLike) -> None:
        """Write ``tokenizer.json`` + ``tokenizer_config.json`` (atomically) so HF tools can load this tokenizer."""
        from seqlab.io.checkpoint import atomic_write_text

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / "tokenizer.json", self.backend.to_str())
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos_token,
            "add_eos_token": self.add_eos_token,
            **{f"{n}_token": self.token(getattr(self, f"{n}_token_id")) for n in ("bos", "eos", "pad", "unk")},
        }
        if self.chat_template:
            config["chat_template"] = self.chat_template
        atomic_write_text(folder / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    # ------------------------------------------------------------------------------------------ basics
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.token(self.eos_token_id)

    @property
    def pad_token(self) -> str | None:
        return self.token(self.pad_token_id)

    @property
    def unk_token(self) -> str | None:
        return self.token(self.unk_token_id)

    @property
    def special_ids(self) -> set[int]:
        return {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}

    # ------------------------------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids. ``add_special_tokens`` applies the file's BOS/EOS rule (SmolLM2: adds nothing)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def pad(self, batch: Sequence[Sequence[int]], side: str = "right", pad_id: int | None = None):
        """Ragged id lists -> ``(input_ids, attention_mask)`` LongTensors; left padding for batched generation."""
        import torch

        if side not in ("left", "right"):
            raise ValueError(f"pad side must be 'left' or 'right', got {side!r}")
        pad = pad_id if pad_id is not None else (self.pad_token_id if self.pad_token_id is not None else (self.eos_token_id or 0))
        T = max((len(s) for s in batch), default=0)
        ids = torch.full((len(batch), T), int(pad), dtype=torch.long)
        mask = torch.zeros((len(batch), T), dtype=torch.long)
        for i, s in enumerate(batch):
            sl = slice(T - len(s), T) if side == "left" else slice(0, len(s))
            ids[i, sl] = torch.tensor(list(s), dtype=torch.long)
            mask[i, sl] = 1
        return ids, mask

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Ids -> text. Invalid UTF-8 (a character split across tokens) decodes as U+FFFD, like HF."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------------------------------ chat
    def render_chat(self, messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = False,
                    chat_template: str | None = None, **extra: Any) -> str:
        """The prompt text the model's chat template produces for ``messages``."""
        template = chat_template or self.chat_template
        if not template:
            raise TokenizerError(f"{self.source}: this tokenizer has no chat template (pass chat_template=...)")
        specials = {f"{n}_token": getattr(self, f"{n}_token") for n in ("bos", "eos", "pad", "unk")}
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt, **{**specials, **extra})

    def apply_chat_template(self, messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = False,
                            tokenize: bool = True, chat_template: str | None = None, **extra: Any) -> list[int] | str:
        """Render ``messages`` with the chat template; return ids (default) or the text (``tokenize=False``).

        The template writes its own special tokens, so the text is encoded without adding BOS/EOS again (as HF).
        """
        text = self.render_chat(messages, add_generation_prompt, chat_template, **extra)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return (f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
                f"eos={self.eos_token!r}, pad={self.pad_token!r}, chat_template={'yes' if self.chat_template else 'no'})")
