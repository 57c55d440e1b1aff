"""``seqlab serve``: an OpenAI-compatible HTTP server (chat and text completions) with continuous batching.

    seqlab serve --gguf model.gguf --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "model", "messages": [{"role": "user", "content": "Hi"}]}'

See docs/serving.md for the endpoints, the scheduler and the load test.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from torch import nn

from seqlab.accel import accelerate
from seqlab.cli.model_args import add_model_source, load_model, prompt_ids
from seqlab.cli.packaged import SMOLLM2_PACKAGE, missing_package, packaged_smollm2
from seqlab.serve.app import create_app
from seqlab.serve.scheduler import Engine
from seqlab.serve.server import bind, serve


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server with continuous batching",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models and /health. Requests join and leave "
                    "the running decode batch at every step; at start-up one line `listening on http://HOST:PORT` "
                    "is printed. SIGTERM stops admitting, lets running replies finish (--shutdown-timeout), ends the "
                    "rest with an API error and exits 0. With no model given it serves the packaged "
                    "SmolLM2-135M-Instruct.")
    # none given: the packaged SmolLM2-135M-Instruct, as `seqlab chat`
    add_model_source(p, required=False, auto_dtype="fp32 weights and products")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on the listening line)")
    p.add_argument("--max-batch", type=int, default=16, help="KV slots: requests decoded together (default 16)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot; beyond that the answer is 429 (default 64)")
    p.add_argument("--context", type=int, default=2048,
                   help="positions per KV slot: prompt + reply (default 2048, at most the model's own context)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens prefilled per step; running replies wait at most this long (default 256)")
    p.add_argument("--no-accel", "--no-pack", dest="no_accel", action="store_true",
                   help="plain dense weights (default: the CPU routes seqlab measured fastest here)")
    p.add_argument("--accel-rows", type=int, default=None,
                   help="rows per decode step the CPU routes are measured for (default: --max-batch, the batch a "
                        "busy server steps; 1 favours a lone client)")
    p.add_argument("--model-name", help="the model id clients pass (default: the file or folder name)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds after SIGTERM until running replies are ended with an error (the last second is "
                        "kept to send it; default 10)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run)


def _check_args(args) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    for flag in ("max_batch", "max_queue", "context", "prefill_chunk", "accel_rows"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not args.shutdown_timeout >= 0:  # (`nan < 0` is False)
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")


def prepare_model(model: nn.Module, accel: bool = True, rows: int = 1) -> nn.Module:
    """The one place the loaded model is made ready for serving: the CPU routes measured fastest for decode steps
    of ``rows`` rows (the running batch a busy server steps), applied from outside as everywhere else."""
    if accel:
        accelerate(model, "decode", rows=rows, dtype=None)
    return model


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    if not (args.checkpoint or args.gguf or args.model) and packaged_smollm2() is None:
        raise missing_package(SMOLLM2_PACKAGE, "--gguf")
    sock = bind(args.host, args.port)  # before loading: a busy port fails fast
    loaded = load_model(args, default_gguf=packaged_smollm2())
    model = prepare_model(loaded.model, accel=not args.no_accel, rows=args.accel_rows or args.max_batch)
    source = Path(args.checkpoint or args.gguf or args.model or loaded.path)  # a run folder: its name, not a step's
    name = args.model_name or (source.stem if source.is_file() else source.name)
    engine = Engine(model, max_batch=args.max_batch, max_queue=args.max_queue,
                    context=min(args.context, model.config.max_seq_len), prefill_chunk=args.prefill_chunk)
    app = create_app(engine, loaded.tokenizer, name, encode_prompt=lambda text: prompt_ids(loaded, text))
    serve(app, engine, sock, args.host, shutdown_timeout=args.shutdown_timeout)
    return 0
