"""ctypes access to the patched ggml that llama_cpp loads: type ids, (de)quantisation, counters.

llama_cpp loads ``llama_cpp/lib/libllama.so``; set-up points that folder at our build, so the
``libggml-base.so`` opened here is the very library llama_cpp uses (the dynamic loader hands back
the already-loaded object), and the counters read here are the ones its attention increments.
"""

from __future__ import annotations

import ctypes
import functools
import os
from enum import IntEnum
from pathlib import Path
from types import ModuleType

import numpy as np

from rotaryquant import kvtypes
from rotaryquant.errors import MissingBuildError, RQError


class RQTypeError(RQError, ValueError):
    """An unknown ggml type name (a ValueError too: callers that parse types catch that)."""


class GGMLType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ3_XXS = 18
    IQ4_NL = 20
    IQ3_S = 21
    IQ4_XS = 23
    BF16 = 30
    ISOQUANT3_0 = 240
    ITQ3_S = 241
    ISOQUANT4_0 = 244
    ISOQUANT3_64 = 245  # the 64-value-block siblings (head size 64)
    ISOQUANT4_64 = 246


# the order of enum ggml_rq_counter
COUNTERS = ("iso_dequant_rows", "iso_fused_calls", "iso_fallback_calls", "iso_quant_rows", "iso_avx512_calls",
            "iso_split_calls")
ISO_VARIANTS = ("v3", "v2", "v1", "none")


def load_llama_cpp() -> ModuleType:
    """The llama_cpp package set-up installs over our build; MissingBuildError when it cannot be loaded."""
    try:
        import llama_cpp  # lazy: loads libllama and, through it, libggml* (needs the build)
    except (ImportError, OSError, RuntimeError) as e:  # not installed, or its shared libraries missing
        raise MissingBuildError(f"the patched llama_cpp cannot be loaded ({type(e).__name__}: {e})") from e
    return llama_cpp


def lib_dir() -> Path:
    """The folder llama_cpp loads its shared libraries from."""
    return Path(load_llama_cpp().__file__).resolve().parent / "lib"


@functools.cache
def _ggml() -> ctypes.CDLL:
    lib = lib_dir()
    try:
        # libggml.so pulls in libggml-base and libggml-cpu (ggml_quantize_chunk & co. live in ggml-base)
        base = ctypes.CDLL(str(lib / "libggml-base.so"))
        ctypes.CDLL(str(lib / "libggml-cpu.so"))
    except OSError as e:
        raise MissingBuildError(f"the patched ggml libraries cannot be loaded from {lib} ({e})") from e
    if not hasattr(base, "ggml_rq_version"):
        raise MissingBuildError(f"{lib}/libggml-base.so is not the RotaryQuant build (no ggml_rq_version)")
    base.ggml_rq_version.restype = ctypes.c_int
    base.ggml_rq_counter_get.restype = ctypes.c_uint64
    base.ggml_rq_counter_get.argtypes = [ctypes.c_int]
    base.ggml_rq_counter_name.restype = ctypes.c_char_p
    base.ggml_rq_counter_name.argtypes = [ctypes.c_int]
    base.ggml_rq_counters_reset.restype = None
    base.ggml_rq_iso_set_variant.argtypes = [ctypes.c_int]
    base.ggml_rq_iso_get_variant.restype = ctypes.c_int
    base.ggml_rq_iso_set_skip_inverse.argtypes = [ctypes.c_bool]
    base.ggml_rq_cpu_set_avx512.argtypes = [ctypes.c_bool]
    base.ggml_rq_cpu_get_avx512.restype = ctypes.c_bool
    avx = os.environ.get("GGML_RQ_CPU_AVX512", "")
    if avx:  # as llama.cpp's tools read it (common-rq.cpp)
        base.ggml_rq_cpu_set_avx512(avx != "0")
    base.ggml_rq_cpu_set_split.argtypes = [ctypes.c_bool]
    base.ggml_rq_cpu_get_split.restype = ctypes.c_bool
    if os.environ.get("GGML_RQ_CPU_SPLIT", "") == "0":  # a benchmark's A/B: the same bits either way
        base.ggml_rq_cpu_set_split(False)
    base.ggml_rq_tensor_offset.restype = ctypes.c_size_t
    base.ggml_rq_tensor_offset.argtypes = [ctypes.c_char_p]
    base.ggml_type_name.restype = ctypes.c_char_p
    base.ggml_type_name.argtypes = [ctypes.c_int]
    base.ggml_blck_size.restype = ctypes.c_int64
    base.ggml_blck_size.argtypes = [ctypes.c_int]
    base.ggml_row_size.restype = ctypes.c_size_t
    base.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    base.ggml_quantize_chunk.restype = ctypes.c_size_t
    base.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    base.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    base.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    base.ggml_get_type_traits.restype = ctypes.c_void_p
    if hasattr(base, "ggml_rq_iso_roundtrip"):
        base.ggml_rq_iso_roundtrip.restype = None
        base.ggml_rq_iso_roundtrip.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    if hasattr(base, "ggml_rq_quantize_itq3_s_xtx"):
        base.ggml_rq_quantize_itq3_s_xtx.restype = ctypes.c_size_t
        base.ggml_rq_quantize_itq3_s_xtx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                     ctypes.c_void_p]
    base.ggml_get_type_traits.argtypes = [ctypes.c_int]
    return base


