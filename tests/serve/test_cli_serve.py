"""``seqlab serve`` as a user starts it: the listening line, a greedy chat reply equal to ``seqlab chat``'s, and
SIGTERM while replies are streaming (they finish, the process exits 0)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

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


def test_replies_cut_by_the_shutdown_end_with_the_apis_error(tmp_path):
    """SIGTERM with replies longer than --shutdown-timeout: each still ends in the API's own form (a JSON error for
    a plain reply; an error chunk, then [DONE], for a stream), not uvicorn's plain-text 500 or a cut stream, and
    the process exits 0 without a traceback."""
    tok = ByteTokenizer()
    model = tiny_decoder(seed=3, vocab_size=tok.vocab_size, max_seq_len=4096, d_model=256, n_layers=4, n_heads=4,
                         pad_token_id=tok.pad_id, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id)  # ~3 ms a step
    save_pretrained(model, tmp_path / "long")
    tok.save(tmp_path / "long" / "tokenizer.json")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "seqlab", "serve", "--checkpoint", str(tmp_path / "long"),
                             "--port", str(port), "--no-accel", "--shutdown-timeout", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert proc.stdout.readline() == f"listening on http://127.0.0.1:{port}\n"
        said: dict[str, bytes] = {}

        def ask(stream: bool) -> None:
            body = json.dumps({"model": "long", "prompt": "KING", "max_tokens": 2000, "ignore_eos": True,
                               "stream": stream}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    said[f"{stream} {r.status}"] = r.read()
            except urllib.error.HTTPError as e:
                said[f"{stream} {e.code}"] = e.read()

        threads = [threading.Thread(target=ask, args=(stream,)) for stream in (False, True)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # both replies generating
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
                if json.loads(r.read())["active"] == 2:
                    break
            assert not said, said  # refused, or over already
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=60)
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err and "CancelledError" not in err, err
        plain = json.loads(said["False 500"])
        assert plain["error"]["message"] == "the server shut down before the reply finished", plain
        events = [line for line in said["True 200"].decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and "shut down before the reply finished" in events[-2], events[-3:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


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
