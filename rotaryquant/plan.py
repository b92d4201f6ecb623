"""``rq-plan``: the best quality that fits a memory budget — weights recipe x KV-cache type, at the
context the user needs, predicted from llama.cpp's own memory accounting and our measured quality.

What a candidate costs (peak resident memory of ``llama-server`` on CPU, VmHWM after a request that
fills the context):

- weights: the model file's tensor data, memory-mapped; tensors that the CPU backend repacks
  (``CPU_REPACK``: Q4_0/Q4_K/IQ4_NL ... on x86 AVX2) are also copied into anonymous memory, and
  their mapped pages stay resident after loading. Which tensor goes where is llama.cpp's decision: a
  metadata-only load (``no_alloc``) with every tensor routed through the CPU buffer list logs it;
- KV cache and compute buffers: a dry ``llama_init_from_model`` on that load, with the server's
  parameters (context, slots, batch sizes, flash attention, cache types) logs both. The compute buffer
  counted is the graph the server runs (one row of logits per slot); its n_batch-row reservation
  stays virtual memory;
- deferred-prefill transient (``--deferred``): F16 K and V of every cache cell, eq. 12 of the
  RotaryQuant paper (2 x L x H_kv x d x T x 2 bytes) with llama.cpp's own per-cache sizes from a dry
  F16 context (an SWA layer's cache holds its window, not T). The prompt graphs of deferred prefill
  need more working memory, which llama.cpp does not reserve in advance: that part is not predicted;
- the server process itself (code, heap, vocabulary): constants measured on this build (``BASE``).

The peak is the larger of serving (above) and loading (the whole file is read in, MAP_POPULATE, while
the repacked copies are made).

For a weights recipe that is not a file yet, a *skeleton* GGUF is written: the source's metadata and
tensor infos with the recipe's types, its data region a sparse hole (no disk space, never read), so
llama.cpp accounts for the converted model exactly as it will load it. Kurtosis promotions (which
rq-convert measures while converting) are not predicted.

Quality comes only from measured tables (docs/results/*.json): KLD against the model's own F16 run,
each number with the model and context it was measured on. A candidate whose quality was not
measured on this model shows "unknown" and the measurements on other models as evidence.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import re
import struct
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rotaryquant import paths

MiB = 1 << 20
RESULTS = paths.REPO / "docs" / "results"

# llama-server's own resident memory beyond the buffers llama.cpp reports: program and library code
# (~15 MiB of file pages), threads and heap, and the vocabulary (per token: text, score, attributes,
# lookup maps). Measured on this build as VmHWM minus every predicted buffer, at ctx 512: SmolLM2-135M
# (49152 tokens) 37.3 MiB, Gemma3-270M (262144 tokens) 69.5 MiB; the slope gives the per-token part
# (docs/results/plan-verify.md verifies at ctx 4096, and on models not used here).
BASE = 30 * MiB
BASE_PER_TOKEN = 157

# llama-server defaults the plan mirrors in its dry run
N_BATCH = 2048
N_UBATCH = 512

# KV-cache specs the planner considers ("K/V"; "+calib": with the model's K calibration), best first
# by bits per value; head sizes that are neither 64 nor multiples of 128 rule out the IsoQuant ones (llama.cpp
# refuses them at context creation, and the dry run records that; for head size 64 it uses the 64-wide siblings)
KV_SPECS = ("f16", "q8_0", "q8_0/isoquant3_0", "q8_0/isoquant3_0+calib", "q4_0", "q4_0+calib", "isoquant4_0",
            "isoquant4_0+calib", "isoquant4_0/isoquant3_0+calib", "isoquant3_0", "isoquant3_0+calib")
KV_DEFAULT = ("f16", "q8_0", "q8_0/isoquant3_0+calib", "q4_0+calib", "isoquant4_0+calib",
              "isoquant4_0/isoquant3_0+calib", "isoquant3_0+calib")

_FLOAT_TYPES = (0, 1, 30)  # f32, f16, bf16
_INT_TYPES = (24, 25, 26, 27)  # i8, i16, i32, i64


class PlanError(Exception):
    """A plan that cannot be made. ``str(e)`` is one line for the user: what is wrong and the fix."""

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        self.message = message
        self.fix = fix
        super().__init__(message if not fix else f"{message}; {fix}")


# --- sizes ------------------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": MiB, "mib": MiB, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def parse_size(text: str) -> int:
    """'16G' / '16GiB' -> 16 GiB, '16GB' -> 16e9 bytes, '512M' -> 512 MiB, '1073741824' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise PlanError(f"cannot read the size {text!r}", fix="write e.g. 16G (GiB), 16GB (10^9 bytes) or 512M")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise PlanError(f"size {text!r} is not positive", fix="give a budget such as 16G")
    return n


def mib(n: float) -> float:
    return n / MiB


# --- GGUF header (read without touching tensor data) ------------------------------------------------

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


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
    path: Path
    version: int
    fields: dict[str, Any]       # scalars and short arrays; long arrays as their length
    kv_raw: bytes                # the key/value section, verbatim
    n_kv: int
    tensors: list[TensorInfo]
    alignment: int
    data_offset: int
    file_size: int
    # HF input: upstream's own float-only decisions (tensor -> keep float; None: written as given)
    keep_float: dict[str, bool | None] | None = None
    # HF input: the checkpoint's float types (ggml ids); the skeleton itself holds F32 as upstream hands it over
    source_types: set[int] | None = None

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
    def calibrated(self) -> bool:
        return any(k.startswith("rotaryquant.k_center.") for k in self.fields)

    @property
    def n_vocab(self) -> int:
        v = self.fields.get("tokenizer.ggml.tokens")
        return int(v) if isinstance(v, int) else len(v or ())


def tensor_bytes(qtype: int, ne: Sequence[int]) -> int:
    """Bytes of a tensor of ggml type ``qtype`` and shape ``ne`` (ggml's own row size)."""
    from rotaryquant.bindings import row_size

    return row_size(qtype, ne[0]) * math.prod(ne[1:])


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
                if count > 64:
                    self.skip_strings(count)
                    return count
                return [self.string() for _ in range(count)]
            if sub == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            fmt = _SCALAR[sub]
            size = struct.calcsize(fmt)
            if count > 4096:
                self.need(size * count)
                self.pos += size * count
                return count
            self.need(size * count)
            vals = list(struct.unpack_from("<" + fmt[1] * count, self.data, self.pos))
            self.pos += size * count
            return vals
        return self.unpack(_SCALAR[vtype])


