"""llama.cpp's own memory accounting: a metadata-only load (``no_alloc``) and dry contexts.

Every figure comes from llama.cpp's C API, through the patched build's functions
(ggml-patches/src/llama/llama-rq.cpp), never from its log:

- per tensor, the buffer type it is placed in (``CPU``: memory-mapped, ``CPU_REPACK``: copied):
  ``llama_rq_model_tensor_buft(model, name)`` for each tensor of the GGUF (a no_alloc load gives every tensor a
  dummy buffer of its buffer type). Every tensor is routed through the CPU buffer list, which is what llama.cpp
  does on a CPU-only machine anyway;
- what a context allocates (a no_alloc context: what it would allocate), ``llama_rq_get_memory(ctx)``: K and V
  bytes of all its KV caches (an iSWA model has two), the caches' K-centring tensors, the output (logits)
  buffer, the compute buffers of all backends, and the weights of all buffers (which reveals a tied output's
  own copy, see :meth:`NoAllocModel.placement`).

The log is captured only so that it does not reach the terminal, and so that a failed load or context can say
why in llama.cpp's words (:func:`errors`): text for the user, no number is read from it.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rotaryquant import gguf_io, kvtypes
from rotaryquant.bindings import context, ggml
from rotaryquant.errors import PlanError

# llama-server defaults the plan mirrors in its dry run
N_BATCH = 2048
N_UBATCH = 512

TIED = "token_embd.weight"       # a tied output reads the token embeddings (llama.cpp: TENSOR_DUPLICATED)


@dataclass
class ContextCost:
    spec: str
    n_ctx: int = 0
    kv: int = 0                  # KV cache bytes (all caches: SWA and full), K + V
    k: int = 0                   # of which K
    v: int = 0                   # of which V
    kv_other: int = 0            # the caches' other tensors (K centring)
    compute: int = 0             # compute buffer bytes
    output: int = 0              # logits/embeddings output buffer
    model: int = 0               # weights, all buffers (llama_rq_memory.model)
    error: str = ""              # why llama.cpp refused this cache type here


@dataclass
class DryRun:
    """What llama.cpp would allocate for one GGUF (or skeleton) under the server's parameters."""

    placement: dict[str, list[str]]          # buffer type -> tensor names (a tied output's own copy appears twice)
    contexts: dict[str, ContextCost]
    seconds: float


_LOG_LOCK = threading.Lock()
GGML_LOG_LEVEL_ERROR = 4         # ggml.h: enum ggml_log_level


@contextlib.contextmanager
def captured_log() -> Iterator[list[str]]:
    """llama.cpp's log, kept from the terminal and collected (error lines marked, for :func:`errors`)."""
    import llama_cpp as L  # lazy: loads the patched libllama: needs the build

    lines: list[str] = []

    @L.llama_log_callback
    def cb(level: int, text: bytes, _ud: Any) -> None:
        lines.append(("\x00E" if level == GGML_LOG_LEVEL_ERROR else "") + text.decode("utf-8", errors="replace"))

    with _LOG_LOCK:
        L.llama_log_set(cb, ctypes.c_void_p(0))
        try:
            yield lines
        finally:
            from llama_cpp import _logger  # lazy: loads the patched libllama: needs the build

            L.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def _unprefixed(line: str) -> str:
    """``"llama_model_load: error loading ..."`` -> ``"error loading ..."`` (the function name dropped)."""
    head, sep, rest = line.partition(": ")
    return rest if sep and head and all(c.islower() or c == "_" for c in head) else line


def errors(lines: list[str]) -> str:
    """Why llama.cpp failed, for the user: its error lines, else its last line, without function-name prefixes."""
    bad = [ln[2:].strip() for ln in lines if ln.startswith("\x00E") and ln[2:].strip()]
    generic = ("failed to initialize the context", "failed to create context", "failed to load model")
    bad = [b for b in bad if not any(g in b for g in generic)] or bad
    if not bad:
        bad = [ln.strip() for ln in lines if ln.strip()][-1:]
    return "; ".join(dict.fromkeys(_unprefixed(b) for b in bad))[:400]


