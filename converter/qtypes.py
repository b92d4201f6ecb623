"""Tensor types: names as llama-quantize spells them, block sizes, llama.cpp's fallback for rows that
do not fit a block, and quantisation of float32 rows to any of them.

Every quantised type, ITQ3_S included, goes through ggml's own ``ggml_quantize_chunk``
(``rotaryquant.bindings.quantize``, what llama-quantize calls; for ITQ3_S byte-identical to the numpy
reference ``rotaryquant.quants.itq3``, and faster); F32/F16 are numpy casts and BF16 rounds to nearest
even (as gguf-py does). ITQ3_S with an ``xtx`` (the inputs' 256x256 Gram blocks, from calibration) goes
through ``ggml_rq_quantize_itq3_s_xtx`` (LDLQ, docs/itq3-design.md §5.3) instead.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from rotaryquant import bindings
from rotaryquant.bindings.ggml import quantize_itq3_s_xtx
from rotaryquant.converter.dtypes import f32_to_bf16_bits
from rotaryquant.converter.errors import ConvertError

QT = GGMLQuantizationType
FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)

# llama.cpp's tensor_type_fallback (src/llama-quant.cpp), including our ITQ3_S row
FALLBACK: dict[QT, QT] = {
    QT.IQ1_S: QT.IQ4_NL, QT.IQ1_M: QT.IQ4_NL, QT.IQ2_XXS: QT.IQ4_NL, QT.IQ2_XS: QT.IQ4_NL,
    QT.IQ2_S: QT.IQ4_NL, QT.IQ3_XXS: QT.IQ4_NL, QT.IQ3_S: QT.IQ4_NL, QT.IQ4_XS: QT.IQ4_NL,
    QT.ITQ3_S: QT.IQ4_NL,
    QT.Q2_K: QT.Q4_0, QT.Q3_K: QT.Q4_0, QT.TQ1_0: QT.Q4_0, QT.TQ2_0: QT.Q4_0,
    QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0,
}
if hasattr(QT, "Q2_0"):
    FALLBACK[QT.Q2_0] = QT.Q4_0

# the ftype llama.cpp would call a file whose weights are mostly this type
_FTYPE_OF: dict[QT, LlamaFileType] = {
    QT.F32: LlamaFileType.ALL_F32, QT.F16: LlamaFileType.MOSTLY_F16, QT.BF16: LlamaFileType.MOSTLY_BF16,
    QT.Q4_0: LlamaFileType.MOSTLY_Q4_0, QT.Q4_1: LlamaFileType.MOSTLY_Q4_1, QT.Q5_0: LlamaFileType.MOSTLY_Q5_0,
    QT.Q5_1: LlamaFileType.MOSTLY_Q5_1, QT.Q8_0: LlamaFileType.MOSTLY_Q8_0, QT.Q2_K: LlamaFileType.MOSTLY_Q2_K,
    QT.Q3_K: LlamaFileType.MOSTLY_Q3_K_M, QT.Q4_K: LlamaFileType.MOSTLY_Q4_K_M,
    QT.Q5_K: LlamaFileType.MOSTLY_Q5_K_M, QT.Q6_K: LlamaFileType.MOSTLY_Q6_K,
    QT.IQ4_NL: LlamaFileType.MOSTLY_IQ4_NL, QT.IQ4_XS: LlamaFileType.MOSTLY_IQ4_XS,
    QT.IQ3_S: LlamaFileType.MOSTLY_IQ3_S, QT.IQ3_XXS: LlamaFileType.MOSTLY_IQ3_XXS,
    QT.IQ2_XXS: LlamaFileType.MOSTLY_IQ2_XXS, QT.IQ2_XS: LlamaFileType.MOSTLY_IQ2_XS,
    QT.IQ2_S: LlamaFileType.MOSTLY_IQ2_S, QT.IQ1_S: LlamaFileType.MOSTLY_IQ1_S,
    QT.IQ1_M: LlamaFileType.MOSTLY_IQ1_M, QT.TQ1_0: LlamaFileType.MOSTLY_TQ1_0,
    QT.TQ2_0: LlamaFileType.MOSTLY_TQ2_0, QT.ITQ3_S: LlamaFileType.MOSTLY_ITQ3_S,
}

# types ggml cannot quantise without an importance matrix (ggml_quantize_requires_imatrix)
NEEDS_IMATRIX = {QT.IQ2_XXS, QT.IQ2_XS, QT.IQ1_S, QT.IQ1_M}
# not usable as a target at all (KV-cache only, integer, or no quantiser)
NOT_TARGETS = {QT.F64, QT.I8, QT.I16, QT.I32, QT.I64, QT.ISOQUANT3_0}


def type_name(t: QT) -> str:
    """The name ggml and llama-quantize print (``q4_K``, ``itq3_s``, ``f16``)."""
    n = t.name.lower()
    return n[:-1] + "K" if n.endswith("_k") else n


def parse_type(name: str, *, what: str = "type") -> QT:
    """A target type from its ggml name, case-insensitive (``q4_k``, ``Q4_K``, ``itq3_s``, ``f16``)."""
    key = name.strip().upper()
    try:
        t = QT[key]
    except KeyError:
        known = ", ".join(sorted(type_name(t) for t in QT if t not in NOT_TARGETS and block_size(t) > 0))
        raise ConvertError(f"unknown {what} {name!r}", fix=f"use one of: {known}") from None
    if t in NOT_TARGETS:
        raise ConvertError(f"{type_name(t)} cannot be used as a weight type", fix="pick a quantised or float type")
    return t


def block_size(t: QT) -> int:
    return int(GGML_QUANT_SIZES[t][0])


def row_bytes(t: QT, n: int) -> int:
    blk, size = GGML_QUANT_SIZES[t]
    return n // blk * size


def fits(t: QT, ncols: int) -> bool:
    return ncols % block_size(t) == 0


def fit_type(t: QT, ncols: int) -> tuple[QT, str | None]:
    """llama.cpp's per-tensor fallback: (type, reason) with reason None when ``t`` fits as is."""
    if fits(t, ncols):
        return t, None
    fb = FALLBACK.get(t)
    if fb is None or not fits(fb, ncols):
        fb = QT.F16
    return fb, f"{ncols} columns not divisible by {type_name(t)}'s block of {block_size(t)} -> {type_name(fb)}"


