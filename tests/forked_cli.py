"""Run ``seqlab ARGS`` in a fresh process forked from one that has imported seqlab already.

Why: each ``python -m seqlab`` spends about 2 s importing torch (4 s for commands that build an optimizer, which
imports ``torch._dynamo``) before it reads its first argument. The bad-input table (about 90 cases that fail within
milliseconds of reading their arguments) and the docs' 65 ``seqlab`` commands paid that in every process: about a
third of the suite's time. A forkserver imports seqlab's command line once; every command is then its own process
forked from it (the pytest worker's state never leaks into a command, nor one command into the next) that runs
``seqlab.cli.main`` as ``python -m seqlab`` does, in its own folder, with stdin, stdout and stderr on files at the
descriptor level, and exits with main's code.

What differs from ``python -m seqlab``, and is guarded here: the forkserver is started with the worker's seqlab on
its path (a checkout without an editable install, or a git worktree, tests its own code), and the child checks it;
settings read at import (OpenMP's, MKL's, oneDNN's, torch's and seqlab's environment variables) are the server's,
so a command whose environment differs in them is refused rather than run with the server's. What is not the same:
the child leaves through ``os._exit`` after flushing ``sys.stdout`` and ``sys.stderr``, so ``atexit`` handlers and
C stdio buffers are not run or flushed. The bad-input test still runs one case of each command as a real
``python -m seqlab``.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import seqlab

PRELOAD = ["seqlab.cli", "torch._dynamo"]
IMPORT_TIME_VARS = ("OMP_", "KMP_", "GOMP_", "MKL_", "ATEN_", "ONEDNN_", "DNNL_", "TORCH", "PYTORCH_", "SEQLAB_")


def seqlab_root() -> str:
    """The folder this process imports seqlab from (``src`` of a checkout, or site-packages)."""
    return str(Path(seqlab.__file__).resolve().parents[1])


SEQLAB_ROOT = seqlab_root()


class ForkedCli:
    """``run(args, cwd, env, input)`` -> ``subprocess.CompletedProcess`` with text output, like ``subprocess.run``."""

    def __init__(self) -> None:
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(PRELOAD)
        self.server_env: dict[str, str] | None = None

    def _start(self) -> None:
        """Start the forkserver with this process's seqlab first on its path (Python 3.11's forkserver does not
        take the parent's ``sys.path``), and remember the environment its imports read."""
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([SEQLAB_ROOT, *([before] if before else [])])
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            if before is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = before
        self.server_env = {k: v for k, v in os.environ.items() if k.startswith(IMPORT_TIME_VARS)}

    def run(self, args: list[str], cwd: Path, env: dict[str, str] | None = None, input: str = "",
            timeout: float = 600) -> subprocess.CompletedProcess:
        if self.server_env is None:
            self._start()
        env = dict(os.environ if env is None else env)
        differ = sorted(k for k in {*self.server_env, *env} if k.startswith(IMPORT_TIME_VARS)
                        and env.get(k) != self.server_env.get(k))
        if differ:
            raise ValueError(f"forked seqlab: {', '.join(differ)} differ from the forkserver's environment, and are "
                             "read at import: run this command as a real process")
        with tempfile.TemporaryDirectory(prefix="seqlab-forked-") as tmp:
            stdin, out, err = (Path(tmp) / name for name in ("stdin", "stdout", "stderr"))
            stdin.write_text(input)
            for empty in (out, err):  # a child that dies before it opens them reads as empty output
                empty.touch()
            files = (str(stdin), str(out), str(err))
            proc = self.context.Process(target=_main, args=(list(args), str(cwd), env, files, SEQLAB_ROOT))
            proc.start()
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()
                raise subprocess.TimeoutExpired(["seqlab", *args], timeout)
            stderr = err.read_text()
            if proc.exitcode != 0 and not stderr:  # it died before its stderr was the file: the server's has why
                stderr = f"forked seqlab: the child exited {proc.exitcode} before running seqlab\n"
            return subprocess.CompletedProcess(["seqlab", *args], proc.exitcode, out.read_text(), stderr)


def _main(args: list[str], cwd: str, env: dict[str, str], files: tuple[str, str, str], root: str) -> None:
    """The child: ``python -m seqlab ARGS`` from ``cwd`` with ``env``, its stdin, stdout and stderr the files."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.stdin.close()  # multiprocessing's os.devnull, on descriptor 0, which the stdin file takes over
    for fd, path in enumerate(files):
        handle = os.open(path, os.O_RDONLY if fd == 0 else os.O_WRONLY | os.O_TRUNC)
        if handle != fd:
            os.dup2(handle, fd)
            os.close(handle)
    sys.stdin = open(0, closefd=False)
    if seqlab_root() != root:
        raise RuntimeError(f"forked seqlab: the forkserver imported {seqlab.__file__}, not the one under {root}")
    from seqlab.cli import main  # the forkserver imported it (not the workers: a broken command fails its tests only)

    sys.argv = [str(Path(sys.executable).parent / "seqlab"), *args]
    sys.exit(main(args))
