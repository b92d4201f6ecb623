"""Constants, the deterministic primitives (they define the bit-exact reference), the grids and the generic
per-block quantiser of the ITQ3_S design study."""
import sys
import time

import numpy as np

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