def read_header(path: str | Path) -> Header:
    """Parse a GGUF file's metadata and tensor infos; a PlanError that names the file when it cannot."""
    path = Path(path).expanduser()
    try:
        size = path.stat().st_size
        f = open(path, "rb")
    except OSError as e:
        raise PlanError(f"cannot read {path} ({e.strerror or e})", fix="check the path and its permissions") from None
    bad = f"{path} is not a readable GGUF file"
    with f:
        b = _Buf(f, size)
        try:
            if b.unpack("<I") != 0x46554747:
                raise PlanError(f"{bad} (no GGUF magic)", fix="pass a .gguf model, an HF folder or a repo id")
            version = b.unpack("<I")
            if version not in (2, 3):
                raise PlanError(f"{bad} (GGUF version {version})", fix="convert it with a current llama.cpp")
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
            raise PlanError(f"{bad} (truncated header)", fix="re-download or re-copy it") from None
        except (ValueError, KeyError, struct.error, UnicodeDecodeError) as e:
            raise PlanError(f"{bad} ({e})", fix="re-download it, or check it is a model GGUF") from None
    if "general.architecture" not in fields:
        raise PlanError(f"{path} has no general.architecture", fix="is it a model GGUF (not an imatrix/LoRA)?")
    if int(fields.get("split.count", 1) or 1) > 1:
        raise PlanError(f"{path} is one shard of a split GGUF", fix="merge it first (llama-gguf-split --merge)")
    align = int(fields.get("general.alignment", 32))
    data_offset = b.pos + (-b.pos % align)
    for t in tensors:
        try:
            t.nbytes = tensor_bytes(t.type, t.ne)
        except Exception:  # noqa: BLE001
            raise PlanError(f"{bad} (tensor {t.name} has unknown type id {t.type})",
                            fix="it needs a llama.cpp with that type") from None
        if data_offset + t.offset + t.nbytes > size:
            raise PlanError(f"{path} is truncated: tensor {t.name} ends past the end of the file",
                            fix="re-download or re-copy it")
    return Header(path, version, fields, kv_raw, n_kv, tensors, align, data_offset, size)


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
        nm = t.name.encode()
        infos += struct.pack("<Q", len(nm)) + nm + struct.pack("<I", len(t.ne))
        infos += b"".join(struct.pack("<Q", n) for n in t.ne) + struct.pack("<IQ", qt, off)
        off += nb + (-nb % h.alignment)
    with open(out, "wb") as f:
        f.write(struct.pack("<IIQQ", 0x46554747, h.version, len(h.tensors), h.n_kv))
        f.write(h.kv_raw)
        f.write(infos)
        f.write(b"\0" * (-f.tell() % h.alignment))
        f.truncate(f.tell() + off)
    return off


# --- the model and its identity ---------------------------------------------------------------------

@dataclass(frozen=True)
class KnownModel:
    """A model our quality tables were measured on, recognised by its shape (not its file name)."""

    id: str
    label: str
    arch: str
    n_layer: int
    n_embd: int
    n_params: int
    file_type: int           # general.file_type of the file measured
    files: tuple[str, ...]   # file names the results JSON use for it (".kc": the same file after rq-calibrate)


KNOWN_MODELS = (
    KnownModel("smollm2-135m", "SmolLM2-135M-Instruct Q4_1", "llama", 30, 576, 134_515_008, 3,
               ("SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2.kc.gguf")),
    KnownModel("gemma3-270m", "Gemma3-270M Q4_K_M", "gemma3", 18, 640, 268_098_176, 15,
               ("gemma-3-270m-q4_k_m.gguf", "gemma3.kc.gguf")),
    KnownModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M", "qwen2", 28, 1536, 1_777_088_000, 15,
               ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen.kc.gguf")),
)


def identify(h: Header) -> tuple[KnownModel | None, bool]:
    """(the known model this file is, whether its weights are the measured file's)."""
    for km in KNOWN_MODELS:
        if (h.arch, h.get("block_count"), h.get("embedding_length"), h.n_params) == \
                (km.arch, km.n_layer, km.n_embd, km.n_params):
            return km, int(h.fields.get("general.file_type", -1)) == km.file_type
    return None, False


def _known_by_file(name: str) -> KnownModel | None:
    return next((km for km in KNOWN_MODELS if name in km.files), None)


# --- measured quality -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Measurement:
    what: str                # "kv" or "weights"
    spec: str                # KV spec ("q8_0/isoquant3_0+calib") or recipe ("q8_0")
    model: str               # known model id, or the file name when unknown
    label: str               # human name of the model and file measured
    ctx: int
    kld: float
    source: str              # results file


def _norm_spec(label: str) -> str:
    k, _, v = label.replace("+calib", "").partition("/")
    spec = k if not v or v == k else f"{k}/{v}"
    return spec + ("+calib" if label.endswith("+calib") else "")


def _result_files(results: Path, pattern: str) -> Iterator[tuple[Path, dict]]:
    """(path, parsed JSON) of each readable results file matching pattern."""
    for p in sorted(Path(results).glob(pattern)):
        try:
            yield p, json.loads(p.read_text())
        except (OSError, ValueError):
            continue


def load_measurements(results: Path = RESULTS) -> list[Measurement]:
    """Every KLD in docs/results that rq-plan can use: KV types (kv-quality*.json, fused, not deferred)
    and whole-model weight types (weights-*.json rows that requantise every tensor)."""
    out: list[Measurement] = []
    for p, d in _result_files(results, "kv-quality*.json"):
        km = _known_by_file(d.get("model", ""))
        for r in d.get("rows", []):
            label = r.get("label", "")
            if r.get("unfused") or r.get("deferred") or " " in label or r.get("kld_mean") is None:
                continue
            out.append(Measurement("kv", _norm_spec(label), km.id if km else d["model"],
                                   f"{km.label if km else d['model']} ({d['model']})", int(r["ctx"]),
                                   float(r["kld_mean"]), p.name))
    for p, d in _result_files(results, "weights-*.json"):
        km = _known_by_file(d.get("model", ""))
        for r in d.get("rows", []):
            label = r.get("label", "")
            # "Q8_0" rows requantise every tensor; "role=type" rows change one role only
            if "=" in label or r.get("kld_mean") is None:
                continue
            out.append(Measurement("weights", label.lower(), km.id if km else d["model"],
                                   f"{km.label if km else d['model']} ({d['model']}, requantised from its F16)",
                                   int(d.get("ctx", 0)), float(r["kld_mean"]), p.name))
    return out


@dataclass
class Quality:
    """KLD of one component (weights or KV) of a candidate against the model's own F16."""

    kld: float | None = None           # on this model (None: unknown)
    exact: bool = False                # 0 by construction (the reference itself)
    where: str = ""                    # which measurement, or why exact
    elsewhere: list[dict] = field(default_factory=list)  # measurements on other models

    @property
    def key(self) -> float:
        """Ranking key: this model's number; else the worst measured elsewhere; else unknown (inf)."""
        if self.kld is not None:
            return self.kld
        vals = [e["kld"] for e in self.elsewhere]
        return max(vals) if vals else math.inf

    def text(self) -> str:
        if self.kld is not None:
            return "0 (exact)" if self.exact else f"{self.kld:.4f}"
        return "unknown"


def _kv_quality(spec: str, meas: list[Measurement], model: KnownModel | None, same_weights: bool) -> Quality:
    if spec == "f16":
        return Quality(0.0, True, "f16 KV is the reference")
    rows = [m for m in meas if m.what == "kv" and m.spec == spec]
    mine = [m for m in rows if model is not None and m.model == model.id and same_weights]
    q = Quality()
    if mine:
        m = max(mine, key=lambda m: (m.ctx, m.source))
        q.kld, q.where = m.kld, f"{m.label}, ctx {m.ctx} ({m.source})"
    q.elsewhere = _elsewhere([m for m in rows if m not in mine])
    return q


