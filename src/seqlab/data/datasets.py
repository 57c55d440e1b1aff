"""``build_dataset``: the examples each objective trains on, from a file or from the built-in defaults.

Defaults (no ``--data``): the embedded Shakespeare corpus for clm/mlm, the synthetic date-normalisation task for
seq2seq, built-in chats for sft and preference pairs for dpo (``data.synthetic``) — all deterministic.

Splits of a user file (so one file is enough): JSONL examples with ``index % 20 == 19`` are validation, the rest
train; a single plain-text document keeps its last 5-7.5 % (:func:`split_text`) for validation. ``split="all"``
uses everything (e.g. when a separate validation file is given).

CLM rows are windows of ``seq_len`` tokens over the token stream (documents joined by EOS) with stride
``seq_len - 1``: consecutive windows share one token, so every token of the stream after the first is a target
exactly once (the window's first token is context only). Evaluating the validation split therefore scores the whole
held-out text once — what perplexity and bits per byte need.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from seqlab.data import readers, synthetic
from seqlab.data.chat import ChatTemplateSpanError, cut_preference, tokenize_chat, tokenize_preference
from seqlab.data.chat_template import ChatTemplateError
from seqlab.data.collate import IGNORE_INDEX
from seqlab.data.corpus import load_documents, normalise_split
from seqlab.data.packing import pack_documents

HOLDOUT_EVERY = 20
SYNTHETIC_SIZES = {"seq2seq": (20000, 500), "sft": (4000, 200), "dpo": (4000, 200)}  # (train, validation)
_VAL_SEED_OFFSET = 1_000_003


class Examples(Dataset):
    """A map-style dataset over a list, or over ``fn(index)`` for examples generated on the fly."""

    def __init__(self, items: Sequence[Any] | None = None, fn: Callable[[int], Any] | None = None, size: int = 0,
                 info: dict[str, Any] | None = None):
        self.items, self.fn = items, fn
        self.size = len(items) if items is not None else size
        self.info = info or {}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> Any:
        if not -self.size <= i < self.size:
            raise IndexError(i)
        i %= self.size
        return self.items[i] if self.items is not None else self.fn(i)


def _split_split(split: str) -> str:
    return "all" if split == "all" else normalise_split(split)


def split_items(items: Sequence[Any], split: str, source: str | os.PathLike | None = None) -> list[Any]:
    """The ``split`` of ``items`` (from the file ``source``, named in errors): every 20th is validation."""
    if split == "all":
        return list(items)
    if len(items) < 2:
        where = f"{source}: " if source is not None else ""
        raise ValueError(f"{where}{len(items)} example(s); a file split into train and validation needs at least 2 "
                         "(every 20th example, and at least one, is held out for validation)")
    held = [i for i in range(len(items)) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1] or [len(items) - 1]
    held_set = set(held)
    keep = held if split == "validation" else [i for i in range(len(items)) if i not in held_set]
    return [items[i] for i in keep]


def _at_line(path: str | os.PathLike, example: dict, tokenize: Callable, *args: Any) -> Any:
    """``tokenize(*args)``, its refusal (a chat template's ``raise_exception``, an answer the template does not
    render) named by the file and the example's line, as a malformed line is."""
    try:
        return tokenize(*args)
    except (ChatTemplateError, ChatTemplateSpanError) as e:
        raise readers.DataError(path, example.get(readers.LINE), str(e)) from None


def split_text(text: str, split: str, frac: float = 0.05) -> str:
    """The last ``frac`` of one document held out for validation, cut after a line break, else after a space,
    within the ``frac / 2`` of the text before the exact cut (so 5-7.5 % is held out). Why the window: a file of few
    lines (a paragraph per line) would otherwise hand most of its text to validation."""
    if split == "all":
        return text
    cut = int(len(text) * (1 - frac))
    lo = cut - int(len(text) * frac / 2)
    for sep in ("\n", " "):
        at = text.rfind(sep, max(lo, 0), cut)
        if at > 0:
            cut = at + 1
            break
    return text[cut:] if split == "validation" else text[:cut]


def split_documents(path: str | os.PathLike | None, split: str) -> list[str]:
    """The documents of ``split`` of a text file (or the embedded corpus): a BPE tokenizer learns from the training
    split alone, as the model does, or the validation text's words become single tokens."""
    if path is None:
        splits = ("train", "validation") if split == "all" else (split,)
        return [d.text for s in splits for d in load_documents(s)]
    docs = readers.read_documents(path)
    if len(docs) == 1:
        return [split_text(docs[0], split)]
    return split_items(docs, split, path)


