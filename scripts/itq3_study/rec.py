"""The recommended ITQ3_S quantiser (vectorised and its scalar twin), packing, the rotated-domain int8 dot
and the original-domain references (Q4_0, 3-bit per-32) of the design study."""
import numpy as np

from .core import CHUNK, F32, QK, Grid, assign, cand_factors, fwht_cols, to_f16, tree_sum


# ----------------------------------------------------------------------------
# Recommended quantiser (no imatrix): vectorised + scalar reference
# ----------------------------------------------------------------------------

ITQ3_GRID = np.array([-127, -79, -45, -14, 14, 45, 79, 127], dtype=F32)
ITQ3_C = F32(0.0169463)   # Gaussian-optimal d/sigma for ITQ3_GRID (see grid table)
ITQ3_VAR_EPS = F32(2.0 ** -80)  # blocks with var <= this are "flat" (d = 0; fp16 d would be 0 anyway)


def lcg_signs(seed=0x12345678):
    """Optional fixed sign vector s (±1), LCG x = 1664525 x + 1013904223 mod 2^32,
    s_j = -1 if the top bit of the j-th output is set."""
    st = seed
    out = np.empty(QK, F32)
    for j in range(QK):
        st = (st * 1664525 + 1013904223) & 0xFFFFFFFF
        out[j] = -1.0 if st >> 31 else 1.0
    return out


class Itq3Rec:
    """Recommended ITQ3_S quantiser.

    grid: Lloyd-Max int8 levels; offset m is a free LS parameter inside the
    loop; K scale candidates around c*sigma, then L Lloyd steps on (d, m).
    signs: None (format as specified) or a fixed ±1 vector applied before the
    FWHT (y = H diag(s) w; decode w = diag(s) H y)."""

    def __init__(self, K=4, L=3, signs=None):
        assert L >= 1
        self.grid = Grid("Lloyd-Max int8", ITQ3_GRID, c_rms=ITQ3_C)
        self.K = K
        self.L = L
        self.fs = cand_factors(K)
        self.c = ITQ3_C
        self.signs = signs

    def _idx(self, X2):
        f = np.floor(X2)
        np.clip(f, -256, 255, out=f)
        return f.astype(np.intp)

    def _stats(self, g, Yc):
        sgy = tree_sum(g * Yc)
        sg = tree_sum(g)          # exact integer (|sg| <= 32512)
        sg2 = tree_sum(g * g)     # exact integer (<= 4129024 < 2^24)
        sgi = sg.astype(np.int64)
        den = (256 * sg2.astype(np.int64) - sgi * sgi).astype(F32)  # exact int, then RNE to f32
        return sgy, sg, den

    def quantize_chunk(self, Wc):
        """Wc (nb, 256) float32 original weights -> q (nb,256) uint8, d16, m16 (float32 holding fp16)."""
        lutg = self.grid.lut_g
        X = Wc.T
        if self.signs is not None:
            X = X * self.signs[:, None]
        Y = fwht_cols(X)
        nb = Y.shape[1]
        sy = tree_sum(Y)
        ss = tree_sum(Y * Y)
        mu = sy * F32(1 / 256)
        var = ss * F32(1 / 256) - mu * mu
        flat = ~(var > ITQ3_VAR_EPS)
        Yc = Y - mu
        d0 = (self.c * np.sqrt(np.where(flat, F32(1), var))).astype(F32)
        best = np.full(nb, -1.0, F32)
        bsgy = np.zeros(nb, F32)
        bsg = np.zeros(nb, F32)
        bden = np.ones(nb, F32)
        one = F32(1)
        for f in self.fs:
            dk = d0 * f
            g = lutg[self._idx(Yc * (F32(2) / dk))]
            sgy, sg, den = self._stats(g, Yc)
            pos = den > 0
            sc = np.where(pos, sgy * sgy / np.where(pos, den, one), F32(0))
            better = sc > best            # strict: ties keep the lowest k
            best = np.where(better, sc, best)
            bsgy = np.where(better, sgy, bsgy)
            bsg = np.where(better, sg, bsg)
            bden = np.where(better, den, bden)
        pos = bden > 0
        d = np.where(pos, F32(256) * bsgy / np.where(pos, bden, one), F32(0))
        o = -(d * bsg) * F32(1 / 256)
        for _ in range(self.L):
            dd = np.where(d > 0, d, d0)
            fi = self._idx((Yc - o) * (F32(2) / dd))
            g = lutg[fi]
            sgy, sg, den = self._stats(g, Yc)
            pos = den > 0
            d = np.where(pos, F32(256) * sgy / np.where(pos, den, one), F32(0))
            o = -(d * sg) * F32(1 / 256)
        q = self.grid.lut_q[fi]
        d = np.where(flat | ~(d > 0), F32(0), d).astype(F32)
        d16 = to_f16(d)
        m = (sy - d16 * sg) * F32(1 / 256)
        m16 = to_f16(np.where(flat, mu, m))
        return q.T.astype(np.uint8), d16, m16

    def quantize(self, Wb):
        nb = Wb.shape[0]
        q = np.empty((nb, QK), np.uint8)
        d = np.empty(nb, F32)
        m = np.empty(nb, F32)
        for i in range(0, nb, CHUNK):
            q[i:i + CHUNK], d[i:i + CHUNK], m[i:i + CHUNK] = self.quantize_chunk(Wb[i:i + CHUNK])
        return q, d, m

    def dequantize(self, q, d, m):
        Yh = ITQ3_GRID[q.astype(np.intp)] * d[:, None] + m[:, None]
        out = np.empty_like(Yh)
        for i in range(0, Yh.shape[0], CHUNK):
            out[i:i + CHUNK] = fwht_cols(Yh[i:i + CHUNK].T).T
        if self.signs is not None:
            out *= self.signs[None, :]
        return out

    def roundtrip(self, Wb):
        return self.dequantize(*self.quantize(Wb))


