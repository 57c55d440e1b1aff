"""``seqlab chat``: talk to a chat model, whatever its source (a seqlab SFT run, a GGUF file, a HF folder).

    seqlab chat                                   # interactive, packaged SmolLM2-135M-Instruct
    seqlab chat --checkpoint runs/sft --message "Hi" --temperature 0      # one reply, for scripts
    seqlab chat --gguf model.gguf | --model hf-folder

Chat keeps the whole conversation as a list of ``{"role", "content"}`` messages and re-renders it with the model's
own chat template every turn, so roles reach the model exactly as it was fine-tuned to see them. Replies stream
token by token; ``/reset`` forgets the conversation, ``/exit`` (or Ctrl-D) leaves. On a terminal, ``readline``
gives line editing and a history (``~/.seqlab_chat_history``). Output: only the reply goes to stdout (the prompt
is a rendered conversation, not text the user typed); status lines go to stderr.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
from pathlib import Path

import torch

from seqlab.accel import accelerate
from seqlab.cli.generate import add_decode_speed_options
from seqlab.cli.model_args import add_model_source, load_model
from seqlab.cli.packaged import SMOLLM2_PACKAGE, missing_package, packaged_smollm2
from seqlab.data import Tokenizer
from seqlab.data.chat_template import ChatTemplateError
from seqlab.generate import stream
from seqlab.generate.chat import turn_end_ids
from seqlab.runtime.memory import keep_freed_blocks

HISTORY_FILE = Path(os.environ.get("SEQLAB_CHAT_HISTORY", Path.home() / ".seqlab_chat_history"))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "chat", help="chat with a model (seqlab checkpoint, GGUF or HF folder; default: packaged SmolLM2)",
        description="Multi-turn chat using the model's own chat template. Interactive by default (/reset clears "
                    "the conversation, /exit quits); --message answers one message and prints only the reply.",
    )
    add_model_source(p, required=False)
    p.add_argument("--message", "-m", metavar="TEXT", help="answer this one user message and exit (for scripts)")
    p.add_argument("--system", metavar="TEXT", help="system prompt (default: the template's own, if any)")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default 0.7)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default 0.9)")
    p.add_argument("--top-k", type=int, default=0, help="keep only the k most likely tokens (0 = off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="reply length limit in tokens (default 256, or half the model's context if that is less)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    add_decode_speed_options(p)
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run_chat)


class MessageTooLong(ValueError):
    """One message does not fit the context window even alone: the interactive session refuses it and goes on."""


class ChatSession:
    """A conversation with a model: the message list, and a ``reply`` that generates the assistant's next turn."""

    def __init__(self, model, tokenizer: Tokenizer, system: str | None = None, max_new_tokens: int | None = None,
                 temperature: float = 0.7, top_p: float = 0.9, top_k: int = 0, repetition_penalty: float = 1.0,
                 seed: int | None = 0, compile: bool = False):
        context = model.config.max_seq_len
        if max_new_tokens is None:  # not asked for: a default that leaves room for the conversation in any context
            max_new_tokens = min(256, context // 2)
        if max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        if max_new_tokens >= context:
            raise ValueError(f"--max-new-tokens {max_new_tokens} does not fit the model's context of {context} tokens "
                             f"(ModelConfig.max_seq_len) with a prompt; use at most {context - 1}")
        if temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {temperature}")
        self.model, self.tokenizer, self.system = model, tokenizer, system
        self.gen = dict(max_new_tokens=max_new_tokens, do_sample=temperature > 0, temperature=temperature or 1.0,
                        top_p=top_p, top_k=top_k, repetition_penalty=repetition_penalty, seed=seed,
                        eos_token_id=turn_end_ids(tokenizer, model.config), compile=compile)
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def _prompt_ids(self) -> list[int]:
        """The rendered conversation; the oldest turns are dropped if it would not fit the context window."""
        budget = self.model.config.max_seq_len - self.gen["max_new_tokens"]
        keep_from = 1 if self.system else 0
        messages = list(self.messages)
        while True:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            if len(ids) <= budget or len(messages) - keep_from <= 1:
                break
            del messages[keep_from : keep_from + 2]  # forget the oldest user/assistant exchange
        if len(ids) > budget:  # the new message alone is too long: the conversation so far is kept as it was
            raise MessageTooLong(f"the message is {len(ids)} tokens; the model's context allows {budget} "
                             f"with --max-new-tokens {self.gen['max_new_tokens']}")
        self.messages = messages
        return ids

    def reply(self, user_text: str, on_text=None) -> str:
        """Add the user's message, generate the assistant's reply (streamed to ``on_text``), remember and return it.
        A message that cannot fit the context is refused (``MessageTooLong``) and leaves the conversation as it was."""
        self.messages.append({"role": "user", "content": user_text})
        try:
            prompt = self._prompt_ids()
        except (MessageTooLong, ChatTemplateError):  # the conversation stays as it was
            self.messages.pop()
            raise
        ids = torch.tensor([prompt], dtype=torch.long, device=next(self.model.parameters()).device)
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
        if on_text is not None and len(text) > shown:  # the piece held back at the end (a character cut short)
            on_text(text[shown:])
        self.messages.append({"role": "assistant", "content": text.strip()})
        return text


def _load_chat_model(args):
    if not (args.checkpoint or args.gguf or args.model) and packaged_smollm2() is None:
        raise missing_package(SMOLLM2_PACKAGE, "--gguf")
    loaded = load_model(args, default_gguf=packaged_smollm2())
    if not loaded.tokenizer.chat_template:
        raise ValueError(f"{loaded.path}: the model has no chat template; use `seqlab generate` instead")
    keep_freed_blocks()  # each turn's prefill reuses the pages the last one freed instead of faulting in fresh ones
    if not args.no_accel:  # (after the allocator setting: the calibration times prefills as they will run)
        accelerate(loaded.model, "decode", rows=1, dtype="auto" if args.dtype == "auto" else None)
    return loaded.path, loaded.model, loaded.tokenizer


def run_chat(args: argparse.Namespace) -> int:
    if args.message is not None and not args.message.strip():  # (the interactive session skips blank lines)
        raise ValueError("--message is empty: give the text the model should answer")
    if args.temperature == 0 and (args.top_k or args.top_p is not None):  # as `seqlab generate` refuses them
        raise ValueError("--temperature 0 is greedy decoding: --top-k/--top-p do not apply (drop them, or give a "
                         "temperature above 0)")
    path, model, tokenizer = _load_chat_model(args)
    session = ChatSession(model, tokenizer, system=args.system, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_p=0.9 if args.top_p is None else args.top_p,
                          top_k=args.top_k,
                          repetition_penalty=args.repetition_penalty, seed=args.seed,
                          compile=getattr(args, "compile", False))
    if args.message is not None:
        print(session.reply(args.message).strip(), flush=True)
        return 0
    return _interactive(session, path)


def _enable_line_editing() -> None:
    """readline on a terminal: arrow-key editing and a history kept across sessions (saved at exit)."""
    if not sys.stdin.isatty():
        return
    try:
        import readline  # not on every platform (Windows): chat works without it
    except ImportError:
        return
    try:
        readline.read_history_file(HISTORY_FILE)
    except OSError:
        pass
    readline.set_history_length(1000)
    atexit.register(_save_history, readline)


def _save_history(readline) -> None:
    try:
        readline.write_history_file(HISTORY_FILE)
    except OSError:
        pass


def _interactive(session: ChatSession, path: Path) -> int:
    name = session.model.config.extra.get("name") or path.name
    err = sys.stderr
    _enable_line_editing()
    print(f"seqlab chat: {name} ({path.name}). Type a message; /reset clears the conversation, /exit quits.", file=err)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print(flush=True)  # after input()'s prompt on stdout: a transcript ends with a whole line
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

        try:
            session.reply(text, on_text=show)
        except (MessageTooLong, ChatTemplateError) as e:  # a message too long, or one the template refuses (a role
            sys.stdout.write("\n")                         # it does not take): say so, keep the session going
            print(f"error: {e} (not sent; the conversation so far is kept)", file=err)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