def _elsewhere(rows: list[Measurement]) -> list[dict]:
    best: dict[str, Measurement] = {}
    for m in rows:  # per model, the longest context measured
        if m.model not in best or (m.ctx, m.source) > (best[m.model].ctx, best[m.model].source):
            best[m.model] = m
    return [{"model": m.label, "ctx": m.ctx, "kld": m.kld, "source": m.source} for m in best.values()]


# --- weights options --------------------------------------------------------------------------------

@dataclass
class Weights:
    """One way to hold the weights: the file as it is ("keep") or an rq-convert recipe."""

    name: str
    types: dict[str, int]            # tensor -> ggml type
    bytes_by_role: dict[str, int]
    total: int                       # tensor data bytes
    bpw: float                       # over the 2-D+ layer weights
    quality: Quality
    skeleton: Path | None = None     # the GGUF llama.cpp accounts for (the file itself for keep)
    fallbacks: int = 0


def _role_bytes(h: Header, types: dict[str, int]) -> tuple[dict[str, int], int, float]:
    from rotaryquant.converter import roles as R

    out: dict[str, int] = {}
    wbits = wn = 0
    for t in h.tensors:
        role = R.classify(t.name, len(t.ne))
        nb = tensor_bytes(types.get(t.name, t.type), t.ne)
        out[role] = out.get(role, 0) + nb
        if role in (R.ATTENTION, R.FFN_DENSE, R.FFN_ROUTED, R.FFN_SHARED, R.OTHER):
            wbits += nb * 8
            wn += t.n
    return out, sum(out.values()), (wbits / wn if wn else 0.0)


def recipe_types(h: Header, recipe: str) -> tuple[dict[str, int], int]:
    """The type rq-convert gives each tensor of ``h`` under ``recipe`` (kurtosis promotions aside)."""
    import numpy as np

    from rotaryquant.converter import roles as R
    from rotaryquant.converter.errors import ConvertError
    from rotaryquant.converter.recipes import Planner, get_recipe

    try:
        pl = Planner(get_recipe(recipe), promote=False, measure=False,
                     tied="output.weight" not in {t.name for t in h.tensors})
    except ConvertError as e:
        raise PlanError(str(e)) from None
    zero = np.zeros(1, np.float32)
    types: dict[str, int] = {}
    fallbacks = 0
    for t in h.tensors:
        if t.type in _INT_TYPES:
            continue
        role = R.classify(t.name, len(t.ne))
        if h.keep_float is not None:  # HF input: what rq-convert's sink is told by upstream
            keep = h.keep_float.get(t.name)
            if keep is None:
                continue
        else:                         # GGUF input: as rq-convert's GGUF path decides
            keep = role in R.KEPT_F32 or (t.type == 0 and role == R.OTHER)
        shape = tuple(reversed(t.ne))
        fake = np.lib.stride_tricks.as_strided(zero, shape=shape, strides=(0,) * len(shape))
        d = pl.decide(t.name, fake, keep_float=keep)
        types[t.name] = int(d.qtype)
        fallbacks += d.fallback
    return types, fallbacks


def weights_options(h: Header, recipes: Sequence[str], *, source_kind: str, meas: list[Measurement],
                    model: KnownModel | None) -> tuple[list[Weights], list[str]]:
    """The file as it is (GGUF input) and each recipe; recipes that only grow a quantised file are dropped."""
    notes: list[str] = []
    out: list[Weights] = []
    src_float = all(t.type in _FLOAT_TYPES or t.type in _INT_TYPES for t in h.tensors)
    src_types = h.source_types if h.source_types is not None else \
        {t.type for t in h.tensors if t.type not in _INT_TYPES and len(t.ne) >= 2}
    if source_kind == "gguf":
        roles, total, bpw = _role_bytes(h, {})
        out.append(Weights("keep", {}, roles, total, bpw, Quality(0.0, True, "the file's own weights"),
                           skeleton=h.path))
    for r in recipes:
        types, fb = recipe_types(h, r)
        roles, total, bpw = _role_bytes(h, types)
        if source_kind == "gguf" and not src_float and total >= out[0].total:
            notes.append(f"recipe {r}: {mib(total):.0f} MiB, not smaller than the file's "
                         f"{mib(out[0].total):.0f} MiB and its weights are already quantised: left out")
            continue
        q = Quality()
        lossless = r == "f32" or (src_float and r in ("bf16", "f16") and src_types <= {_type_id(r)})
        if lossless:
            q = Quality(0.0, True, f"{r} holds the source's {'/'.join(sorted(_tname(t) for t in src_types))} "
                                   "weights exactly")
        else:
            rows = [m for m in meas if m.what == "weights" and m.spec == r]
            mine = [m for m in rows if model is not None and m.model == model.id and src_float]
            if mine:
                m = mine[0]
                q.kld, q.where = m.kld, f"{m.label} ({m.source})"
            q.elsewhere = _elsewhere([m for m in rows if m not in mine])
            if not src_float:
                q.where = "requantises already-quantised weights: not measured"
        same = next((o for o in out if o.name != "keep" and o.types == types), None)
        if same is not None:
            notes.append(f"recipe {r} gives this model the same types as {same.name}: shown once, as {same.name}")
            continue
        out.append(Weights(r, types, roles, total, bpw, q, fallbacks=fb))
    return out, notes


def _type_id(name: str) -> int:
    from rotaryquant.bindings import type_from_name

    return type_from_name(name)


def _tname(t: int) -> str:
    from rotaryquant.bindings import type_name

    return type_name(t)


# --- llama.cpp's own accounting: a metadata-only load and dry contexts --------------------------------

@dataclass
class ContextCost:
    spec: str
    n_ctx: int = 0
    kv: int = 0                  # KV cache bytes (all caches: SWA and full)
    k: int = 0                   # of which K
    v: int = 0                   # of which V
    compute: int = 0             # compute buffer bytes
    output: int = 0              # logits/embeddings output buffer
    error: str = ""              # why llama.cpp refused this cache type here
    kv_lines: list[str] = field(default_factory=list)


@dataclass
class DryRun:
    """What llama.cpp would allocate for one GGUF (or skeleton) under the server's parameters."""

    placement: dict[str, list[str]]          # buffer type -> tensor names (a tied output appears twice)
    contexts: dict[str, ContextCost]
    seconds: float


_LOG_LOCK = threading.Lock()
_RX_OVERRIDE = re.compile(r"tensor (\S+) \(\d+ MiB \S+\) buffer type overridden to (\S+)")
_RX_KV = re.compile(r"llama_kv_cache: size = +([0-9.]+) MiB.*K \(\S+\): +([0-9.]+) MiB, V \(\S+\): +([0-9.]+) MiB")
_RX_COMPUTE = re.compile(r"(\S+) compute buffer size = +([0-9.]+) MiB")
_RX_OUTPUT = re.compile(r"(\S+) +output buffer size = +([0-9.]+) MiB")


