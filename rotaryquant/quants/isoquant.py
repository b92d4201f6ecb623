"""Bit-exact numpy reference of the ISOQUANT3_0 and ISOQUANT4_0 KV-cache block types.

One block packs one 128-float vector (one attention head) into 50 bytes::

    struct block_isoquant3_0 { uint16_t d;       /* IEEE fp16, little endian */
                               uint8_t  qs[48]; /* 128 x 3-bit indices     */ };

The C implementation (compiled with ``-ffp-contract=off``) follows the same
operation order, so both produce identical bytes.  The spec, step by step, is
written next to each helper below and in docs/isoquant-design.md; in short:

quantize
  1. ``ss`` = float64 tree sum of ``double(x_i)^2`` (strides 64, 32, ..., 1).
  2. ``sd = sqrt(ss)``; ``xh_i = float32(double(x_i) / sd)`` (all zero if sd == 0).
  3. ``t_i = xh_i * S_i`` (S = SIGNS, exactly +-1: an exact negation), then the
     float32 unnormalised Walsh-Hadamard butterflies, then ``* WHT_SCALE``.
  4. per group g of 4: ``y[4g+r] = ((M[g][r][0]*u0 + M[g][r][1]*u1) + M[g][r][2]*u2)
     + M[g][r][3]*u3`` in float32.
  5. ``idx_i = #{k : y_i > BND[k]}``.
  6. ``d = fp16(float32(min(D, 65504)))`` with ``D`` from ``norm_mode``; the format's
     default is ``"preserve"``: ``D = sd / sqrt(tree(c_i^2))``, ``c_i = double(CB[idx_i])``.
  7. 16 groups of 8 indices -> 24-bit little-endian words -> 3 bytes each.

dequantize
  ``y_i = float32(d) * CB[idx_i]``, transpose SO(4) (same summation order), the same
  WHT butterflies, ``* WHT_SCALE``, then ``* S_i``.

Steps 3 and the WHT part of dequantize apply to the variants that use the WHT
(v3, the format, and the v1 ablation); v2 and none use neither the WHT nor S.
The other norm modes ("raw", "lsq", "unbiased") are kept as research parameters.

ISOQUANT4_0 (``bits=4`` everywhere below) is the same format with the 16-level
codebook CODEBOOK4/BOUNDS4 and 4-bit indices: 66 bytes per block (``d`` then 64 bytes;
group g of 8 indices is the 32-bit little-endian word ``sum_k idx[8g+k] << 4k``, i.e.
two indices per byte, the even one in the low nibble).  The packing rule is one for
both: group g of 8 indices is the ``bits``-byte little-endian word ``sum_k idx << bits*k``.

ISOQUANT3_64 / ISOQUANT4_64 (``qk=64`` everywhere below) are the 64-wide siblings for head size
64: the same steps on 64-value blocks, with the first 64 signs, the first 16 SO(4)/SO(3) groups,
WHT-64 scaled by WHT_SCALE_64 = 1/8, and the Lloyd-Max codebooks of the R^64 marginal
(CODEBOOK_64, CODEBOOK4_64): 26 bytes (3-bit) / 34 bytes (4-bit) per 64 values.

Everything is vectorised over blocks: arrays are ``(nblocks, qk)``.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from rotaryquant.quants import as_blocks

from . import isoquant_tables as _tables

__all__ = [
    "QK", "BLOCK_BYTES", "CODEBOOK", "BOUNDS", "SO4", "SO3", "SIGNS", "WHT_SCALE",
    "BITS", "BLOCK_BYTES4", "CODEBOOK4", "BOUNDS4", "block_bytes", "codebook", "bounds",
    "QKS", "CODEBOOK_64", "BOUNDS_64", "CODEBOOK4_64", "BOUNDS4_64", "WHT_SCALE_64", "fwht",
    "DEFAULT_NORM_MODE",
    "VARIANTS", "NORM_MODES", "Variant", "NormMode",
    "fwht128", "rotate", "rotate_inverse", "pack_indices", "unpack_indices",
    "quantize_blocks", "dequantize_blocks", "quantize_row", "dequantize_row",
    "quantize_indices", "dequantize_indices",
]

QK = 128
BLOCK_BYTES = 2 + QK * 3 // 8  # 50  (ISOQUANT3_0)
BLOCK_BYTES4 = 2 + QK * 4 // 8  # 66 (ISOQUANT4_0)
BITS: tuple[int, ...] = (3, 4)
QKS: tuple[int, ...] = (128, 64)  # block widths: ISOQUANT{3,4}_0 and ISOQUANT{3,4}_64
NGROUPS = QK // 4
FP16_MAX = 65504.0

CODEBOOK = np.asarray(_tables.CODEBOOK, dtype=np.float32)          # (8,)
BOUNDS = np.asarray(_tables.BOUNDS, dtype=np.float32)              # (7,)
CODEBOOK4 = np.asarray(_tables.CODEBOOK4, dtype=np.float32)        # (16,)
BOUNDS4 = np.asarray(_tables.BOUNDS4, dtype=np.float32)            # (15,)
SO4 = np.asarray(_tables.SO4, dtype=np.float32).reshape(NGROUPS, 4, 4)
SO3 = np.asarray(_tables.SO3, dtype=np.float32).reshape(NGROUPS, 4, 4)
SIGNS = np.asarray(_tables.SIGNS, dtype=np.float32)                # (128,) exactly +-1
WHT_SCALE = np.float32(_tables.WHT_SCALE)
CODEBOOK_64 = np.asarray(_tables.CODEBOOK_64, dtype=np.float32)    # (8,)  R^64 marginal
BOUNDS_64 = np.asarray(_tables.BOUNDS_64, dtype=np.float32)
CODEBOOK4_64 = np.asarray(_tables.CODEBOOK4_64, dtype=np.float32)  # (16,)
BOUNDS4_64 = np.asarray(_tables.BOUNDS4_64, dtype=np.float32)
WHT_SCALE_64 = np.float32(_tables.WHT_SCALE_64)
for _a in (CODEBOOK, BOUNDS, CODEBOOK4, BOUNDS4, SO4, SO3, SIGNS, CODEBOOK_64, BOUNDS_64, CODEBOOK4_64, BOUNDS4_64):
    _a.setflags(write=False)

Variant = Literal["v3", "v2", "v1", "none"]
NormMode = Literal["raw", "preserve", "lsq", "unbiased"]
VARIANTS: tuple[str, ...] = ("v3", "v2", "v1", "none")
NORM_MODES: tuple[str, ...] = ("raw", "preserve", "lsq", "unbiased")
DEFAULT_NORM_MODE = "preserve"   # the format; the others are research parameters

_CHUNK = 2048  # blocks per vectorised chunk (cache-sized working set)


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------

def _as_blocks(x, dtype, name="x", qk: int = QK) -> np.ndarray:
    return as_blocks(x, dtype, qk, name)


def _check_qk(qk: int) -> None:
    if qk not in QKS:
        raise ValueError(f"unknown block width {qk!r}; expected one of {QKS}")


def _tree_sum_f64(a: np.ndarray) -> np.ndarray:
    """Fixed-order float64 sum over the last axis (length qk = 128 or 64):
    for s in qk/2, ..., 1: a[i] = a[i] + a[i+s] for i < s.  Returns a[0]."""
    s = a.shape[1] // 2
    while s >= 1:
        a = a[:, :s] + a[:, s:2 * s]
        s //= 2
    return a[:, 0]


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"unknown index width {bits!r}; expected one of {BITS}")


def codebook(bits: int = 3, qk: int = QK) -> np.ndarray:
    """The Lloyd-Max levels of ISOQUANT3_0 (bits=3) or ISOQUANT4_0 (bits=4); qk=64: of the 64-wide types."""
    _check_bits(bits)
    _check_qk(qk)
    if qk == 64:
        return CODEBOOK_64 if bits == 3 else CODEBOOK4_64
    return CODEBOOK if bits == 3 else CODEBOOK4


def bounds(bits: int = 3, qk: int = QK) -> np.ndarray:
    _check_bits(bits)
    _check_qk(qk)
    if qk == 64:
        return BOUNDS_64 if bits == 3 else BOUNDS4_64
    return BOUNDS if bits == 3 else BOUNDS4


def block_bytes(bits: int = 3, qk: int = QK) -> int:
    _check_bits(bits)
    _check_qk(qk)
    return 2 + qk * bits // 8


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; expected one of {VARIANTS}")


# --------------------------------------------------------------------------
# rotations
# --------------------------------------------------------------------------

def fwht(v, qk: int = QK, *, normalize: bool = True) -> np.ndarray:
    """Walsh-Hadamard transform of each row of a (n, qk) float32 array (qk = 128 or 64).

    Butterflies in float32, for len = 1, 2, ..., qk/2: for each pair (j, j+len)
    inside blocks of 2*len: v[j], v[j+len] = a + b, a - b.  With ``normalize``
    the result is then multiplied (float32) by float32(1/sqrt(qk)) (WHT_SCALE,
    WHT_SCALE_64), making the transform orthonormal and (up to rounding) its own inverse.
    """
    _check_qk(qk)
    v = _as_blocks(v, np.float32, qk=qk)
    n = v.shape[0]
    h = 1
    while h < qk:
        w = v.reshape(n, qk // (2 * h), 2, h)
        out = np.empty_like(w)
        np.add(w[:, :, 0, :], w[:, :, 1, :], out=out[:, :, 0, :])
        np.subtract(w[:, :, 0, :], w[:, :, 1, :], out=out[:, :, 1, :])
        v = out.reshape(n, qk)
        h *= 2
    if normalize:
        v = v * (WHT_SCALE if qk == QK else WHT_SCALE_64)
    return v


def fwht128(v, *, normalize: bool = True) -> np.ndarray:
    """:func:`fwht` of (n, 128) rows."""
    return fwht(v, QK, normalize=normalize)


def _block_apply(v: np.ndarray, m: np.ndarray) -> np.ndarray:
    """y[4g+r] = ((m[g,r,0]*u0 + m[g,r,1]*u1) + m[g,r,2]*u2) + m[g,r,3]*u3 (float32); groups
    g < qk/4 (the 64-wide types use the first 16 matrices)."""
    n, qk = v.shape
    m = m[:qk // 4]
    u = v.reshape(n, qk // 4, 1, 4)
    y = m[:, :, 0] * u[..., 0]          # (n, 32, 4): index r on the last axis
    y = y + m[:, :, 1] * u[..., 1]
    y = y + m[:, :, 2] * u[..., 2]
    y = y + m[:, :, 3] * u[..., 3]
    return y.reshape(n, qk)


def _group_matrix(variant: str) -> np.ndarray | None:
    if variant in ("v3", "v2"):
        return SO4
    if variant == "v1":
        return SO3
    return None


def rotate(x, variant: Variant = "v3", qk: int = QK) -> np.ndarray:
    """Forward rotation R of each row of a (n, qk) float32 array (qk = 128 or 64: S[:qk], SO(4)[:qk/4]).

    v3: sign flip S, WHT, then SO(4) blocks (R = SO4 . WHT . diag(S));
    v2: SO(4) blocks only; v1: sign flip S, WHT, then the SO(3) single-quaternion
    conjugation blocks; none: identity.  C: ``t[i] = x[i] * iq3_signs[i]`` before
    the butterflies (exact: S is +-1).
    """
    _check_variant(variant)
    _check_qk(qk)
    v = _as_blocks(x, np.float32, qk=qk)
    if variant in ("v3", "v1"):
        v = fwht(v * SIGNS[:qk], qk)
    m = _group_matrix(variant)
    if m is not None:
        v = _block_apply(v, m)
    return v.copy() if variant == "none" else v


def rotate_inverse(y, variant: Variant = "v3", qk: int = QK) -> np.ndarray:
    """Inverse rotation R^T: transposed blocks (same summation order), then the WHT
    butterflies, ``* WHT_SCALE``, then ``* S`` (v3, v1; C: ``t[i] *= iq3_signs[i]``)."""
    _check_variant(variant)
    _check_qk(qk)
    v = _as_blocks(y, np.float32, qk=qk)
    m = _group_matrix(variant)
    if m is not None:
        v = _block_apply(v, np.ascontiguousarray(m.transpose(0, 2, 1)))
    if variant in ("v3", "v1"):
        v = fwht(v, qk) * SIGNS[:qk]     # the scale multiply first, then the (exact) sign flip
    return v.copy() if variant == "none" else v


# --------------------------------------------------------------------------
# index packing
# --------------------------------------------------------------------------

def pack_indices(idx, bits: int = 3) -> np.ndarray:
    """(n, qk) indices in 0..2^bits-1 -> (n, qk/8*bits) bytes: group gi of 8 indices is the
    (8*bits)-bit little-endian word sum_k idx[8gi+k] << bits*k in qs[bits*gi..bits*gi+bits-1]."""
    _check_bits(bits)
    idx = np.asarray(idx)
    n = idx.shape[0]
    ngroups = idx.shape[1] // 8
    g = idx.reshape(n, ngroups, 8).astype(np.uint32)
    w = np.bitwise_or.reduce(g << (bits * np.arange(8, dtype=np.uint32)), axis=-1)
    qs = np.empty((n, ngroups, bits), dtype=np.uint8)
    for b in range(bits):
        qs[..., b] = (w >> (8 * b)) & 0xFF
    return qs.reshape(n, ngroups * bits)


def unpack_indices(qs, bits: int = 3) -> np.ndarray:
    """(n, qk/8*bits) bytes -> (n, qk) uint8 indices (inverse of pack_indices)."""
    _check_bits(bits)
    qs = np.asarray(qs, dtype=np.uint8)
    n = qs.shape[0]
    ngroups = qs.shape[1] // bits
    b = qs.reshape(n, ngroups, bits).astype(np.uint32)
    w = np.zeros(b.shape[:2], dtype=np.uint32)
    for k in range(bits):
        w |= b[..., k] << (8 * k)
    shifts = bits * np.arange(8, dtype=np.uint32)
    return ((w[..., None] >> shifts) & ((1 << bits) - 1)).astype(np.uint8).reshape(n, 8 * ngroups)


# --------------------------------------------------------------------------
# quantize / dequantize
# --------------------------------------------------------------------------

def quantize_indices(x, *, variant: Variant = "v3", norm_mode: NormMode = DEFAULT_NORM_MODE, bits: int = 3,
                     qk: int = QK) -> tuple[np.ndarray, np.ndarray]:
    """Steps 1-6 of quantize: returns (d as float16 (n,), idx as uint8 (n, qk))."""
    _check_variant(variant)
    _check_bits(bits)
    _check_qk(qk)
    if norm_mode not in NORM_MODES:
        raise ValueError(f"unknown norm_mode {norm_mode!r}; expected one of {NORM_MODES}")
    x = _as_blocks(x, np.float32, qk=qk)
    with np.errstate(all="ignore"):  # inf/NaN inputs follow the C semantics silently
        return _quantize_indices(x, variant, norm_mode, bits, qk)


def _quantize_indices(x: np.ndarray, variant: str, norm_mode: str, bits: int, qk: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    x64 = x.astype(np.float64)

    # 1-2. norm (float64 tree) and normalisation (float64 divide, round to float32).
    # C: xh[i] = sd > 0.0 ? (float)((double)x[i] / sd) : 0.0f   (NaN norm -> zeros)
    sd = np.sqrt(_tree_sum_f64(x64 * x64))
    pos = sd > 0.0
    xh = (x64 / np.where(pos, sd, 1.0)[:, None]).astype(np.float32)
    xh[~pos] = 0.0

    # 3-4. rotation (float32)
    y = rotate(xh, variant, qk)

    # 5. idx = number of boundaries strictly below y
    idx = np.zeros(y.shape, dtype=np.uint8)
    for b in bounds(bits, qk):
        idx += y > b

    # 6. scale in float64, then float64 -> float32 -> fp16 (round to nearest even)
    if norm_mode == "raw":
        dd = sd
    else:
        c64 = codebook(bits, qk)[idx].astype(np.float64)
        if norm_mode == "preserve":        # d = sd / ||c||
            dd = sd / np.sqrt(_tree_sum_f64(c64 * c64))
        else:
            yc = _tree_sum_f64(y.astype(np.float64) * c64)
            if norm_mode == "lsq":         # d = (sd * <y,c>) / <c,c>
                dd = (sd * yc) / _tree_sum_f64(c64 * c64)
            else:                          # unbiased: d = sd / <y,c>  (<x_hat, x> = ||x||^2)
                dd = np.where(yc > 0.0, sd / np.where(yc > 0.0, yc, 1.0), 0.0)
    # C: (dd < 65504.0 ? dd : 65504.0)  -> (float) -> GGML_FP32_TO_FP16
    dd = np.where(dd < FP16_MAX, dd, FP16_MAX)
    d = dd.astype(np.float32).astype(np.float16)
    return d, idx


def quantize_blocks(x, *, variant: Variant = "v3", norm_mode: NormMode = DEFAULT_NORM_MODE,
                    bits: int = 3, qk: int = QK) -> np.ndarray:
    """Quantize (n, 128) float32 vectors to (n, 50) uint8 ISOQUANT3_0 blocks (bits=4:
    (n, 66) ISOQUANT4_0 blocks; qk=64: (n, 64) vectors to 26- / 34-byte ISOQUANT3_64 / 4_64 blocks)."""
    _check_qk(qk)
    x = _as_blocks(x, np.float32, qk=qk)
    n = x.shape[0]
    out = np.empty((n, block_bytes(bits, qk)), dtype=np.uint8)
    for i in range(0, n, _CHUNK):  # chunks keep the working set in cache (results are per block)
        d, idx = quantize_indices(x[i:i + _CHUNK], variant=variant, norm_mode=norm_mode, bits=bits, qk=qk)
        m = idx.shape[0]
        out[i:i + m, :2] = np.ascontiguousarray(d.astype("<f2")).view(np.uint8).reshape(m, 2)
        out[i:i + m, 2:] = pack_indices(idx, bits)
    return out


def dequantize_indices(d, idx, *, variant: Variant = "v3", bits: int = 3, qk: int = QK) -> np.ndarray:
    """y = float32(d) * CB[idx] then the inverse rotation; returns (n, qk) float32."""
    d32 = np.asarray(d, dtype=np.float16).astype(np.float32)
    y = d32[:, None] * codebook(bits, qk)[np.asarray(idx)]
    return rotate_inverse(y, variant, qk)


def dequantize_blocks(b, *, variant: Variant = "v3", bits: int = 3, qk: int = QK) -> np.ndarray:
    """Dequantize (n, 50) uint8 ISOQUANT3_0 blocks (bits=4: (n, 66) ISOQUANT4_0 blocks) to
    (n, 128) float32 vectors (qk=64: the 64-wide types' blocks to (n, 64))."""
    nbytes = block_bytes(bits, qk)
    b = np.asarray(b, dtype=np.uint8)
    if b.ndim == 1:
        b = b.reshape(1, -1)
    if b.ndim != 2 or b.shape[1] != nbytes:
        raise ValueError(f"expected shape (n, {nbytes}), got {b.shape}")
    n = b.shape[0]
    out = np.empty((n, qk), dtype=np.float32)
    for i in range(0, n, _CHUNK):
        c = b[i:i + _CHUNK]
        d = np.ascontiguousarray(c[:, :2]).view("<f2").reshape(c.shape[0])
        out[i:i + c.shape[0]] = dequantize_indices(d, unpack_indices(c[:, 2:], bits), variant=variant, bits=bits,
                                                   qk=qk)
    return out


def quantize_row(x, *, variant: Variant = "v3", norm_mode: NormMode = DEFAULT_NORM_MODE,
                 bits: int = 3, qk: int = QK) -> np.ndarray:
    """Quantize a flat float32 row (len % qk == 0) to a flat uint8 array of
    len / qk * block_bytes(bits, qk) bytes (the ggml row layout: consecutive blocks)."""
    _check_qk(qk)
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if x.size % qk:
        raise ValueError(f"row length {x.size} is not a multiple of {qk}")
    return quantize_blocks(x.reshape(-1, qk), variant=variant, norm_mode=norm_mode, bits=bits, qk=qk).reshape(-1)


def dequantize_row(b, *, variant: Variant = "v3", bits: int = 3, qk: int = QK) -> np.ndarray:
    """Inverse of quantize_row: flat bytes (len % block_bytes(bits, qk) == 0) -> flat float32."""
    nbytes = block_bytes(bits, qk)
    b = np.asarray(b, dtype=np.uint8).reshape(-1)
    if b.size % nbytes:
        raise ValueError(f"byte length {b.size} is not a multiple of {nbytes}")
    return dequantize_blocks(b.reshape(-1, nbytes), variant=variant, bits=bits, qk=qk).reshape(-1)
