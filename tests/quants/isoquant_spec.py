"""Shared by the ISOQUANT reference tests (tests/quants/test_isoquant_*.py), not a test module: the literal
scalar transcription of the spec (`_spec_quantize`, `_spec_dequantize`), the edge-case blocks and an
independent Lloyd-Max quadrature (numpy only).
"""

from __future__ import annotations

import math
import struct
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # allow running without an installed package / PYTHONPATH
    sys.path.insert(0, str(ROOT))

from rotaryquant.quants import isoquant as iq  # noqa: E402
from rotaryquant.quants import isoquant_tables as tables  # noqa: E402

DIM = 128
F32 = np.float32
PRED_REL_MSE = DIM * tables.LLOYD_MSE_PER_COORD  # expected ||x - x_hat||^2 / ||x||^2


def _cell_moments(lo, hi, n=200, dim=DIM):
    """(∫ f, ∫ x f) over [lo, hi] for f ∝ (1-x^2)^((dim-3)/2) by Gauss-Legendre (numpy only)."""
    xg, wg = np.polynomial.legendre.leggauss(n)
    x = 0.5 * (hi - lo) * xg + 0.5 * (hi + lo)
    w = 0.5 * (hi - lo) * wg
    f = (1.0 - x * x) ** ((dim - 3) / 2.0)
    return float(np.sum(w * f)), float(np.sum(w * x * f))


def _lloyd_update(cb, bnd, dim=DIM):
    t = np.concatenate(([-1.0], np.asarray(bnd, np.float64), [1.0]))
    z = _cell_moments(-1.0, 1.0, 400, dim)[0]
    out, mse = [], 0.0
    ex2 = 1.0 / dim
    for k in range(len(cb)):
        m0, m1 = _cell_moments(t[k], t[k + 1], dim=dim)
        out.append(m1 / m0)
        mse += (2.0 * cb[k] * m1 - cb[k] ** 2 * m0) / z
    return np.array(out), ex2 - mse