def itq3_quantize_block_scalar(w, K=4, L=3, signs=None):
    """Scalar, loop-by-loop reference of Itq3Rec for ONE block (list of 256
    float32).  Written the way the C code should be written; used to check
    that the vectorised numpy path is bit-identical."""
    f32 = np.float32
    x = [f32(v) for v in w]
    if signs is not None:
        x = [x[j] * f32(signs[j]) for j in range(QK)]
    h = 1
    while h < QK:                                   # FWHT, stage order h = 1..128
        for i in range(0, QK, 2 * h):
            for j in range(i, i + h):
                a, b = x[j], x[j + h]
                x[j], x[j + h] = a + b, a - b
        h *= 2
    y = [v * f32(0.0625) for v in x]

    def tsum(v):
        v = list(v)
        n = QK
        while n > 1:
            n //= 2
            for i in range(n):
                v[i] = v[i] + v[i + n]
        return v[0]

    lev = [int(v) for v in ITQ3_GRID]
    thr2 = [lev[k] + lev[k + 1] for k in range(7)]   # 2*T_k (integers)

    def code(xv):                                     # q = #{k: x >= T_k} via floor(2x)
        fl = int(np.floor(xv))
        return sum(1 for t in thr2 if fl >= t)

    sy = tsum(y)
    ss = tsum([v * v for v in y])
    mu = sy * f32(1 / 256)
    var = ss * f32(1 / 256) - mu * mu
    flat = not (var > ITQ3_VAR_EPS)
    yc = [v - mu for v in y]
    d0 = ITQ3_C * np.sqrt(f32(1) if flat else var)

    def stats(q):
        g = [f32(lev[k]) for k in q]
        sgy = tsum([g[j] * yc[j] for j in range(QK)])
        sg = sum(lev[k] for k in q)                    # int
        sg2 = sum(lev[k] * lev[k] for k in q)          # int
        return sgy, sg, f32(256 * sg2 - sg * sg)

    best = f32(-1)
    bsgy, bsg, bden = f32(0), 0, f32(1)
    for f in cand_factors(K):
        dk = d0 * f
        id2 = f32(2) / dk
        q = [code(v * id2) for v in yc]
        sgy, sg, den = stats(q)
        sc = sgy * sgy / den if den > 0 else f32(0)
        if sc > best:
            best, bsgy, bsg, bden = sc, sgy, sg, den
    d = f32(256) * bsgy / bden if bden > 0 else f32(0)
    o = -(d * f32(bsg)) * f32(1 / 256)
    for _ in range(L):
        dd = d if d > 0 else d0
        id2 = f32(2) / dd
        q = [code((v - o) * id2) for v in yc]
        sgy, sg, den = stats(q)
        d = f32(256) * sgy / den if den > 0 else f32(0)
        o = -(d * f32(sg)) * f32(1 / 256)
    if flat or not (d > 0):
        d = f32(0)
    d16 = f32(np.float16(d))
    m = mu if flat else (sy - d16 * f32(sg)) * f32(1 / 256)
    return np.array(q, np.uint8), d16, f32(np.float16(m))


def itq3_pack(q, d16, m16):
    """(nb,256) codes 0..7 + fp16-valued d, m -> (nb, 100) uint8 blocks.
    Layout: [0:2] d (fp16 LE), [2:4] m (fp16 LE), [4:68] qs, [68:100] qh with
      qs[j] = sum_{s=0..3} (q[64s + j] & 3) << 2s          (j < 64)
      qh[j] = sum_{b=0..7} ((q[32b + j] >> 2) & 1) << b     (j < 32)"""
    nb = q.shape[0]
    q = q.astype(np.uint8)
    out = np.empty((nb, 100), np.uint8)
    out[:, 0:2] = d16.astype(np.float16).view(np.uint8).reshape(nb, 2)
    out[:, 2:4] = m16.astype(np.float16).view(np.uint8).reshape(nb, 2)
    lo = (q & 3).reshape(nb, 4, 64)
    out[:, 4:68] = lo[:, 0] | (lo[:, 1] << 2) | (lo[:, 2] << 4) | (lo[:, 3] << 6)
    hi = ((q >> 2) & 1).reshape(nb, 8, 32)
    qh = np.zeros((nb, 32), np.uint8)
    for b in range(8):
        qh |= hi[:, b] << b
    out[:, 68:100] = qh
    return out


