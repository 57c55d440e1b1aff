"""Read GGUF files (llama.cpp's format): a bounds-checked parser of the header, metadata and tensor table.

Kept apart from what the tensors mean (:mod:`seqlab.io.gguf_arch`) and from building a model
(:mod:`seqlab.io.gguf`): this module only knows the container. Every tensor's byte range is checked against the
file size, so a truncated download is refused with a message instead of a numpy or mmap crash halfway through.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GGUFError", "GGUFFile", "GGUFTensorInfo", "import_gguf", "is_gguf_file", "read_gguf", "refuse_gguf_file"]

GGUF_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """The file is not a usable GGUF: malformed, truncated, or an architecture / tensor type we cannot load."""


def is_gguf_file(path: str | Path) -> bool:
    """A file that begins with GGUF's magic, whatever its name (``model.GGUF``, a download kept as ``model.bin``)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:  # a folder, a missing path, an unreadable file: not one to read as GGUF
        return False


def refuse_gguf_file(path: str | Path) -> None:
    """Raise where a folder loader was handed a GGUF file, saying what reads one."""
    if is_gguf_file(path):
        raise GGUFError(f"{path}: a GGUF file, not a model folder: commands that read one take --gguf; for a folder, "
                        "save what seqlab.io.load_gguf returns with save_pretrained")


