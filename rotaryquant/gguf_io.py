"""GGUF files: the one module that reads and writes them outside gguf-py itself.

gguf-py (the patched copy in the tree, which knows our types) is used wherever it serves:

- ``gguf.GGUFReader`` for whole files (:func:`open_reader`; converter.gguf_source, the evals, and
  :func:`rewrite_metadata`, which finds each key's bytes through the reader's field offsets);
- ``gguf.GGUFWriter`` for files written from scratch (rq-convert, rq-plan's HF skeletons), and its value
  packer for the keys :func:`rewrite_metadata` adds (:func:`encode_kv`).

Two things are done here by hand, for reasons gguf-py cannot meet:

- :func:`read_header` (rq-plan): GGUFReader maps the whole file and turns every string of the vocabulary
  into numpy views before it returns; rq-plan needs only the sizes and shapes and answers in a second or two.
  Measured (2-core x86 VM, best of 3): Gemma3-270M (262144 tokens) GGUFReader 15.9 s, read_header 0.07 s;
  SmolLM2-135M (49152 tokens) 2.6 s vs 0.03 s. read_header reads the head of the file in 1 MiB steps, keeps long arrays
  as their length, tells a truncated file from a corrupt one, and keeps the key/value section verbatim.
- :func:`write_skeleton`: that verbatim key/value section, new tensor types and a data region that is a
  sparse hole. GGUFWriter would re-encode every key (the vocabulary again, value by value) and has no way
  to leave the data out while keeping its size.
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from rotaryquant.errors import RQError
from rotaryquant.files import publish

MAGIC = 0x46554747            # "GGUF", little-endian (gguf.GGUF_MAGIC)
DEFAULT_ALIGNMENT = 32        # gguf.GGUF_DEFAULT_ALIGNMENT

# gguf.GGUFValueType ids -> struct formats (test_gguf_io checks them against gguf-py)
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_SHORT_STRINGS = 64           # string arrays longer than this are kept as their length (vocabularies)
_SHORT_ARRAY = 4096           # other arrays longer than this likewise (token types, scores, merges)


class GGUFError(RQError):
    """A GGUF file that cannot be read or written; the message names the file."""


def tensor_bytes(qtype: int, ne: Sequence[int]) -> int:
    """Bytes of a tensor of ggml type ``qtype`` and shape ``ne``: ggml's row size, from gguf-py's table of block
    and type sizes (the patched copy's, which has our types; GGUFReader sizes tensors by it too)."""
    # lazy: gguf is set-up's install from the tree, and 0.1 s of import that most commands' --help does not need
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    blck, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
    if ne[0] % blck:
        raise ValueError(f"rows of {ne[0]} values are not whole blocks of {blck} (ggml type {qtype})")
    return ne[0] // blck * size * math.prod(ne[1:])


@dataclass
class TensorInfo:
    name: str
    ne: tuple[int, ...]          # ggml order: ne[0] = row length
    type: int                    # ggml type id
    offset: int                  # relative to the data section
    nbytes: int

    @property
    def n(self) -> int:
        return math.prod(self.ne)


@dataclass
class Header:
    """A GGUF file's metadata and tensor infos, read without touching tensor data."""

    path: Path
    version: int
    fields: dict[str, Any]       # scalars and short arrays; long arrays as their length
    kv_raw: bytes                # the key/value section, verbatim
    n_kv: int
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int
    file_size: int

    @property
    def arch(self) -> str:
        return str(self.fields.get("general.architecture", "?"))

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(f"{self.arch}.{key}", default)

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def n_params(self) -> int:
        return sum(t.n for t in self.tensors)

    @property
    def n_vocab(self) -> int:
        v = self.fields.get("tokenizer.ggml.tokens")
        return int(v) if isinstance(v, int) else len(v or ())


H = TypeVar("H", bound=Header)


def is_gguf(path: str | Path) -> bool:
    """Whether the file starts with the GGUF magic."""
    with open(path, "rb") as f:
        return f.read(4) == struct.pack("<I", MAGIC)


class _Buf:
    """A growing window over the head of a file (the header is read in 1 MiB steps)."""

    def __init__(self, f: Any, size: int) -> None:
        self.f, self.size, self.data, self.pos = f, size, bytearray(), 0

    def need(self, n: int) -> None:
        while self.pos + n > len(self.data):
            if len(self.data) >= self.size:
                raise EOFError
            self.data += self.f.read(max(1 << 20, self.pos + n - len(self.data)))
            if not self.data or len(self.data) < self.pos + n and len(self.data) >= self.size:
                raise EOFError

    def unpack(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n)
        v = struct.unpack_from(fmt, self.data, self.pos)
        self.pos += n
        return v[0] if len(v) == 1 else v

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > 1 << 24:
            raise ValueError(f"string of {n} bytes")
        self.need(n)
        s = bytes(self.data[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            self.need(8)
            (n,) = struct.unpack_from("<Q", self.data, self.pos)
            self.pos += 8 + n

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            sub, count = self.unpack("<IQ")
            if sub == _STRING:
                if count > _SHORT_STRINGS:
                    self.skip_strings(count)
                    return count
                return [self.string() for _ in range(count)]
            if sub == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            fmt = _SCALAR[sub]
            size = struct.calcsize(fmt)
            if count > _SHORT_ARRAY:
                self.need(size * count)
                self.pos += size * count
                return count
            self.need(size * count)
            vals = list(struct.unpack_from("<" + fmt[1] * count, self.data, self.pos))
            self.pos += size * count
            return vals
        return self.unpack(_SCALAR[vtype])


def read_header(path: str | Path, *, cls: type[H] = Header, model: bool = True,
                foreign: bool = False) -> H:  # type: ignore[assignment]
    """Parse a GGUF file's metadata and tensor infos; a GGUFError that names the file when it cannot.

    ``model``: also require a whole model file (an architecture, not one shard of a split GGUF).
    ``cls``: the Header subclass to return (its extra fields keep their defaults).
    ``foreign``: a file of another build, whose type ids may mean other types here (ik_llama.cpp's IQ3_KT): every
    tensor is sized by the data offsets (the next tensor's, or the file's end; alignment padding included).
    """
    path = Path(path).expanduser()
    try:
        size = path.stat().st_size
        f = open(path, "rb")
    except OSError as e:
        raise GGUFError(f"cannot read {path} ({e.strerror or e})", fix="check the path and its permissions") from None
    bad = f"{path} is not a readable GGUF file"
    with f:
        b = _Buf(f, size)
        try:
            if b.unpack("<I") != MAGIC:
                raise GGUFError(f"{bad} (no GGUF magic)", fix="pass a .gguf model, an HF folder or a repo id")
            version = b.unpack("<I")
            if version not in (2, 3):
                raise GGUFError(f"{bad} (GGUF version {version})", fix="convert it with a current llama.cpp")
            n_tensors, n_kv = b.unpack("<QQ")
            if n_tensors > 1 << 20 or n_kv > 1 << 20:
                raise ValueError(f"{n_tensors} tensors, {n_kv} keys")
            kv_start = b.pos
            fields: dict[str, Any] = {}
            for _ in range(n_kv):
                key = b.string()
                fields[key] = b.value(b.unpack("<I"))
            kv_raw = bytes(b.data[kv_start:b.pos])
            tensors = []
            for _ in range(n_tensors):
                name = b.string()
                nd = b.unpack("<I")
                if nd > 8:
                    raise ValueError(f"tensor {name} has {nd} dimensions")
                ne = tuple(int(b.unpack("<Q")) for _ in range(nd))
                qtype, off = b.unpack("<IQ")
                tensors.append(TensorInfo(name, ne, int(qtype), int(off), 0))
        except EOFError:
            raise GGUFError(f"{bad} (truncated header)", fix="re-download or re-copy it") from None
        except (ValueError, KeyError, struct.error, UnicodeDecodeError) as e:
            raise GGUFError(f"{bad} ({e})", fix="re-download it, or check it is a model GGUF") from None
    if model and "general.architecture" not in fields:
        raise GGUFError(f"{path} has no general.architecture", fix="is it a model GGUF (not an imatrix/LoRA)?")
    if model and int(fields.get("split.count", 1) or 1) > 1:
        raise GGUFError(f"{path} is one shard of a split GGUF", fix="merge it first (llama-gguf-split --merge)")
    align = int(fields.get("general.alignment", DEFAULT_ALIGNMENT))
    data_offset = b.pos + (-b.pos % align)
    ends = sorted({t.offset for t in tensors} | {size - data_offset})
    for t in tensors:
        try:
            t.nbytes = next(e for e in ends if e > t.offset) - t.offset if foreign else tensor_bytes(t.type, t.ne)
        except Exception:  # noqa: BLE001
            raise GGUFError(f"{bad} (tensor {t.name} has unknown type id {t.type})",
                            fix="it needs a llama.cpp with that type") from None
        if data_offset + t.offset + t.nbytes > size:
            raise GGUFError(f"{path} is truncated: tensor {t.name} ends past the end of the file",
                            fix="re-download or re-copy it")
    return cls(path, version, fields, kv_raw, n_kv, tensors, align, data_offset, size)


# --- skeletons: metadata and tensor infos, the data region a sparse hole ----------------------------

def _tensor_info(name: str, ne: Sequence[int], qtype: int, offset: int) -> bytes:
    nm = name.encode()
    return (struct.pack("<Q", len(nm)) + nm + struct.pack("<I", len(ne))
            + b"".join(struct.pack("<Q", n) for n in ne) + struct.pack("<IQ", qtype, offset))


def write_skeleton(h: Header, types: dict[str, int], out: Path) -> int:
    """``h`` with tensor types changed as ``types`` says, data left as a sparse hole; returns the data size.

    llama.cpp's metadata-only load never reads tensor data, so the skeleton stands for the converted
    file in every memory computation without costing its disk space or the conversion time.
    """
    infos = bytearray()
    off = 0
    for t in h.tensors:
        qt = types.get(t.name, t.type)
        nb = tensor_bytes(qt, t.ne)
        infos += _tensor_info(t.name, t.ne, qt, off)
        off += nb + (-nb % h.alignment)
    with open(out, "wb") as f:
        f.write(struct.pack("<IIQQ", MAGIC, h.version, len(h.tensors), h.n_kv))
        f.write(h.kv_raw)
        f.write(infos)
        f.write(b"\0" * (-f.tell() % h.alignment))
        f.truncate(f.tell() + off)
    return off


def skeleton_layout(h: Header, types: dict[str, int]) -> dict[str, tuple[int, int]]:
    """tensor -> (absolute file offset, bytes) as :func:`write_skeleton` lays the file out (``types`` empty:
    the file ``h`` itself)."""
    if not types:
        return {t.name: (h.data_offset + t.offset, t.nbytes) for t in h.tensors}
    infos = sum(8 + len(t.name.encode()) + 4 + 8 * len(t.ne) + 12 for t in h.tensors)
    start = 24 + len(h.kv_raw) + infos
    start += -start % h.alignment
    out, off = {}, 0
    for t in h.tensors:
        nb = tensor_bytes(types.get(t.name, t.type), t.ne)
        out[t.name] = (start + off, nb)
        off += nb + (-nb % h.alignment)
    return out


def add_sparse_data(path: Path, writer: Any) -> None:
    """Give a GGUF that ``writer`` (a gguf.GGUFWriter) wrote without tensor data its data region, as a hole."""
    align = int(getattr(writer, "data_alignment", DEFAULT_ALIGNMENT))
    with open(path, "r+b") as f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        end += -end % align
        data = sum(ti.nbytes + (-ti.nbytes % align) for ti in writer.tensors[0].values())
        f.truncate(end + data)


# --- gguf-py: whole files, and new metadata in an existing file --------------------------------------

def open_reader(path: str | Path, *, fix: str = "re-download it, or check it was written by a llama.cpp "
                                                  "of this tree") -> Any:
    """gguf.GGUFReader of ``path``; a GGUFError that names the file when gguf-py cannot read it."""
    # lazy: gguf is set-up's install from the tree, 0.1 s of import most commands' --help skip
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # noqa: BLE001 (ValueError, struct.error, KeyError on unknown types ...)
        raise GGUFError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})", fix=fix) from None


@lru_cache(maxsize=1)
def _packer() -> Any:
    # lazy: gguf is set-up's install from the tree, 0.1 s of import most commands' --help skip
    from gguf import GGUFWriter

    return GGUFWriter(path=None, arch="")


def encode_kv(key: str, value: Any) -> bytes:
    """One metadata key and value as GGUF bytes, packed by gguf-py's writer.

    str -> STRING, bool -> BOOL, int -> UINT32, float -> FLOAT32, a float32 or int32 numpy array ->
    ARRAY of that type (gguf-py refuses empty arrays).
    """
    # lazy: gguf is set-up's install from the tree, 0.1 s of import most commands' --help skip
    from gguf import GGUFValueType as VT

    w = _packer()
    head = w._pack_val(key, VT.STRING, add_vtype=False)
    if isinstance(value, np.ndarray):
        sub = {np.dtype(np.float32): VT.FLOAT32, np.dtype(np.int32): VT.INT32}[value.dtype]
        return head + w._pack_val(value.ravel().tolist(), VT.ARRAY, add_vtype=True, sub_type=sub)
    if isinstance(value, str):
        vt = VT.STRING
    elif isinstance(value, (bool, np.bool_)):
        vt, value = VT.BOOL, bool(value)
    elif isinstance(value, (int, np.integer)):
        vt, value = VT.UINT32, int(value)
    else:
        vt, value = VT.FLOAT32, float(value)
    return head + w._pack_val(value, vt, add_vtype=True)


def _field_span(f: Any) -> tuple[int, int]:
    return f.offset, f.offset + sum(int(p.nbytes) for p in f.parts)


def rewrite_metadata(src: Path, dst: Path, set_kv: dict[str, Any], *, drop: Callable[[str], bool],
                     reader: Any = None, progress: Callable[[int, int], None] | None = None) -> None:
    """Copy ``src`` to ``dst`` (atomically) with the keys ``drop`` says removed and ``set_kv`` added.

    The kept keys, the tensor infos and the tensor data are copied verbatim (a 1 GB file takes seconds and no
    tensor is decoded); new keys are packed by gguf-py (:func:`encode_kv`). ``progress(done, total)`` is
    called as the data is copied.
    """
    r = reader if reader is not None else open_reader(src)
    keep = [f for k, f in r.fields.items() if not k.startswith("GGUF.") and not drop(k)]
    n_kv = len(keep) + len(set_kv)
    align_f = r.fields.get("general.alignment")
    align = int(align_f.contents()) if align_f is not None else DEFAULT_ALIGNMENT
    ti = [_field_span(t.field) for t in r.tensors]
    ti_start, ti_end = (min(a for a, _ in ti), max(b for _, b in ti)) if ti else (0, 0)
    version = int(r.fields["GGUF.version"].contents())

    dst = Path(dst)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out, open(src, "rb") as fin:
            out.write(struct.pack("<IIQQ", MAGIC, version, len(r.tensors), n_kv))
            for f in keep:
                a, b = _field_span(f)
                fin.seek(a)
                out.write(fin.read(b - a))
            for k, v in set_kv.items():
                out.write(encode_kv(k, v))
            if ti:
                fin.seek(ti_start)
                out.write(fin.read(ti_end - ti_start))
            out.write(b"\0" * (-out.tell() % align))
            fin.seek(r.data_offset)
            total, done = os.path.getsize(src) - r.data_offset, 0
            while chunk := fin.read(1 << 24):
                out.write(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(done, total)
        publish(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
