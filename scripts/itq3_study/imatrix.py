"""The importance-matrix (imatrix) methods of the design study: weighted refit and search, Jacobi, LDLQ."""
import numpy as np

from .core import F32, QK, assign, cand_factors, fwht_cols, to_f16, tree_sum


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
