"""Training checkpoints: atomic directories of safetensors + JSON, verified on load, last K kept.

Layout of one checkpoint (``<out>/checkpoints/step_00001000/``)::

    model.safetensors      full (unsharded) model weights; tied tensors stored once (aliases in state.json)
    optimizer.safetensors  optimizer tensors keyed "<param fqn>/<slot>" (exp_avg, exp_avg_sq, step)
    state.json             step, configs, trainer counters, data position, per-rank RNG states,
                           optimizer hyper-parameters, and the sha256 of every file above

Why this shape: no pickles anywhere (a checkpoint from the internet cannot run code), every file is readable
by other tools, and the sha256 list turns a truncated or bit-rotted file into a clear refusal instead of a
silently different model. Atomicity comes from writing into a hidden temporary directory, fsyncing, and then
one ``os.replace`` of the directory: a reader (or a resume after a crash) sees a complete checkpoint or none.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from seqlab.runtime import CheckpointError, atomic_write_text  # noqa: F401  (re-exported for the trainer)

FORMAT = "seqlab-train-checkpoint"
VERSION = 1
STEP_DIR = re.compile(r"^step_(\d+)$")


# --- RNG states --------------------------------------------------------------------------------------------

def capture_rng() -> dict[str, Any]:
    """This process's RNG states as JSON-able data (torch CPU/CUDA, Python ``random``, NumPy if loaded)."""
    state: dict[str, Any] = {
        "torch": base64.b64encode(bytes(torch.get_rng_state().tolist())).decode(),
        "python": _py_state_to_json(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [base64.b64encode(bytes(s.tolist())).decode() for s in torch.cuda.get_rng_state_all()]
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    raw = base64.b64decode(state["torch"])
    torch.set_rng_state(torch.tensor(list(raw), dtype=torch.uint8))
    random.setstate(_py_state_from_json(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(list(base64.b64decode(s)), dtype=torch.uint8) for s in state["cuda"]])
    np = _numpy()
    if np is not None and "numpy" in state:
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))


def _numpy():
    import sys

    return sys.modules.get("numpy")


def _py_state_to_json(s) -> list:
    version, internal, gauss = s
    return [version, list(internal), gauss]


def _py_state_from_json(s) -> tuple:
    version, internal, gauss = s
    return (version, tuple(internal), gauss)


# --- file helpers ------------------------------------------------------------------------------------------

def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dedupe_shared(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses tensors that share memory (tied embeddings): keep the first name, alias the rest."""
    out, aliases, seen = {}, {}, {}
    for name, t in tensors.items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride())) if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        out[name] = t.detach().contiguous()
    return out, aliases


# --- optimizer state flattening ----------------------------------------------------------------------------

def flatten_optimizer(osd: dict) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an (FQN-keyed) optimizer state dict into tensors for safetensors and the rest for JSON."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pname, slots in osd["state"].items():
        for slot, value in slots.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pname}/{slot}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pname), {})[slot] = value
    groups = []
    for g in osd["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = list(g["betas"])
        groups.append(g)
    return tensors, {"param_groups": groups, "scalars": scalars}


def unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict:
    state: dict[str, dict[str, Any]] = {}
    for key, t in tensors.items():
        pname, slot = key.rsplit("/", 1)
        state.setdefault(pname, {})[slot] = t
    for pname, slots in meta.get("scalars", {}).items():
        state.setdefault(pname, {}).update(slots)
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    return {"state": state, "param_groups": groups}


# --- save / load / list -------------------------------------------------------------------------------------

def checkpoint_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:08d}"


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root`` as (step, path), oldest first. Temporary directories are ignored."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def save_checkpoint(root: Path, step: int, model_sd: dict[str, torch.Tensor], optim_sd: dict | None,
                    state: dict[str, Any], keep_last: int | None = None,
                    extra_files: dict[str, bytes] | None = None) -> Path:
    """Write one checkpoint atomically and prune to the newest ``keep_last``. Call on the main rank only.

    ``extra_files`` (name -> content), e.g. the model's ``config.json`` and ``tokenizer.json``, are written into
    the same directory and covered by the same hashes, so a checkpoint directory is a self-contained model."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_dir(root, step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    model_tensors, aliases = _dedupe_shared({k: v.detach().cpu() for k, v in model_sd.items()})
    save_file(model_tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    files = {"model.safetensors": None}
    meta: dict[str, Any] = dict(state)
    meta.update(format=FORMAT, version=VERSION, step=step, model_aliases=aliases)
    if optim_sd is not None:
        opt_tensors, opt_meta = flatten_optimizer(optim_sd)
        save_file(opt_tensors, tmp / "optimizer.safetensors", metadata={"format": "pt"})
        files["optimizer.safetensors"] = None
        meta["optimizer"] = opt_meta
    for name, content in (extra_files or {}).items():
        (tmp / name).write_bytes(content)
        files[name] = None
    for name in files:
        _fsync(tmp / name)
        files[name] = sha256_file(tmp / name)
    meta["files"] = files
    with open(tmp / "state.json", "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():  # re-saving a step (e.g. after a resume): move the old one out of the way first
        old = root / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)
    try:  # make the rename itself durable
        dfd = os.open(root, os.O_RDONLY)
        os.fsync(dfd)
        os.close(dfd)
    except OSError:
        pass
    if keep_last:
        for _, old in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def read_state(path: Path) -> dict[str, Any]:
    path = Path(path)
    sp = path / "state.json"
    if not sp.is_file():
        raise CheckpointError(f"{sp}: missing; {path} is not a complete seqlab checkpoint")
    try:
        state = json.loads(sp.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{sp}: corrupt checkpoint state (not valid JSON: {e})") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{sp}: not a seqlab training checkpoint (format={state.get('format') if isinstance(state, dict) else None!r})")
    if state.get("version") != VERSION:
        raise CheckpointError(f"{sp}: checkpoint version {state.get('version')} is not supported (expected {VERSION})")
    return state


def verify(path: Path, state: dict[str, Any]) -> None:
    """Refuse a checkpoint whose files are missing or do not match the sha256 recorded when it was written."""
    for name, digest in state.get("files", {}).items():
        fp = Path(path) / name
        if not fp.is_file():
            raise CheckpointError(f"{fp}: missing from checkpoint")
        actual = sha256_file(fp)
        if actual != digest:
            raise CheckpointError(
                f"{fp}: corrupt checkpoint file (sha256 {actual[:12]}... does not match the recorded "
                f"{digest[:12]}...); refusing to load it. Delete {path} to resume from an older checkpoint."
            )


def load_checkpoint(path: Path, load_optimizer: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict | None]:
    """Read and verify a checkpoint: (state, model state dict, optimizer state dict or None)."""
    path = Path(path)
    state = read_state(path)
    verify(path, state)
    try:
        model_sd = load_file(path / "model.safetensors")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path / 'model.safetensors'}: unreadable ({e})") from e
    for alias, target in state.get("model_aliases", {}).items():
        model_sd[alias] = model_sd[target]
    optim_sd = None
    if load_optimizer and "optimizer" in state:
        try:
            opt_tensors = load_file(path / "optimizer.safetensors")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path / 'optimizer.safetensors'}: unreadable ({e})") from e
        optim_sd = unflatten_optimizer(opt_tensors, state["optimizer"])
    return state, model_sd, optim_sd