def import_gguf():
    try:
        import gguf  # noqa: F401
    except ImportError as e:  # the package is an optional extra
        raise GGUFError("reading GGUF files needs the `gguf` package: pip install 'seqlab[gguf]'") from e
    return gguf


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensorInfo:
    """Where one tensor lives: ``shape`` in PyTorch order (slowest dim first), ``start``/``nbytes`` in the file."""

    name: str
    shape: tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType
    start: int
    nbytes: int


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file; any overrun is a truncation error."""

    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.size:
            raise GGUFError(f"{self.path}: truncated or malformed GGUF: {what} needs {n} bytes at offset {self.pos}, "
                            f"file has {self.size}")

    def scalar(self, vtype: int, what: str):
        fmt = _SCALARS[vtype]
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> str:
        n = self.scalar(10, what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what} is not valid UTF-8 at offset {self.pos - n}") from e

    def value(self, vtype: int, what: str):
        if vtype in _SCALARS:
            return self.scalar(vtype, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            itype = self.scalar(4, what)
            count = self.scalar(10, what)
            if itype in _NUMPY_SCALARS:  # numeric arrays in one read (token types, scores)
                dt = np.dtype(_NUMPY_SCALARS[itype])
                self.need(count * dt.itemsize, what)
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return [bool(x) for x in arr] if itype == 7 else arr.tolist()
            if count > self.size - self.pos:  # each item takes at least one byte: refuse absurd counts early
                raise GGUFError(f"{self.path}: malformed GGUF: {what} claims {count} items at offset {self.pos}")
            return [self.value(itype, f"{what}[{i}]") for i in range(count)]
        raise GGUFError(f"{self.path}: malformed GGUF: {what} has unknown value type {vtype} at offset {self.pos - 4}")


class GGUFFile:
    """A validated, memory-mapped GGUF file: ``metadata`` (plain Python values) and ``tensors`` (infos by name).

    The header is parsed here rather than with ``gguf.GGUFReader`` because that reader builds a numpy view per
    string and takes 5-20 s on a 49k-token vocabulary; this parser takes well under a second. Every read is bounds
    checked, so a truncated or corrupted file raises :class:`GGUFError` naming the offset, never a crash. Tensor
    payloads stay in the mmap until :meth:`dequantize` reads one.
    """

    def __init__(self, path: str | os.PathLike):
        gguf = import_gguf()
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: " + ("a folder, not a GGUF file (a Hugging Face folder is --model, a "
                                                 "seqlab one --checkpoint)" if self.path.is_dir() else "no such file"))
        with open(self.path, "rb") as fh:
            if os.fstat(fh.fileno()).st_size < 24:
                raise GGUFError(f"{self.path}: truncated GGUF: {os.fstat(fh.fileno()).st_size} bytes is shorter than the header")
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(self._mm, self.path)
        magic = bytes(self._mm[:4])
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (first bytes {magic!r}, expected {GGUF_MAGIC!r})")
        cur.pos = 4
        self.version = cur.scalar(4, "version")
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version} is not supported (supported: 2, 3)")
        n_tensors = cur.scalar(10, "tensor_count")
        n_kv = cur.scalar(10, "kv_count")
        if n_tensors > cur.size or n_kv > cur.size:
            raise GGUFError(f"{self.path}: malformed GGUF header: tensor_count={n_tensors}, kv_count={n_kv}")
        self.metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key #{i}")
            vtype = cur.scalar(4, f"type of {key!r}")
            self.metadata[key] = cur.value(vtype, f"metadata {key!r}")
        infos = []
        for i in range(n_tensors):
            name = cur.string(f"tensor name #{i}")
            n_dims = cur.scalar(4, f"tensor {name!r} n_dims")
            if not 1 <= n_dims <= 4:
                raise GGUFError(f"{self.path}: malformed GGUF: tensor {name!r} has {n_dims} dimensions")
            dims = [cur.scalar(10, f"tensor {name!r} dims") for _ in range(n_dims)]
            type_id = cur.scalar(4, f"tensor {name!r} type")
            offset = cur.scalar(10, f"tensor {name!r} offset")
            try:
                qtype = gguf.GGMLQuantizationType(type_id)
            except ValueError:
                raise GGUFError(f"{self.path}: tensor {name!r} has unknown GGML type id {type_id}") from None
            infos.append((name, dims, qtype, offset))
        align = int(self.metadata.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise GGUFError(f"{self.path}: general.alignment={align} is not a power of two")
        data_start = -(-cur.pos // align) * align
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, qtype, offset in infos:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims))
            if dims[0] % block:
                raise GGUFError(f"{self.path}: tensor {name!r} row length {dims[0]} is not a multiple of the "
                                f"{qtype.name} block size {block}")
            nbytes = n // block * type_size
            start = data_start + offset
            if offset % align:  # llama.cpp refuses these too: a shifted offset reads every weight shifted
                raise GGUFError(f"{self.path}: malformed GGUF: tensor {name!r} offset {offset} is not a multiple of "
                                f"general.alignment={align}")
            if start + nbytes > cur.size:
                raise GGUFError(f"{self.path}: truncated GGUF: tensor {name!r} needs bytes up to {start + nbytes} "
                                f"but the file has {cur.size}")
            if name in self.tensors:
                raise GGUFError(f"{self.path}: malformed GGUF: tensor {name!r} appears twice")
            self.tensors[name] = GGUFTensorInfo(name, tuple(int(d) for d in reversed(dims)), qtype, start, nbytes)
        spans = sorted((t.start, t.start + t.nbytes, t.name) for t in self.tensors.values())
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if start < end:
                raise GGUFError(f"{self.path}: malformed GGUF: tensors {first!r} and {second!r} overlap")

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: metadata key 'general.architecture' is missing")
        return arch

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
        return self.metadata[key]

    def dequantize(self, name: str) -> np.ndarray:
        """One tensor as float32 numpy, in PyTorch layout (``[out_features, in_features]`` for matrices)."""
        gguf = import_gguf()
        t = self.tensors[name]
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=t.nbytes, offset=t.start)
        raw = raw.reshape(*t.shape[:-1], t.nbytes // max(1, int(np.prod(t.shape[:-1]))))
        try:
            values = gguf.quants.dequantize(raw, t.qtype)
        except NotImplementedError as e:
            raise GGUFError(f"{self.path}: tensor {name!r} has type {t.qtype.name}, which cannot be dequantised ({e})") from e
        return np.asarray(values, dtype=np.float32).reshape(t.shape)


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open and validate a GGUF file (header, metadata and tensor byte ranges); tensors are not read yet."""
    return GGUFFile(path)
