"""``seqlab serve``: an OpenAI-compatible HTTP server (chat and text completions) with continuous batching.

    seqlab serve --gguf model.gguf --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "model", "messages": [{"role": "user", "content": "Hi"}]}'

See docs/serving.md for the endpoints, the scheduler and the load test.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server with continuous batching",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models and /health. Requests join and leave "
                    "the running decode batch at every step; at start-up one line `listening on http://HOST:PORT` "
                    "is printed. SIGTERM stops admitting, lets running replies finish (--shutdown-timeout) and "
                    "exits 0.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", metavar="PATH", help="Llama-family GGUF file (tokenizer and chat template inside)")
    src.add_argument("--checkpoint", metavar="DIR", help="seqlab checkpoint folder (with tokenizer.json)")
    src.add_argument("--model", metavar="HFDIR", help="Hugging Face model folder (config.json, model.safetensors, "
                                                     "tokenizer.json)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on the listening line)")
    p.add_argument("--max-batch", type=int, default=16, help="KV slots: requests decoded together (default 16)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait for a slot; beyond that the answer is 429 (default 64)")
    p.add_argument("--context", type=int, default=2048,
                   help="positions per KV slot: prompt + reply (default 2048, at most the model's own context)")
    p.add_argument("--prefill-chunk", type=int, default=256,
                   help="prompt tokens prefilled per step; running replies wait at most this long (default 256)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--quant", metavar="SCHEME", help="weight-only quantisation scheme (needs seqlab.quant)")
    p.add_argument("--no-pack", action="store_true", help="keep linear weights dense (default: packed for oneDNN)")
    p.add_argument("--model-name", help="the model id clients pass (default: the file or folder name)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds running replies may take to finish after SIGTERM (default 10)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    p.set_defaults(func=run)


def _check_args(args) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    for flag in ("max_batch", "max_queue", "context", "prefill_chunk"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.quant and importlib.util.find_spec("seqlab.quant") is None:
        raise ValueError(f"--quant {args.quant}: quantisation is not available in this build (no seqlab.quant)")
    path = Path(args.gguf or args.checkpoint or args.model)
    if args.gguf and not path.is_file():
        raise FileNotFoundError(f"--gguf {path}: no such file")
    if not args.gguf and not path.is_dir():
        raise FileNotFoundError(f"--{'checkpoint' if args.checkpoint else 'model'} {path}: no such folder")


def load(args):
    """(model, tokenizer, default model id) from --gguf, --checkpoint or --model."""
    import torch

    from seqlab.io import load_gguf, load_pretrained
    from seqlab.io.tokenizer import Tokenizer

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    if args.gguf:
        model, tokenizer = load_gguf(args.gguf, dtype=dtype)
        return model, tokenizer, Path(args.gguf).stem
    folder = Path(args.checkpoint or args.model)
    model = load_pretrained(folder, dtype=dtype)
    return model, Tokenizer.from_pretrained(folder), folder.name


def prepare_model(model, args):
    """The one place the loaded model is made ready for serving (quantisation, packed weights)."""
    if args.quant:
        quant = importlib.import_module("seqlab.quant")  # a layer built in parallel; reconnect here when it lands
        if not hasattr(quant, "quantize_model"):
            raise ValueError(f"--quant {args.quant}: seqlab.quant has no quantize_model(model, scheme) to apply it")
        model = quant.quantize_model(model, args.quant)
    if not args.no_pack:
        from seqlab.model import pack_for_inference

        pack_for_inference(model, rows_hint=1)  # rows_hint=1: a lone request computes exactly as `seqlab chat`
    return model


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    if importlib.util.find_spec("starlette") is None or importlib.util.find_spec("uvicorn") is None:
        raise RuntimeError("serving needs starlette and uvicorn: pip install 'seqlab[serve]'")
    # the HTTP stack is an optional dependency, imported only when a server is started
    from seqlab.serve.app import create_app
    from seqlab.serve.scheduler import Engine
    from seqlab.serve.server import bind, serve

    sock = bind(args.host, args.port)  # before loading: a busy port fails fast
    model, tokenizer, name = load(args)
    model = prepare_model(model, args)
    engine = Engine(model, max_batch=args.max_batch, max_queue=args.max_queue,
                    context=min(args.context, model.config.max_seq_len), prefill_chunk=args.prefill_chunk)
    serve(create_app(engine, tokenizer, args.model_name or name), engine, sock, args.host,
          shutdown_timeout=args.shutdown_timeout)
    return 0
