#!/usr/bin/env python3
"""Derive the offline constant tables of the ISOQUANT3_0 / ISOQUANT4_0 KV-cache types.

Deterministic.  Usage (from the repository root):

    python3 scripts/derive_isoquant_tables.py            # (re)write the tables
    python3 scripts/derive_isoquant_tables.py --check    # exit 1 if they differ
    python3 scripts/derive_isoquant_tables.py --report   # print the derivation log

What is derived
---------------
* ``iq3_codebook[8]``: the 3-bit Lloyd-Max quantizer for the exact marginal
  density of one coordinate of a uniform random unit vector in R^128,
  f(x) ∝ (1 - x^2)^((128-3)/2) on [-1, 1].  Cell masses use the regularised
  incomplete beta function and cell first moments use their closed form
  ∫ x (1-x^2)^a dx = -(1-x^2)^(a+1) / (2(a+1)), so each Lloyd iteration is
  exact to float64 rounding.  Symmetry is imposed exactly: only the positive
  half is iterated and mirrored, hence the middle boundary is exactly 0.
  Centroids are rounded to float32; boundaries are float32((c_k+c_{k+1})/2)
  computed in float64 from the float64 centroids.
* ``iq4_codebook[16]``, ``iq4_bounds[15]``: the same derivation with 16 levels
  (4-bit, ISOQUANT4_0); rotation, signs and scale are shared with the 3-bit type.
* ``iq3_64_codebook[8]``, ``iq4_64_codebook[16]`` and their bounds: the same
  derivation for R^64, f(x) ∝ (1 - x^2)^(61/2) (a wider marginal than R^128's,
  so derived, not scaled), for the 64-wide types ISOQUANT3_64 / ISOQUANT4_64
  (head size 64).  Their rotation reuses the first 64 signs and the first 16
  SO(4)/SO(3) groups below, with ``iq64_wht_scale`` = float32(1/sqrt(64)).
* ``iq3_so4[32][16]``: for each of the 32 groups of 4 coordinates the
  row-major 4x4 matrix of v -> q_L * v * conj(q_R) (Hamilton product, v as
  the quaternion (w, x, y, z)), with (q_L, q_R) uniform on S^3 drawn from
  ``numpy.random.default_rng(SEED)``; computed in float64, rounded to float32.
* ``iq3_so3[32][16]``: the single-quaternion conjugation v -> q_L v conj(q_L)
  (the "v1" ablation).  It is written as blockdiag(1, R3(q_L)) so that the
  invariant direction e_0 of every group is kept *exactly* in float32.
* ``iq3_signs[128]``: the fixed random +-1 vector S applied before the WHT
  (v = WHT(S * xh); the inverse multiplies by S after the final WHT scaling).
  Drawn from a *separate* stream so the quaternions above are unchanged:
  ``bits = numpy.random.default_rng(SEED + 1).integers(0, 2, 128)``,
  ``S = 1 - 2 * bits`` (bit 0 -> +1.0, bit 1 -> -1.0).  Exactly +-1, so the
  multiply is an exact (sign-only) float operation.  Without S the WHT maps a
  constant offset across channels onto the single coordinate 0.
* ``iq3_wht_scale`` = float32(1/sqrt(128)).

Outputs: ``ggml-patches/src/isoquant-tables.h`` (C) and
``rotaryquant/quants/isoquant_tables.py`` with ``isoquant_tables_so.py`` (Python: the
SO(4)/SO(3) matrices are a module of their own, re-exported by ``isoquant_tables``), all generated.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np
from scipy import integrate, special

SEED = 20260808
DIM = 128
NGROUPS = DIM // 4
NLEVELS = 8     # ISOQUANT3_0
NLEVELS4 = 16   # ISOQUANT4_0
DIM64 = 64      # ISOQUANT3_64 / ISOQUANT4_64 (head size 64)
LLOYD_MAX_ITERS = 100_000

ROOT = Path(__file__).resolve().parent.parent
C_HEADER = ROOT / "ggml-patches" / "src" / "isoquant-tables.h"
PY_TABLES = ROOT / "rotaryquant" / "quants" / "isoquant_tables.py"
PY_TABLES_SO = ROOT / "rotaryquant" / "quants" / "isoquant_tables_so.py"
COMMAND = "python3 scripts/derive_isoquant_tables.py"

# exponent of the marginal density (1 - x^2)^A
A_EXP = (DIM - 3) / 2.0


# --------------------------------------------------------------------------
# Lloyd-Max codebook for the sphere marginal
# --------------------------------------------------------------------------

def _half_beta(a: float = A_EXP) -> float:
    """∫_0^1 (1-x^2)^a dx = B(1/2, a+1) / 2."""
    return 0.5 * math.exp(special.betaln(0.5, a + 1.0))


def _mass(lo: float, hi: float, a: float = A_EXP) -> float:
    """Unnormalised ∫_lo^hi (1-x^2)^a dx for 0 <= lo < hi <= 1."""
    hb = _half_beta(a)
    if hi >= 1.0:  # upper tail: use the complementary function (no cancellation)
        return hb * float(special.betaincc(0.5, a + 1.0, lo * lo))
    return hb * float(special.betainc(0.5, a + 1.0, hi * hi)
                      - special.betainc(0.5, a + 1.0, lo * lo))


def _first_moment(lo: float, hi: float, a: float = A_EXP) -> float:
    """Unnormalised ∫_lo^hi x (1-x^2)^a dx (closed form)."""
    a1 = a + 1.0
    return ((1.0 - lo * lo) ** a1 - (1.0 - hi * hi) ** a1) / (2.0 * a1)


def density(x, a: float = A_EXP):
    """Normalised marginal density on [-1, 1]."""
    return (1.0 - np.square(x)) ** a / (2.0 * _half_beta(a))


def _exponent(dim: int) -> float:
    """Exponent of the marginal density of one coordinate of a unit vector in R^dim."""
    return (dim - 3) / 2.0


def lloyd_step(c_pos: np.ndarray, dim: int = DIM) -> np.ndarray:
    """One Lloyd iteration on the positive half (levels c_pos ascending > 0)."""
    a = _exponent(dim)
    t = np.concatenate(([0.0], 0.5 * (c_pos[:-1] + c_pos[1:]), [1.0]))
    return np.array([_first_moment(t[k], t[k + 1], a) / _mass(t[k], t[k + 1], a)
                     for k in range(len(c_pos))])


def lloyd_max(nlevels: int = NLEVELS, dim: int = DIM) -> tuple[np.ndarray, int, float]:
    """Return (float64 centroids ascending [nlevels], iterations, final step size)."""
    sigma = 1.0 / math.sqrt(dim)
    # start from a uniform grid spanning +-4 sigma; Lloyd is globally convergent for log-concave f
    c_pos = sigma * (8.0 / nlevels) * (np.arange(nlevels // 2) + 0.5)
    step = float("inf")
    it = 0
    for it in range(1, LLOYD_MAX_ITERS + 1):  # noqa: B007  (returned: the iterations it took)
        new = lloyd_step(c_pos, dim)
        step = float(np.max(np.abs(new - c_pos)))
        c_pos = new
        # the float64 evaluation of one step is accurate to ~1e-15 (absolute);
        # stop once the update is at that noise floor (float32 ulp is ~1e-9)
        if step <= 1e-14:
            break
    else:  # pragma: no cover - would indicate a broken derivation
        raise RuntimeError("Lloyd-Max did not converge")
    return np.concatenate((-c_pos[::-1], c_pos)), it, step


def quantizer_mse(centroids: np.ndarray, bounds: np.ndarray, dim: int = DIM) -> float:
    """Per-coordinate MSE E[(X - Q(X))^2], Q given by centroids/bounds (float64).

    Uses E[X^2] = 1/dim and the closed-form cell moments:
        MSE = Σ_k ∫_cell (x - c_k)^2 f = E[X^2] - Σ_k (2 c_k m1_k - c_k^2 m0_k).
    """
    a = _exponent(dim)
    z = 2.0 * _half_beta(a)
    t = np.concatenate(([-1.0], bounds, [1.0]))
    acc = 1.0 / dim
    for k, c in enumerate(centroids):
        lo, hi = t[k], t[k + 1]
        if lo >= 0.0:
            m0, m1 = _mass(lo, hi, a), _first_moment(lo, hi, a)
        elif hi <= 0.0:  # mirror
            m0, m1 = _mass(-hi, -lo, a), -_first_moment(-hi, -lo, a)
        else:
            m0 = _mass(0.0, -lo, a) + _mass(0.0, hi, a)
            m1 = _first_moment(0.0, hi, a) - _first_moment(0.0, -lo, a)
        acc -= (2.0 * c * m1 - c * c * m0) / z
    return acc


def quantizer_mse_quad(centroids: np.ndarray, bounds: np.ndarray, dim: int = DIM) -> float:
    """Independent cross-check of quantizer_mse by adaptive quadrature."""
    a = _exponent(dim)
    t = np.concatenate(([-1.0], bounds, [1.0]))
    tot = 0.0
    for k, c in enumerate(centroids):
        val, _ = integrate.quad(lambda x, c=c: (x - c) ** 2 * density(x, a),
                                t[k], t[k + 1], epsabs=1e-17, epsrel=1e-12, limit=200)
        tot += val
    return tot


# --------------------------------------------------------------------------
# quaternion rotations
# --------------------------------------------------------------------------

def hamilton(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Hamilton product of quaternions (w, x, y, z), float64."""
    a1, b1, c1, d1 = p
    a2, b2, c2, d2 = q
    return np.array([
        a1 * a2 - b1 * b2 - c1 * c2 - d1 * d2,
        a1 * b2 + b1 * a2 + c1 * d2 - d1 * c2,
        a1 * c2 - b1 * d2 + c1 * a2 + d1 * b2,
        a1 * d2 + b1 * c2 - c1 * b2 + d1 * a2,
    ])