def memory(ctx: Any) -> dict[str, int]:
    """``llama_rq_get_memory(ctx)``: bytes a context allocated (or, no_alloc, would), by kind."""
    import llama_cpp as L  # lazy: loads the patched libllama: needs the build

    m = L.llama_rq_get_memory(ctx)
    return {f: int(getattr(m, f)) for f, _ in L.llama_rq_memory._fields_}


class NoAllocModel:
    """A model loaded by llama.cpp with ``no_alloc`` (metadata only): where each tensor would live, and
    what a context of any size and cache type would allocate. Use as a context manager."""

    def __init__(self, gguf: Path) -> None:
        self.gguf = Path(gguf)
        self._placement: dict[str, list[str]] | None = None
        self._model: Any = None
        self._log: Any = None
        self._model_bytes = -1   # llama_rq_memory.model, from the first context
        self.lines: list[str] = []

    def __enter__(self) -> "NoAllocModel":
        import llama_cpp as L  # lazy: loads the patched libllama: needs the build

        lib = ggml._ggml()
        lib.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p

        class Override(ctypes.Structure):
            _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]

        # every tensor through the CPU buffer list: the same choice llama.cpp makes on a CPU-only
        # machine (CPU = memory-mapped, CPU_REPACK = copied)
        self._ov = (Override * 2)()
        self._ov[0].pattern, self._ov[0].buft = b".", lib.ggml_backend_cpu_buffer_type()
        mp = L.llama_model_default_params()
        mp.no_alloc = True
        mp.load_mode = L.LLAMA_LOAD_MODE_NONE
        mp.n_gpu_layers = 0
        mp.tensor_buft_overrides = ctypes.cast(self._ov, ctypes.c_void_p)
        self._log = captured_log()
        self.lines = self._log.__enter__()
        try:
            self._model = L.llama_model_load_from_file(str(self.gguf).encode(), mp)
            if not self._model:
                raise PlanError(f"llama.cpp cannot load {self.gguf.name}: {errors(self.lines) or 'no reason given'}",
                                fix="is the architecture one this llama.cpp supports? (llama-cli -m FILE shows "
                                    "its full log)")
        except BaseException:
            self._log.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        import llama_cpp as L  # lazy: loads the patched libllama: needs the build

        if self._model:
            L.llama_model_free(self._model)
            self._model = None
        self._log.__exit__(*exc)

    @property
    def placement(self) -> dict[str, list[str]]:
        """Buffer type -> names of the tensors llama.cpp placed there (``llama_rq_model_tensor_buft``).

        A tied output (no ``output.weight``) reads ``token_embd.weight``; when the buffer type chosen for the
        output's matrix multiplication differs from the embeddings' (a repacking type), llama.cpp gives it its own
        copy under the same name, which a lookup by name does not see. The weights' total
        (``llama_rq_memory.model``) does: that copy is listed once more, under the repacking buffer type.
        """
        if self._placement is None:
            import llama_cpp as L  # lazy: loads the patched libllama: needs the build

            tensors = {t.name: t for t in gguf_io.read_header(self.gguf).tensors}
            placed: dict[str, list[str]] = {}
            for name in tensors:
                buft = L.llama_rq_model_tensor_buft(self._model, name.encode())
                if buft is not None:
                    placed.setdefault(buft.decode(), []).append(name)
            if TIED in tensors and "output.weight" not in tensors and any(TIED in v for v in placed.values()):
                if self._model_bytes < 0:
                    self.context("f16", 256)
                unique = sum(tensors[n].nbytes for names in placed.values() for n in names)
                extra = self._model_bytes - unique
                if extra >= tensors[TIED].nbytes // 2:
                    placed.setdefault(_repack_buft(placed), []).append(TIED)
            self._placement = placed
        return self._placement

    def context(self, spec: str, n_ctx: int, *, n_seq: int = 1, n_batch: int = N_BATCH, n_ubatch: int = N_UBATCH,
                n_outputs: int | None = None, swa_full: bool = False) -> ContextCost:
        """What llama_init_from_model allocates for cache type ``spec`` (KV, compute, output buffers).

        ``n_outputs``: output rows the compute graph is reserved for. llama-server reserves for n_batch
        (its buffer is that large, but only virtually) and asks for one row of logits per sequence, so
        the pages it touches are those of a graph with ``n_seq`` outputs: the default here. ``swa_full``: SWA
        layers hold the whole context too (llama_context_default_params' choice; llama-server's is False).
        """
        import llama_cpp as L  # lazy: loads the patched libllama: needs the build

        k, v = kvtypes.split(spec)
        cost = ContextCost(spec, n_ctx)
        try:
            tk, tv = ggml.type_from_name(k), ggml.type_from_name(v)
        except ggml.RQTypeError as e:
            raise PlanError(f"KV spec {spec!r}: {e}") from None
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_ubatch, n_seq
        cp.type_k, cp.type_v = tk, tv
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        # llama-server's choices: SWA caches sized to the window, one stream per slot (--parallel N)
        cp.swa_full, cp.kv_unified, cp.no_perf = swa_full, False, True
        layers = kvtypes.layer_types(spec)
        cp.kv_layer_types = layers.encode() if layers else None  # read while the context is built, below
        cp.n_threads = cp.n_threads_batch = 1
        cp.n_outputs_max = n_outputs or n_seq
        # K centring is a setting of the context (llama_context_params.k_center): "+calib" specs use the
        # model's calibration, the others run without it; the recent window is the spec's ("+wN"; none without)
        context.apply(cp, k_center="auto" if kvtypes.k_center(spec) else "off", window=kvtypes.window(spec))
        n0 = len(self.lines)
        ctx = L.llama_init_from_model(self._model, cp)
        if not ctx:
            cost.error = errors(self.lines[n0:]) or "llama_init_from_model failed"
            return cost
        try:
            m = memory(ctx)
        finally:
            L.llama_free(ctx)
        cost.k, cost.v, cost.kv_other = m["kv_k"], m["kv_v"], m["kv_other"]
        cost.kv = cost.k + cost.v
        cost.compute, cost.output, cost.model = m["compute"], m["output"], m["model"]
        if self._model_bytes < 0:
            self._model_bytes = cost.model
        return cost


