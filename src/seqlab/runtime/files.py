"""Atomic file writes: a temporary file in the same folder, fsync, then ``os.replace``; and where seqlab caches.

Readers see the old file or the new one, never half of either, whatever signal or crash comes in between.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _read_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# Read once, at import: os.umask can only be read by setting it, which is not safe while other threads create files.
_NEW_FILE_MODE = 0o666 & ~_read_umask()


def cache_root() -> Path:
    """The folder of everything seqlab caches (compiled kernels, calibration timings): ``$SEQLAB_CACHE``, else
    ``$XDG_CACHE_HOME/seqlab``, else ``~/.cache/seqlab``. One variable moves all of it (a read-only home, a test)."""
    if os.environ.get("SEQLAB_CACHE"):
        return Path(os.environ["SEQLAB_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "seqlab"


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file that was written by name (by a library, or another process) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` for writers that want a file name (safetensors, GGUF, a compiler).

    When the block ends without an error the file is flushed to disk, given the mode a plain ``open`` would have
    given it (mkstemp's 0600 would make a saved model private) and renamed onto ``path``; otherwise it is removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        fsync_path(tmp)
        os.chmod(tmp, _NEW_FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old or the new content."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int | None = 2) -> None:
    atomic_write_text(path, json.dumps(obj, indent=indent) + "\n")


def read_json_object(path: str | os.PathLike, error: type[Exception] = ValueError) -> dict[str, Any]:
    """The JSON object in ``path``; a missing file, bad JSON or another JSON type raises ``error`` (the caller's
    error class) naming the file, and the line where the JSON breaks."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{path}: file not found")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise error(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from e
    except UnicodeDecodeError as e:
        raise error(f"{path}: not valid JSON (not UTF-8 text)") from e
    if not isinstance(doc, dict):
        raise error(f"{path}: expected a JSON object, got {type(doc).__name__}")
    return doc


def check_not_under_a_file(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a Path, unless a folder it would need is a file: a one-line error naming ``what`` (a flag)
    then, instead of the OS's "Not a directory" later."""
    path = Path(path)
    blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"{what} {path}: lies under {blocker}, which is a file")
    return path


def ensure_writable_dir(path: str | os.PathLike, what: str) -> Path:
    """Create ``path`` if needed and check that files can be made in it; a clear one-line error naming ``what``
    (a flag) otherwise, before any long work starts."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path}: is a file, not a directory")
    check_not_under_a_file(path, what)
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise ValueError(f"{what} {path}: not writable ({e.strerror or e})") from e
    return path


def check_readable_file(path: str | os.PathLike, what: str) -> Path:
    """``path`` as a Path where it is a file; else a one-line error naming ``what`` (a flag) and what is there."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {path}: {'a folder, not a file' if path.is_dir() else 'file not found'}")
    return path


def check_writable_file(path: str | os.PathLike, what: str) -> Path:
    """Check that ``path`` can be written (its folder exists or can be made, and it is not a folder) without
    creating it, so that a long job does not fail only at its end."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path}: is a directory")
    check_not_under_a_file(path, what)
    ensure_writable_dir(path.parent, what)
    return path