def itq3_unpack(blk):
    d = np.ascontiguousarray(blk[:, 0:2]).view(np.float16).astype(F32)[:, 0]
    m = np.ascontiguousarray(blk[:, 2:4]).view(np.float16).astype(F32)[:, 0]
    qs = blk[:, 4:68]
    qh = blk[:, 68:100]
    i = np.arange(QK)
    lo = (qs[:, i % 64] >> (2 * (i // 64)).astype(np.uint8)) & 3
    hi = (qh[:, i % 32] >> (i // 32).astype(np.uint8)) & 1
    return (lo | (hi << 2)).astype(np.uint8), d, m


def rotated_int8_dot(blk, x, signs=None, int8=True):
    """Matmul path check: one weight row (nb blocks) · activation x (nb*256),
    in the rotated domain with int8 activations (one scale per 256):
      x~ = FWHT(s*x) per block, qx = round(x~/dx), dx = max|x~|/127
      dot = sum_b dx_b * (d_b * sum_k grid[q_k] qx_k + m_b * sum_k qx_k)."""
    q, d, m = itq3_unpack(blk)
    X = x.reshape(-1, QK).astype(F32)
    if signs is not None:
        X = X * signs[None, :]
    Xr = fwht_cols(X.T).T
    if not int8:   # same formula with float activations (checks the algebra exactly)
        g = ITQ3_GRID[q.astype(np.intp)].astype(np.float64)
        Xr = Xr.astype(np.float64)
        return float((d * (g * Xr).sum(1) + m * Xr.sum(1)).sum())
    dx = np.abs(Xr).max(1) / F32(127)
    qx = np.rint(Xr / np.where(dx > 0, dx, 1)[:, None]).astype(np.int32)
    g = ITQ3_GRID.astype(np.int32)[q.astype(np.intp)]
    isum = (g * qx).sum(1)            # int32 exact: |sum| <= 256*127*127
    xsum = qx.sum(1)
    return float((dx.astype(np.float64) * (d * isum + m * xsum)).sum())


# ----------------------------------------------------------------------------
# References (original domain)
# ----------------------------------------------------------------------------

def ref_q4_0(W):
    """llama.cpp quantize_row_q4_0_ref: per-32 signed absmax, d = max/-8."""
    X = W.reshape(-1, 32).astype(F32)
    idx = np.abs(X).argmax(1)
    mx = X[np.arange(len(X)), idx]
    d = mx / F32(-8)
    with np.errstate(divide="ignore"):
        idd = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    q = np.minimum(15, (X * idd[:, None] + F32(8.5)).astype(np.int8))
    d16 = to_f16(d)
    return ((q.astype(F32) - 8) * d16[:, None]).reshape(W.shape)


def ref_affine32_3bit(W):
    """3-bit per-32 affine min/max (Q4_1 style with 8 levels), fp16 d and min: 4.0 bpw."""
    X = W.reshape(-1, 32).astype(F32)
    mn = X.min(1)
    mx = X.max(1)
    d = (mx - mn) / F32(7)
    with np.errstate(divide="ignore"):
        idd = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    q = np.clip(((X - mn[:, None]) * idd[:, None] + F32(0.5)).astype(np.int8), 0, 7)
    return (q.astype(F32) * to_f16(d)[:, None] + to_f16(mn)[:, None]).reshape(W.shape)


def ref_sym32_3bit(W, grid):
    """3-bit per-32 symmetric (odd grid, rms init + 8-cand search + LS), one fp16 scale: 3.5 bpw."""
    X = W.reshape(-1, 32).astype(F32)
    X = np.ascontiguousarray(X.T)  # (32, nb)
    # reuse generic code with a 32-row tree
    best = np.full(X.shape[1], -1.0, F32)
    rms = np.sqrt((X * X).mean(0, dtype=F32))
    d0 = grid.c_rms * rms
    bd = d0.copy()
    for f in cand_factors(8, 0.7, 1.4):
        dk = d0 * f
        g = assign(X, grid, dk, None)[1]
        sgy = (g * X).sum(0)
        sg2 = (g * g).sum(0)
        sc = np.where(sg2 > 0, sgy * sgy / np.where(sg2 > 0, sg2, 1), 0)
        b = sc > best
        best = np.where(b, sc, best)
        bd = np.where(b, np.where(sg2 > 0, sgy / np.where(sg2 > 0, sg2, 1), 0), bd)
    bd = to_f16(bd)
    g = assign(X, grid, np.where(bd != 0, bd, F32(1)), None)[1]
    return (g * bd).T.reshape(W.shape)