@contextlib.contextmanager
def _captured_log() -> Iterator[list[str]]:
    import llama_cpp as L

    lines: list[str] = []

    @L.llama_log_callback
    def cb(level: int, text: bytes, _ud: Any) -> None:
        # errors are marked so that _errors can pick them out (GGML_LOG_LEVEL_ERROR = 4)
        lines.append(("\x00E" if level == 4 else "") + text.decode("utf-8", errors="replace"))

    with _LOG_LOCK:
        L.llama_log_set(cb, ctypes.c_void_p(0))
        try:
            yield lines
        finally:
            from llama_cpp import _logger

            L.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def _errors(lines: list[str]) -> str:
    """Why llama.cpp failed: its error lines, else its last line, without function-name prefixes."""
    bad = [ln[2:].strip() for ln in lines if ln.startswith("\x00E") and ln[2:].strip()]
    generic = ("failed to initialize the context", "failed to create context", "failed to load model")
    bad = [b for b in bad if not any(g in b for g in generic)] or bad
    if not bad:
        bad = [ln.strip() for ln in lines if ln.strip()][-1:]
    return "; ".join(dict.fromkeys(re.sub(r"^[a-z_]+: ", "", b) for b in bad))[:400]


class NoAllocModel:
    """A model loaded by llama.cpp with ``no_alloc`` (metadata only): where each tensor would live, and
    what a context of any size and cache type would allocate. Use as a context manager."""

    def __init__(self, gguf: Path) -> None:
        self.gguf = Path(gguf)
        self.placement: dict[str, list[str]] = {}
        self._model: Any = None
        self._log: Any = None
        self.lines: list[str] = []

    def __enter__(self) -> "NoAllocModel":
        import llama_cpp as L

        from rotaryquant import bindings

        ggml = bindings.ggml._ggml()
        ggml.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p

        class Override(ctypes.Structure):
            _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

        # every tensor through the CPU buffer list: the same choice llama.cpp makes on a CPU-only
        # machine, but logged per tensor (CPU = memory-mapped, CPU_REPACK = copied)
        self._ov = (Override * 2)()
        self._ov[0].pattern, self._ov[0].buft = b".", ggml.ggml_backend_cpu_buffer_type()
        mp = L.llama_model_default_params()
        mp.no_alloc = True
        mp.load_mode = L.LLAMA_LOAD_MODE_NONE
        mp.n_gpu_layers = 0
        mp.tensor_buft_overrides = ctypes.cast(self._ov, ctypes.c_void_p)
        self._log = _captured_log()
        self.lines = self._log.__enter__()
        try:
            self._model = L.llama_model_load_from_file(str(self.gguf).encode(), mp)
            if not self._model:
                raise PlanError(f"llama.cpp cannot load {self.gguf.name}: {_errors(self.lines) or 'no reason given'}",
                                fix="is the architecture one this llama.cpp supports? (llama-cli -m FILE shows "
                                    "its full log)")
        except BaseException:
            self._log.__exit__(None, None, None)
            raise
        for ln in self.lines:
            if m := _RX_OVERRIDE.search(ln):
                self.placement.setdefault(m.group(2), []).append(m.group(1))
        return self

    def __exit__(self, *exc: Any) -> None:
        import llama_cpp as L

        if self._model:
            L.llama_model_free(self._model)
            self._model = None
        self._log.__exit__(*exc)

    def context(self, spec: str, n_ctx: int, *, n_seq: int = 1, n_batch: int = N_BATCH, n_ubatch: int = N_UBATCH,
                n_outputs: int | None = None) -> ContextCost:
        """What llama_init_from_model allocates for cache type ``spec`` (KV, compute, output buffers).

        ``n_outputs``: output rows the compute graph is reserved for. llama-server reserves for n_batch
        (its buffer is that large, but only virtually) and asks for one row of logits per sequence, so
        the pages it touches are those of a graph with ``n_seq`` outputs: the default here.
        """
        import llama_cpp as L

        from rotaryquant import bindings
        from rotaryquant.eval import kvtypes

        k, v = kvtypes.split(spec)
        cost = ContextCost(spec, n_ctx)
        try:
            tk, tv = bindings.type_from_name(k), bindings.type_from_name(v)
        except bindings.RQTypeError as e:
            raise PlanError(f"KV spec {spec!r}: {e}") from None
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_ubatch, n_seq
        cp.type_k, cp.type_v = tk, tv
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        # llama-server's choices: SWA caches sized to the window, one stream per slot (--parallel N)
        cp.swa_full, cp.kv_unified, cp.no_perf = False, False, True
        cp.n_threads = cp.n_threads_batch = 1
        cp.n_outputs_max = n_outputs or n_seq
        n0 = len(self.lines)
        with _k_center(kvtypes.k_center(spec)):
            ctx = L.llama_init_from_model(self._model, cp)
        new = self.lines[n0:]
        if not ctx:
            cost.error = _errors(new) or "llama_init_from_model failed"
            return cost
        L.llama_free(ctx)
        for ln in new:
            if m := _RX_KV.search(ln):
                cost.kv += round(float(m.group(1)) * MiB)
                cost.k += round(float(m.group(2)) * MiB)
                cost.v += round(float(m.group(3)) * MiB)
                cost.kv_lines.append(ln.strip().lstrip("\x00E"))
            elif m := _RX_COMPUTE.search(ln):
                cost.compute += round(float(m.group(2)) * MiB)
            elif m := _RX_OUTPUT.search(ln):
                cost.output += round(float(m.group(2)) * MiB)
        return cost


def dry_run(gguf: Path, specs: Sequence[str], *, n_ctx: int, n_seq: int = 1) -> DryRun:
    """llama.cpp's own memory accounting for ``gguf`` and each cache type (no tensor data is read)."""
    t0 = time.perf_counter()
    with NoAllocModel(gguf) as m:
        contexts = {spec: m.context(spec, n_ctx, n_seq=n_seq) for spec in specs}
    return DryRun(m.placement, contexts, time.perf_counter() - t0)


@contextlib.contextmanager
def _k_center(on: bool) -> Iterator[None]:
    from rotaryquant import bindings

    try:
        was = bindings.k_center()
    except Exception:  # noqa: BLE001  (a build without K centring)
        yield
        return
    bindings.set_k_center("auto" if on else "off")
    try:
        yield
    finally:
        bindings.set_k_center(was)


# --- the plan ---------------------------------------------------------------------------------------

