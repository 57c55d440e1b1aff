"""Checkpoints as step directories of safetensors + one state.json, written atomically and verified on load.

One checkpoint (``<root>/step_00001000/``) holds ``<name>.safetensors`` for each tensor group (model,
optimizer, ...), any extra files the caller adds (config.json, tokenizer.json), and ``state.json`` with the
caller's state plus the sha256 of every other file and of its own content. No pickles anywhere, so a checkpoint
from elsewhere cannot run code; the hashes turn a truncated or bit-rotted file into a clear refusal instead of a
different model. The directory is written under a hidden temporary name and renamed once: a reader, or a resume
after a crash, sees a complete checkpoint or none.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from seqlab.runtime.errors import CheckpointError
from seqlab.runtime.files import fsync_path

STEP_DIR = re.compile(r"^step_(\d+)$")
STALE_PREFIXES = (".tmp-", ".old-")


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def state_digest(state: dict[str, Any]) -> str:
    """The sha256 of a state.json's content (all but its own ``state_sha256``) in one canonical JSON spelling, taken
    after a JSON round trip so that what is written and what is read back hash alike (tuples as lists, keys as
    strings). state.json holds the step, the data position, the RNG states and the optimiser's step counts: a
    flipped bit there resumes a different run as surely as one in the weights."""
    body = {k: v for k, v in state.items() if k != "state_sha256"}
    canonical = json.dumps(json.loads(json.dumps(body, sort_keys=True)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def _dedupe_shared(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses tensors that share memory (tied embeddings): keep the first name, alias the rest."""
    out, aliases, seen = {}, {}, {}
    for name, t in tensors.items():
        t = t.detach()
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride())) if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        out[name] = t.cpu().contiguous()
    return out, aliases


# --- optimizer state as tensors + JSON ------------------------------------------------------------------------

def optimizer_dict_to_tensors(osd: dict) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split an optimizer state dict into ``"<param key>/<slot>"`` tensors and the JSON-able rest."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pname, slots in osd["state"].items():
        for slot, value in slots.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pname}/{slot}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(pname), {})[slot] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in osd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def optimizer_dict_from_tensors(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict:
    """Inverse of ``optimizer_dict_to_tensors``; integer parameter ids (a plain ``opt.state_dict()``) come back
    as integers, names (a distributed FQN-keyed state dict) as names."""
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["param_groups"]]
    int_ids = {p for g in groups for p in g.get("params", []) if isinstance(p, int)}

    def key(pname: str) -> int | str:
        return int(pname) if pname.lstrip("-").isdigit() and int(pname) in int_ids else pname

    state: dict[int | str, dict[str, Any]] = {}
    for name, t in tensors.items():
        pname, slot = name.rsplit("/", 1)
        state.setdefault(key(pname), {})[slot] = t
    for pname, slots in meta.get("scalars", {}).items():
        state.setdefault(key(pname), {}).update(slots)
    return {"state": state, "param_groups": groups}


def optimizer_state_to_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer's state as (tensors for safetensors, JSON-able metadata): never ``torch.save``."""
    return optimizer_dict_to_tensors(opt.state_dict())