def _spec_quantize(x, mode, variant="v3", bits=3):
    """Literal scalar transcription of the spec (the future C code), one block of 128 or 64 values."""
    DIM = len(x)  # noqa: N806  (128: ISOQUANT3_0/4_0; 64: ISOQUANT3_64/4_64)
    if DIM == 64:
        cb, bnd = (iq.CODEBOOK_64, iq.BOUNDS_64) if bits == 3 else (iq.CODEBOOK4_64, iq.BOUNDS4_64)
    else:
        cb, bnd = (iq.CODEBOOK, iq.BOUNDS) if bits == 3 else (iq.CODEBOOK4, iq.BOUNDS4)
    scale = iq.WHT_SCALE if DIM == 128 else iq.WHT_SCALE_64
    mats = {"v3": iq.SO4, "v2": iq.SO4, "v1": iq.SO3, "none": None}[variant]

    def tree(a):
        a = list(a)
        s = DIM // 2
        while s >= 1:
            for i in range(s):
                a[i] = a[i] + a[i + s]
            s //= 2
        return a[0]

    sd = math.sqrt(tree(float(v) * float(v) for v in x))
    v = [F32(float(xi) / sd) for xi in x] if sd > 0.0 else [F32(0.0)] * DIM
    if variant in ("v3", "v1"):
        v = [vi * si for vi, si in zip(v, iq.SIGNS)]       # t[i] = x[i] * iq3_signs[i]
        ln = 1
        while ln < DIM:
            for i in range(0, DIM, 2 * ln):
                for j in range(i, i + ln):
                    a, b = v[j], v[j + ln]
                    v[j], v[j + ln] = a + b, a - b
            ln *= 2
        v = [vi * scale for vi in v]
    if mats is not None:
        y = []
        for g in range(DIM // 4):
            m, u = mats[g], v[4 * g:4 * g + 4]
            y += [((m[r, 0] * u[0] + m[r, 1] * u[1]) + m[r, 2] * u[2]) + m[r, 3] * u[3]
                  for r in range(4)]
    else:
        y = v
    assert all(type(t) is F32 for t in y)
    idx = [sum(1 for b in bnd if yi > b) for yi in y]
    c = [float(cb[k]) for k in idx]
    if mode == "raw":
        dd = sd
    elif mode == "preserve":
        dd = sd / math.sqrt(tree(ci * ci for ci in c))
    elif mode == "lsq":
        dd = (sd * tree(float(yi) * ci for yi, ci in zip(y, c))) / tree(ci * ci for ci in c)
    else:
        yc = tree(float(yi) * ci for yi, ci in zip(y, c))
        dd = sd / yc if yc > 0 else 0.0
    dd = dd if dd < 65504.0 else 65504.0
    out = bytearray(struct.pack("<e", float(F32(dd))))   # independent RNE fp32 -> fp16
    if bits == 4:   # two indices per byte, the even one in the low nibble
        out += bytes(idx[2 * j] | (idx[2 * j + 1] << 4) for j in range(DIM // 2))
        return bytes(out)
    for gi in range(DIM // 8):
        w = sum(idx[8 * gi + k] << (3 * k) for k in range(8))
        out += bytes((w & 0xFF, (w >> 8) & 0xFF, w >> 16))
    return bytes(out)


def _spec_dequantize(blk, variant="v3", bits=3, dim=DIM):
    DIM = dim  # noqa: N806
    if DIM == 64:
        cb, scale = iq.CODEBOOK_64 if bits == 3 else iq.CODEBOOK4_64, iq.WHT_SCALE_64
    else:
        cb, scale = iq.CODEBOOK if bits == 3 else iq.CODEBOOK4, iq.WHT_SCALE
    mats = {"v3": iq.SO4, "v2": iq.SO4, "v1": iq.SO3, "none": None}[variant]
    blk = [int(t) for t in bytes(blk)]
    d = F32(struct.unpack("<e", bytes(blk[:2]))[0])
    y = []
    if bits == 4:
        for j in range(DIM // 2):
            y += [d * cb[blk[2 + j] & 15], d * cb[blk[2 + j] >> 4]]
    for gi in range(DIM // 8 if bits == 3 else 0):
        w = blk[2 + 3 * gi] | (blk[3 + 3 * gi] << 8) | (blk[4 + 3 * gi] << 16)
        y += [d * cb[(w >> (3 * k)) & 7] for k in range(8)]
    if mats is not None:
        v = []
        for g in range(DIM // 4):
            m, u = mats[g], y[4 * g:4 * g + 4]
            v += [((m[0, r] * u[0] + m[1, r] * u[1]) + m[2, r] * u[2]) + m[3, r] * u[3]
                  for r in range(4)]
    else:
        v = y
    if variant in ("v3", "v1"):
        ln = 1
        while ln < DIM:
            for i in range(0, DIM, 2 * ln):
                for j in range(i, i + ln):
                    a, b = v[j], v[j + ln]
                    v[j], v[j + ln] = a + b, a - b
            ln *= 2
        v = [vi * scale for vi in v]
        v = [vi * si for vi, si in zip(v, iq.SIGNS)]       # after the scale: t[i] *= iq3_signs[i]
    return np.array(v, dtype=F32)


def _edge_blocks():
    rng = np.random.default_rng(99)
    blocks = [
        rng.standard_normal(DIM),
        rng.standard_t(3, DIM) * 1e4,
        np.zeros(DIM),
        np.full(DIM, 1e-30),
        np.full(DIM, 1e30),
        rng.standard_normal(DIM) * 10.0 ** rng.uniform(-40, 38, DIM),   # mixed scales
        rng.standard_normal(DIM) * 1e-3 + 300.0,                        # d ~ 3400
    ]
    spike = np.zeros(DIM)
    spike[3] = -7.0
    blocks.append(spike)
    blocks = np.clip(np.array(blocks), -3.4e38, 3.4e38)
    nonfinite = rng.standard_normal((3, DIM))
    nonfinite[0, 5] = np.nan
    nonfinite[1, 9] = np.inf
    nonfinite[2, 1::2] = -np.inf
    return np.concatenate([blocks, nonfinite]).astype(F32)
