"""The HTTP server, driven by the official ``openai`` client against a tiny random GGUF model on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import threading
import time

import urllib.error
import urllib.request
import openai
import pytest
import torch

from seqlab.generate import generate
from seqlab.generate.chat import chat_prompt_ids, reply_text, turn_end_ids
from seqlab.io import load_gguf
from tests.serve.conftest import MODEL_ID, running_server

HELLO = [{"role": "user", "content": "the cat sat on"}]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def post(url: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def client(url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, **kw)


def wait_idle(url: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = get_json(f"{url}/health")
        if health["active"] == 0 and health["waiting"] == 0:
            return health
        time.sleep(0.05)
    raise AssertionError(f"the server did not free its slots: {health}")


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    """Greedy replies computed alone by seqlab.generate, and the tokenizer."""
    model, tok = load_gguf(tiny_gguf)

    def greedy(messages, n):
        ids = chat_prompt_ids(tok, messages)
        new = generate(model, torch.tensor([ids]), max_new_tokens=n, eos_token_id=turn_end_ids(tok))[0, len(ids):]
        return reply_text(tok, new.tolist(), turn_end_ids(tok)), len(ids)

    return greedy, tok


def test_models_and_health(server):
    url, _ = server
    assert [m.id for m in client(url).models.list().data] == [MODEL_ID]
    health = get_json(f"{url}/health")
    assert health["status"] == "ok" and health["slots"] == 4


def test_chat_completion_is_the_greedy_reply(server, reference):
    url, _ = server
    greedy, _ = reference
    r = client(url).chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=12, temperature=0)
    text, n_prompt = greedy(HELLO, 12)
    assert r.choices[0].message.content == text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 12)


def test_streaming_pieces_add_up_to_the_reply(server, reference):
    url, _ = server
    stream = client(url).chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True,
                                                                              "include_obfuscation": False})
    chunks = list(stream)
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert "".join(pieces) == reference[0](HELLO, 12)[0]
    assert finish == ["length"] and chunks[-1].usage.completion_tokens == 12


def test_completions_max_tokens_and_stop_strings(server, reference):
    url, _ = server
    _, tok = reference
    c = client(url)
    full = c.completions.create(model=MODEL_ID, prompt="the cat", max_tokens=20, temperature=0)
    assert full.usage.completion_tokens == 20 and full.choices[0].finish_reason == "length"
    text = full.choices[0].text
    stop = next(text[i : i + 2] for i in range(3, len(text) - 1) if text[i : i + 2].strip()
                and "\ufffd" not in text[i : i + 2])
    cut = c.completions.create(model=MODEL_ID, prompt="the cat", max_tokens=20, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[: text.find(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model=MODEL_ID, prompt="the cat", max_tokens=20, temperature=0, stop=stop,
                                    stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == cut.choices[0].text


def test_seeded_sampling_repeats(server):
    url, _ = server
    c = client(url)
    kw = dict(model=MODEL_ID, messages=HELLO, max_tokens=16, temperature=0.9, top_p=0.95)
    a, b = (c.chat.completions.create(seed=7, **kw).choices[0].message.content for _ in range(2))
    assert a == b


@pytest.mark.parametrize("body, param", [
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 3.5}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0}, "top_p"),
    ({"n": 2}, "n"),
    ({"seed": 2**64}, "seed"),
    ({"logprobs": True}, "logprobs"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"stop": [""]}, "stop"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "the " * 3000}]}, "messages"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # only with stream: true, as in OpenAI's API
    ({"stream": True, "stream_options": {"include_usage": True, "continuous": True}}, "stream_options.continuous"),
    ({"stream": True, "stream_options": {"include_obfuscation": "no"}}, "stream_options.include_obfuscation"),
    ({"functions": [{"name": "f", "parameters": {}}], "function_call": "auto"}, "functions"),
    ({"max_tokens": 2048}, "messages"),  # prompt + max_tokens past the context of 2048
])
def test_bad_fields_are_400_naming_the_field(server, body, param):
    url, _ = server
    kw = {"model": MODEL_ID, "messages": HELLO, **body}
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(**kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param
    assert param in e.value.body["message"]


@pytest.mark.parametrize("field, value", [("min_tokens", 25), ("repetition_penalty", 2.0), ("min_p", 0.9),
                                          ("stop_token_ids", [13]), ("max_new_tokens", 3), ("guided_json", {})])
def test_unknown_or_unimplemented_sampling_fields_are_400(server, field, value):
    """vLLM's sampling extensions (a client of such a server sends them) and fields no one defined: refused by
    name, not silently dropped; their neutral values and fields that do not change a reply pass."""
    url, _ = server
    status, body = post(f"{url}/v1/chat/completions", json.dumps(
        {"model": MODEL_ID, "messages": HELLO, "max_tokens": 4, field: value}).encode())
    assert status == 400 and body["error"]["param"] == field, body
    status, body = post(f"{url}/v1/chat/completions", json.dumps(
        {"model": MODEL_ID, "messages": HELLO, "max_tokens": 4, "repetition_penalty": 1.0, "min_tokens": 0,
         "user": "u1", "metadata": {"k": "v"}, "store": False, "skip_special_tokens": True}).encode())
    assert status == 200, body


def test_context_overflow_and_a_completion_asking_for_logprobs_are_400(server):
    """OpenAI answers a request whose prompt and max_tokens pass the context with 400, not a quietly shorter
    reply; a completion's ``logprobs: 0`` asks for the sampled tokens' log-probabilities (0 == false in Python)."""
    url, _ = server
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=2048)
    assert e.value.body["code"] == "context_length_exceeded" and "max_tokens 2048" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client(url).completions.create(model=MODEL_ID, prompt="the cat", logprobs=0)
    assert e.value.body["param"] == "logprobs"


def test_null_means_the_default_and_a_completion_defaults_to_16_tokens(server, reference):
    url, _ = server
    status, body = post(f"{url}/v1/chat/completions", json.dumps(
        {"model": MODEL_ID, "messages": HELLO, "max_tokens": 12, "temperature": 0, "n": None, "stream": None,
         "ignore_eos": None, "stream_options": None}).encode())
    assert status == 200 and body["choices"][0]["message"]["content"] == reference[0](HELLO, 12)[0]
    r = client(url).completions.create(model=MODEL_ID, prompt="the cat", temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("sampling", [{"temperature": 1.0, "top_k": 1}, {"temperature": 1e-40}])
def test_top_k_one_and_a_tiny_temperature_are_greedy(server, reference, sampling):
    """vLLM's ``top_k`` is honoured, not dropped; a temperature of 1e-40 overflowed float32 to a NaN row (500)."""
    url, _ = server
    kw = {k: v for k, v in sampling.items() if k != "top_k"}
    extra = {"top_k": sampling["top_k"]} if "top_k" in sampling else {}
    r = client(url).chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=12, seed=3,
                                            extra_body=extra, **kw)
    assert r.choices[0].message.content == reference[0](HELLO, 12)[0]
    status, body = post(f"{url}/v1/chat/completions",
                        json.dumps({"model": MODEL_ID, "messages": HELLO, "top_k": -2}).encode())
    assert status == 400 and body["error"]["param"] == "top_k"


