"""Production numpy quantiser of GGML_TYPE_ITQ3_S (format v1), bit-exact with the C code.

One block packs 256 float32 weights into 100 bytes (3.125 bits per weight)::

    struct block_itq3_s { ggml_half d;       /* IEEE fp16, little endian            */
                          ggml_half m;       /* rotated-domain offset, fp16         */
                          uint8_t   qs[64];  /* low 2 bits of the 256 codes          */
                          uint8_t   qh[32];  /* high bit of the 256 codes            */ };

Decoding: ``y_i = d * GRID[q_i] + m`` (float32, product then sum), then
``w = S * FWHT256(y)``, where FWHT256 is the normalised (x 1/16, self-inverse)
Sylvester Walsh-Hadamard transform and S the fixed +-1 vector of the tables.

The quantiser follows docs/itq3-design.md ("Final specification") operation by
operation; the C twin (``-ffp-contract=off``, SSE float32, no fast-math, fp16 by
round-to-nearest-even) produces identical bytes.  In short, per block:

  1. ``y = FWHT256(S * w)``; ``sy = TREE(y)``, ``ss = TREE(y*y)``,
     ``mu = sy/256``, ``var = ss/256 - mu*mu``, flat = ``!(var > 2^-80)``.
  2. ``yc = y - mu``; ``d0 = C*sqrt(var)`` (``C`` if flat).
  3. 4 scale candidates ``d0*F[k]``: codes ``code(yc * (2/dk))`` and their
     least-squares ``(d, o)``; keep the best LS score (no imatrix) or the
     smallest imatrix-weighted original-domain error (imatrix).
  4. 3 Lloyd rounds: codes for ``(yc - o) * (2/d)``, then LS ``(d, o)``.
  5. Norm-preserving final step (not least squares, which biases every block's
     gain down by ~relMSE): ``d = sqrt(256*TREE(yc*yc)/den)`` (0 if flat or the
     LS d of the last round is not > 0), ``d16 = fp16(d)``,
     ``m16 = fp16((sy - d16*sg)/256)`` (no imatrix); or, with an imatrix, the
     weighted norm-preserving step in the original domain
     ``d = sqrt(Σ' iw w² / Σ' iw u²)`` (when the weighted LS fit is positive) and
     the m that makes weight 0 of the block exact.
  6. pack the codes (2 low bits in 4 planes of 64, high bit in 8 planes of 32).

Everything is vectorised over blocks.  Internally the blocks are *columns* of
a (256, nb) float32 array so that every butterfly and tree-sum stage is one
contiguous slab operation; blocks are processed in chunks of ``_CHUNK``
columns to keep the working set in cache (every result is per block, so the
chunking does not change a bit).
"""

from __future__ import annotations

import numpy as np

from rotaryquant.quants import as_blocks

from rotaryquant.quants import itq3_tables as _tables

__all__ = [
    "QK", "BLOCK_BYTES", "GRID", "THR2", "C", "F", "VAR_EPS", "SIGNS", "FP16_MAX", "N_LLOYD",
    "fwht256", "rotate", "rotate_inverse", "f16_sat",
    "quantize_codes", "pack_blocks", "unpack_blocks",
    "quantize_blocks", "quantize_rows", "dequantize_blocks", "dequantize_rows",
    "DAMP", "hessian_rotated", "ldlq_factor", "LDLQFactor", "quantize_rows_ldlq",
]

F32 = np.float32
QK = 256
BLOCK_BYTES = 4 + QK * 3 // 8          # 100
FP16_MAX = 65504.0
N_LLOYD = 3

GRID_I8 = np.asarray(_tables.GRID, dtype=np.int8)
GRID = GRID_I8.astype(F32)                                   # (8,) float32 levels
THR2 = np.asarray(_tables.THR2, dtype=np.int32)              # (7,)
C = F32(_tables.C)
F = np.asarray(_tables.F, dtype=F32)                         # (4,)
VAR_EPS = F32(_tables.VAR_EPS)
SIGNS = np.asarray(_tables.SIGNS, dtype=F32)                 # (256,) exactly +-1
for _a in (GRID_I8, GRID, THR2, F, SIGNS):
    _a.setflags(write=False)

