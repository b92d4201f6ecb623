#!/usr/bin/env python3
"""Derive the constant tables of the ITQ3_S weight type (GGML_TYPE_ITQ3_S, format v1).

Deterministic.  Usage (from the repository root):

    python3 scripts/derive_itq3_tables.py            # (re)write the tables
    python3 scripts/derive_itq3_tables.py --check    # exit 1 if they differ
    python3 scripts/derive_itq3_tables.py --report   # print the derivation log

What is derived (docs/itq3-design.md has the measurements behind each choice)
-----------------------------------------------------------------------------
* ``itq3_grid[8]`` (int8): the 8-level Lloyd-Max quantiser of N(0, 1) (Lloyd
  iterations with exact Gaussian cell moments, scipy.stats.norm), scaled so the
  outer level is 127 and rounded to integers: {-127, -79, -45, -14, 14, 45, 79, 127}.
  The script asserts that this reproduces the format's grid.
* ``THR2[7]`` = grid[k] + grid[k+1]: twice the decision mid-points, integers.
  A rotated value x (in units of d) gets code #{k : 2x >= THR2[k]} (ties go up).
* ``itq3_C`` = float32(0.0169463) (bits 0x3c8ad2f8): the Gaussian-MSE-optimal
  step d/sigma for the grid, to 6 significant digits (the design study's value;
  the exact optimum is printed by --report and asserted to be within 1e-6).
* ``itq3_F[4]``: the 4 scale-candidate factors 0.8 * (1.25/0.8)^(k/3), k = 0..3,
  computed in float64 and rounded to float32 (bits 0x3f4ccccd, 0x3f6da63c,
  0x3f89e242, 0x3fa00000; asserted).
* ``VAR_EPS`` = 2^-80 (float32): blocks with var <= VAR_EPS are "flat".
* ``itq3_signs[256]``: the fixed random +-1 vector S applied before the FWHT
  (y = FWHT256(S * w); decode w = S * FWHT256(y)).  One draw, no rejection:
  ``bits = numpy.random.default_rng(20260327).integers(0, 2, 256)``,
  ``S = 1 - 2 * bits`` (bit 0 -> +1.0, bit 1 -> -1.0).  Exactly +-1, so the
  multiply is exact.  The report gives max |FWHT256(S)| (the image of the
  constant vector), which should be far from 16 (= S being a Walsh function).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
C_HEADER = ROOT / "ggml-patches" / "src" / "itq3-tables.h"
PY_TABLES = ROOT / "rotaryquant" / "quants" / "itq3_tables.py"
COMMAND = "python3 scripts/derive_itq3_tables.py"

QK = 256
SEED = 20260327
GRID = (-127, -79, -45, -14, 14, 45, 79, 127)          # the format (asserted below)
C_LITERAL = 0.0169463                                   # the format (float32 0x3c8ad2f8)
C_BITS = 0x3C8AD2F8
F_BITS = (0x3F4CCCCD, 0x3F6DA63C, 0x3F89E242, 0x3FA00000)
VAR_EPS = 2.0 ** -80
LLOYD_ITERS = 4000


# --------------------------------------------------------------------------
# grid and step
# --------------------------------------------------------------------------

def lloyd_max_gauss(n: int = 8) -> np.ndarray:
    """8-level Lloyd-Max quantiser of N(0,1) (float64, ascending)."""
    from scipy.stats import norm
    lv = np.linspace(-2.0, 2.0, n)
    for _ in range(LLOYD_ITERS):
        t = np.concatenate(([-np.inf], 0.5 * (lv[1:] + lv[:-1]), [np.inf]))
        a, b = t[:-1], t[1:]
        new = (norm.pdf(a) - norm.pdf(b)) / (norm.cdf(b) - norm.cdf(a))
        if np.max(np.abs(new - lv)) < 1e-15:
            lv = new
            break
        lv = new
    return lv


def gauss_mse(levels, s: float) -> float:
    """E[(X - Q(X))^2] for X ~ N(0,1), Q = nearest of levels*s (closed-form cell moments)."""
    from scipy.stats import norm
    lv = np.asarray(levels, np.float64) * s
    t = np.concatenate(([-np.inf], 0.5 * (lv[1:] + lv[:-1]), [np.inf]))
    a, b = np.clip(t[:-1], -60, 60), np.clip(t[1:], -60, 60)

    def m2(x):
        return norm.cdf(x) - x * norm.pdf(x)
    e = (m2(b) - m2(a)) - 2 * lv * (norm.pdf(a) - norm.pdf(b)) + lv ** 2 * (norm.cdf(b) - norm.cdf(a))
    return float(e.sum())


def gauss_opt_step(levels) -> tuple[float, float]:
    from scipy.optimize import minimize_scalar
    r = minimize_scalar(lambda s: gauss_mse(levels, s), bounds=(1e-4, 0.1), method="bounded",
                        options={"xatol": 1e-13})
    return float(r.x), float(r.fun)


# --------------------------------------------------------------------------
# sign vector
# --------------------------------------------------------------------------

def signs() -> np.ndarray:
    """(256,) float64 in {+1, -1}: S = 1 - 2 * default_rng(SEED).integers(0, 2, 256)."""
    bits = np.random.default_rng(SEED).integers(0, 2, QK)
    return 1.0 - 2.0 * bits.astype(np.float64)


def hadamard() -> np.ndarray:
    """Sylvester Hadamard matrix (natural order = the butterfly FWHT), float64, unscaled."""
    h = np.array([[1.0]])
    while h.shape[0] < QK:
        h = np.block([[h, h], [h, -h]])
    return h


# --------------------------------------------------------------------------
# derivation + rendering
# --------------------------------------------------------------------------

def derive() -> dict:
    lm = lloyd_max_gauss()
    grid = np.round(lm * 127.0 / lm[-1]).astype(np.int64)
    assert tuple(int(v) for v in grid) == GRID, grid
    thr2 = grid[1:] + grid[:-1]
    c_opt, mse_opt = gauss_opt_step(grid)
    c32 = np.float32(C_LITERAL)
    assert int(c32.view(np.uint32)) == C_BITS
    assert abs(c_opt - float(c32)) < 1e-6, c_opt
    k = np.arange(4, dtype=np.float64)
    f32 = (0.8 * (1.25 / 0.8) ** (k / 3.0)).astype(np.float32)
    assert tuple(int(v) for v in f32.view(np.uint32)) == F_BITS, [hex(v) for v in f32.view(np.uint32)]

    s = signs()
    img = hadamard() @ s / 16.0           # FWHT256(S) = FWHT256 of the all-ones vector after the flip
    wmax = float(np.max(np.abs(img)))
    assert abs(float(img @ img) - QK) < 1e-9
    assert wmax < 8.0, wmax               # far from a Walsh function (that would give 16)
    # typical value for a random draw: quantiles of the same statistic over other seeds
    ref = np.array([np.max(np.abs(hadamard() @ (1.0 - 2.0 * np.random.default_rng(i).integers(0, 2, QK))))
                    for i in range(200)]) / 16.0
    return {
        "grid": grid,
        "grid_float": lm,
        "thr2": thr2,
        "c": c32,
        "c_opt": c_opt,
        "mse_opt": mse_opt,
        "mse_c": gauss_mse(grid, float(c32)),
        "mse_float_grid": gauss_mse(lm, 1.0),
        "f": f32,
        "var_eps": np.float32(VAR_EPS),
        "signs": s,
        "signs_nneg": int(np.sum(s < 0)),
        "signs_wht_max": wmax,
        "signs_wht_argmax": int(np.argmax(np.abs(img))),
        "signs_wht_ref": (float(np.percentile(ref, 5)), float(np.median(ref)), float(np.percentile(ref, 95))),
    }


def _c_float(v) -> str:
    s = "%.9g" % float(np.float32(v))
    if not any(ch in s for ch in ".en"):
        s += ".0"
    return s + "f"


def _py_float(v) -> str:
    return repr(float(np.float32(v)))    # the exact double value of the float32


def _bits(v) -> str:
    return "0x%08x" % int(np.float32(v).view(np.uint32))


def render_c(t: dict) -> str:
    o = []
    o.append("/* GENERATED FILE - DO NOT EDIT.")
    o.append(f" * Generated by `{COMMAND}` (sign seed {SEED});")
    o.append(f" * verify with `{COMMAND} --check`.")
    o.append(" *")
    o.append(" * Constant tables of GGML_TYPE_ITQ3_S, format v1 (see docs/itq3-design.md):")
    o.append(" *   itq3_grid:  8-level Lloyd-Max N(0,1) grid scaled to +-127, rounded (int8);")
    o.append(" *               decoded rotated value = d * itq3_grid[q] + m")
    o.append(" *               thresholds (not stored): THR2[k] = itq3_grid[k] + itq3_grid[k+1] =")
    o.append(" *               {" + ", ".join("%d" % v for v in t["thr2"]) + "};"
             " code(x2) = #{k : x2 >= (float)THR2[k]}")
    o.append(f" *   itq3_C:     Gaussian-optimal step d/sigma for the grid (bits {_bits(t['c'])})")
    o.append(" *   itq3_F:     the 4 scale-candidate factors 0.8*(1.25/0.8)^(k/3) (bits "
             + ", ".join(_bits(v) for v in t["f"]) + ")")
    o.append(" *   itq3_signs: fixed random +-1 vector S (exactly 1.0f / -1.0f):")
    o.append(" *               quantise y = FWHT256(w[i] * itq3_signs[i]); dequantise w[i] = FWHT256(y)[i] *")
    o.append(" *               itq3_signs[i] (after the final * 0.0625f)")
    o.append(" *   VAR_EPS (not stored) = 0x1p-80f: a block with !(var > VAR_EPS) is flat")
    o.append(" */")
    o.append("#pragma once")
    o.append("")
    o.append("#include <stdint.h>")
    o.append("")
    o.append("static const int8_t itq3_grid[8] = { " + ", ".join("%d" % v for v in t["grid"]) + " };")
    o.append("")
    o.append(f"static const float itq3_C = {_c_float(t['c'])}; /* {_bits(t['c'])} */")
    o.append("")
    o.append("static const float itq3_F[4] = { " + ", ".join(_c_float(v) for v in t["f"]) + " };"
             " /* " + ", ".join(_bits(v) for v in t["f"]) + " */")
    o.append("")
    o.append("static const float itq3_signs[256] = {")
    for r in range(0, QK, 16):
        o.append("    " + " ".join(("1.0f," if v > 0 else "-1.0f,").rjust(6)
                                   for v in t["signs"][r:r + 16]).rstrip())
    o.append("};")
    o.append("")
    return "\n".join(o)


def render_py(t: dict) -> str:
    o = []
    o.append('"""Constant tables of the ITQ3_S weight type, format v1 (GENERATED - DO NOT EDIT).')
    o.append("")
    o.append(f"Generated by `{COMMAND}`;")
    o.append(f"verify with `{COMMAND} --check`.")
    o.append("Every float below is the exact value of a float32 (wrap with numpy.float32);")
    o.append("the C twin is ggml-patches/src/itq3-tables.h.  See docs/itq3-design.md.")
    o.append('"""')
    o.append("")
    o.append(f"QK = {QK}")
    o.append(f"SEED = {SEED}")
    o.append("")
    o.append("# 8-level Lloyd-Max N(0,1) grid scaled to +-127 and rounded")
    o.append("GRID = [" + ", ".join("%d" % v for v in t["grid"]) + "]")
    o.append("# THR2[k] = GRID[k] + GRID[k+1]; code(x2) = #{k : x2 >= THR2[k]}")
    o.append("THR2 = [" + ", ".join("%d" % v for v in t["thr2"]) + "]")
    o.append("")
    o.append(f"# Gaussian-optimal d/sigma for GRID, float32 bits {_bits(t['c'])}")
    o.append(f"C = {_py_float(t['c'])}")
    o.append("# scale-candidate factors 0.8*(1.25/0.8)**(k/3), float32 bits "
             + ", ".join(_bits(v) for v in t["f"]))
    o.append("F = [" + ", ".join(_py_float(v) for v in t["f"]) + "]")
    o.append("# a block with not (var > VAR_EPS) is flat (d = 0, m = mean of the rotated block)")
    o.append(f"VAR_EPS = {_py_float(t['var_eps'])}  # 2**-80")
    o.append("")
    o.append("# fixed random +-1 vector S applied before the FWHT:")
    o.append(f"# S = 1 - 2 * numpy.random.default_rng({SEED}).integers(0, 2, {QK})")
    o.append(f"# max |FWHT256(S)| = {t['signs_wht_max']:g} (of norm 16; a Walsh function would give 16)")
    o.append(f"SIGNS_WHT_MAX = {t['signs_wht_max']!r}")
    o.append("SIGNS = [")
    for r in range(0, QK, 16):
        o.append("    " + " ".join((f"{v:.1f},").rjust(5) for v in t["signs"][r:r + 16]))
    o.append("]")
    o.append("")
    return "\n".join(o)


