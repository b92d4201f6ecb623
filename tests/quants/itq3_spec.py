"""Shared by the ITQ3_S reference tests (tests/quants/test_itq3_*.py), not a test module.

The centre piece is `scalar_quantize_block`: a literal, loop-by-loop transcription of
the format spec (docs/itq3-design.md, "Final specification") in numpy float32
scalars, written independently of the vectorised code (it shares only the constant
tables); with it the scalar packing, FWHT and dequantisation, and the special blocks.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # allow running without an installed package / PYTHONPATH
    sys.path.insert(0, str(ROOT))

from rotaryquant.quants import itq3_tables as tables  # noqa: E402

F32 = np.float32
QK = 256


# --------------------------------------------------------------------------
# literal scalar transcription of the spec (one block)
# --------------------------------------------------------------------------

def scalar_quantize_block(w, iw=None):
    """One block, loop by loop, float32 scalars.  Returns (q list, d16, m16, trace) with d16/m16 as
    np.float16 and trace the float32 intermediates (same keys as itq3._quantize_trace)."""
    f32 = np.float32
    S = [f32(v) for v in tables.SIGNS]
    GR = [int(v) for v in tables.GRID]
    TH = [int(v) for v in tables.THR2]
    C = f32(tables.C)
    Fk = [f32(v) for v in tables.F]
    VAR_EPS = f32(2.0 ** -80)
    CL = f32(1e15)  # input clamp: beyond it d and m saturate anyway, and the sums would overflow
    w = [CL if f32(v) > CL else (-CL if f32(v) < -CL else f32(v)) for v in w]
    iw = None if iw is None else [f32(v) for v in iw]

    def fwht(v):
        x = list(v)
        h = 1
        while h < QK:
            for i in range(0, QK, 2 * h):
                for j in range(i, i + h):
                    a = x[j]
                    b = x[j + h]
                    x[j] = a + b
                    x[j + h] = a - b
            h *= 2
        return [x[j] * f32(0.0625) for j in range(QK)]

    def tree(v):
        v = list(v)
        n = QK // 2
        while n >= 1:
            for i in range(n):
                v[i] = v[i] + v[i + n]
            n //= 2
        return v[0]

    def code(x2):
        c = 0
        for k in range(7):
            if x2 >= f32(TH[k]):
                c += 1
        return c

    def stats(q, t):
        sgt = tree([f32(GR[q[i]]) * t[i] for i in range(QK)])
        sg = 0
        sg2 = 0
        for i in range(QK):
            sg += GR[q[i]]
            sg2 += GR[q[i]] * GR[q[i]]
        den = f32(256 * sg2 - sg * sg)
        return sgt, sg, den

    def ls(sgt, sg, den):
        d = f32(256.0) * sgt / den if den > 0 else f32(0)
        o = -(d * f32(sg)) * f32(1.0 / 256)
        return d, o

    def f16_sat(x):
        x = f32(x)
        if x > f32(65504):
            x = f32(65504)
        elif x < f32(-65504):
            x = f32(-65504)
        return np.float16(x)

    # 1
    y = fwht([S[i] * w[i] for i in range(QK)])
    # 2
    sy = tree(y)
    ss = tree([y[i] * y[i] for i in range(QK)])
    mu = sy * f32(1.0 / 256)
    var = ss * f32(1.0 / 256) - mu * mu
    flat = not (var > VAR_EPS)
    # 3
    yc = [y[i] - mu for i in range(QK)]
    d0 = C * np.sqrt(f32(1) if flat else var)
    # 4
    if iw is None:
        best = f32(-1)
        b_sgt, b_sg, b_den = f32(0), 0, f32(0)
        for k in range(4):
            dk = d0 * Fk[k]
            inv = f32(2) / dk
            q = [code(yc[i] * inv) for i in range(QK)]
            sgt, sg, den = stats(q, yc)
            score = sgt * sgt / den if den > 0 else f32(0)
            if score > best:
                best, b_sgt, b_sg, b_den = score, sgt, sg, den
        d, o = ls(b_sgt, b_sg, b_den)
    else:
        best = f32(np.inf)
        d, o = f32(0), -(f32(0) * f32(0)) * f32(1.0 / 256)
        for k in range(4):
            dk = d0 * Fk[k]
            inv = f32(2) / dk
            q = [code(yc[i] * inv) for i in range(QK)]
            dl, ol = ls(*stats(q, yc))
            e = [y[i] - ((dl * f32(GR[q[i]]) + ol) + mu) for i in range(QK)]
            eh = fwht(e)
            E = [S[i] * eh[i] for i in range(QK)]
            score = tree([iw[i] * (E[i] * E[i]) for i in range(QK)])
            if score < best:
                best, d, o = score, dl, ol
    tr = dict(sy=sy, ss=ss, mu=mu, var=var, d0=d0, best=best, d_cand=d, o_cand=o)
    # 5
    for _ in range(3):
        dd = d if d > 0 else d0
        inv = f32(2) / dd
        q = [code((yc[i] - o) * inv) for i in range(QK)]
        sgt, sg, den = stats(q, yc)
        d, o = ls(sgt, sg, den)
    tr.update(d_lloyd=d, o_lloyd=o, sg=f32(sg))
    # 6 (norm-preserving step)
    if iw is None:
        syc2 = tree([yc[i] * yc[i] for i in range(QK)])
        if flat or not (d > 0):
            d = f32(0)
        else:
            d = np.sqrt(f32(256.0) * syc2 / den)
        d16 = f16_sat(d)
        m = mu if flat else (sy - f32(d16) * f32(sg)) * f32(1.0 / 256)
        tr.update(syc2=syc2)
    else:
        if flat or not (d > 0):
            d = f32(0)
        uh = fwht([f32(GR[q[i]]) for i in range(QK)])
        u = [S[i] * uh[i] for i in range(QK)]
        tn = [(iw[i] * w[i]) * u[i] for i in range(QK)]
        td = [(iw[i] * u[i]) * u[i] for i in range(QK)]
        tw = [(iw[i] * w[i]) * w[i] for i in range(QK)]
        tn[0] = f32(0)
        td[0] = f32(0)
        tw[0] = f32(0)
        num = tree(tn)
        dn = tree(td)
        ww = tree(tw)
        if (not flat) and dn > 0 and num > 0:
            d = np.sqrt(ww / dn)
        d16 = f16_sat(d)
        m = mu if flat else (w[0] - f32(d16) * u[0]) / (f32(16) * S[0])
        tr.update(num=num, dn=dn, ww=ww)
    tr.update(d=d, m=m)
    m16 = f16_sat(m)
    return q, d16, m16, tr


def scalar_pack(q, d16, m16):
    out = bytearray(100)
    out[0:2] = np.float16(d16).astype("<f2").tobytes()
    out[2:4] = np.float16(m16).astype("<f2").tobytes()
    for j in range(64):
        out[4 + j] = (q[j] & 3) | (q[64 + j] & 3) << 2 | (q[128 + j] & 3) << 4 | (q[192 + j] & 3) << 6
    for j in range(32):
        v = 0
        for b in range(8):
            v |= ((q[32 * b + j] >> 2) & 1) << b
        out[68 + j] = v
    return bytes(out)


def scalar_fwht(v):
    """FWHT256 (normalised), scalar butterflies h = 1, 2, ..., 128, then * 0.0625."""
    f32 = np.float32
    y = [f32(t) for t in v]
    h = 1
    while h < QK:
        for i in range(0, QK, 2 * h):
            for j in range(i, i + h):
                a, b = y[j], y[j + h]
                y[j], y[j + h] = a + b, a - b
        h *= 2
    return np.array([t * f32(0.0625) for t in y], dtype=f32)


def scalar_dequantize_block(blk):
    f32 = np.float32
    S = [f32(v) for v in tables.SIGNS]
    d = f32(np.frombuffer(blk[0:2], "<f2")[0])
    m = f32(np.frombuffer(blk[2:4], "<f2")[0])
    y = []
    for i in range(QK):
        qi = ((blk[4 + i % 64] >> (2 * (i // 64))) & 3) | (((blk[68 + i % 32] >> (i // 32)) & 1) << 2)
        y.append(d * f32(tables.GRID[qi]) + m)
    x = scalar_fwht(y)
    return np.array([S[i] * x[i] for i in range(QK)], dtype=f32)


# --------------------------------------------------------------------------
# test data
# --------------------------------------------------------------------------

def _special_blocks() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    g = rng.standard_normal((4, QK)).astype(F32)
    out = {
        "uniform": rng.uniform(-1, 1, QK).astype(F32),
        "gauss": (g[0] * F32(0.02)).astype(F32),
        "gauss_offset": (g[1] * F32(0.02) + F32(0.05)).astype(F32),
        "student_t2": (rng.standard_t(2, QK) * 0.01).astype(F32),
        "cauchy": (rng.standard_cauchy(QK) * 0.01).astype(F32),
        "outlier_cols": np.where(np.arange(QK) % 37 == 3, g[2] * 30, g[2]).astype(F32),
        "zero": np.zeros(QK, F32),
        "constant": np.full(QK, F32(1e-3)),
        "spike0": np.eye(1, QK, 0, dtype=F32)[0] * F32(0.37),
        "spike100": np.eye(1, QK, 100, dtype=F32)[0] * F32(-2.5),
        "two_values": np.where(np.arange(QK) < 128, F32(1), F32(-1)).astype(F32),
        "integers": rng.integers(-4, 5, QK).astype(F32),
        "huge_1e30": (g[3] * F32(1e30)).astype(F32),
        "huge_1e18": (g[3] * F32(1e18)).astype(F32),
        "big_1e4": (g[3] * F32(2e4)).astype(F32),
        "tiny_1e-30": (g[0] * F32(1e-30)).astype(F32),
        "tiny_1e-8": (g[1] * F32(1e-8)).astype(F32),
        "denormal": (g[2] * F32(1e-40)).astype(F32),
        "fp32_max": np.full(QK, np.finfo(F32).max, F32),
        "inf": np.where(np.arange(QK) == 5, F32(np.inf), g[0]).astype(F32),
        "nan": np.where(np.arange(QK) == 9, F32(np.nan), g[1]).astype(F32),
    }
    return out
