"""The one Tokenizer of seqlab: a Hugging Face ``tokenizers`` backend plus special ids and a chat template.

Why wrap ``tokenizers`` instead of writing BPE: it is the reference implementation, it is fast (Rust), and
whatever we build saves as a standard ``tokenizer.json`` + ``tokenizer_config.json`` pair that
``tokenizers.Tokenizer.from_file`` and ``transformers.AutoTokenizer`` read with the same ids. The byte tokenizer
is such a backend too (a BPE without merges over GPT-2's 256 byte aliases), so it needs no private format.

Conventions, chosen once for every caller:

- ``encode(text)`` adds no BOS/EOS (objectives place them); ``add_special_tokens=True`` applies the file's rule.
  Special-token strings inside the text (``<|im_start|>``) become their single ids, as in HF.
- ``decode(ids)`` skips special tokens (text meant for people); pass ``skip_special_tokens=False`` to keep them.
- Special ids are ``pad_id``, ``bos_id``, ``eos_id``, ``mask_id``, ``unk_id`` and ``eot_id`` (end of turn).
- ``byte_lengths()`` gives the UTF-8 bytes each id stands for, which makes bits per byte tokenizer independent.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from tokenizers import Tokenizer as Backend
from tokenizers import processors

from seqlab.data.byte_lengths import piece_byte_lengths
from seqlab.data.chat_template import ChatTemplateError, render_chat_template
from seqlab.runtime import atomic_write_text
from seqlab.runtime.files import read_json_object

PAD, BOS, EOS, MASK = "<pad>", "<bos>", "<eos>", "<mask>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, MASK, IM_START, IM_END)

# ChatML with tool calls: the default template of the tokenizers built here. Newlines are emitted explicitly
# because the sandbox runs with trim_blocks/lstrip_blocks (as Hugging Face does). A call's ``arguments`` may be an
# object or, as OpenAI's API sends them, a JSON string, which goes in as written (as Qwen's templates do), not
# encoded a second time.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] %}{{ message['content'] }}{% endif %}"
    "{% if message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{% if call['function'] is defined %}{% set call = call['function'] %}{% endif %}"
    "{% set arguments = call['arguments'] if call['arguments'] is string else call['arguments'] | tojson %}"
    "{{ '<tool_call>{\"name\": ' + (call['name'] | tojson) + ', \"arguments\": ' + arguments + '}</tool_call>' }}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Usual spellings of each role, tried when a file does not name its specials.
_SPECIAL_NAMES = {
    "pad": ("<pad>", "[PAD]", "<|pad|>", "<|finetune_right_pad_id|>"),
    "bos": ("<bos>", "<s>", "[CLS]", "<|begin_of_text|>", "<|startoftext|>", "<|endoftext|>"),
    "eos": ("<eos>", "</s>", "[SEP]", "<|end_of_text|>", "<|endoftext|>", "<|im_end|>"),
    "mask": ("<mask>", "[MASK]"),
    "unk": ("<unk>", "[UNK]"),
}
_ROLES = ("pad", "bos", "eos", "mask", "unk")


def id_list(ids: Iterable[int]) -> list[int]:
    """``ids`` (a list or a tensor) as Python ints, refusing a negative one with a message (a backend would raise
    an OverflowError, or a byte range error, that says nothing of where it came from)."""
    out = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
    if any(i < 0 for i in out):
        raise ValueError(f"token ids are >= 0, got {min(out)} (a padding or ignore value such as -100 left in?)")
    return out


class TokenizerError(ValueError):
    """The tokenizer description is missing or inconsistent (the message names the file and key)."""


def special_post_processor(spell: Callable[[int], str], bos: int | None, eos: int | None):
    """The backend post-processor that wraps an encoded text in ``bos``/``eos`` (either may be None) when asked for
    special tokens: what ``add_bos_token``/``add_eos_token`` mean, in the form tokenizer.json stores."""
    if bos is None and eos is None:
        return processors.ByteLevel(trim_offsets=False)
    b = [f"{spell(bos)}:0"] if bos is not None else []
    e = [f"{spell(eos)}:0"] if eos is not None else []
    special = [(spell(i), i) for i in {x for x in (bos, eos) if x is not None}]
    return processors.TemplateProcessing(
        single=" ".join(b + ["$A:0"] + e), pair=" ".join(b + ["$A:0"] + e + b + ["$B:1"] + e), special_tokens=special
    )


class Tokenizer:
    """Text <-> ids with special ids and a chat template (see the module docstring for the conventions)."""

    def __init__(self, backend: Backend, *, pad_id: int | None = None, bos_id: int | None = None,
                 eos_id: int | None = None, mask_id: int | None = None, unk_id: int | None = None,
                 eot_token: str | None = None, chat_template: str | None = None, add_bos_token: bool = False,
                 add_eos_token: bool = False, name: str = "tokenizer"):
        # A tokenizer.json may pin padding/truncation (MiniLM pads every text to 128): batching is the caller's job.
        backend.no_padding()
        backend.no_truncation()
        self.backend = backend
        self.name = name
        n = backend.get_vocab_size(with_added_tokens=True)
        for role, value in zip(_ROLES, (pad_id, bos_id, eos_id, mask_id, unk_id)):
            if value is not None and not 0 <= int(value) < n:
                raise TokenizerError(f"{name}: {role}_id={value} is outside the vocabulary [0, {n})")
        self.pad_id, self.bos_id, self.eos_id, self.mask_id, self.unk_id = (
            None if v is None else int(v) for v in (pad_id, bos_id, eos_id, mask_id, unk_id))
        self.special_tokens: dict[str, int] = {t.content: i for i, t in backend.get_added_tokens_decoder().items()
                                               if t.special}
        # ChatML needs its markers as single tokens; without them do not guess another format.
        chatml = IM_START in self.special_tokens and IM_END in self.special_tokens
        self.chat_template = chat_template if chat_template is not None else (CHATML_TEMPLATE if chatml else None)
        self.template_source: str | None = None  # the file the chat template came from, where not ``name``
        # End of an assistant turn (the SFT loss target): ChatML's marker, else the EOS most templates end with.
        self.eot_token = eot_token if eot_token is not None else (IM_END if chatml else self.token(self.eos_id))
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self._byte_lengths: list[int] | None = None

    # ------------------------------------------------------------------------------------------ construction
    @classmethod
    def from_backend(cls, backend: Backend, *, name: str = "tokenizer", **roles: Any) -> "Tokenizer":
        """Build from token *strings*: ``pad="<pad>"`` etc. (ids via the backend); unnamed roles are guessed among
        the special tokens by their usual spellings. Other keyword arguments go to the constructor."""
        specials = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        ids: dict[str, int | None] = {}
        for role in _ROLES:
            want = roles.pop(role, None)
            tid = backend.token_to_id(want) if isinstance(want, str) else None
            if tid is None and want is not False:  # False: the config says this role has no token (null)
                tid = next((specials[s] for s in _SPECIAL_NAMES[role] if s in specials), None)
            ids[f"{role}_id"] = tid
        return cls(backend, name=name, **ids, **roles)

    @classmethod
    def from_file(cls, path: str | os.PathLike, **overrides: Any) -> "Tokenizer":
        """Load ``tokenizer.json`` (or a folder holding it); ``tokenizer_config.json`` beside it names the specials,
        the chat template and the BOS/EOS rule, as in Hugging Face folders (a ``chat_template.jinja`` beside it
        holds the template, first, as transformers reads it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path}: no tokenizer.json here")
        try:
            backend = Backend.from_file(str(path))
        except Exception as e:  # the Rust error text is specific but names no file
            raise TokenizerError(f"{path}: not a valid tokenizer.json: {e}") from e
        config = path.with_name("tokenizer_config.json")
        kw = read_tokenizer_config(config) if path.name == "tokenizer.json" else {}
        # transformers 5 saves the template as chat_template.jinja (and not in the config), and reads it first
        jinja = path.with_name("chat_template.jinja")
        if path.name == "tokenizer.json" and jinja.is_file():
            try:
                kw["chat_template"], config = jinja.read_text(encoding="utf-8"), jinja
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{jinja}: unreadable chat template ({e})") from None
        from_config = "chat_template" in kw
        kw.update({k: v for k, v in overrides.items() if v is not None})
        tok = cls.from_backend(backend, name=str(path), **kw)
        if from_config and overrides.get("chat_template") is None:  # its errors name the file it came from
            tok.template_source = str(config)
        return tok

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "Tokenizer":
        """A Hugging Face (or seqlab) folder with ``tokenizer.json`` [+ ``tokenizer_config.json``]."""
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise TokenizerError(f"{folder}: no tokenizer.json")
        return cls.from_file(folder / "tokenizer.json")

    @property
    def adds_bos(self) -> bool:
        """Whether ``encode(text, add_special_tokens=True)`` starts with BOS: what encoding does, not the config
        flag (a Llama-3 folder's post-processor adds BOS with no ``add_bos_token`` set)."""
        return self.bos_id is not None and self.encode("a", add_special_tokens=True)[:1] == [self.bos_id]

    @property
    def adds_eos(self) -> bool:
        """Whether ``encode(text, add_special_tokens=True)`` ends with EOS (BERT's [SEP], a seq2seq source's EOS)."""
        return self.eos_id is not None and self.encode("a", add_special_tokens=True)[-1:] == [self.eos_id]

    def set_special_rule(self, add_bos: bool, add_eos: bool = False) -> None:
        """Make ``encode(text, add_special_tokens=True)`` start with BOS / end with EOS, and store the rule in the
        backend, so a saved tokenizer.json carries it to transformers (and an export to llama.cpp's flag)."""
        for wanted, role in ((add_bos, "bos"), (add_eos, "eos")):
            if wanted and getattr(self, f"{role}_id") is None:
                raise TokenizerError(f"{self.name}: add_{role}_token needs a {role} token, and this tokenizer has none")
        self.backend.post_processor = special_post_processor(self.token, self.bos_id if add_bos else None,
                                                             self.eos_id if add_eos else None)
        self.add_bos_token, self.add_eos_token = add_bos, add_eos

    # ------------------------------------------------------------------------------------------ saving
    def save(self, path: str | os.PathLike, model_max_length: int | None = None, segments: bool = False) -> None:
        """Write ``tokenizer.json`` at ``path``; when the file is named so, ``tokenizer_config.json`` goes beside it
        (specials, chat template), so a reload (e.g. on resume) gets the same specials and template."""
        path = Path(path)
        atomic_write_text(path, self.backend.to_str(pretty=True))
        if path.name == "tokenizer.json":
            atomic_write_text(path.with_name("tokenizer_config.json"),
                              json.dumps(self.tokenizer_config(model_max_length, segments), indent=2,
                                         ensure_ascii=False) + "\n")

    def save_pretrained(self, folder: str | os.PathLike, model_max_length: int | None = None,
                        segments: bool = False) -> Path:
        """Write ``tokenizer.json`` + ``tokenizer_config.json`` into ``folder`` (atomically): the pair that
        ``tokenizers.Tokenizer.from_file`` and ``transformers.AutoTokenizer.from_pretrained`` load."""
        folder = Path(folder)
        self.save(folder / "tokenizer.json", model_max_length, segments)
        return folder

    def tokenizer_config(self, model_max_length: int | None = None, segments: bool = False) -> dict[str, Any]:
        """The ``tokenizer_config.json`` document (HF keys, plus ``seqlab_eot_token``); ``model_max_length`` is the
        model's context where one is known (an export), else HF's "no limit". ``segments``: the model reads token
        type ids (BERT's sentence pairs), which transformers returns only when the config names them."""
        cfg: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                               "add_bos_token": self.add_bos_token, "add_eos_token": self.add_eos_token}
        for role in _ROLES:
            token = self.token(getattr(self, f"{role}_id"))
            if token is not None:
                cfg[f"{role}_token"] = token
        if self.adds_bos and self.adds_eos:
            # BERT's rule, [CLS] text [SEP]: transformers' BERT code reads them as cls and sep, not bos and eos
            cfg["cls_token"], cfg["sep_token"] = self.bos_token, self.eos_token
        cfg["model_max_length"] = model_max_length or int(1e30)  # HF's "no limit" unless the model's context is known
        if self.chat_template:
            cfg["chat_template"] = self.chat_template
        if self.eot_token:
            cfg["seqlab_eot_token"] = self.eot_token
        if segments:
            cfg["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
        return cfg

    # ------------------------------------------------------------------------------------------ basics
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token(self, token_id: int | None) -> str | None:
        """The string of an id (None for None)."""
        return None if token_id is None else self.backend.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        """The id of any token string, or None."""
        return self.backend.token_to_id(token)

    def token_id(self, token: str) -> int:
        """The id of a *special* token string (chat markers); KeyError naming the specials otherwise."""
        if token not in self.special_tokens:
            raise KeyError(f"{token!r} is not a special token of {self.name} (have {sorted(self.special_tokens)})")
        return self.special_tokens[token]

    @property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self.special_tokens.values())

    @property
    def eot_id(self) -> int | None:
        return self.token_to_id(self.eot_token) if self.eot_token else None

    @property
    def bos_token(self) -> str | None:
        return self.token(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return self.token(self.eos_id)

    @property
    def pad_token(self) -> str | None:
        return self.token(self.pad_id)

    @property
    def unk_token(self) -> str | None:
        return self.token(self.unk_id)

    # ------------------------------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text. Invalid UTF-8 (a character split across tokens) decodes as U+FFFD, like HF."""
        return self.backend.decode(id_list(ids), skip_special_tokens=skip_special_tokens)

    def pad(self, batch: Sequence[Sequence[int]], side: str = "right", pad_id: int | None = None):
        """Ragged id lists -> ``(input_ids, attention_mask)`` LongTensors; left padding for batched generation."""
        if side not in ("left", "right"):
            raise ValueError(f"pad side must be 'left' or 'right', got {side!r}")
        pad = next((p for p in (pad_id, self.pad_id, self.eos_id) if p is not None), 0)
        width = max((len(s) for s in batch), default=0)
        ids = torch.full((len(batch), width), int(pad), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, s in enumerate(batch):
            cols = slice(width - len(s), width) if side == "left" else slice(0, len(s))
            ids[i, cols] = torch.tensor(list(s), dtype=torch.long)
            mask[i, cols] = 1
        return ids, mask

    def byte_lengths(self) -> list[int]:
        """UTF-8 bytes per id (0 for specials), as :func:`seqlab.data.byte_lengths.piece_byte_lengths` counts them."""
        if self._byte_lengths is None:
            self._byte_lengths = piece_byte_lengths(self.backend, self.vocab_size, self.special_ids)
        return self._byte_lengths

    def count_bytes(self, ids: Iterable[int]) -> int:
        """UTF-8 bytes the ids stand for (specials count 0): the denominator of bits per byte."""
        table = self.byte_lengths()
        ids = id_list(ids)
        bad = next((i for i in ids if not 0 <= i < len(table)), None)
        if bad is not None:  # a negative id would read the table from its end
            raise TokenizerError(f"{self.name}: token id {bad} is outside the vocabulary [0, {len(table)})")
        return sum(table[i] for i in ids)

    # ------------------------------------------------------------------------------------------ chat
    def render_chat(self, messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = False,
                    chat_template: str | None = None, **extra: Any) -> str:
        """The prompt text the chat template produces for ``messages`` (rendered in a sandbox)."""
        template = chat_template or self.chat_template
        if not template:
            raise TokenizerError(f"{self.name}: this tokenizer has no chat template (pass chat_template=...)")
        # the special tokens this tokenizer has, as HF passes them: one it lacks is left undefined (renders as
        # nothing), not passed as None (which renders as the text "None")
        specials = {f"{n}_token": self.token(getattr(self, f"{n}_id")) for n in _ROLES}
        specials = {k: v for k, v in specials.items() if v is not None}
        try:
            return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                        **{**specials, **extra})
        except ChatTemplateError as e:  # name where the template came from
            where = self.template_source if chat_template is None and self.template_source else self.name
            raise ChatTemplateError(f"{where}: {e}") from e

    def apply_chat_template(self, messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = False,
                            tokenize: bool = True, chat_template: str | None = None, **extra: Any) -> list[int] | str:
        """Render ``messages``; return ids (default) or the text. The template writes its own specials, so the text
        is encoded without adding BOS/EOS again (as HF)."""
        text = self.render_chat(messages, add_generation_prompt, chat_template, **extra)
        return self.encode(text) if tokenize else text

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
                f"eos={self.eos_token!r}, pad={self.pad_token!r}, chat_template={'yes' if self.chat_template else 'no'})")