def file_type_for(weights_per_type: dict[QT, int]) -> LlamaFileType:
    """general.file_type: the ftype of the type holding most weights of the 2-D+ tensors."""
    if not weights_per_type:
        return LlamaFileType.ALL_F32
    top = max(weights_per_type.items(), key=lambda kv: (kv[1], -int(kv[0])))[0]
    return _FTYPE_OF.get(top, LlamaFileType.GUESSED)


# --- quantisation -----------------------------------------------------------------------------------

def _bf16(x: np.ndarray) -> np.ndarray:
    return f32_to_bf16_bits(x).view(np.uint8)


def _rows(x: np.ndarray, t: QT, imatrix: np.ndarray | None, xtx: np.ndarray | None = None) -> np.ndarray:
    if xtx is not None:
        return quantize_itq3_s_xtx(x, xtx)
    return bindings.quantize(x, int(t), imatrix)


def _check_xtx(xtx: np.ndarray, cols: int) -> np.ndarray:
    x = np.ascontiguousarray(xtx, dtype=np.float32)
    if x.shape != (cols // 256, 256, 256):
        raise ConvertError(f"xtx has shape {x.shape}; rows of {cols} values need ({cols // 256}, 256, 256) "
                           "(one 256x256 Gram matrix per 256-column block)")
    return x


def quantize(data: np.ndarray, t: QT, imatrix: np.ndarray | None = None, *, xtx: np.ndarray | None = None,
             threads: int | None = None) -> np.ndarray:
    """Quantise a float tensor (numpy shape (..., rows, cols)) to ``t``.

    Returns what GGUFWriter.add_tensor takes with ``raw_dtype=t``: float32/float16 arrays for F32/F16,
    uint8 bytes of shape (..., rows, row_bytes) otherwise. ``imatrix``: (cols,) or, for a 3-D expert
    tensor, (n_expert, cols) — one importance vector per expert, as llama-quantize applies it.
    ``xtx``: ITQ3_S only, (cols/256, 256, 256) Gram matrices of the matmul's inputs (sums of x x^T per
    256-column block, the original domain), shared by all matrices of a 3-D tensor; it takes precedence over
    ``imatrix`` (which it contains, up to scale, as its diagonal). The bytes do not depend on ``threads``.
    """
    if xtx is not None and t != QT.ITQ3_S:
        raise ConvertError(f"second-order calibration (xtx) is only used by ITQ3_S, not {type_name(t)}",
                           fix="quantise this tensor without xtx, or choose itq3_s")
    if t == QT.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if t == QT.F16:
        return np.ascontiguousarray(data, dtype=np.float16)
    if t == QT.BF16:
        return _bf16(np.asarray(data, dtype=np.float32)).reshape(*data.shape[:-1], data.shape[-1] * 2)
    x = np.asarray(data, dtype=np.float32)
    cols = x.shape[-1]
    if cols % block_size(t):
        raise ConvertError(f"rows of {cols} values do not fit {type_name(t)}'s block of {block_size(t)}")
    if t in NEEDS_IMATRIX and imatrix is None:
        raise ConvertError(f"{type_name(t)} needs an importance matrix", fix="pass --imatrix FILE")
    gram = None if xtx is None else _check_xtx(xtx, cols)
    lead = x.shape[:-2] if x.ndim >= 2 else ()
    mats = x.reshape(-1, *x.shape[-2:]) if x.ndim >= 2 else x.reshape(1, 1, cols)
    n_mat = mats.shape[0]
    im = None
    if imatrix is not None and gram is None:
        im = np.asarray(imatrix, dtype=np.float32).reshape(-1, cols)
        if im.shape[0] not in (1, n_mat):
            raise ConvertError(f"importance matrix has {im.shape[0]} rows for a tensor of {n_mat} matrices")
    out = np.empty((n_mat, mats.shape[1], row_bytes(t, cols)), dtype=np.uint8)
    threads = max(1, threads or os.cpu_count() or 1)
    jobs = []
    step = max(1, -(-mats.shape[1] // threads))
    for e in range(n_mat):
        w = None if im is None else im[e if im.shape[0] > 1 else 0]
        for r0 in range(0, mats.shape[1], step):
            jobs.append((e, r0, min(r0 + step, mats.shape[1]), w))

    def run(job: tuple) -> None:
        e, r0, r1, w = job
        out[e, r0:r1] = _rows(np.ascontiguousarray(mats[e, r0:r1]), t, w, gram)

    if threads == 1 or len(jobs) == 1:
        for j in jobs:
            run(j)
    else:
        with ThreadPoolExecutor(threads) as ex:
            list(ex.map(run, jobs))
    return out.reshape(*lead, mats.shape[1], out.shape[-1]) if x.ndim >= 2 else out.reshape(-1)