@dataclass
class Candidate:
    weights: str                     # "keep" or a recipe
    kv: str                          # KV spec, "K/V" with optional "+calib"
    ctx: int                         # per slot
    n_ctx: int                       # llama-server -c (ctx x slots)
    bytes: dict[str, int] = field(default_factory=dict)
    peak: int = 0                    # predicted peak RSS (CPU) or VRAM (CUDA)
    host: int = 0                    # CUDA: host RAM for what stays on the CPU
    fits: bool = False
    error: str = ""                  # llama.cpp refused this combination
    weights_quality: Quality = field(default_factory=Quality)
    kv_quality: Quality = field(default_factory=Quality)
    bpw: float = 0.0
    kv_bits: float = 0.0             # bits per cached value (K and V averaged)
    predicted: list[str] = field(default_factory=list)   # components that come from a formula
    experts_on_cpu: int = 0          # CUDA: layers whose routed experts stay in RAM (-ot)
    rank: int = 0

    @property
    def quality_key(self) -> float:
        return self.weights_quality.key + self.kv_quality.key

    @property
    def label(self) -> str:
        return f"{self.weights} + {self.kv}"


@dataclass
class Plan:
    model: str
    source_kind: str                 # "gguf" | "hf"
    arch: str
    n_params: int
    known: str | None                # the measured model this file is, if any
    same_weights: bool
    budget: int
    ctx: int
    parallel: int
    device: str
    deferred: bool
    candidates: list[Candidate]
    commands: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def winner(self) -> Candidate | None:
        return next((c for c in self.candidates if c.fits and not c.error), None)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["winner"] = asdict(self.winner) if self.winner else None
        for c in d["candidates"] + ([d["winner"]] if d["winner"] else []):
            c["peak_mib"] = round(mib(c["peak"]), 1)
        return d


# llama.cpp stores isoquant3_0/4_0 on heads that are all 64 wide as these siblings (more bits per value)
_ISO64 = {"isoquant3_0": "isoquant3_64", "isoquant4_0": "isoquant4_64"}


def _kv_bits(spec: str, head: tuple[int, int] = (128, 128)) -> float:
    """Bits per cached value of a K/V spec, for heads of (K, V) width ``head``."""
    from rotaryquant import bindings
    from rotaryquant.eval import kvtypes

    def bits(t: str, d: int) -> float:
        t = _ISO64.get(t, t) if d == 64 else t
        n = 64 if d == 64 else 128
        return bindings.row_size(bindings.type_from_name(t), n) * 8 / n

    k, v = kvtypes.split(spec)
    return (bits(k, head[0]) + bits(v, head[1])) / 2


