"""Run ``seqlab ARGS`` in a fresh process forked from one that has imported seqlab already.

Why: each ``python -m seqlab`` spends about 2 s importing torch (4 s for commands that build an optimizer, which
imports ``torch._dynamo``) before it reads its first argument. The bad-input table (about 90 cases that fail within
milliseconds of reading their arguments) and the docs' 65 ``seqlab`` commands paid that in every process: about a
third of the suite's time. A forkserver imports seqlab's command line once; every command is then its own process
forked from it (the pytest worker's state never leaks into a command, nor one command into the next), runs
``seqlab.cli.main`` as ``python -m seqlab`` does, in its own folder and environment, with stdin, stdout and stderr
at the file-descriptor level (what C code writes is caught too), and exits with main's code. The bad-input test
still runs one case of each command as a real ``python -m seqlab``.
"""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from seqlab.cli import main

PRELOAD = ["seqlab.cli", "torch._dynamo"]


class ForkedCli:
    """``run(args, cwd, env, input)`` -> ``subprocess.CompletedProcess`` with text output, like ``subprocess.run``."""

    def __init__(self) -> None:
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(PRELOAD)

    def run(self, args: list[str], cwd: Path, env: dict[str, str] | None = None, input: str = "",
            timeout: float = 600) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="seqlab-forked-") as tmp:
            stdin, out, err = (Path(tmp) / name for name in ("stdin", "stdout", "stderr"))
            stdin.write_text(input)
            out.touch(), err.touch()  # a child that dies before it opens them reads as empty output
            files = (str(stdin), str(out), str(err))
            proc = self.context.Process(target=_main, args=(list(args), str(cwd), dict(env or os.environ), files))
            proc.start()
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()
                raise subprocess.TimeoutExpired(["seqlab", *args], timeout)
            return subprocess.CompletedProcess(["seqlab", *args], proc.exitcode, out.read_text(), err.read_text())


def _main(args: list[str], cwd: str, env: dict[str, str], files: tuple[str, str, str]) -> None:
    """The child: ``python -m seqlab ARGS`` from ``cwd`` with ``env``, its stdin, stdout and stderr the files."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.stdin.close()  # multiprocessing's os.devnull: its descriptor may be 0, which the stdin file takes over
    for fd, path in enumerate(files):
        handle = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_TRUNC)
        if handle != fd:
            os.dup2(handle, fd)
            os.close(handle)
    sys.stdin = open(0, closefd=False)
    sys.argv = [str(Path(sys.executable).parent / "seqlab"), *args]
    sys.exit(main(args))