def rq_version() -> int:
    return int(_ggml().ggml_rq_version())


def type_from_name(name: str) -> int:
    """ggml type id from its name as ggml spells it (``isoquant3_0``, ``q8_0``, ``itq3_s`` ...)."""
    ids = _type_ids()
    try:
        return ids[name.strip().lower()]
    except KeyError:
        raise RQTypeError(f"unknown ggml type {name!r}; known: {', '.join(sorted(ids))}") from None


@functools.cache
def _type_count() -> int:
    return int(load_llama_cpp().GGML_TYPE_COUNT)


@functools.cache
def _type_ids() -> dict[str, int]:
    out = {}
    for t in range(_type_count()):
        tn = _ggml().ggml_type_name(t)
        if tn and _ggml().ggml_blck_size(t) > 0 and b" " not in tn:
            out[tn.decode().lower()] = t
    return out


def validate_kv_spec(spec: str) -> str:
    """``spec`` (a KV-cache spec, :mod:`rotaryquant.kvtypes`) when every type it names is one of this ggml's;
    RQTypeError naming the first that is not."""
    for t in kvtypes.type_names(spec):
        type_from_name(t)
    return spec


def type_names() -> tuple[str, ...]:
    return tuple(_ggml().ggml_type_name(t).decode() for t in _type_ids().values())


def type_name(t: int) -> str:
    tn = _ggml().ggml_type_name(int(t))
    if not tn:
        raise RQTypeError(f"unknown ggml type id {t}")
    return tn.decode()


def row_size(t: int, n: int) -> int:
    return int(_ggml().ggml_row_size(int(t), int(n)))


