"""Graph capture: the one way our code reads tensors of a llama.cpp forward pass (the ``cb_eval`` hook).

Every collector goes through :class:`EvalCallback`: :func:`capture` here (layer-by-layer comparisons of
code paths on a real model), rq-calibrate's K statistics (``converter.kcenter``) and the ITQ3_S Gram
matrices (``converter.calibration``). The callback hands them a :class:`Node`, a view of one
``struct ggml_tensor`` through the ctypes mirror :class:`GGMLTensor`; nothing else reads that struct.

The mirror is checked against the build: the patched libggml-base exports ``ggml_rq_tensor_offset(field)``
(``offsetof`` as compiled, ``sizeof`` for "sizeof"), and :func:`check_layout` compares the size and every
field's offset. It runs once, on first use (:func:`lib`), not at import: loading the libraries imports
llama_cpp (a second or more, and a MissingBuildError without a build), and the converter and planner
import this module without always running a model.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rotaryquant.bindings import context as _ctx
from rotaryquant.bindings import ggml as _g
from rotaryquant.errors import RQError

# ggml.h
GGML_MAX_DIMS, GGML_MAX_OP_PARAMS, GGML_MAX_SRC, GGML_MAX_NAME = 4, 64, 10, 64
_SIZE_MAX = (1 << (8 * ctypes.sizeof(ctypes.c_size_t))) - 1  # ggml_rq_tensor_offset: unknown field


class GGMLTensor(ctypes.Structure):
    """struct ggml_tensor (ggml/include/ggml.h), field for field; checked by :func:`check_layout`."""

    _fields_ = [
        ("type", ctypes.c_int),                                   # enum ggml_type
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),                                     # enum ggml_op
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class LayoutError(RQError):
    """The ctypes mirror of struct ggml_tensor and the compiled library disagree."""


_LAYOUT_FIX = ("re-run set-up (`make setup`) if the library is older than the headers; if ggml.h changed, "
               "update GGMLTensor in bindings/capture.py to match it")


def check_layout(base: Any, mirror: type[ctypes.Structure] = GGMLTensor) -> None:
    """LayoutError unless every field of ``mirror`` sits where the build's ``ggml_rq_tensor_offset``
    says, and the sizes match. ``base``: libggml-base (anything with ``ggml_rq_tensor_offset``)."""
    offset = base.ggml_rq_tensor_offset
    for name, *_ in mirror._fields_:
        built, mine = offset(name.encode()), getattr(mirror, name).offset
        if built == _SIZE_MAX:
            raise LayoutError(f"struct ggml_tensor: the mirror has a field {name!r} the build does not know: "
                              "the build and the mirror disagree", _LAYOUT_FIX)
        if built != mine:
            raise LayoutError(f"struct ggml_tensor.{name}: the build puts it at byte {built}, the ctypes mirror "
                              f"at byte {mine}: the build and the mirror disagree", _LAYOUT_FIX)
    built, mine = offset(b"sizeof"), ctypes.sizeof(mirror)
    if built != mine:
        raise LayoutError(f"struct ggml_tensor: sizeof is {built} bytes in the build, {mine} in the ctypes mirror: "
                          "the build and the mirror disagree", _LAYOUT_FIX)


@functools.cache
def lib() -> ctypes.CDLL:
    """libggml-base with the calls the collectors use, its struct layout checked (once, on first use)."""
    base = _g._ggml()  # MissingBuildError without the build
    base.ggml_nbytes.restype = ctypes.c_size_t
    base.ggml_nbytes.argtypes = [ctypes.c_void_p]
    base.ggml_is_contiguous.restype = ctypes.c_bool
    base.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
    base.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    base.ggml_op_name.restype = ctypes.c_char_p
    base.ggml_op_name.argtypes = [ctypes.c_int]
    check_layout(base)
    return base


@functools.cache
def op_id(name: str) -> int:
    """enum ggml_op value of an op name ("MUL_MAT")."""
    base = lib()
    return next(i for i in range(200) if base.ggml_op_name(i) == name.encode())  # stops at the match


class Node:
    """One ``struct ggml_tensor`` seen by the callback: its fields through the checked mirror (``.t``), its
    data read on demand (a collector may want a source's data, not the node's: matmul inputs)."""

    __slots__ = ("addr", "t")

    def __init__(self, addr: int) -> None:
        self.addr = addr
        self.t = GGMLTensor.from_address(addr)

    @property
    def name(self) -> str:
        return self.t.name.decode(errors="replace")

    @property
    def type(self) -> int:
        return int(self.t.type)

    @property
    def op(self) -> int:
        return int(self.t.op)

    @property
    def ne(self) -> tuple[int, int, int, int]:
        return tuple(self.t.ne)  # type: ignore[return-value]

    def src(self, i: int) -> Node | None:
        p = self.t.src[i]
        return Node(p) if p else None

    def is_contiguous(self) -> bool:
        return bool(lib().ggml_is_contiguous(self.addr))

    def f32(self) -> np.ndarray | None:
        """An F32 tensor as [ne3, ne2, ne1, ne0] (strided views included, copied); None for other types."""
        if self.type != _g.GGMLType.F32:
            return None
        base = lib()
        span = base.ggml_nbytes(self.addr)
        raw = np.empty(span, np.uint8)
        base.ggml_backend_tensor_get(self.addr, raw.ctypes.data, 0, span)
        buf = raw.view(np.float32) if span % 4 == 0 else raw[: span - span % 4].view(np.float32)
        arr = np.lib.stride_tricks.as_strided(buf, shape=self.ne[::-1], strides=tuple(self.t.nb)[::-1],
                                              writeable=False)
        return np.array(arr, np.float32)


class EvalCallback:
    """A ``cb_eval`` for ``llama_context_params``: ``want(node)`` picks nodes in the scheduler's ask phase,
    ``take(node)`` receives each picked node once it is computed. An exception in either is kept and stops
    the graph (llama_decode then fails); :meth:`raise_pending` raises it. Keep the object alive as long as
    the context (it owns the C function pointer)."""

    def __init__(self, want: Callable[[Node], bool], take: Callable[[Node], Any]) -> None:
        lib()  # first: without the build this is a MissingBuildError, not an ImportError; checks the layout
        import llama_cpp as L  # lazy: loads the patched libllama: needs the build

        self.want, self.take = want, take
        self.errors: list[BaseException] = []
        self.c_fn = L.ggml_backend_sched_eval_callback(self._cb)

    def _cb(self, t: int, ask: bool, _ud: int) -> bool:
        try:
            n = Node(t)
            if ask:
                return bool(self.want(n))
            self.take(n)
            return True
        except BaseException as e:  # noqa: BLE001 (ctypes would print and swallow it)
            self.errors.append(e)
            return False

    def install(self, cparams: Any) -> None:
        cparams.cb_eval, cparams.cb_eval_user_data = self.c_fn, None

    def raise_pending(self) -> None:
        if self.errors:
            raise self.errors[0]


def _decode(L, ctx, toks, n: int, positions: Sequence[tuple[int, int]] | None) -> int:
    if positions is None:
        return L.llama_decode(ctx, L.llama_batch_get_one(toks, n))
    if len(positions) != n:
        raise ValueError(f"{len(positions)} positions for {n} tokens")
    b = L.llama_batch_init(n, 0, 1)
    try:
        for i, (p, s) in enumerate(positions):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = toks[i], p, 1, i + 1 == n
            b.seq_id[i][0] = s
        b.n_tokens = n
        return L.llama_decode(ctx, b)
    finally:
        L.llama_batch_free(b)


def capture(model: Path | str, prompt: str | list[int], names: Iterable[str], *, type_k: int, type_v: int,
            iso_unfused: bool = False, k_center: str = "auto", n_ctx: int = 512,
            threads: int = 2, kv_window: int | None = None,
            positions: Sequence[tuple[int, int]] | None = None) -> dict[str, np.ndarray]:
    """Run the prompt (text, or token ids decoded as one batch) once; return the contiguous F32 tensors whose
    names start with one of ``names`` (flat, the first of each name). ``positions``: (position, sequence) of each
    token id, for a batch of several sequences at positions of their own (else one sequence from 0)."""
    prefixes = tuple(names)
    out: dict[str, np.ndarray] = {}

    def take(n: Node) -> None:
        if n.type == _g.GGMLType.F32 and n.is_contiguous():
            out.setdefault(n.name, n.f32().reshape(-1))

    cb = EvalCallback(lambda n: n.name.startswith(prefixes), take)
    import llama_cpp as L  # lazy: loads the patched libllama: needs the build

    model_p = L.llama_model_load_from_file(str(model).encode(), L.llama_model_default_params())
    if not model_p:
        raise RuntimeError(f"could not load {model}")
    try:
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_threads, cp.n_threads_batch = n_ctx, threads, threads
        if not isinstance(prompt, str):
            cp.n_batch = cp.n_ubatch = max(len(prompt), 1)
        if positions is not None:
            cp.n_seq_max = max(s for _, s in positions) + 1
        cp.type_k, cp.type_v = type_k, type_v
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cb.install(cp)
        _ctx.apply(cp, unfused=iso_unfused, k_center=k_center, window=kv_window)
        ctx = L.llama_init_from_model(model_p, cp)
        if not ctx:
            raise RuntimeError("llama_init_from_model failed (see the log above)")
        try:
            if isinstance(prompt, str):
                vocab = L.llama_model_get_vocab(model_p)
                data = prompt.encode()
                toks = (L.llama_token * (len(data) + 8))()
                n = L.llama_tokenize(vocab, data, len(data), toks, len(toks), True, False)
            else:
                toks, n = (L.llama_token * len(prompt))(*prompt), len(prompt)
            rc = _decode(L, ctx, toks, n, positions)
            cb.raise_pending()
            if rc != 0:
                raise RuntimeError("llama_decode failed")
        finally:
            L.llama_free(ctx)
    finally:
        L.llama_model_free(model_p)
    return out