def test_one_model_by_its_id(server):
    url, _ = server
    assert client(url).models.retrieve(MODEL_ID).id == MODEL_ID
    with pytest.raises(openai.NotFoundError) as e:
        client(url).models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found"


def test_unknown_model_is_404_and_bad_json_is_400(server):
    url, _ = server
    with pytest.raises(openai.NotFoundError) as e:
        client(url).chat.completions.create(model="gpt-4", messages=HELLO)
    assert e.value.body["code"] == "model_not_found"
    status, body = post(f"{url}/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = post(f"{url}/v1/complete", b"{}")  # a mistyped route: the API's error form, not plain text
    assert status == 404 and "/v1/completions" in body["error"]["message"]
    try:
        get_json(f"{url}/v1/completions")
    except urllib.error.HTTPError as e:
        assert e.code == 405 and json.loads(e.read())["error"]["type"] == "invalid_request_error"
    else:
        raise AssertionError("GET on a POST route was answered")


def test_a_lone_surrogate_is_400_and_a_huge_prompt_is_refused_before_tokenizing(server):
    """JSON may escape a lone surrogate (\\ud800), which is no character: the client's error, not the server's. A
    prompt with more bytes than the context could hold at the tokenizer's longest token is refused at once, so it
    cannot hold up every other client while it is tokenized."""
    url, engine = server
    for route, body in (("chat/completions", {"messages": [{"role": "user", "content": "\ud800 hi"}]}),
                        ("completions", {"prompt": "\ud800 hi"})):
        status, reply = post(f"{url}/v1/{route}", json.dumps({"model": MODEL_ID, **body}).encode())
        assert status == 400 and "lone UTF-16 surrogate" in reply["error"]["message"], reply
    huge = "word " * 40_000  # 200 kB, more than 2048 tokens of this vocabulary can spell: refused untokenized
    status, reply = post(f"{url}/v1/completions", json.dumps({"model": MODEL_ID, "prompt": huge}).encode())
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert "bytes of text cannot fit the context" in reply["error"]["message"]  # the check before tokenizing
    assert get_json(f"{url}/health")["status"] == "ok"


def test_an_oversized_or_malformed_body_is_refused_as_it_arrives(server):
    """A body larger than any text the context could hold is a 413, by its declared length or, chunked, as it
    arrives (a 400 MiB body was read whole); JSON that Python's parser rejects past its limits (an integer of 5000
    digits, arrays nested 100 000 deep) is a 400, not a 500; a 405 names the allowed method."""
    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    for chunked in (False, True):  # a declared length is refused before any of the body; chunked, at the limit
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader(*(("Transfer-Encoding", "chunked") if chunked else ("Content-Length", str(400 << 20))))
        conn.endheaders()
        try:
            for _ in range(64 if chunked else 0):  # 4 MiB, past this server's limit
                conn.send(b"10000\r\n" + b"w" * 65536 + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):  # the server answered and closed: what it said follows
            pass
        reply = conn.getresponse()
        assert reply.status == 413 and b"larger than this server takes" in reply.read(), chunked
        conn.close()
    for raw in (b'{"model": "tiny", "prompt": "hi", "seed": 1' + b"9" * 5000 + b"}", b"[" * 100_000 + b"]" * 100_000):
        status, reply = post(f"{url}/v1/completions", raw)
        assert status == 400 and "not valid JSON" in reply["error"]["message"], reply
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{url}/v1/completions", timeout=30)
    assert e.value.code == 405 and e.value.headers["Allow"] == "POST"
    assert get_json(f"{url}/health")["status"] == "ok"


@pytest.mark.parametrize("route, body, param", [
    ("chat/completions", {"messages": HELLO, "prompt": "hi"}, "prompt"),
    ("completions", {"prompt": "hi", "messages": HELLO}, "messages"),
    ("chat/completions", {"messages": [{"role": "assistant", "content": "", "tool_calls": [{}]}]},
     "messages[0].tool_calls"),
    ("completions", {"prompt": "hi", "stop": ["x" * 1025]}, "stop")])
def test_what_an_endpoint_would_ignore_is_refused(server, route, body, param):
    """The other endpoint's input, a message's tool calls (the prompt would not hold them) and a stop string past
    1024 characters (checked every token, on the thread every request shares) are 400s naming the field."""
    url, _ = server
    status, reply = post(f"{url}/v1/{route}", json.dumps({"model": MODEL_ID, **body}).encode())
    assert status == 400 and reply["error"]["param"] == param, reply


def test_disconnect_cancels_the_request_and_frees_its_slot(server):
    url, engine = server
    wait_idle(url)
    steps_before = engine.steps
    # ignore_eos: the reply must run long whatever the sampled tokens, so only the disconnect can cut it short
    stream = client(url).chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=1900,
                                                 temperature=0.8, seed=1, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()  # the client goes away after the first chunk
    wait_idle(url)
    assert engine.steps - steps_before < 1900  # it was cut short, not run to the end
    # a non-streaming client that times out is cancelled as well
    with pytest.raises(openai.APITimeoutError):
        client(url, timeout=0.5).chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=1900,
                                                         temperature=0.8, seed=2, extra_body={"ignore_eos": True})
    wait_idle(url)
    assert engine.steps - steps_before < 2 * 1900