_S_COL = SIGNS[:, None]
_ONE = F32(1)
_TWO = F32(2)
_INV256 = F32(1.0 / 256)
_F256 = F32(256)
_SIXTEEN_S0 = F32(16) * SIGNS[0]                 # 16.0f * S[0] (exact)
W_CLAMP = F32(1e15)                              # input clamp, see _quantize_chunk
_CHUNK = 512                                      # blocks per vectorised chunk

# code(x2) = #{k : x2 >= THR2[k]}.  THR2 are integers, so x2 >= T <=> floor(x2) >= T;
# floor(x2) is clamped to [-256, 255] (beyond that the code is 0 or 7) and looked up.
# NaN goes to -256 (np.fmax ignores NaN), i.e. code 0: every comparison with NaN is false.
_FL = np.arange(-256, 256)
_LUT_Q = (_FL[:, None] >= THR2[None, :]).sum(1).astype(np.uint8)    # index f + 256
_LUT_G = GRID[_LUT_Q.astype(np.intp)]
for _a in (_LUT_Q, _LUT_G):
    _a.setflags(write=False)


# --------------------------------------------------------------------------
# primitives (columns layout: blocks are the columns of a (256, nb) array)
# --------------------------------------------------------------------------

def _fwht_cols(x: np.ndarray) -> np.ndarray:
    """FWHT256 of every column of a C-contiguous (256, nb) float32 array (not modified).

    Stages h = 1, 2, ..., 128; within each block of 2h rows the pair (j, j+h)
    becomes (a + b, a - b); then * 0.0625 (exact)."""
    nb = x.shape[1]
    a = np.empty_like(x)
    b = np.empty_like(x)
    src = x
    h = 1
    while h < QK:
        sv = src.reshape(QK // (2 * h), 2, h, nb)
        dv = a.reshape(QK // (2 * h), 2, h, nb)
        np.add(sv[:, 0], sv[:, 1], out=dv[:, 0])
        np.subtract(sv[:, 0], sv[:, 1], out=dv[:, 1])
        src = a
        a, b = b, a
        h *= 2
    src *= F32(0.0625)
    return src


def _tree(x: np.ndarray) -> np.ndarray:
    """TREE over axis 0 of (256, nb) float32: for n = 128, ..., 1: v[i] += v[i+n] (i < n)."""
    s = x[:128] + x[128:]
    n = 128
    while n > 1:
        n //= 2
        s = s[:n] + s[n:2 * n]
    return s[0]


def _tree0(x: np.ndarray) -> np.ndarray:
    """TREE' : TREE with entry 0 set to 0 (x is modified)."""
    x[0] = 0
    return _tree(x)


def _idx(x2: np.ndarray) -> np.ndarray:
    """LUT index (floor(x2) clamped to [-256, 255], NaN -> -256) + 256, as intp."""
    f = np.floor(x2)
    np.fmax(f, F32(-256), out=f)
    np.minimum(f, F32(255), out=f)
    f += F32(256)
    return f.astype(np.intp)


def _stats(g: np.ndarray, t: np.ndarray):
    """STATS: sgt = TREE(g*t) (float32), sg = Σg, sg2 = Σg² (exact ints), den = float(256*sg2 - sg²)."""
    sgt = _tree(g * t)
    sg = _tree(g)            # exact in float32: |partial sums| <= 32512
    sg2 = _tree(g * g)       # exact in float32: partial sums <= 4129024 < 2^24
    sgi = sg.astype(np.int64)
    den = (256 * sg2.astype(np.int64) - sgi * sgi).astype(F32)   # int, then one RNE conversion
    return sgt, sg, den


def _ls(sgt, sg, den):
    """d = den > 0 ? 256*sgt/den : 0;  o = -(d*sg) * (1/256)."""
    pos = den > 0
    d = np.where(pos, _F256 * sgt / np.where(pos, den, _ONE), F32(0))
    o = -(d * sg) * _INV256
    return d, o


def f16_sat(x) -> np.ndarray:
    """fp16(x > 65504 ? 65504 : (x < -65504 ? -65504 : x)), round-to-nearest-even; NaN stays NaN."""
    x = np.asarray(x, dtype=F32)
    x = np.where(x > F32(FP16_MAX), F32(FP16_MAX), np.where(x < F32(-FP16_MAX), F32(-FP16_MAX), x))
    return x.astype(np.float16)


# --------------------------------------------------------------------------
# the quantiser on one chunk of blocks
# --------------------------------------------------------------------------

def _quantize_chunk(w: np.ndarray, iw: np.ndarray | None, trace: dict | None = None):
    """w (nb, 256) float32, iw (nb, 256) float32 or None -> q (nb,256) uint8, d16, m16 (nb,) float16.

    trace: if a dict, the float32 intermediates of every block are stored in it (tests compare
    them with the scalar transcription of the spec: rounding-order slips show up there long
    before they flip a stored fp16 value)."""
    wt = np.ascontiguousarray(w.T)
    # |w| beyond W_CLAMP is unrepresentable anyway (d and m saturate at 65504) and would overflow the
    # float32 butterflies and sums of squares into Inf/NaN: clamp first (NaN stays NaN)
    wt = np.where(wt > W_CLAMP, W_CLAMP, np.where(wt < -W_CLAMP, -W_CLAMP, wt))
    x = wt * _S_COL
    y = _fwht_cols(x)                                   # 1. rotate
    nb = y.shape[1]
    sy = _tree(y)                                       # 2. moments
    ss = _tree(y * y)
    mu = sy * _INV256
    var = ss * _INV256 - mu * mu
    flat = ~(var > VAR_EPS)
    yc = y - mu                                         # 3. centre, start step
    d0 = C * np.sqrt(np.where(flat, _ONE, var))
    iwt = None if iw is None else np.ascontiguousarray(iw.T)

    # 4. scale candidates
    d = np.zeros(nb, F32)
    o = -(d * F32(0)) * _INV256                         # -0.0: the state when no candidate is kept
    if iwt is None:
        best = np.full(nb, -1.0, F32)
        for fk in F:
            dk = d0 * fk
            g = _LUT_G[_idx(yc * (_TWO / dk))]
            sgt, sg, den = _stats(g, yc)
            pos = den > 0
            sc = np.where(pos, sgt * sgt / np.where(pos, den, _ONE), F32(0))
            better = sc > best                          # strict: the lowest k wins ties
            best = np.where(better, sc, best)
            dl, ol = _ls(sgt, sg, den)
            d = np.where(better, dl, d)
            o = np.where(better, ol, o)
    else:
        best = np.full(nb, np.inf, F32)
        for fk in F:
            dk = d0 * fk
            g = _LUT_G[_idx(yc * (_TWO / dk))]
            dl, ol = _ls(*_stats(g, yc))
            e = dl * g                                  # rotated reconstruction (dl*g + ol) + mu,
            e += ol
            e += mu
            np.subtract(y, e, out=e)                    # rotated error y - r
            eo = _fwht_cols(e)
            eo *= _S_COL                                # original-domain error E
            eo *= eo
            eo *= iwt                                   # iw * (E*E)
            sc = _tree(eo)
            better = sc < best                          # strict: the lowest k wins ties
            best = np.where(better, sc, best)
            d = np.where(better, dl, d)
            o = np.where(better, ol, o)
    if trace is not None:
        trace.update(sy=sy, ss=ss, mu=mu, var=var, d0=d0, best=best, d_cand=d, o_cand=o)

    # 5. Lloyd rounds
    for _ in range(N_LLOYD):
        dd = np.where(d > 0, d, d0)
        fi = _idx((yc - o) * (_TWO / dd))
        g = _LUT_G[fi]
        sgt, sg, den = _stats(g, yc)
        d, o = _ls(sgt, sg, den)

    # 6. final scale and offset
    if trace is not None:
        trace.update(d_lloyd=d, o_lloyd=o, sg=sg)
    # The step is norm-preserving, not least-squares: the LS step shrinks every block's gain by
    # ~(1 - relMSE), a systematic bias in every matmul output; matching the energy halves it.
    d = np.where(flat | ~(d > 0), F32(0), d)           # a non-positive LS fit still gives 0
    if iwt is None:
        syc2 = _tree(yc * yc)
        ok = d > 0                                      # (den > 0 is implied)
        d = np.where(ok, np.sqrt(_F256 * syc2 / np.where(ok, den, _ONE)), F32(0))
        d16 = f16_sat(d)
        m = (sy - d16.astype(F32) * sg) * _INV256
        if trace is not None:
            trace.update(syc2=syc2)
    else:
        u = _fwht_cols(g)
        u *= _S_COL                                     # u = S * FWHT256(GRID[q]), exact
        iww = iwt * wt
        num = _tree0(iww * u)
        dn = _tree0((iwt * u) * u)
        ww = _tree0(iww * wt)
        ok = ~flat & (dn > 0) & (num > 0)               # num > 0: the sign / validity of the fit only
        d = np.where(ok, np.sqrt(ww / np.where(ok, dn, _ONE)), d)
        d16 = f16_sat(d)
        m = (wt[0] - d16.astype(F32) * u[0]) / _SIXTEEN_S0
        if trace is not None:
            trace.update(num=num, dn=dn, ww=ww)
    m = np.where(flat, mu, m)
    m16 = f16_sat(m)
    if trace is not None:
        trace.update(d=d, m=m)
    return np.ascontiguousarray(_LUT_Q[fi].T), d16, m16


# --------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------

def _as_blocks(x, dtype, name="w") -> np.ndarray:
    return as_blocks(x, dtype, QK, name)


def _imatrix_blocks(imatrix, n: int) -> np.ndarray | None:
    if imatrix is None:
        return None
    iw = np.asarray(imatrix, dtype=F32)
    if iw.shape == (QK,):
        return np.broadcast_to(iw, (n, QK))
    if iw.shape != (n, QK):
        raise ValueError(f"imatrix: expected shape ({QK},) or ({n}, {QK}), got {iw.shape}")
    return iw


def fwht256(v) -> np.ndarray:
    """FWHT256 (normalised, no sign flip) of each row of a (n, 256) float32 array."""
    v = _as_blocks(v, F32, "v")
    out = np.empty_like(v)
    for i in range(0, v.shape[0], _CHUNK):
        out[i:i + _CHUNK] = _fwht_cols(np.ascontiguousarray(v[i:i + _CHUNK].T)).T
    return out


def rotate(w) -> np.ndarray:
    """The forward rotation of the format, per row: FWHT256(S * w)."""
    return fwht256(_as_blocks(w, F32) * SIGNS)


def rotate_inverse(y) -> np.ndarray:
    """The inverse rotation, per row: S * FWHT256(y)."""
    return fwht256(y) * SIGNS


def quantize_codes(w, imatrix=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Quantise (n, 256) blocks; returns (q (n, 256) uint8 codes 0..7, d16 (n,) float16, m16 (n,) float16).

    imatrix: None, (256,) (same importances for every block) or (n, 256), >= 0."""
    w = _as_blocks(w, F32)
    n = w.shape[0]
    iw = _imatrix_blocks(imatrix, n)
    q = np.empty((n, QK), np.uint8)
    d16 = np.empty(n, np.float16)
    m16 = np.empty(n, np.float16)
    with np.errstate(all="ignore"):      # inf/NaN inputs follow the C semantics silently
        for i in range(0, n, _CHUNK):
            sl = slice(i, i + _CHUNK)
            q[sl], d16[sl], m16[sl] = _quantize_chunk(w[sl], None if iw is None else iw[sl])
    return q, d16, m16


def _quantize_trace(w, imatrix=None):
    """quantize_codes for a few blocks in one chunk, plus the dict of float32 intermediates (tests)."""
    w = _as_blocks(w, F32)
    iw = _imatrix_blocks(imatrix, w.shape[0])
    trace: dict = {}
    with np.errstate(all="ignore"):
        q, d16, m16 = _quantize_chunk(w, iw, trace)
    return q, d16, m16, trace


def pack_blocks(q, d16, m16) -> np.ndarray:
    """(n, 256) codes + (n,) fp16 d, m -> (n, 100) uint8 blocks:
    [0:2] d, [2:4] m (fp16 little endian), [4:68] qs, [68:100] qh with
      qs[j] = Σ_{s<4} (q[64s + j] & 3) << 2s     (j < 64)
      qh[j] = Σ_{b<8} ((q[32b + j] >> 2) & 1) << b   (j < 32)"""
    q = np.asarray(q, dtype=np.uint8)
    n = q.shape[0]
    out = np.empty((n, BLOCK_BYTES), np.uint8)
    out[:, 0:2] = np.asarray(d16, dtype="<f2").reshape(n, 1).view(np.uint8)
    out[:, 2:4] = np.asarray(m16, dtype="<f2").reshape(n, 1).view(np.uint8)
    lo = (q & 3).reshape(n, 4, 64)
    out[:, 4:68] = lo[:, 0] | (lo[:, 1] << 2) | (lo[:, 2] << 4) | (lo[:, 3] << 6)
    hi = ((q >> 2) & 1).reshape(n, 8, 32)
    qh = hi[:, 0].copy()
    for b in range(1, 8):
        qh |= hi[:, b] << b
    out[:, 68:100] = qh
    return out


_I = np.arange(QK)
_QS_IDX, _QS_SH = _I % 64, (2 * (_I // 64)).astype(np.uint8)
_QH_IDX, _QH_SH = _I % 32, (_I // 32).astype(np.uint8)


def unpack_blocks(b) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n, 100) uint8 blocks -> (q (n, 256) uint8, d16 (n,) float16, m16 (n,) float16)."""
    b = np.asarray(b, dtype=np.uint8)
    if b.ndim == 1:
        b = b.reshape(1, -1)
    if b.ndim != 2 or b.shape[1] != BLOCK_BYTES:
        raise ValueError(f"expected shape (n, {BLOCK_BYTES}), got {b.shape}")
    d16 = np.ascontiguousarray(b[:, 0:2]).view("<f2")[:, 0].astype(np.float16)
    m16 = np.ascontiguousarray(b[:, 2:4]).view("<f2")[:, 0].astype(np.float16)
    q = ((b[:, 4:68][:, _QS_IDX] >> _QS_SH) & 3) | (((b[:, 68:100][:, _QH_IDX] >> _QH_SH) & 1) << 2)
    return q.astype(np.uint8), d16, m16


def quantize_blocks(w, imatrix=None) -> np.ndarray:
    """Quantise (n, 256) float32 blocks to (n, 100) uint8 ITQ3_S blocks.

    imatrix: None, (256,) or (n, 256) per-weight importances (>= 0) of each block's columns."""
    return pack_blocks(*quantize_codes(w, imatrix))


def _dequantize_codes(q, d16, m16) -> np.ndarray:
    n = q.shape[0]
    out = np.empty((n, QK), F32)
    d = d16.astype(F32)
    m = m16.astype(F32)
    for i in range(0, n, _CHUNK):
        sl = slice(i, i + _CHUNK)
        y = GRID[q[sl].T.astype(np.intp)] * d[sl] + m[sl]       # product, then sum (float32)
        x = _fwht_cols(y)
        x *= _S_COL
        out[sl] = x.T
    return out


def dequantize_blocks(b) -> np.ndarray:
    """(n, 100) uint8 ITQ3_S blocks -> (n, 256) float32 weights."""
    with np.errstate(all="ignore"):
        return _dequantize_codes(*unpack_blocks(b))


def quantize_rows(w2d, imatrix=None) -> np.ndarray:
    """Quantise a (nrows, n_per_row) float32 matrix (n_per_row % 256 == 0) to
    (nrows, n_per_row/256*100) uint8 (the ggml row layout), as the C ``quantize_itq3_s`` does.
    imatrix: None or (n_per_row,) column importances; then LDLQ with H = diag(imatrix) per
    256-column block (``quantize_rows_ldlq``; docs/itq3-design.md §5.3). The v1 per-block imatrix
    quantiser is ``quantize_blocks(w, iw)``."""
    w = np.asarray(w2d, dtype=F32)
    if w.ndim != 2 or w.shape[1] % QK:
        raise ValueError(f"expected (nrows, n_per_row) with n_per_row % {QK} == 0, got {w.shape}")
    if imatrix is not None:
        return quantize_rows_ldlq(w, imatrix=imatrix)
    nrows, npr = w.shape
    nbr = npr // QK
    blk = quantize_blocks(w.reshape(nrows * nbr, QK))
    return blk.reshape(nrows, nbr * BLOCK_BYTES)


def dequantize_rows(b2d) -> np.ndarray:
    """(nrows, row_bytes) uint8 (row_bytes % 100 == 0) -> (nrows, row_bytes/100*256) float32."""
    b = np.asarray(b2d, dtype=np.uint8)
    if b.ndim != 2 or b.shape[1] % BLOCK_BYTES:
        raise ValueError(f"expected (nrows, k*{BLOCK_BYTES}) bytes, got {b.shape}")
    nrows, nbytes = b.shape
    nbr = nbytes // BLOCK_BYTES
    return dequantize_blocks(b.reshape(nrows * nbr, BLOCK_BYTES)).reshape(nrows, nbr * QK)


# --------------------------------------------------------------------------
# LDLQ: error feedback in the rotated domain (docs/itq3-design.md §5.3)
# --------------------------------------------------------------------------
# float64, the same operations in the same order as itq3.c (itq3_hess_rotate, itq3_ldlq_factor,
# itq3_ldlq_block): elementwise numpy ops, loops where C sums sequentially, never a BLAS dot.

DAMP = 0.1                                       # lambda: A' = A/mean(diag A) + DAMP*I
_F64 = np.float64
_SS = np.outer(SIGNS, SIGNS).astype(_F64)         # S_i*S_j, exactly +-1
_GRID64 = GRID.astype(_F64)
_DET_EPS = 1e-9


def hessian_rotated(xtx_block=None, iw=None) -> np.ndarray:
    """A = R H R^T (float64, 256x256) for H = (xtx + xtx^T)/2 or H = diag(iw); R = FWHT256 diag(S)."""
    if xtx_block is not None:
        h = np.asarray(xtx_block, dtype=F32).astype(_F64)
        a = (0.5 * (h + h.T)) * _SS
    else:
        a = np.diag(np.asarray(iw, dtype=F32).astype(_F64))
    a = np.ascontiguousarray(_fwht_cols(np.ascontiguousarray(a.T)).T)      # every row
    return _fwht_cols(a)                                                    # every column


class LDLQFactor:
    """The per-column-block factor: V (upper, A' = V V^T), L[k, j] = V_kj/V_jj (j > k), b = V^T 1, c11 = |b|^2."""

    def __init__(self, v: np.ndarray, l: np.ndarray, b: np.ndarray, c11: float):  # noqa: E741
        self.V, self.L, self.b, self.c11 = v, l, b, c11


def ldlq_factor(a: np.ndarray, damp: float = DAMP) -> LDLQFactor | None:
    """Normalise, damp and factor a rotated Hessian A (not modified); None if it is degenerate
    (non-finite, mean diagonal not > 0, or a pivot not > 0): the plain quantiser is used then."""
    a = np.array(a, dtype=_F64)
    if not np.isfinite(a).all():
        return None
    mu = _tree(np.diag(a).copy()) * (1.0 / 256)
    if not (mu > 0 and np.isfinite(mu)):
        return None
    a = a / mu
    a[_I, _I] = a[_I, _I] + _F64(damp)
    v = np.zeros((QK, QK))
    for k in range(QK - 1, -1, -1):                 # backward Cholesky: A' = V V^T, V upper
        p = a[k, k]
        if not (p > 0 and np.isfinite(p)):
            return None
        vkk = np.sqrt(p)
        v[k, k] = vkk
        col = a[:k, k] / vkk
        v[:k, k] = col
        a[:k, :k] -= np.multiply.outer(col, col)
    l = np.triu(v / np.diag(v)[None, :], 1)        # noqa: E741
    b = np.zeros(QK)
    for j in range(QK):
        b[j:] = b[j:] + v[j, j:] * 1.0
    c11 = _F64(0.0)
    for k in range(QK):
        c11 = c11 + b[k] * b[k]
    return LDLQFactor(v, l, b, c11)


def _idx64(x2: np.ndarray) -> np.ndarray:
    f = np.floor(x2)
    np.fmax(f, -256.0, out=f)
    np.minimum(f, 255.0, out=f)
    f += 256.0
    return f.astype(np.intp)


def _ldlq_chunk(w: np.ndarray, fac: LDLQFactor, q: np.ndarray, d16: np.ndarray, m16: np.ndarray) -> None:
    """LDLQ codes and the A'-weighted refit for (n, 256) blocks w of one column block, in place on the plain
    quantiser's (q, d16, m16); blocks whose plain step is unusable (flat, NaN/inf) keep the plain result."""
    d = d16.astype(F32)
    m = m16.astype(F32)
    wc = np.where(w > W_CLAMP, W_CLAMP, np.where(w < -W_CLAMP, -W_CLAMP, w))
    y = rotate(wc)
    ok = (d > 0) & np.isfinite(d) & np.isfinite(m) & np.isfinite(y).all(axis=1)
    sel = np.flatnonzero(ok)
    if sel.size == 0:
        return
    yt = np.ascontiguousarray(y[sel].T).astype(_F64)     # (256, r)
    dd = d[sel].astype(_F64)
    mm = m[sel].astype(_F64)
    inv2 = 2.0 / dd
    t = yt.copy()
    qq = np.empty(yt.shape, np.uint8)
    for k in range(QK):                                  # sequential rounding with error feedback
        qk = _LUT_Q[_idx64((t[k] - mm) * inv2)]
        qq[k] = qk
        e = yt[k] - (dd * _GRID64[qk.astype(np.intp)] + mm)
        t[k + 1:] += fac.L[k, k + 1:, None] * e[None, :]
    g = _GRID64[qq.astype(np.intp)]
    a = np.zeros_like(yt)
    c = np.zeros_like(yt)
    for j in range(QK):                                  # a = V^T g, c = V^T y, summed over j in order
        vj = fac.V[j, j:, None]
        a[j:] += vj * g[j]
        c[j:] += vj * yt[j]
    c00 = np.zeros(sel.size)
    c01 = np.zeros(sel.size)
    r0 = np.zeros(sel.size)
    r1 = np.zeros(sel.size)
    b = fac.b
    for k in range(QK):
        c00 = c00 + a[k] * a[k]
        c01 = c01 + a[k] * b[k]
        r0 = r0 + a[k] * c[k]
        r1 = r1 + b[k] * c[k]
    c11 = fac.c11
    det = c00 * c11 - c01 * c01
    dn = (r0 * c11 - r1 * c01) / det
    dn16 = f16_sat(dn.astype(F32))
    d2 = dn16.astype(F32).astype(_F64)
    mn = (r1 - d2 * c01) / c11
    fit = (det > _DET_EPS * (c00 * c11)) & np.isfinite(det) & (dn > 0) & np.isfinite(dn) & (d2 > 0) & np.isfinite(mn)
    q[sel] = qq.T
    d16[sel[fit]] = dn16[fit]
    m16[sel[fit]] = f16_sat(mn[fit].astype(F32))


def quantize_rows_ldlq(w2d, xtx=None, imatrix=None, *, damp: float = DAMP) -> np.ndarray:
    """Quantise a (nrows, n_per_row) float32 matrix with LDLQ (the C ``ggml_rq_quantize_itq3_s_xtx`` for xtx,
    the LDLQ-diag path for an imatrix). xtx: (n_per_row/256, 256, 256) Gram matrices of the inputs (original
    domain, raw sums); imatrix: (n_per_row,) column importances (H = diag). Neither: the plain quantiser."""
    w = np.asarray(w2d, dtype=F32)
    if w.ndim != 2 or w.shape[1] % QK:
        raise ValueError(f"expected (nrows, n_per_row) with n_per_row % {QK} == 0, got {w.shape}")
    nrows, npr = w.shape
    nbr = npr // QK
    if xtx is not None and imatrix is not None:
        raise ValueError("give xtx or imatrix, not both")
    if xtx is not None:
        xtx = np.asarray(xtx, dtype=F32)
        if xtx.shape != (nbr, QK, QK):
            raise ValueError(f"xtx: expected shape ({nbr}, {QK}, {QK}), got {xtx.shape}")
    elif imatrix is not None:
        imatrix = np.asarray(imatrix, dtype=F32)
        if imatrix.shape != (npr,):
            raise ValueError(f"imatrix: expected shape ({npr},), got {imatrix.shape}")
    else:
        return quantize_rows(w)
    blocks = np.ascontiguousarray(w.reshape(nrows, nbr, QK).transpose(1, 0, 2))     # (nbr, nrows, 256)
    out = np.empty((nbr, nrows, BLOCK_BYTES), np.uint8)
    with np.errstate(all="ignore"):
        for ib in range(nbr):
            iw = None if imatrix is None else imatrix[ib * QK:(ib + 1) * QK]
            fac = ldlq_factor(hessian_rotated(xtx[ib]) if iw is None else hessian_rotated(iw=iw), damp)
            if fac is None:          # degenerate H: the plain quantiser (xtx) or the v1 imatrix one (imatrix)
                q, d16, m16 = quantize_codes(blocks[ib], iw)
            else:
                q, d16, m16 = quantize_codes(blocks[ib])
                _ldlq_chunk(blocks[ib], fac, q, d16, m16)
            out[ib] = pack_blocks(q, d16, m16)
    return np.ascontiguousarray(out.transpose(1, 0, 2)).reshape(nrows, nbr * BLOCK_BYTES)