def example_texts(objective: str, path: str | os.PathLike | None, split: str, seed: int = 0) -> list[str]:
    """The texts of ``split`` of a seq2seq / sft / dpo file (sources and targets, message contents, prompts and
    responses): what a BPE tokenizer for such a run learns from, as a clm run's learns from its documents. Without a
    file, the built-in training examples' (it learned from the play, whose words the tasks barely use)."""
    if path is None:
        make = {"seq2seq": synthetic.date_example, "sft": synthetic.chat_example,
                "dpo": synthetic.preference_example}[objective]
        items = [make(seed, i, "train") for i in range(SYNTHETIC_SIZES[objective][0])]
    else:
        read = {"seq2seq": readers.read_seq2seq, "sft": readers.read_sft, "dpo": readers.read_preferences}[objective]
        items = split_items(read(path), split, path)
    if objective == "seq2seq":
        return [t for ex in items for t in (ex["source"], ex["target"])]
    if objective == "sft":
        return [m["content"] for ex in items for m in ex["messages"] if m.get("content")]
    texts = []
    for ex in items:
        prompt = ex["prompt"]
        texts += [prompt] if isinstance(prompt, str) else [m["content"] for m in prompt if m.get("content")]
        texts += [ex["chosen"], ex["rejected"]]
    return texts


def token_stream(docs: Sequence[str], tokenizer: Any, bos: bool = False) -> torch.Tensor:
    """Documents encoded and joined into one long tensor, each followed by EOS and, with ``bos``, preceded by BOS.

    Why BOS for CLM: generation, perplexity and the HF export start every prompt of a seqlab checkpoint with BOS,
    so training must show the model BOS before each document (as ``--pack`` does), or its first input at inference
    is a token it never saw. MLM rows add their own BOS and EOS around each window. Where BOS is EOS (GPT-2's
    ``<|endoftext|>``) one token ends a document and starts the next, as at inference: only the first document gets
    its own, or every later one would follow two, and the second would be scored as a free target.
    """
    eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    start = [tokenizer.bos_id] if bos and tokenizer.bos_id is not None else []
    first = start
    if start == eos:
        start = []
    # via numpy: torch.tensor(list) is ~10x slower on multi-million-token lists
    parts = [torch.from_numpy(np.array((first if i == 0 else start) + enc + eos, dtype=np.int64))
             for i, enc in enumerate(tokenizer.encode_batch(list(docs)))]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def n_windows(n_tokens: int, seq_len: int, stride: int) -> int:
    """Windows starting every ``stride`` tokens that still hold a target (>= 2 tokens)."""
    return len(range(0, max(n_tokens - 1, 0), stride))


def _window(stream: torch.Tensor, seq_len: int, stride: int, i: int) -> list[int]:
    return stream[i * stride: i * stride + seq_len].tolist()


def _mlm_row(stream: torch.Tensor, body: int, start: list[int], end: list[int], i: int) -> list[int]:
    return start + stream[i * body: (i + 1) * body].tolist() + end


def windows(stream: torch.Tensor, seq_len: int, stride: int) -> list[list[int]]:
    """Windows of ``seq_len`` starting every ``stride`` tokens; the last one may be shorter (never below 2)."""
    return [_window(stream, seq_len, stride, i) for i in range(n_windows(len(stream), seq_len, stride))]


def _seq2seq_cut(source: list[int], target: list[int], seq_len: int, eos: int) -> dict[str, list[int]]:
    """A pair's rows: the source cut to ``seq_len - 1`` tokens and ended by EOS, the target cut alike (a batch adds
    its start token)."""
    return {"source_ids": source[: seq_len - 1] + [eos], "target_ids": target[: seq_len - 1]}


def _seq2seq_item(tokenizer: Any, seq_len: int, ex: dict[str, str]) -> dict[str, list[int]]:
    return _seq2seq_cut(tokenizer.encode(ex["source"]), tokenizer.encode(ex["target"]), seq_len, tokenizer.eos_id)