def load_optimizer_state(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    opt.load_state_dict(optimizer_dict_from_tensors(tensors, meta))


# --- the store -------------------------------------------------------------------------------------------------

class CheckpointStore:
    """Step directories under ``root``; the newest ``keep_last`` are kept (``None`` or 0 keeps all).

    ``kind`` is written into every state.json and checked on load, so a VMC checkpoint is never read as a
    training one. Call ``save`` and ``clean_stale`` on the main rank only.
    """

    def __init__(self, root: str | os.PathLike, keep_last: int | None = None, *, kind: str = "seqlab-checkpoint",
                 version: int = 1):
        self.root = Path(root)
        self.keep_last = keep_last
        self.kind, self.version = kind, version

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def list(self) -> list[tuple[int, Path]]:
        """Complete checkpoints as (step, path), oldest first; temporary directories are not checkpoints."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir()]
        return sorted(found)

    def latest(self) -> Path | None:
        found = self.list()
        return found[-1][1] if found else None

    def clean_stale(self) -> list[Path]:
        """Remove what killed saves left behind (hidden ``.tmp-*`` / ``.old-*`` entries); returns them. An
        ``.old-step_N`` whose ``step_N`` is missing (killed between moving it aside and putting the new copy in
        place) is the complete checkpoint of that step: it is moved back, not removed."""
        if not self.root.is_dir():
            return []
        stale = []
        for p in self.root.iterdir():
            if not p.name.startswith(STALE_PREFIXES):
                continue
            final = self.root / p.name.removeprefix(".old-").rsplit("-", 1)[0]
            if p.name.startswith(".old-") and STEP_DIR.match(final.name) and p.is_dir() and not final.exists():
                os.replace(p, final)
            else:
                stale.append(p)
        for p in stale:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        return stale

    def save(self, step: int, tensors: dict[str, dict[str, torch.Tensor]], state: dict[str, Any],
             files: dict[str, bytes] | None = None) -> Path:
        """Write ``step_{step:08d}/`` atomically, then prune to ``keep_last``.

        ``tensors`` maps a file stem ("model", "optimizer") to its tensors; tied tensors are stored once and
        recorded as ``<stem>_aliases`` in the state. ``files`` are extra files covered by the same hashes."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path_for(step)
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        meta: dict[str, Any] = dict(state)
        names: list[str] = []
        for stem, group in tensors.items():
            unique, aliases = _dedupe_shared(group)
            save_file(unique, tmp / f"{stem}.safetensors", metadata={"format": "pt"})
            meta[f"{stem}_aliases"] = aliases
            names.append(f"{stem}.safetensors")
        for name, content in (files or {}).items():
            (tmp / name).write_bytes(content)
            names.append(name)
        digests = {}
        for name in names:
            fsync_path(tmp / name)
            digests[name] = sha256_file(tmp / name)
        meta.update(format=self.kind, version=self.version, step=step, files=digests)
        meta["state_sha256"] = state_digest(meta)
        with open(tmp / "state.json", "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        old = None
        if final.exists():  # re-saving a step (after a resume): the old one aside, dropped once the new is in place
            old = self.root / f".old-{final.name}-{os.getpid()}"
            os.replace(final, old)
        os.replace(tmp, final)
        try:  # make the rename itself durable
            dfd = os.open(self.root, os.O_RDONLY)
            os.fsync(dfd)
            os.close(dfd)
        except OSError:
            pass
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        if self.keep_last:
            for _, old in self.list()[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def read_state(self, path: str | os.PathLike) -> dict[str, Any]:
        """The state.json of one checkpoint, checked for kind and version (files not yet verified)."""
        path = Path(path)
        sp = path / "state.json"
        if not sp.is_file():
            raise CheckpointError(f"{sp}: missing; {path} is not a complete seqlab checkpoint")
        try:
            state = json.loads(sp.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{sp}: corrupt checkpoint state (not valid JSON: {e})") from e
        if isinstance(state, dict) and "state_sha256" in state and state_digest(state) != state["state_sha256"]:
            raise CheckpointError(f"{sp}: corrupt checkpoint state (its content no longer matches the sha256 "
                                  f"recorded in it); refusing to load it. Delete {path} to resume from an older "
                                  f"checkpoint.")
        kind = state.get("format") if isinstance(state, dict) else None
        files = state.get("files", {}) if isinstance(state, dict) else {}
        listed = isinstance(files, dict) and all(
            isinstance(k, str) and Path(k).name == k and isinstance(v, str) for k, v in files.items())
        if not listed:
            raise CheckpointError(f"{sp}: corrupt checkpoint state (its files record is not a table of names and "
                                  "sha256 digests)")
        if kind != self.kind:
            raise CheckpointError(f"{sp}: not a {self.kind} (format={kind!r})")
        if state.get("version") != self.version:
            raise CheckpointError(f"{sp}: checkpoint version {state.get('version')} is not supported "
                                  f"(expected {self.version})")
        return state

    @staticmethod
    def verify(path: str | os.PathLike, state: dict[str, Any]) -> None:
        """Refuse a checkpoint whose files are missing or differ from the sha256 recorded when it was written."""
        for name, digest in state.get("files", {}).items():
            fp = Path(path) / name
            if not fp.is_file():
                raise CheckpointError(f"{fp}: missing from checkpoint")
            actual = sha256_file(fp)
            if actual != digest:
                raise CheckpointError(
                    f"{fp}: corrupt checkpoint file (sha256 {actual[:12]}... does not match the recorded "
                    f"{digest[:12]}...); refusing to load it. Delete {path} to resume from an older checkpoint.")

    def load(self, path: str | os.PathLike, stems: tuple[str, ...] | None = None
             ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, Any]]:
        """Verify every file, then read the tensor groups (all, or only ``stems``): (tensors, state)."""
        path = Path(path)
        state = self.read_state(path)
        self.verify(path, state)
        tensors: dict[str, dict[str, torch.Tensor]] = {}
        for name in state.get("files", {}):
            stem = name.removesuffix(".safetensors")
            if not name.endswith(".safetensors") or (stems is not None and stem not in stems):
                continue
            try:
                group = load_file(path / name)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path / name}: unreadable ({e})") from e
            for alias, target in state.get(f"{stem}_aliases", {}).items():
                group[alias] = group[target]
            tensors[stem] = group
        return tensors, state