def conj(q: np.ndarray) -> np.ndarray:
    return np.array([q[0], -q[1], -q[2], -q[3]])


def so4_matrix(ql: np.ndarray, qr: np.ndarray) -> np.ndarray:
    """4x4 float64 matrix M with M @ v == q_L * v * conj(q_R)."""
    qrc = conj(qr)
    cols = [hamilton(hamilton(ql, e), qrc) for e in np.eye(4)]
    return np.stack(cols, axis=1)


def so3_matrix(q: np.ndarray) -> np.ndarray:
    """4x4 float64 matrix of v -> q v conj(q) = blockdiag(1, R3(q))."""
    w, x, y, z = q  # already unit
    m = np.zeros((4, 4))
    m[0, 0] = 1.0
    m[1:, 1:] = [
        [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
        [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
        [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
    ]
    return m


def quaternions() -> np.ndarray:
    """(32, 2, 4) float64 unit quaternions; [:,0] = q_L, [:,1] = q_R."""
    rng = np.random.default_rng(SEED)
    q = rng.standard_normal((NGROUPS, 2, 4))
    # explicit, fixed-order norm (no BLAS) so the float64 values are reproducible
    n = np.sqrt(((q[..., 0] * q[..., 0] + q[..., 1] * q[..., 1])
                 + q[..., 2] * q[..., 2]) + q[..., 3] * q[..., 3])
    return q / n[..., None]


# --------------------------------------------------------------------------
# sign vector (randomised Hadamard)
# --------------------------------------------------------------------------

def signs() -> np.ndarray:
    """(128,) float64 in {+1, -1}: S = 1 - 2 * default_rng(SEED + 1).integers(0, 2, 128)."""
    bits = np.random.default_rng(SEED + 1).integers(0, 2, DIM)
    return 1.0 - 2.0 * bits.astype(np.float64)


def hadamard(dim: int = DIM) -> np.ndarray:
    """Sylvester Hadamard matrix (natural order, = the butterfly WHT), float64, unscaled."""
    h = np.array([[1.0]])
    while h.shape[0] < dim:
        h = np.block([[h, h], [h, -h]])
    return h


# --------------------------------------------------------------------------
# derivation + rendering
# --------------------------------------------------------------------------

def codebook(nlevels: int, dim: int = DIM) -> dict:
    """Lloyd-Max codebook with nlevels levels for R^dim: float32 tables and the derivation log."""
    cb64, iters, last_step = lloyd_max(nlevels, dim)
    cb32 = cb64.astype(np.float32)
    bnd32 = (0.5 * (cb64[:-1] + cb64[1:])).astype(np.float32)
    # fixed-point residual of the float64 codebook
    resid = float(np.max(np.abs(lloyd_step(cb64[nlevels // 2:], dim) - cb64[nlevels // 2:])))
    return {
        "dim": dim,
        "codebook_f64": cb64,
        "codebook": cb32,
        "bounds": bnd32,
        "iterations": iters,
        "last_step": last_step,
        "fixed_point_residual": resid,
        "mse_per_coord": quantizer_mse(cb64, 0.5 * (cb64[:-1] + cb64[1:]), dim),
        "mse_per_coord_f32": quantizer_mse(cb32.astype(np.float64), bnd32.astype(np.float64), dim),
        "mse_per_coord_quad": quantizer_mse_quad(cb64, 0.5 * (cb64[:-1] + cb64[1:]), dim),
    }


def derive() -> dict:
    cb3 = codebook(NLEVELS)

    q = quaternions()
    so4 = np.stack([so4_matrix(q[g, 0], q[g, 1]) for g in range(NGROUPS)])
    so3 = np.stack([so3_matrix(q[g, 0]) for g in range(NGROUPS)])
    # sanity: the analytic SO(3) form equals the quaternion conjugation
    so3_ref = np.stack([so4_matrix(q[g, 0], q[g, 0]) for g in range(NGROUPS)])
    assert np.max(np.abs(so3 - so3_ref)) < 1e-14
    eye = np.eye(4)
    assert np.max(np.abs(so4 @ so4.transpose(0, 2, 1) - eye)) < 1e-14
    assert np.all(np.linalg.det(so4) > 0) and np.all(np.linalg.det(so3) > 0)

    s = signs()
    # S must not be (close to) a Walsh function, else the constant vector would still
    # land on few WHT coordinates: largest |WHT(S)| coefficient, in units of ||S||
    wht_s = hadamard() @ s / DIM
    dc_max = float(np.max(np.abs(wht_s)))
    assert dc_max < 0.5, dc_max
    # the 64-wide types use S[:64]: the same property for WHT-64
    dc_max64 = float(np.max(np.abs(hadamard(DIM64) @ s[:DIM64] / DIM64)))
    assert dc_max64 < 0.5, dc_max64

    return {
        **cb3,
        "cb4": codebook(NLEVELS4),
        "cb3_64": codebook(NLEVELS, DIM64),
        "cb4_64": codebook(NLEVELS4, DIM64),
        "signs_dc_max64": dc_max64,
        "signs": s,
        "signs_dc_max": dc_max,
        "signs_nneg": int(np.sum(s < 0)),
        "so4": so4.astype(np.float32).reshape(NGROUPS, 16),
        "so3": so3.astype(np.float32).reshape(NGROUPS, 16),
        "quats": q,
        "wht_scale": np.float32(1.0 / math.sqrt(DIM)),
    }


def _c_float(v) -> str:
    s = "%.9g" % float(np.float32(v))
    if not any(ch in s for ch in ".en"):
        s += ".0"
    return s + "f"


def _py_float(v) -> str:
    # the exact double value of the float32: float32(this) round-trips exactly
    return repr(float(np.float32(v)))


def render_c(t: dict) -> str:
    out = []
    out.append("/* GENERATED FILE - DO NOT EDIT.")
    out.append(f" * Generated by `{COMMAND}` (seed {SEED});")
    out.append(f" * verify with `{COMMAND} --check`.")
    out.append(" *")
    out.append(" * Constant tables of GGML_TYPE_ISOQUANT3_0 (see docs/isoquant-design.md):")
    out.append(" *   iq3_codebook: 3-bit Lloyd-Max levels for one coordinate of a uniform")
    out.append(" *                 unit vector in R^128, f(x) ~ (1-x^2)^62.5 on [-1,1]")
    out.append(f" *                 (per-coordinate MSE {t['mse_per_coord']:.6e},"
               f" relative MSE per vector {DIM * t['mse_per_coord']:.5f})")
    out.append(" *   iq3_bounds:   decision thresholds, idx = #{k : y > iq3_bounds[k]}")
    out.append(" *   iq3_so4:      per 4-group row-major 4x4 matrix of v -> qL v conj(qR)")
    out.append(" *   iq3_so3:      per 4-group row-major 4x4 matrix of v -> qL v conj(qL) (v1 ablation)")
    out.append(" *   iq3_signs:    fixed random +-1 vector S (exactly 1.0f / -1.0f) of the rotation")
    out.append(" *                 R = SO4 . WHT . diag(S): rotate t[i] = x[i] * iq3_signs[i] before the")
    out.append(" *                 WHT; the inverse multiplies by it after the final WHT scaling (v3, v1)")
    out.append(" *   iq3_wht_scale: float32(1/sqrt(128))")
    out.append(" *   iq4_codebook, iq4_bounds: the 16-level (4-bit) Lloyd-Max quantizer of the same")
    out.append(f" *                 density for GGML_TYPE_ISOQUANT4_0 (per-coordinate MSE {t['cb4']['mse_per_coord']:.6e},")
    out.append(f" *                 relative MSE per vector {DIM * t['cb4']['mse_per_coord']:.5f}); rotation as above")
    out.append(" */")
    out.append("#pragma once")
    out.append("")
    out.append(f"static const float iq3_wht_scale = {_c_float(t['wht_scale'])};")
    out.append("")
    out.append("static const float iq3_signs[128] = {")
    for r in range(0, DIM, 16):
        out.append("    " + " ".join(("1.0f," if v > 0 else "-1.0f,").rjust(6)
                                     for v in t["signs"][r:r + 16]).rstrip())
    out.append("};")
    out.append("")
    out.append("static const float iq3_codebook[8] = {")
    out.append("    " + ", ".join(_c_float(v) for v in t["codebook"][:4]) + ",")
    out.append("    " + ", ".join(_c_float(v) for v in t["codebook"][4:]) + ",")
    out.append("};")
    out.append("")
    out.append("static const float iq3_bounds[7] = {")
    out.append("    " + ", ".join(_c_float(v) for v in t["bounds"][:3]) + ",")
    out.append("    " + ", ".join(_c_float(v) for v in t["bounds"][3:]) + ",")
    out.append("};")
    for name in ("so4", "so3"):
        out.append("")
        out.append(f"static const float iq3_{name}[32][16] = {{")
        for g in range(NGROUPS):
            m = t[name][g]
            out.append(f"    {{ /* group {g} */")
            for r in range(4):
                out.append("        " + " ".join(_c_float(v) + "," for v in m[4 * r:4 * r + 4]))
            out.append("    },")
        out.append("};")
    cb4 = t["cb4"]
    out.append("")
    out.append(f"static const float iq4_codebook[{NLEVELS4}] = {{")
    for r in range(0, NLEVELS4, 4):
        out.append("    " + ", ".join(_c_float(v) for v in cb4["codebook"][r:r + 4]) + ",")
    out.append("};")
    out.append("")
    out.append(f"static const float iq4_bounds[{NLEVELS4 - 1}] = {{")
    for r in range(0, NLEVELS4 - 1, 4):
        out.append("    " + ", ".join(_c_float(v) for v in cb4["bounds"][r:r + 4]) + ",")
    out.append("};")
    out.append("")
    out.append("/* the 64-wide types (ISOQUANT3_64, ISOQUANT4_64): R = SO4 . WHT-64 . diag(S) with the first")
    out.append(f" * {DIM64} signs and the first {DIM64 // 4} groups of the tables above, WHT scale float32(1/sqrt({DIM64})),")
    out.append(f" * and Lloyd-Max codebooks of the R^{DIM64} marginal, f(x) ~ (1-x^2)^{(DIM64 - 3) / 2} (per-coordinate MSE")
    out.append(f" * {t['cb3_64']['mse_per_coord']:.6e} (3-bit), {t['cb4_64']['mse_per_coord']:.6e} (4-bit); relative MSE per vector"
               f" {DIM64 * t['cb3_64']['mse_per_coord']:.5f}, {DIM64 * t['cb4_64']['mse_per_coord']:.5f}) */")
    out.append(f"static const float iq64_wht_scale = {_c_float(np.float32(1.0 / math.sqrt(DIM64)))};")
    for name, key, n in (("iq3_64", "cb3_64", NLEVELS), ("iq4_64", "cb4_64", NLEVELS4)):
        out.append("")
        out.append(f"static const float {name}_codebook[{n}] = {{")
        for r in range(0, n, 4):
            out.append("    " + ", ".join(_c_float(v) for v in t[key]["codebook"][r:r + 4]) + ",")
        out.append("};")
        out.append("")
        out.append(f"static const float {name}_bounds[{n - 1}] = {{")
        for r in range(0, n - 1, 4):
            out.append("    " + ", ".join(_c_float(v) for v in t[key]["bounds"][r:r + 4]) + ",")
        out.append("};")
    out.append("")
    return "\n".join(out)


def render_py(t: dict) -> str:
    out = []
    out.append('"""Constant tables of the ISOQUANT3_0/4_0 KV-cache types (GENERATED - DO NOT EDIT).')
    out.append("")
    out.append(f"Generated by `{COMMAND}`;")
    out.append(f"verify with `{COMMAND} --check`.")
    out.append("Every float below is the exact value of a float32 (wrap with numpy.float32);")
    out.append("the C twin is ggml-patches/src/isoquant-tables.h.  See docs/isoquant-design.md.")
    out.append("The SO(4)/SO(3) block matrices SO4 and SO3 are generated into isoquant_tables_so.py")
    out.append("and re-exported here.")
    out.append('"""')
    out.append("")
    out.append("from .isoquant_tables_so import SO3, SO4  # noqa: F401  (re-exported)")
    out.append("")
    out.append(f"SEED = {SEED}")
    out.append(f"DIM = {DIM}")
    out.append("# per-coordinate MSE of the Lloyd-Max quantizer for a unit vector in R^128")
    out.append("# (6 significant digits; multiply by DIM for the expected relative MSE)")
    out.append(f"LLOYD_MSE_PER_COORD = {float('%.6e' % t['mse_per_coord'])!r}")
    out.append("")
    out.append(f"WHT_SCALE = {_py_float(t['wht_scale'])}")
    out.append("")
    out.append("# fixed random +-1 vector S applied before the WHT (v3, v1):")
    out.append(f"# S = 1 - 2 * numpy.random.default_rng({SEED} + 1).integers(0, 2, {DIM})")
    out.append("SIGNS = [")
    for r in range(0, DIM, 16):
        out.append("    " + " ".join((f"{v:.1f},").rjust(5) for v in t["signs"][r:r + 16]))
    out.append("]")
    out.append("")
    def float_list(name, values):
        out.append(f"{name} = [")
        out.extend(f"    {_py_float(v)}," for v in values)
        out.append("]")
        out.append("")

    float_list("CODEBOOK", t["codebook"])
    float_list("BOUNDS", t["bounds"])
    cb4 = t["cb4"]
    out.append(f"# ISOQUANT4_0: the {NLEVELS4}-level Lloyd-Max quantizer of the same density")
    out.append(f"LLOYD_MSE_PER_COORD4 = {float('%.6e' % cb4['mse_per_coord'])!r}")
    out.append("")
    float_list("CODEBOOK4", cb4["codebook"])
    float_list("BOUNDS4", cb4["bounds"])
    out.append(f"# ISOQUANT3_64 / ISOQUANT4_64 (head size {DIM64}): SIGNS[:{DIM64}], SO4/SO3[:{DIM64 // 4}],")
    out.append(f"# WHT_SCALE_64 = float32(1/sqrt({DIM64})), Lloyd-Max codebooks of the R^{DIM64} marginal")
    out.append(f"DIM64 = {DIM64}")
    out.append(f"WHT_SCALE_64 = {_py_float(np.float32(1.0 / math.sqrt(DIM64)))}")
    out.append(f"LLOYD_MSE_PER_COORD_64 = {float('%.6e' % t['cb3_64']['mse_per_coord'])!r}")
    out.append(f"LLOYD_MSE_PER_COORD4_64 = {float('%.6e' % t['cb4_64']['mse_per_coord'])!r}")
    out.append("")
    float_list("CODEBOOK_64", t["cb3_64"]["codebook"])
    float_list("BOUNDS_64", t["cb3_64"]["bounds"])
    float_list("CODEBOOK4_64", t["cb4_64"]["codebook"])
    float_list("BOUNDS4_64", t["cb4_64"]["bounds"])
    out.append("# unit quaternions (w, x, y, z) per group, float64 (reference): [q_L, q_R]")
    out.append("QUATERNIONS = [")
    for g in range(NGROUPS):
        ql = ", ".join(repr(float(v)) for v in t["quats"][g, 0])
        qr = ", ".join(repr(float(v)) for v in t["quats"][g, 1])
        out.append(f"    [[{ql}],")
        out.append(f"     [{qr}]],")
    out.append("]")
    out.append("")
    return "\n".join(out)


def render_py_so(t: dict) -> str:
    out = []
    out.append('"""SO(4)/SO(3) block rotation matrices of the ISOQUANT KV-cache types (GENERATED - DO NOT EDIT).')
    out.append("")
    out.append(f"Generated by `{COMMAND}`;")
    out.append(f"verify with `{COMMAND} --check`.")
    out.append("Built from isoquant_tables.QUATERNIONS, which re-exports SO4 and SO3; every float")
    out.append("below is the exact value of a float32.  The C twin is ggml-patches/src/isoquant-tables.h.")
    out.append('"""')
    for name, comment in (("so4", "v -> q_L v conj(q_R)"), ("so3", "v -> q_L v conj(q_L)")):
        out.append("")
        out.append(f"# row-major 4x4 per group: {comment}")
        out.append(f"{name.upper()} = [")
        for g in range(NGROUPS):
            m = t[name][g]
            out.append(f"    [  # group {g}")
            for r in range(4):
                out.append("        " + ", ".join(_py_float(v) for v in m[4 * r:4 * r + 4]) + ",")
            out.append("    ],")
        out.append("]")
    out.append("")
    return "\n".join(out)


def _report_codebook(t: dict) -> list[str]:
    n = len(t["codebook"])
    dim = t["dim"]
    return [
        f"R^{dim}, {n} levels: Lloyd-Max: {t['iterations']} iterations, last step {t['last_step']:.3e}, "
        f"fixed-point residual {t['fixed_point_residual']:.3e}",
        f"per-coordinate MSE  closed form {t['mse_per_coord']:.12e}",
        f"                    quadrature  {t['mse_per_coord_quad']:.12e}",
        f"                    float32 cb  {t['mse_per_coord_f32']:.12e}",
        f"relative MSE per {dim}-vector (x dim): {dim * t['mse_per_coord']:.6f}",
        "codebook (float32): " + ", ".join("%.9g" % v for v in t["codebook"]),
        "bounds   (float32): " + ", ".join("%.9g" % v for v in t["bounds"]),
        f"codebook x sqrt({dim}): " + ", ".join("%.5f" % (v * math.sqrt(dim)) for v in t["codebook_f64"]),
    ]


def report(t: dict) -> str:
    lines = (_report_codebook(t) + _report_codebook(t["cb4"]) + _report_codebook(t["cb3_64"])
             + _report_codebook(t["cb4_64"])) + [
        "signs S: " + "".join("+" if v > 0 else "-" for v in t["signs"])
        + f"  ({t['signs_nneg']} negative; max |WHT(S)|/||S|| = {t['signs_dc_max']:.4f};"
        f" S[:{DIM64}] under WHT-{DIM64}: {t['signs_dc_max64']:.4f})",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="regenerate in memory; exit 1 if the committed files differ")
    ap.add_argument("--report", action="store_true", help="print the derivation log")
    args = ap.parse_args(argv)

    t = derive()
    files = {C_HEADER: render_c(t), PY_TABLES: render_py(t), PY_TABLES_SO: render_py_so(t)}
    if args.report or not args.check:
        print(report(t))
    if args.check:
        bad = [p for p, txt in files.items()
               if not p.exists() or p.read_text(encoding="utf-8") != txt]
        for p in bad:
            print(f"STALE: {p.relative_to(ROOT)} differs from a fresh derivation; "
                  f"run `{COMMAND}`", file=sys.stderr)
        if not bad:
            print("isoquant tables up to date")
        return 1 if bad else 0
    for p, txt in files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(txt, encoding="utf-8")
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