def test_a_full_queue_is_429(tiny_gguf):
    with running_server(tiny_gguf, start_engine=False, max_batch=1, max_queue=2) as (url, engine):
        results = []

        def ask():
            results.append(client(url).chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=3,
                                                               temperature=0))

        # one request for the free slot and two waiting for a slot: the engine has not picked any of them up
        waiting = [threading.Thread(target=ask) for _ in range(3)]
        for t in waiting:
            t.start()
        while len(engine.waiting) < 3:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as e:
            client(url, timeout=30).chat.completions.create(model=MODEL_ID, messages=HELLO, max_tokens=3)
        assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
        assert "2 requests are already waiting for a slot" in e.value.body["message"]
        engine.start()  # the queued requests are then served
        for t in waiting:
            t.join(timeout=30)
        assert [r.usage.completion_tokens for r in results] == [3, 3, 3]


def test_sse_wire_format(server):
    url, _ = server
    body = {"model": MODEL_ID, "messages": HELLO, "max_tokens": 3, "stream": True}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.read().decode().splitlines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    first = json.loads(events[0][6:])
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"


def test_a_completions_default_16_tokens_past_the_context_is_refused_like_an_explicit_16(tiny_gguf):
    """With no max_tokens a completion asks for 16 (OpenAI's default): where the context had room for fewer, the
    reply was quietly shortened and ended "length", while the same request with max_tokens 16 was refused."""
    _, tokenizer = load_gguf(tiny_gguf)
    prompt = "the cat sat on the mat " * 3
    n = len(tokenizer.encode(prompt))
    with running_server(tiny_gguf, context=n + 8) as (url, _):
        with pytest.raises(openai.BadRequestError) as e:
            client(url).completions.create(model=MODEL_ID, prompt=prompt, temperature=0)
        assert e.value.body["code"] == "context_length_exceeded" and "max_tokens 16" in e.value.body["message"]
        r = client(url).completions.create(model=MODEL_ID, prompt=prompt, temperature=0, max_tokens=8)
        assert r.usage.completion_tokens <= 8