def read_tokenizer_config(path: Path) -> dict[str, Any]:
    """The constructor arguments a ``tokenizer_config.json`` gives (token strings, template, BOS/EOS rule)."""
    if not path.is_file():
        return {}
    cfg = read_json_object(path, TokenizerError)

    def name(key: str) -> str | bool | None:
        """The token's text; False where the config says null (no such token: not to be guessed); None if absent."""
        val = cfg.get(key)
        if key in cfg and val is None:
            return False
        return val.get("content") if isinstance(val, dict) else val if isinstance(val, str) else None

    kw: dict[str, Any] = {role: name(f"{role}_token") for role in _ROLES}
    for role, stand_in in (("bos", "cls_token"), ("eos", "sep_token")):  # BERT: [CLS] opens, [SEP] closes
        if kw[role] is None:
            kw[role] = name(stand_in) or None
    template = cfg.get("chat_template")
    if isinstance(template, list):  # HF allows named templates; "default" is the chat one
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if isinstance(template, str):
        kw["chat_template"] = template
    if isinstance(cfg.get("seqlab_eot_token"), str):
        kw["eot_token"] = cfg["seqlab_eot_token"]
    kw["add_bos_token"] = bool(cfg.get("add_bos_token", False))
    kw["add_eos_token"] = bool(cfg.get("add_eos_token", False))
    return kw
