"""docs/serving.md: its curl and openai examples run against a real server (tiny model, shrunk max_tokens)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
DOC_URL, DOC_MODEL = "http://127.0.0.1:8000", "SmolLM2-135M-Instruct.Q4_1"


def snippet(name: str) -> str:
    match = re.search(rf"<!-- doc-test: {name} -->\n```\w+\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/serving.md has no {name} example"
    return match.group(1)


def _adapt(code: str, url: str) -> str:
    assert DOC_URL in code and DOC_MODEL in code
    return code.replace(DOC_URL, url).replace(DOC_MODEL, "tiny").replace("max_tokens\": 64", "max_tokens\": 8") \
        .replace("max_tokens=64", "max_tokens=8")


def test_curl_example(server):
    url, _ = server
    out = subprocess.run(["bash", "-c", _adapt(snippet("curl"), url)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] <= 8
    assert reply["choices"][0]["finish_reason"] in ("stop", "length")


def test_openai_example(server):
    url, _ = server
    out = subprocess.run([sys.executable, "-c", _adapt(snippet("openai"), url)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.endswith("\n")


def test_serve_line_in_readme():
    readme = (DOC.parents[1] / "README.md").read_text()
    assert "seqlab serve --gguf" in readme
