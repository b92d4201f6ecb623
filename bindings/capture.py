"""Capture named intermediate tensors of one llama.cpp forward pass (the ``cb_eval`` hook).

Used to compare code paths layer by layer on a real model: e.g. the fused and unfused IsoQuant
attention must give the same layer-0 attention output, since layer 0 sees identical inputs.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from rotaryquant.bindings import ggml as _g


def _base() -> ctypes.CDLL:
    lib = _g._ggml()
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_nelements.restype = ctypes.c_int64
    lib.ggml_nelements.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_is_contiguous.restype = ctypes.c_bool
    lib.ggml_is_contiguous.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    return lib


def capture(model: Path | str, prompt: str, names: Iterable[str], *, type_k: int, type_v: int,
            iso_unfused: bool = False, n_ctx: int = 512, threads: int = 2) -> dict[str, np.ndarray]:
    """Run the prompt once; return the F32 tensors whose names start with one of ``names``."""
    import llama_cpp as L

    lib = _base()
    prefixes = tuple(names)
    out: dict[str, np.ndarray] = {}

    def cb(t: int, ask: bool, _ud: int) -> bool:
        name = lib.ggml_get_name(t).decode()
        if ask:
            return name.startswith(prefixes)
        # enum ggml_type is the first field of struct ggml_tensor
        if ctypes.c_int.from_address(t).value == _g.GGMLType.F32 and lib.ggml_is_contiguous(t):
            buf = np.empty(lib.ggml_nelements(t), np.float32)
            lib.ggml_backend_tensor_get(t, buf.ctypes.data, 0, lib.ggml_nbytes(t))
            out.setdefault(name, buf)
        return True

    cb_c = L.ggml_backend_sched_eval_callback(cb)
    was = _g.iso_unfused()
    _g.set_iso_unfused(iso_unfused)
    model_p = L.llama_model_load_from_file(str(model).encode(), L.llama_model_default_params())
    if not model_p:
        raise RuntimeError(f"could not load {model}")
    try:
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_threads, cp.n_threads_batch = n_ctx, threads, threads
        cp.type_k, cp.type_v = type_k, type_v
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cp.cb_eval, cp.cb_eval_user_data = cb_c, None
        ctx = L.llama_init_from_model(model_p, cp)
        if not ctx:
            raise RuntimeError("llama_init_from_model failed (see the log above)")
        try:
            vocab = L.llama_model_get_vocab(model_p)
            data = prompt.encode()
            toks = (L.llama_token * (len(data) + 8))()
            n = L.llama_tokenize(vocab, data, len(data), toks, len(toks), True, False)
            if L.llama_decode(ctx, L.llama_batch_get_one(toks, n)) != 0:
                raise RuntimeError("llama_decode failed")
        finally:
            L.llama_free(ctx)
    finally:
        L.llama_model_free(model_p)
        _g.set_iso_unfused(was)
    return out