def quantize(x: np.ndarray, t: int, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Quantise rows of ``x`` (2-D float32, shape (nrows, n_per_row)) with ggml's own quantiser."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    nrows, n = x.shape
    blck = int(_ggml().ggml_blck_size(int(t)))
    if blck <= 0 or n % blck:
        raise ValueError(f"rows of {n} values are not a multiple of {type_name(t)}'s block size {blck}")
    if imatrix is None and _ggml().ggml_quantize_requires_imatrix(int(t)):
        raise ValueError(f"{type_name(t)} needs an importance matrix")
    out = np.empty((nrows, row_size(t, n)), dtype=np.uint8)
    im = None
    if imatrix is not None:
        imatrix = np.ascontiguousarray(imatrix, dtype=np.float32)
        if imatrix.shape != (n,):
            raise ValueError(f"imatrix has shape {imatrix.shape}, expected ({n},)")
        im = imatrix.ctypes.data
    done = _ggml().ggml_quantize_chunk(int(t), x.ctypes.data, out.ctypes.data, 0, nrows, n, im)
    assert done == out.nbytes
    return out


def quantize_itq3_s_xtx(x: np.ndarray, xtx: np.ndarray | None) -> np.ndarray:
    """ITQ3_S rows of ``x`` ((nrows, n) float32, n % 256 == 0) quantised with LDLQ against the input Gram
    matrices ``xtx`` ((n/256, 256, 256) float32: per 256-column block sum_t x_t x_t^T, raw sums, the original
    domain); None gives the plain quantiser. Returns (nrows, n/256*100) uint8."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2 or x.shape[1] % 256:
        raise ValueError(f"ITQ3_S rows must be (nrows, n) with n a multiple of 256, got shape {x.shape}")
    nrows, n = x.shape
    ptr = None
    if xtx is not None:
        xtx = np.ascontiguousarray(xtx, dtype=np.float32)
        if xtx.shape != (n // 256, 256, 256):
            raise ValueError(f"xtx has shape {xtx.shape}, expected ({n // 256}, 256, 256) for rows of {n} values")
        ptr = xtx.ctypes.data
    lib = _ggml()
    if not hasattr(lib, "ggml_rq_quantize_itq3_s_xtx"):
        raise MissingBuildError("this libggml-base has no ggml_rq_quantize_itq3_s_xtx (an older build)")
    out = np.empty((nrows, row_size(GGMLType.ITQ3_S, n)), dtype=np.uint8)
    done = lib.ggml_rq_quantize_itq3_s_xtx(x.ctypes.data, out.ctypes.data, nrows, n, ptr)
    assert done == out.nbytes
    return out


class _TypeTraits(ctypes.Structure):
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


def dequantize(q: np.ndarray, t: int, n_per_row: int) -> np.ndarray:
    """Dequantise packed rows (uint8, shape (nrows, row_size)) with ggml's to_float."""
    q = np.ascontiguousarray(q, dtype=np.uint8)
    if q.ndim == 1:
        q = q[None, :]
    if q.shape[1] != row_size(t, n_per_row):
        raise ValueError(f"packed rows of {q.shape[1]} bytes do not hold {n_per_row} {type_name(t)} values")
    traits = _TypeTraits.from_address(_ggml().ggml_get_type_traits(int(t)))
    if not traits.to_float:
        raise ValueError(f"{type_name(t)} has no to_float")
    out = np.empty((q.shape[0], n_per_row), dtype=np.float32)
    _TO_FLOAT(traits.to_float)(q.ctypes.data, out.ctypes.data, q.shape[0] * n_per_row)
    return out


def iso_roundtrip(x: np.ndarray, t: int) -> np.ndarray:
    """``x`` (float32, last axis a multiple of the block) through IsoQuant type ``t``'s quantiser and back, as a cache
    stores and reads it, without counting rows (ggml_rq_iso_roundtrip): the counters keep telling which path ran."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    blck = int(_ggml().ggml_blck_size(int(t)))
    if type_name(t) not in kvtypes.ISO_TYPES or x.shape[-1] % blck:
        raise ValueError(f"{type_name(t)} is not an IsoQuant type, or rows of {x.shape[-1]} values are not whole blocks")
    lib = _ggml()
    if not hasattr(lib, "ggml_rq_iso_roundtrip"):
        raise MissingBuildError("this libggml-base has no ggml_rq_iso_roundtrip (an older build)")
    out = np.empty_like(x)
    lib.ggml_rq_iso_roundtrip(int(t), x.ctypes.data, out.ctypes.data, x.size)
    return out


# --- counters and switches ------------------------------------------------------------------

def counters() -> dict[str, int]:
    """Process-wide IsoQuant kernel counters (ggml-rq.h); a context's deferred-prefill ones: context.kv_stats."""
    lib = _ggml()
    return {COUNTERS[i]: int(lib.ggml_rq_counter_get(i)) for i in range(len(COUNTERS))}


def reset_counters() -> None:
    _ggml().ggml_rq_counters_reset()


def set_iso_variant(variant: str) -> None:
    """Research switch: rotation variant (v3 = the type; v2/v1/none = Table 8 ablations)."""
    if variant not in ISO_VARIANTS:
        raise ValueError(f"unknown IsoQuant variant {variant!r}; choose from {', '.join(ISO_VARIANTS)}")
    _ggml().ggml_rq_iso_set_variant(ISO_VARIANTS.index(variant))


def iso_variant() -> str:
    return ISO_VARIANTS[int(_ggml().ggml_rq_iso_get_variant())]


def set_iso_skip_inverse(skip: bool) -> None:
    """Research switch: fused attention leaves its output rotated (the paper's 'no inverse' ablation)."""
    _ggml().ggml_rq_iso_set_skip_inverse(bool(skip))


def set_cpu_avx512(allow: bool) -> None:
    """The CPU's AVX-512 IsoQuant attention kernels (VNNI scores, bf16 V) where the CPU has them (the default), or the
    float ones (False): for A/B benchmarks; the environment's GGML_RQ_CPU_AVX512=0 sets False, as in llama.cpp's tools."""
    _ggml().ggml_rq_cpu_set_avx512(bool(allow))


def cpu_avx512() -> bool:
    return bool(_ggml().ggml_rq_cpu_get_avx512())


def set_cpu_split(allow: bool) -> None:
    """Single-token decode with fewer K/V heads than threads splits each head's keys across the threads (the default,
    the same bits), or only the heads' rows (False): for A/B benchmarks; GGML_RQ_CPU_SPLIT=0 in the environment sets
    False."""
    _ggml().ggml_rq_cpu_set_split(bool(allow))


def cpu_split() -> bool:
    return bool(_ggml().ggml_rq_cpu_get_split())