def report(t: dict) -> str:
    lo, med, hi = t["signs_wht_ref"]
    return "\n".join([
        "Lloyd-Max N(0,1) 8 levels: " + ", ".join("%.6f" % v for v in t["grid_float"])
        + f"  (MSE {t['mse_float_grid']:.6f})",
        "grid (x127/max, rounded): " + ", ".join("%d" % v for v in t["grid"]),
        "THR2: " + ", ".join("%d" % v for v in t["thr2"]),
        f"C: optimum d/sigma {t['c_opt']:.9f} (MSE {t['mse_opt']:.6f}); "
        f"format C = {float(t['c']):.9g} ({_bits(t['c'])}, MSE {t['mse_c']:.6f})",
        "F: " + ", ".join("%.9g (%s)" % (float(v), _bits(v)) for v in t["f"]),
        "signs S: " + "".join("+" if v > 0 else "-" for v in t["signs"]),
        f"  {t['signs_nneg']} negative; max |FWHT256(S)| = {t['signs_wht_max']:g} at index "
        f"{t['signs_wht_argmax']} (= {t['signs_wht_max'] / 16:.4f} of ||S||; a constant block "
        f"puts at most {(t['signs_wht_max'] / 16) ** 2 * 100:.2f}% of its energy on one rotated "
        f"coordinate); random draws (200 seeds): 5%/50%/95% = {lo:g}/{med:g}/{hi:g}",
    ])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="regenerate in memory; exit 1 if the committed files differ")
    ap.add_argument("--report", action="store_true", help="print the derivation log")
    args = ap.parse_args(argv)

    t = derive()
    files = {C_HEADER: render_c(t), PY_TABLES: render_py(t)}
    if args.report or not args.check:
        print(report(t))
    if args.check:
        bad = [p for p, txt in files.items()
               if not p.exists() or p.read_text(encoding="utf-8") != txt]
        for p in bad:
            print(f"STALE: {p.relative_to(ROOT)} differs from a fresh derivation; "
                  f"run `{COMMAND}`", file=sys.stderr)
        if not bad:
            print("itq3 tables up to date")
        return 1 if bad else 0
    for p, txt in files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(txt, encoding="utf-8")
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