def _file_items(objective: str, path: str | os.PathLike, tokenizer: Any, seq_len: int, split: str) -> list[dict]:
    """The ``split`` of a seq2seq / sft / dpo file, each example cut to ``seq_len`` tokens. Cut examples are counted
    in a warning that names the file, and an SFT example left with no answer token is dropped: it would teach
    nothing, and a batch of only such examples has no target at all."""
    if objective == "seq2seq":
        full = [(tokenizer.encode(ex["source"]), tokenizer.encode(ex["target"]))
                for ex in split_items(readers.read_seq2seq(path), split, path)]
        items = [_seq2seq_cut(s, t, seq_len, tokenizer.eos_id) for s, t in full]
        lengths = [max(len(s), len(t)) + 1 for s, t in full]  # the source ends in EOS, the target gains one in a batch
    elif objective == "sft":
        full = [_at_line(path, ex, tokenize_chat, tokenizer, ex["messages"])
                for ex in split_items(readers.read_sft(path), split, path)]
        items = [{k: v[:seq_len] for k, v in ex.items()} for ex in full]
        lengths = [len(ex["input_ids"]) for ex in full]
    else:
        full = [_at_line(path, ex, tokenize_preference, tokenizer, ex)
                for ex in split_items(readers.read_preferences(path), split, path)]
        items = [cut_preference(ex, seq_len) for ex in full]
        lengths = [len(ex["prompt_ids"]) + max(len(ex["chosen_ids"]), len(ex["rejected_ids"])) for ex in full]
    n_cut = sum(n > seq_len for n in lengths)
    if objective == "sft":
        kept = [ex for ex in items if any(label != IGNORE_INDEX for label in ex["labels"][1:])]
        dropped, items = len(items) - len(kept), kept
        if not items:
            raise ValueError(f"{path} ({split}): no example keeps an answer token within --seq-len {seq_len} "
                             f"(the longest is {max(lengths)} tokens); raise --seq-len")
    else:
        dropped = 0
    if n_cut:
        left_out = f"; {dropped} of them keep no answer token and are left out" if dropped else ""
        warnings.warn(f"{path} ({split}): {n_cut} of {len(lengths)} examples are longer than a row of {seq_len} "
                      f"tokens and are cut (the longest is {max(lengths)} tokens){left_out}; raise --seq-len to "
                      "keep them whole", stacklevel=2)
    return items


def _synthetic_seq2seq(tokenizer, seq_len, seed, split, i):
    return _seq2seq_item(tokenizer, seq_len, synthetic.date_example(seed, i, split))


def _synthetic_sft(tokenizer, seq_len, seed, split, i):
    return tokenize_chat(tokenizer, synthetic.chat_example(seed, i, split)["messages"], seq_len)


def _synthetic_dpo(tokenizer, seq_len, seed, split, i):
    return tokenize_preference(tokenizer, synthetic.preference_example(seed, i, split), seq_len)


def build_dataset(objective: str, path: str | os.PathLike | None, tokenizer: Any, seq_len: int,
                  split: str = "train", seed: int = 0, *, pack: bool = False, document_bos: bool = True,
                  size: int | None = None) -> Examples:
    """Examples for ``objective`` (what its ``collate`` takes). ``pack`` (clm only): pack whole documents
    (BOS + text + EOS) into rows with ``document_ids`` instead of windows over the joined stream. ``document_bos``
    (clm only): BOS before each document of the stream (False rebuilds a run recorded before it was). ``size``:
    number of synthetic examples (default per objective)."""
    split = _split_split(split)
    if seq_len < 4:
        raise ValueError(f"seq_len must be >= 4, got {seq_len}")
    info = {"objective": objective, "path": str(path) if path else None, "split": split, "seq_len": seq_len}
    if objective == "clm":
        docs = split_documents(path, split)
        if pack:
            eos = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
            # BOS even where it is EOS (GPT-2's <|endoftext|>): a packed document sees nothing of the one before it,
            # so without its own opener its first token would have no position to be predicted from
            bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
            # the padding's id is never read (its document id masks it out), but it must be an id: EOS, else 0
            pad = next((p for p in (tokenizer.pad_id, tokenizer.eos_id) if p is not None), 0)
            rows = pack_documents([bos + ids + eos for ids in tokenizer.encode_batch(docs)], seq_len, pad)
            return Examples(rows, info=info)
        stream = token_stream(docs, tokenizer, bos=document_bos)
        info["n_tokens"] = len(stream)
        return Examples(fn=functools.partial(_window, stream, seq_len, seq_len - 1), info=info,
                        size=n_windows(len(stream), seq_len, seq_len - 1))
    if objective == "mlm":
        docs = split_documents(path, split)
        stream = token_stream(docs, tokenizer)
        # BERT's [CLS] ... [SEP] around each window, where the tokenizer has them (a None in a row crashed collate)
        start, end = ([t] if t is not None else [] for t in (tokenizer.bos_id, tokenizer.eos_id))
        body = seq_len - len(start) - len(end)
        info["n_tokens"] = len(stream)
        return Examples(fn=functools.partial(_mlm_row, stream, body, start, end), size=-(-len(stream) // body),
                        info=info)
    if objective not in SYNTHETIC_SIZES:
        raise ValueError(f"unknown objective {objective!r}; expected clm, mlm, seq2seq, sft or dpo")
    if path is not None:
        return Examples(_file_items(objective, path, tokenizer, seq_len, split), info=info)
    n_train, n_val = SYNTHETIC_SIZES[objective]
    n = size or (n_val if split == "validation" else n_train)
    syn_split = "validation" if split == "validation" else "train"
    syn_seed = seed + (_VAL_SEED_OFFSET if split == "validation" else 0)
    fn = {"seq2seq": _synthetic_seq2seq, "sft": _synthetic_sft, "dpo": _synthetic_dpo}[objective]
    info["synthetic"] = True
    return Examples(fn=functools.partial(fn, tokenizer, seq_len, syn_seed, syn_split), size=n, info=info)
