"""``seqlab`` command line: one subcommand per job.

This package is the only place that knows every part of seqlab. Each job's module exposes ``register(subparsers)``
(its options) and a ``run`` that the parsed arguments call. Every module is imported to build the parser, with
torch among its imports, so ``seqlab --help`` takes about as long as ``import torch`` (the modules keep their
imports at the top, as everywhere in seqlab).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import warnings
from pathlib import Path

import seqlab

# subcommand modules, in the order --help lists them; a module that is missing is skipped
_MODULES = ("train", "generate", "chat", "embed", "serve", "nnqs", "export", "quantize", "perplexity",
            "info")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="seqlab",
        description="One autoregressive Transformer core that learns, generates, and solves molecules.",
    )
    parser.add_argument("--version", action="version", version=f"seqlab {seqlab.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _MODULES:
        try:
            module = importlib.import_module(f"seqlab.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"seqlab.cli.{name}":
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        with warnings.catch_warnings():
            if not getattr(args, "debug", False):
                warnings.showwarning = _one_line_warning(args.command)
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, OSError, RuntimeError) as e:  # bad input or a bad file: one line, nothing half-done
        if getattr(args, "debug", False):
            raise
        message = " ".join(str(e).split())  # one line, whatever the message held
        print(f"seqlab {args.command}: error: {message}", file=sys.stderr)
        return 2


_PACKAGE = Path(seqlab.__file__).resolve().parent


def _one_line_warning(command: str):
    """seqlab's own warnings as the errors are shown: one line naming the command, not Python's source excerpt."""
    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if _PACKAGE not in Path(filename).resolve().parents:  # another library's warning keeps its usual form
            default(message, category, filename, lineno, file, line)
            return
        print(f"seqlab {command}: warning: {' '.join(str(message).split())}", file=file or sys.stderr)
    return show


if __name__ == "__main__":
    sys.exit(main())
