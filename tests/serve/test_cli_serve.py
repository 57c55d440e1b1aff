"""``seqlab serve`` as a user starts it: the listening line, a greedy chat reply equal to ``seqlab chat``'s, and
SIGTERM while replies are streaming (they finish, the process exits 0)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import torch

from seqlab.cli import main
from seqlab.config import ModelConfig
from seqlab.data.tokenizers import ByteTokenizer
from seqlab.io import save_pretrained
from seqlab.model import build_model
from tests.generate.gen_helpers import tiny_decoder

MESSAGE = "the cat sat on"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_cli_matches_chat_and_drains_on_sigterm(tiny_gguf, capsys):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "seqlab", "serve", "--gguf", str(tiny_gguf), "--port", str(port),
                             "--shutdown-timeout", "20"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        line = proc.stdout.readline()
        assert line == f"listening on http://127.0.0.1:{port}\n", proc.stderr.read() if not line else line
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        model = c.models.list().data[0].id
        assert model == tiny_gguf.stem
        reply = c.chat.completions.create(model=model, messages=[{"role": "user", "content": MESSAGE}],
                                          max_tokens=12, temperature=0).choices[0].message.content
        assert main(["chat", "--gguf", str(tiny_gguf), "--message", MESSAGE, "--temperature", "0",
                     "--max-new-tokens", "12"]) == 0
        assert capsys.readouterr().out == reply + "\n"

        # SIGTERM with three replies in flight: they run to their end, then the process exits 0
        results: list[tuple[str | None, int]] = []
        started = threading.Barrier(4)

        def stream_one(i: int) -> None:
            s = c.chat.completions.create(model=model, messages=[{"role": "user", "content": f"{MESSAGE} {i}"}],
                                          max_tokens=60, temperature=0.7, seed=i, stream=True)
            finish, n = None, 0
            for k, chunk in enumerate(s):
                if k == 0:
                    started.wait(timeout=30)
                n += 1
                finish = chunk.choices[0].finish_reason or finish
            results.append((finish, n))

        threads = [threading.Thread(target=stream_one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        started.wait(timeout=30)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
        assert len(results) == 3 and all(f in ("stop", "length") for f, _ in results)  # every reply ran to its end
        assert "Traceback" not in proc.stderr.read()
        # and nothing is admitted after the shutdown
        t0 = time.monotonic()
        try:
            c.models.list()
            raise AssertionError("the server still answers after SIGTERM")
        except openai.APIConnectionError:
            assert time.monotonic() - t0 < 30
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_reads_a_completion_prompt_as_generate_does(tmp_path, capsys):
    """A seqlab checkpoint's prompt starts with BOS in ``seqlab generate``; the server's completions route reads it
    the same way (same greedy text, BOS counted in the usage), and a run folder is served under its own name."""
    tok = ByteTokenizer()
    model = tiny_decoder(seed=41, vocab_size=tok.vocab_size, max_seq_len=64, pad_token_id=tok.pad_id,
                         bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)
    folder = tmp_path / "tiny-run"
    save_pretrained(model, folder)
    tok.save(folder / "tokenizer.json")
    assert main(["generate", "--checkpoint", str(folder), "--prompt", "KING", "--max-new-tokens", "6",
                 "--temperature", "0", "--no-accel"]) == 0
    want = capsys.readouterr().out.removesuffix("\n").removeprefix("KING")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "seqlab", "serve", "--checkpoint", str(folder), "--port",
                             str(port), "--no-accel", "--max-batch", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        line = proc.stdout.readline()
        assert line == f"listening on http://127.0.0.1:{port}\n", proc.stderr.read() if not line else line
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert c.models.list().data[0].id == "tiny-run"
        reply = c.completions.create(model="tiny-run", prompt="KING", max_tokens=6, temperature=0)
        assert reply.usage.prompt_tokens == 1 + len("KING")  # BOS, then the four bytes
        assert reply.choices[0].text == want
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_serve_refuses_an_encoder_before_timing_routes(tmp_path, capsys):
    """An encoder (an mlm run) cannot serve completions: one line saying so, with the default CPU routes on (their
    prefill timing would otherwise try to fill a cache the encoder does not have)."""
    tok = ByteTokenizer()
    torch.manual_seed(0)
    encoder = build_model(ModelConfig(arch="encoder", vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2,
                                      max_seq_len=32, pos="learned", norm="layernorm", mlp="gelu")).eval()
    save_pretrained(encoder, tmp_path / "enc")
    tok.save(tmp_path / "enc" / "tokenizer.json")
    assert main(["serve", "--checkpoint", str(tmp_path / "enc"), "--port", "0"]) == 2
    assert "serving needs a decoder (causal LM) model, this one is 'encoder'" in capsys.readouterr().err