def _head_widths(h: Header) -> tuple[int, int]:
    n_embd = int(h.get("embedding_length", 0) or 0)
    heads = h.get("attention.head_count", 1) or 1
    nh = max(int(heads[0] if isinstance(heads, list) else heads), 1)
    dk = int(h.get("attention.key_length", n_embd // nh) or n_embd // nh)
    return dk, int(h.get("attention.value_length", dk) or dk)


def _layer_dims(h: Header) -> list[tuple[int, int]]:
    """(n_embd_k_gqa, n_embd_v_gqa) per layer, from the GGUF's attention metadata."""
    n_layer = int(h.get("block_count", 0) or 0)
    n_embd = int(h.get("embedding_length", 0) or 0)
    heads = h.get("attention.head_count", 1) or 1
    kv = h.get("attention.head_count_kv", heads)
    per = lambda x, i: int(x[i] if isinstance(x, list) else x)  # noqa: E731
    out = []
    for i in range(n_layer):
        nh = max(per(heads, i), 1)
        dk = int(h.get("attention.key_length", n_embd // nh) or n_embd // nh)
        dv = int(h.get("attention.value_length", dk) or dk)
        out.append((per(kv, i) * dk, per(kv, i) * dv))
    return out


def deferred_transient(h: Header, tokens: int) -> int:
    """Eq. 12 of the RotaryQuant paper: F16 K and V for ``tokens`` prompt tokens in every layer,
    2 x L x H_kv x d x T x 2 bytes (per layer: n_embd_k_gqa + n_embd_v_gqa)."""
    return sum((k + v) * tokens * 2 for k, v in _layer_dims(h))


def transient_bytes(f16: ContextCost | None, spec: str) -> int:
    """The deferred-prefill transient for a prompt that fills the context: F16 K (if K is quantised) and F16 V
    (if V is) of every cache cell, i.e. eq. 12 with llama.cpp's own per-cache sizes (an SWA layer's cache
    holds its window, not the context). ``f16``: llama.cpp's accounting of an F16 cache of this context."""
    from rotaryquant.eval import kvtypes

    if f16 is None:
        return 0
    k, v = kvtypes.split(spec)
    return (f16.k if k not in ("f16", "f32", "bf16") else 0) + (f16.v if v not in ("f16", "f32", "bf16") else 0)


def base_bytes(h: Header) -> int:
    return BASE + BASE_PER_TOKEN * h.n_vocab


def _layout(h: Header, types: dict[str, int]) -> dict[str, tuple[int, int]]:
    """tensor -> (absolute file offset, bytes) as write_skeleton lays the file out (or the file itself)."""
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


def _calib_possible(h: Header) -> str:
    """'' when rq-calibrate can calibrate this architecture, else why not."""
    from rotaryquant.converter import kcenter

    if h.arch in kcenter._REFUSED_ARCHS:
        return f"{h.arch} uses {kcenter._REFUSED_ARCHS[h.arch]}"
    if h.arch in kcenter._UNHOOKED_ARCHS or h.get("attention.kv_lora_rank") is not None:
        return f"{h.arch} writes or reuses its K cache in ways K centring does not cover"
    if any(h.get(k) for k in kcenter._SOFTCAP_KEYS):
        return "attention logit soft-capping"
    if h.get("attention.head_count") is None:
        return "no attention layers"
    return ""


_EXPERTS = re.compile(r"^blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps\.")
PAGE = 4096


def _pages(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _cpu_costs(h: Header, w: Weights, dr: DryRun, cost: ContextCost, *, transient: int) -> \
        tuple[dict[str, int], int, list[str]]:
    layout = _layout(h, w.types)
    mapped = [n for b, names in dr.placement.items() if b == "CPU" for n in names]
    copies = [n for b, names in dr.placement.items() if b != "CPU" for n in names]
    if mapped:
        lo = min(layout[n][0] for n in mapped)
        hi = max(layout[n][0] + layout[n][1] for n in mapped)
        resident = _pages(hi) - (lo // PAGE) * PAGE
    else:
        resident = 0
    repack = sum(layout[n][1] for n in copies)
    file_size = (max(o + b for o, b in layout.values()) if layout else 0)
    b = {"weights_mapped": resident, "weights_copied": repack, "kv": cost.kv, "compute": cost.compute,
         "output": cost.output, "transient": transient, "base": base_bytes(h)}
    serve = sum(b.values())
    load = _pages(file_size) + repack + b["base"]
    b["load_peak"] = load
    predicted = ["base (constant measured on this build)"]
    if transient:
        predicted.append("deferred prefill: the F16 transient (eq. 12, llama.cpp's cache sizes) is counted, the "
                         "prompt graphs' extra working memory is not")
    return b, max(serve, load), predicted


def _gpu_costs(h: Header, w: Weights, cost: ContextCost, *, budget: int, transient: int) -> \
        tuple[dict[str, int], int, int, int, list[str]]:
    """CUDA: everything on the GPU (-ngl 99) except routed experts of the first N layers (-ot ...=CPU)."""
    layout = _layout(h, w.types)
    experts: dict[int, int] = {}
    rest = 0
    for name, (_, nb) in layout.items():
        m = _EXPERTS.match(name)
        if m:
            experts[int(m.group(1))] = experts.get(int(m.group(1)), 0) + nb
        else:
            rest += nb
    fixed = rest + cost.kv + cost.compute + transient
    on_cpu, moved = 0, 0
    vram = fixed + sum(experts.values())
    for il in sorted(experts):
        if vram <= budget:
            break
        vram -= experts[il]
        moved += experts[il]
        on_cpu += 1
    b = {"weights_gpu": rest + sum(experts.values()) - moved, "experts_cpu": moved, "kv": cost.kv,
         "compute": cost.compute, "transient": transient}
    host = moved + cost.output + base_bytes(h)
    predicted = ["compute buffer: the CPU backend's, measured; CUDA's is not measured (no GPU here)",
                 "VRAM placement: not verified on a GPU"]
    if transient:
        predicted.append("deferred prefill: the F16 transient (eq. 12) is counted, the prompt graphs' extra "
                         "working memory is not")
    return b, vram, host, on_cpu, predicted


def _sort(cands: list[Candidate]) -> list[Candidate]:
    """Fitting candidates first, best expected quality first (this model's KLD where measured, else the
    worst measured on other models, else unknown), then more bits, then less memory."""
    def key(c: Candidate) -> tuple:
        return (bool(c.error), not c.fits, c.quality_key, -c.bpw, -c.kv_bits, c.peak)
    out = sorted(cands, key=key)
    for i, c in enumerate(out, 1):
        c.rank = i
    return out


# --- inputs -----------------------------------------------------------------------------------------

def resolve(model: str | Path) -> tuple[str, Path]:
    """('gguf', file) or ('hf', folder) for a GGUF, an HF folder or a repo id in the HF cache."""
    from rotaryquant.converter import hf
    from rotaryquant.converter.errors import ConvertError

    p = Path(model).expanduser()
    if p.exists() and not os.access(p, os.R_OK):
        raise PlanError(f"cannot read {p} (permission denied)", fix="check its permissions")
    try:
        return hf.resolve_input(model)
    except ConvertError as e:
        raise PlanError(e.message, fix=e.fix) from None


def hf_header(folder: Path, workdir: Path) -> Header:
    """An HF folder as llama.cpp's converter would write it (metadata, tensor names, shapes), with no data:
    upstream's per-architecture code runs once, exactly as for rq-convert, and nothing is quantised."""
    import gguf
    import numpy as np

    from rotaryquant.converter import hf
    from rotaryquant.converter.errors import ConvertError
    from rotaryquant.converter.writer import StreamingWriter

    root = paths.llama_root()
    recs: list[tuple[str, tuple[int, ...], int]] = []
    keep: dict[str, bool | None] = {}
    holder: dict[str, Any] = {}

    def sink(name: str, tensor: Any, raw_dtype: Any) -> None:
        shape = tuple(int(n) for n in tensor.shape)
        if raw_dtype is not None and int(raw_dtype) not in _FLOAT_TYPES:
            qt = int(raw_dtype)          # pre-packed by upstream: shape is in bytes
            shape = tuple(int(n) for n in gguf.quant_shape_from_byte_shape(shape, gguf.GGMLQuantizationType(qt)))
        else:
            kind = str(getattr(tensor, "dtype", "float32"))
            qt = 1 if "float16" in kind and "b" not in kind else 0 if "float" in kind else 26
        recs.append((name, shape, qt))
        keep[name] = holder["model"]._rq_keep_float.get(name) if qt in (0, 1) else None
        return None

    try:
        src = hf.inspect_folder(folder, root)
        backend = hf.choose_backend("auto", src.arch)

        def make_writer(arch: str, old: Any) -> StreamingWriter:
            return StreamingWriter(arch, sink=sink, data_file=None, dry_run=True, endianess=old.endianess)

        with hf.quiet_upstream(False):
            model = hf.build_model(src, backend, root, workdir / "source.gguf", make_writer)
            holder["model"] = model
            model.prepare_tensors()
            model.prepare_metadata(vocab_only=False)
    except ConvertError as e:
        raise PlanError(e.message, fix=e.fix) from None
    except Exception as e:  # noqa: BLE001  (upstream raises anything; name the input)
        raise PlanError(f"llama.cpp's converter cannot read {folder} ({type(e).__name__}: {e})",
                        fix="check the folder converts with rq-convert --dry-run") from None
    out = workdir / "source.gguf"
    w = gguf.GGUFWriter(path=out, arch=model.gguf_writer.arch)
    w.kv_data = model.gguf_writer.kv_data
    for name, shape, qt in recs:
        ne = tuple(reversed(shape))
        w.add_tensor_info(name, shape, np.dtype(np.float32), tensor_bytes(qt, ne), raw_dtype=gguf.GGMLQuantizationType(qt))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    h = read_header_sparse(out, w)
    h.keep_float = keep
    st = {"F32": 0, "F16": 1, "BF16": 30, "F64": 0}
    h.source_types = {st[d] for sh in src.shards for d, shape in sh.tensors.values() if d in st and len(shape) >= 2}
    return h


def read_header_sparse(path: Path, w: Any) -> Header:
    """The header of a GGUF written without its data: the data region becomes a sparse hole."""
    with open(path, "r+b") as f:
        f.seek(0, os.SEEK_END)
        end = f.tell()
        end += -end % 32
        data = sum(ti.nbytes + (-ti.nbytes % 32) for ti in w.tensors[0].values())
        f.truncate(end + data)
    return read_header(path)


# --- planning ---------------------------------------------------------------------------------------

RECIPES = ("rotaryquant", "rotaryquant-itq3", "itq3", "q8_0", "f16", "bf16")


def make_plan(model: str | Path, *, budget: int, ctx: int, parallel: int = 1, device: str = "cpu",
              deferred: bool = False, recipes: Sequence[str] | None = None, kv: Sequence[str] | None = None,
              results: Path = RESULTS, workdir: Path | None = None) -> Plan:
    """Every weights option x KV type at ``ctx`` tokens per slot, costed by llama.cpp and ranked."""
    t0 = time.perf_counter()
    if ctx < 16:
        raise PlanError(f"context {ctx} is too small", fix="give the tokens one request needs, e.g. --ctx 32768")
    if parallel < 1:
        raise PlanError(f"--parallel {parallel} must be at least 1")
    if device not in ("cpu", "cuda"):
        raise PlanError(f"unknown device {device!r}", fix="use cpu or cuda")
    kind, src = resolve(model)
    specs = list(kv or KV_DEFAULT)
    from rotaryquant.eval import kvtypes

    for s_ in specs:
        try:
            kvtypes.validate(s_)
        except ValueError as e:
            raise PlanError(f"KV spec {s_!r}: {e}", fix=f"use types such as {', '.join(KV_SPECS[:4])}") from None
    with contextlib.ExitStack() as stack:
        wd = Path(workdir) if workdir else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rq-plan-")))
        h = read_header(src) if kind == "gguf" else hf_header(src, wd)
        km, same = identify(h)
        meas = load_measurements(results)
        n_ctx_train = int(h.get("context_length", 0) or 0)
        notes: list[str] = []
        if n_ctx_train and ctx > n_ctx_train:
            notes.append(f"--ctx {ctx} is beyond the model's training context {n_ctx_train}: quality there is unknown")
        why_no_calib = _calib_possible(h)
        if why_no_calib:
            dropped = [s_ for s_ in specs if kvtypes.k_center(s_)]
            specs = [s_ for s_ in specs if not kvtypes.k_center(s_)]
            if dropped:
                notes.append(f"K calibration is not possible ({why_no_calib}): {', '.join(dropped)} left out")
        options, wnotes = weights_options(h, list(RECIPES if recipes is None else recipes), source_kind=kind,
                                          meas=meas, model=km)
        notes += wnotes
        cands: list[Candidate] = []
        n_ctx = ctx * parallel
        for w in options:
            if w.skeleton is None:
                w.skeleton = wd / f"{w.name}.gguf"
                write_skeleton(h, w.types, w.skeleton)
            run = specs + (["f16"] if deferred and "f16" not in specs else [])
            dr = dry_run(w.skeleton, run, n_ctx=n_ctx, n_seq=parallel)
            f16 = dr.contexts.get("f16") if deferred else None
            for spec in specs:
                cost = dr.contexts[spec]
                transient = transient_bytes(f16, spec)
                c = Candidate(w.name, spec, ctx, n_ctx, bpw=w.bpw, kv_bits=_kv_bits(spec, _head_widths(h)),
                              weights_quality=w.quality,
                              kv_quality=_kv_quality(spec, meas, km, same and w.name == "keep"))
                if cost.error:
                    c.error = cost.error
                elif device == "cpu":
                    c.bytes, c.peak, c.predicted = _cpu_costs(h, w, dr, cost, transient=transient)
                    c.fits = c.peak <= budget
                else:
                    c.bytes, c.peak, c.host, c.experts_on_cpu, c.predicted = _gpu_costs(
                        h, w, cost, budget=budget, transient=transient)
                    c.fits = c.peak <= budget
                cands.append(c)
        plan = Plan(str(src), kind, h.arch, h.n_params, km.label if km else None, same, budget, ctx, parallel,
                    device, deferred, _sort(cands), notes=notes)
        if plan.winner is None:
            msg = _no_fit_message(plan, h, options)
            plan.seconds = time.perf_counter() - t0
            raise NoFit(plan, msg)
        _commands(plan, h)
    plan.seconds = time.perf_counter() - t0
    return plan


class NoFit(PlanError):
    """No candidate fits the budget; ``plan`` holds them all (closest first)."""

    def __init__(self, plan: Plan, message: str, fix: str | None = None) -> None:
        self.plan = plan
        super().__init__(message, fix=fix)


def _no_fit_message(plan: Plan, h: Header, options: list[Weights]) -> str:
    ok = [c for c in plan.candidates if not c.error]
    if not ok:
        errs = "; ".join(dict.fromkeys(c.error for c in plan.candidates))
        return f"llama.cpp accepts none of the candidates for {Path(plan.model).name}: {errs}"
    small = min(ok, key=lambda c: c.peak)
    parts = ", ".join(f"{k} {mib(v):.0f}" for k, v in small.bytes.items() if v >= MiB / 2 and k != "load_peak")
    msg = (f"no candidate fits {mib(plan.budget):.0f} MiB at --ctx {plan.ctx}: the smallest, {small.label}, "
           f"needs {mib(small.peak):.0f} MiB ({parts} MiB)")
    if plan.device == "cpu":
        w = next(o for o in options if o.name == small.weights)
        best = _max_ctx(plan, h, w, small.kv)
        if best:
            msg += f"; with it, the largest context that fits is --ctx {best}"
        else:
            msg += "; even a tiny context does not fit: a smaller model or a larger budget is needed"
    return msg


def _max_ctx(plan: Plan, h: Header, w: Weights, spec: str) -> int:
    """The largest context per slot (a multiple of 256) at which ``w`` + ``spec`` fits the budget."""
    assert w.skeleton is not None
    with NoAllocModel(w.skeleton) as m:
        dr = DryRun(m.placement, {}, 0.0)

        def peak(ctx: int) -> int:
            cost = m.context(spec, ctx * plan.parallel, n_seq=plan.parallel)
            if cost.error:
                return 1 << 62
            f16 = m.context("f16", ctx * plan.parallel, n_seq=plan.parallel) if plan.deferred else None
            return _cpu_costs(h, w, dr, cost, transient=transient_bytes(f16, spec))[1]

        lo, hi = 0, max(1, plan.ctx // 256)
        if peak(256) > plan.budget:
            return 0
        lo = 1
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            if peak(mid * 256) <= plan.budget:
                lo = mid
            else:
                hi = mid
        return lo * 256


def _bin(name: str) -> str:
    from rotaryquant.bindings import tools

    p = tools.bin_dir() / name
    try:
        return os.path.relpath(p) if len(os.path.relpath(p)) < len(str(p)) else str(p)
    except ValueError:
        return str(p)


def _q(p: str | Path) -> str:
    import shlex

    return shlex.quote(str(p))


def expert_rule(layers: Sequence[int]) -> str:
    """The -ot rule that keeps the routed experts of ``layers`` in host memory (as --n-cpu-moe does)."""
    ids = "|".join(str(i) for i in layers)
    return f"blk\\.({ids})\\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU"


def _commands(plan: Plan, h: Header) -> None:
    from rotaryquant.eval import kvtypes

    c = plan.winner
    assert c is not None
    src = Path(plan.model)
    stem = src.name[:-5] if src.name.endswith(".gguf") else src.name
    calib = kvtypes.k_center(c.kv)
    cmds: list[str] = []
    out = src
    if c.weights == "keep":
        if calib and not h.calibrated:
            out = src.with_name(f"{stem}.kc.gguf")
            cmds.append(f"rq-calibrate {_q(src)} -o {_q(out)}")
    else:
        out = src.parent / f"{stem}.{c.weights}.gguf"
        cmds.append(f"rq-convert {_q(src)} {_q(out)} --recipe {c.weights}" + (" --calibrate" if calib else ""))
    has_calib = calib or (h.calibrated and c.weights == "keep")
    k, v = kvtypes.split(c.kv)
    head = max(0, int(mib(plan.budget - c.peak)) - 1) if plan.device == "cpu" else 0
    srv = [_bin("llama-server"), "-m", _q(out), "-c", str(c.n_ctx), "--parallel", str(plan.parallel), "-fa", "on",
           "-ctk", k, "-ctv", v]
    if has_calib and not calib:
        srv.append("--no-k-center")
    if plan.device == "cpu":
        srv += ["--cache-ram", str(head)]
    if plan.deferred and any(t != "f16" for t in (k, v)):
        srv.append("--kv-deferred")
    if plan.device == "cuda":
        srv += ["-ngl", "99", "--fit", "off"]
        if c.experts_on_cpu:
            layers = sorted({int(m.group(1)) for t in h.tensors if (m := _EXPERTS.match(t.name))})
            srv += ["-ot", f'"{expert_rule(layers[:c.experts_on_cpu])}"']
    cmds.append(" ".join(srv))
    plan.commands = cmds
    adv = plan.advice
    b = c.bytes
    if plan.device == "cpu":
        adv.append(f"--cache-ram {head}: llama-server keeps finished prompts' KV in RAM (default up to 8192 MiB); "
                   "the headroom left by the budget is what it may use (0 turns the cache off)")
        mapped = b.get("weights_mapped", 0)
        adv.append(f"the weights are memory-mapped ({mib(mapped):.0f} MiB): under memory pressure the kernel drops "
                   "their pages and reads them back from disk on use, a large slow-down; to pin them add "
                   "-lm mmap+mlock (needs ulimit -l unlimited or CAP_IPC_LOCK)")
        if b.get("weights_copied"):
            adv.append(f"{mib(b['weights_copied']):.0f} MiB of weights are repacked for the CPU matmuls, and their "
                       "mapped file pages stay resident as well (both are in the peak): -lm none reads the weights "
                       "into memory once instead (less resident memory, slower start); --no-repack keeps only the "
                       "mapped copy (slower prompt processing)")
    else:
        adv.append(f"host RAM for what stays on the CPU: {mib(c.host):.0f} MiB"
                   + (f" ({c.experts_on_cpu} layers of routed experts, {mib(b.get('experts_cpu', 0)):.0f} MiB, "
                      "same as --n-cpu-moe " + str(c.experts_on_cpu) + ")" if c.experts_on_cpu else ""))
        adv.append("CUDA placement and compute buffers are predicted from the CPU build's accounting; no GPU here "
                   "has run it (--fit off keeps llama-server from moving layers on its own); add --cache-ram N "
                   "(MiB of host RAM for finished prompts, default 8192) to bound the prompt cache")
    if plan.deferred:
        from rotaryquant import bindings

        has = hasattr(bindings.ggml._ggml(), "ggml_rq_get_kv_deferred")
        adv.append(f"deferred prefill: the F16 transient ({mib(b.get('transient', 0)):.0f} MiB, eq. 12 with "
                   "llama.cpp's cache sizes) is in the peak; llama.cpp does not reserve the prompt graphs' extra "
                   "working memory for it, so that is not (measured: +0 to +36 MiB on the small models here, "
                   "docs/results/plan-verify.md); "
                   + ("this build has --kv-deferred" if has else "this build does not have --kv-deferred yet"))
    if c.weights != "keep":
        adv.append("rq-convert may promote high-kurtosis tensors one type up (see rq-convert --dry-run); the "
                   "prediction is for the recipe's types without promotions")


# --- output -----------------------------------------------------------------------------------------

def _m(n: int) -> str:
    return f"{mib(n):.0f}" if n else "-"


def render(plan: Plan, *, top: int = 12) -> str:
    """The ranked table, the winner's command lines and the advice, as text."""
    cpu = plan.device == "cpu"
    known = f"; quality tables measured on {plan.known}" + ("" if plan.same_weights else " (other weights)") \
        if plan.known else "; no quality measured on this model"
    lines = [f"rq-plan: {Path(plan.model).name} ({plan.arch}, {plan.n_params / 1e9:.2f} B parameters{known})",
             f"budget {mib(plan.budget):.0f} MiB {'RAM' if cpu else 'VRAM'}, --ctx {plan.ctx} x {plan.parallel} "
             f"slot(s), device {plan.device}{', deferred prefill' if plan.deferred else ''}; "
             f"{len(plan.candidates)} candidates costed by llama.cpp in {plan.seconds:.1f} s", ""]
    hdr = (["#", "weights", "KV K/V", "bpw", "KV bits", "weights", "KV", "compute", "other",
            "peak MiB" if cpu else "VRAM MiB", "fits", "KLD KV", "KLD weights", "evidence elsewhere (KV)"])
    rows = []
    shown = [c for c in plan.candidates if not c.error][:top]
    for c in shown:
        b = c.bytes
        wts = b.get("weights_mapped", 0) + b.get("weights_copied", 0) + b.get("weights_gpu", 0)
        other = b.get("output", 0) + b.get("transient", 0) + b.get("base", 0)
        ev = ", ".join(f"{e['model'].split(' (')[0]} {e['kld']:.3f}" for e in c.kv_quality.elsewhere
                       if c.kv_quality.kld is None)
        rows.append([str(c.rank), c.weights, c.kv, f"{c.bpw:.2f}", f"{c.kv_bits:.2f}", _m(wts), _m(b.get("kv", 0)),
                     _m(b.get("compute", 0)), _m(other), f"{mib(c.peak):.0f}", "yes" if c.fits else "no",
                     c.kv_quality.text(), c.weights_quality.text(), ev or "-"])
    widths = [max(len(r[i]) for r in [hdr] + rows) for i in range(len(hdr))]
    right = {0, 3, 4, 5, 6, 7, 8, 9}
    fmt = lambda r: "  ".join(x.rjust(w) if i in right else x.ljust(w) for i, (x, w) in enumerate(zip(r, widths)))  # noqa: E731
    lines += [fmt(hdr)] + [fmt(r) for r in rows]
    rest = len([c for c in plan.candidates if not c.error]) - len(shown)
    if rest > 0:
        lines.append(f"... {rest} more (--top N, or --json for all)")
    refused = [c for c in plan.candidates if c.error]
    if refused:
        lines.append("")
        for spec, err in dict.fromkeys((c.kv, c.error) for c in refused):
            lines.append(f"not possible: {spec}: {err}")
    w = plan.winner
    lines.append("")
    if w:
        lines.append(f"best that fits: {w.label} at {mib(w.peak):.0f} MiB predicted peak"
                     + (f" RSS ({mib(plan.budget - w.peak):.0f} MiB headroom)" if cpu else
                        f" VRAM, {mib(w.host):.0f} MiB host RAM"))
        if w.kv_quality.where:
            lines.append(f"  KV quality: KLD {w.kv_quality.text()} — {w.kv_quality.where}")
        if w.weights_quality.where:
            lines.append(f"  weights quality: {w.weights_quality.text()} — {w.weights_quality.where}")
        lines.append("  components from a formula, not llama.cpp: " + "; ".join(w.predicted))
        lines.append("")
        lines += [f"  {cmd}" for cmd in plan.commands]
        lines.append("")
        lines += [f"- {a}" for a in plan.advice]
    if plan.notes:
        lines += [""] + [f"note: {n}" for n in plan.notes]
    lines.append("")
    lines.append("KLD: mean KL divergence of the next-token distribution against the model's own F16 (weights) or "
                 "F16-KV run, from docs/results; 'unknown': not measured on this model (other models' numbers "
                 "rank it, they are not its quality). Sizes in MiB.")
    return "\n".join(lines)


def to_json(plan: Plan) -> str:
    return json.dumps(plan.to_dict(), indent=1, default=str)
