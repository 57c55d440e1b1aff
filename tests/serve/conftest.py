"""A real server for the tests: the tiny Llama GGUF (with its chat template) behind uvicorn on 127.0.0.1."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn

from seqlab.cli.serve import prepare_model
from seqlab.io import load_gguf
from seqlab.serve.app import create_app
from seqlab.serve.scheduler import Engine
from seqlab.serve.server import bind
from tests.real_models.tiny_gguf import write_tiny_llama

MODEL_ID = "tiny"


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "tiny.gguf"
    write_tiny_llama(path)
    return path


@contextmanager
def running_server(path, start_engine: bool = True, **engine_kw):
    """Yield (base_url, engine) for a server in a background thread; shut it down afterwards."""
    model, tokenizer = load_gguf(path)
    model = prepare_model(model)
    engine = Engine(model, **{"max_batch": 4, "max_queue": 8, "context": 2048, **engine_kw})
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, tokenizer, MODEL_ID), log_level="warning",
                                           lifespan="off", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    if start_engine:
        engine.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", engine
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        if engine._thread is None:
            engine.start()
        engine.stop(timeout=1)
        sock.close()


@pytest.fixture(scope="module")
def server(tiny_gguf):
    with running_server(tiny_gguf) as (url, engine):
        yield url, engine