def _repack_buft(placed: dict[str, list[str]]) -> str:
    """The buffer type a tied output's own copy went to: the repacking type the model's other tensors use, else
    the CPU backend's (its only extra buffer type on a machine without AMX or KleidiAI)."""
    extra = [b for b in placed if b != "CPU"]
    return extra[0] if len(extra) == 1 else "CPU_REPACK"


def dry_run(gguf: Path, specs: Sequence[str], *, n_ctx: int, n_seq: int = 1) -> DryRun:
    """llama.cpp's own memory accounting for ``gguf`` and each cache type (no tensor data is read)."""
    t0 = time.perf_counter()
    with NoAllocModel(gguf) as m:
        contexts = {spec: m.context(spec, n_ctx, n_seq=n_seq) for spec in specs}
        placement = m.placement
    return DryRun(placement, contexts, time.perf_counter() - t0)


def kv_bits_per_value(gguf: Path, specs: list[str], n_ctx: int = 4096) -> dict[str, float]:
    """Bits per cached K/V value of each cache spec on this model: its K+V bytes over the values they hold (an F32
    cache's bytes / 4), every layer holding the whole context (so: the average over layers, weighted by each
    layer's K/V width, per-layer types included), plus a recent window's F16 copies ("+wN": N more positions at 16
    bits, counted on every layer). Dry contexts: nothing is allocated."""
    with NoAllocModel(gguf) as m:
        f32 = m.context("f32", n_ctx, swa_full=True)
        if f32.error:
            raise PlanError(f"{gguf.name}: {f32.error}")
        out = {}
        for spec in specs:
            c = m.context(spec, n_ctx, swa_full=True)
            if c.error:
                raise PlanError(f"KV spec {spec!r}: {c.error}")
            out[spec] = 32.0 * c.kv / f32.kv + 16.0 * min(kvtypes.window(spec), n_ctx) / n_ctx
        return out


def kv_bits_or_none(gguf: Path, specs: list[str], n_ctx: int, progress=print) -> dict[str, float]:
    """kv_bits_per_value for a measurement's rows, which still run when the dry contexts cannot be made: the
    rows then record no bits (and the log says why)."""
    try:
        return kv_bits_per_value(gguf, specs, n_ctx)
    except PlanError as e:
        progress(f"[rq-eval] bits/value not recorded: {e}")
        return {}
