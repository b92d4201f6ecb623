"""Tests of the ITQ3_S tables and primitives of the production numpy quantiser (rotaryquant/quants/itq3.py):
the documented recipes, the C header, the FWHT, the fp16 saturation and the 100-byte packing.

Pure numpy; the derivation --check additionally needs scipy.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the shared helpers next to this file
    sys.path.insert(0, str(HERE))

from itq3_spec import F32, QK, ROOT, scalar_fwht, scalar_pack  # noqa: E402

from rotaryquant.quants import itq3  # noqa: E402
from rotaryquant.quants import itq3_tables as tables  # noqa: E402


# --------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------

def test_derivation_check_passes():
    pytest.importorskip("scipy")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "derive_itq3_tables.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_tables_recipes():
    """The documented recipes of every constant (no scipy needed)."""
    assert tables.GRID == [-127, -79, -45, -14, 14, 45, 79, 127]
    assert tables.THR2 == [tables.GRID[k] + tables.GRID[k + 1] for k in range(7)]
    assert tables.THR2 == [-206, -124, -59, 0, 59, 124, 206]
    assert int(F32(tables.C).view(np.uint32)) == 0x3C8AD2F8
    assert F32(tables.C) == F32(0.0169463)
    assert [int(v) for v in np.asarray(tables.F, F32).view(np.uint32)] == \
        [0x3F4CCCCD, 0x3F6DA63C, 0x3F89E242, 0x3FA00000]
    k = np.arange(4.0)
    np.testing.assert_array_equal(np.asarray(tables.F, F32), (0.8 * (1.25 / 0.8) ** (k / 3)).astype(F32))
    assert F32(tables.VAR_EPS) == F32(2.0 ** -80)
    bits = np.random.default_rng(20260327).integers(0, 2, QK)
    np.testing.assert_array_equal(np.asarray(tables.SIGNS, F32), (1 - 2 * bits).astype(F32))
    # the constant vector is spread by FWHT256(S * .): at most 3/16 of its norm on one coordinate
    img = itq3.fwht256(itq3.SIGNS[None])[0]
    assert float(np.abs(img).max()) == tables.SIGNS_WHT_MAX == 3.0
    assert float((img.astype(np.float64) ** 2).sum()) == 256.0


def test_header_matches_python_tables():
    text = (ROOT / "ggml-patches" / "src" / "itq3-tables.h").read_text()
    assert "#pragma once" in text

    def body(decl):
        b = text.split(decl)[1].split(";")[0].split("=", 1)[1]
        return [t.strip() for t in b.replace("{", " ").replace("}", " ").split(",") if t.strip()]

    assert [int(v) for v in body("static const int8_t itq3_grid[8]")] == tables.GRID
    cval = body("static const float itq3_C")[0]
    assert F32(float(cval.rstrip("f"))) == F32(tables.C)
    fv = body("static const float itq3_F[4]")
    np.testing.assert_array_equal(np.array([F32(float(v.rstrip("f"))) for v in fv]), np.asarray(tables.F, F32))
    sv = body("static const float itq3_signs[256]")
    assert all(v in ("1.0f", "-1.0f") for v in sv)
    np.testing.assert_array_equal(np.array([float(v.rstrip("f")) for v in sv], F32), itq3.SIGNS)


# --------------------------------------------------------------------------
# primitives
# --------------------------------------------------------------------------

def _hadamard() -> np.ndarray:
    h = np.array([[1.0]])
    while h.shape[0] < QK:
        h = np.block([[h, h], [h, -h]])
    return h


def test_fwht_is_the_normalised_sylvester_matrix():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((20, QK)).astype(F32)
    np.testing.assert_allclose(itq3.fwht256(x), x.astype(np.float64) @ _hadamard().T / 16, rtol=0, atol=3e-6)
    np.testing.assert_allclose(itq3.fwht256(itq3.fwht256(x)), x, rtol=0, atol=3e-6)
    # integer inputs are exact (all partial sums are small integers, * 1/16 is exact)
    gi = rng.integers(-127, 128, (5, QK)).astype(F32)
    np.testing.assert_array_equal(itq3.fwht256(gi).astype(np.float64), gi.astype(np.float64) @ _hadamard().T / 16)
    # bit for bit against the scalar butterflies (the stage order decides the rounding)
    for r in range(3):
        np.testing.assert_array_equal(itq3.fwht256(x[r:r + 1])[0].view(np.uint32), scalar_fwht(x[r]).view(np.uint32))


def test_offset_identity():
    """A rotated-domain constant m maps to the original domain as S * FWHT(m * 1) = 16 m S[0] e_0
    (exact), which is why the imatrix path's m = (w_0 - d16 u_0) / (16 S[0]) makes weight 0 exact."""
    for m in (F32(0.37), F32(-1e-3), F32(3.0)):
        v = itq3.rotate_inverse(np.full((1, QK), m, F32))[0]
        want = np.zeros(QK, F32)
        want[0] = F32(16) * m * itq3.SIGNS[0]
        np.testing.assert_array_equal(v, want)


def test_f16_sat():
    x = np.array([0.0, -0.0, 1.0, 65504.0, 65519.0, 65520.0, 1e9, -1e9, np.inf, -np.inf, 6e-8, 2e-8], F32)
    got = itq3.f16_sat(x)
    want = np.array([0.0, -0.0, 1.0, 65504.0, 65504.0, 65504.0, 65504.0, -65504.0, 65504.0, -65504.0,
                     6e-8, 0.0], np.float16)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    assert np.isnan(itq3.f16_sat(np.array([np.nan], F32))[0])
    # round to nearest even: 1 + 2^-11 is a tie between 1 and 1 + 2^-10
    assert itq3.f16_sat(np.array([1 + 2.0 ** -11], F32))[0] == np.float16(1.0)
    assert itq3.f16_sat(np.array([1 + 3 * 2.0 ** -11], F32))[0] == np.float16(1 + 2 * 2.0 ** -10)


def test_pack_layout_and_round_trip():
    rng = np.random.default_rng(5)
    q = rng.integers(0, 8, (9, QK)).astype(np.uint8)
    d16 = rng.standard_normal(9).astype(np.float16)
    m16 = rng.standard_normal(9).astype(np.float16)
    b = itq3.pack_blocks(q, d16, m16)
    assert b.shape == (9, 100) and b.dtype == np.uint8
    for i in range(9):
        assert bytes(b[i]) == scalar_pack(list(q[i]), d16[i], m16[i])
    q2, d2, m2 = itq3.unpack_blocks(b)
    np.testing.assert_array_equal(q2, q)
    np.testing.assert_array_equal(d2.view(np.uint16), d16.view(np.uint16))
    np.testing.assert_array_equal(m2.view(np.uint16), m16.view(np.uint16))
    # single-code probes of the bit positions
    for i in (0, 1, 31, 32, 63, 64, 100, 127, 128, 191, 192, 255):
        qq = np.zeros((1, QK), np.uint8)
        qq[0, i] = 7
        bb = itq3.pack_blocks(qq, np.zeros(1, np.float16), np.zeros(1, np.float16))[0]
        nz = {j: int(v) for j, v in enumerate(bb) if v}
        assert nz == {4 + i % 64: 3 << (2 * (i // 64)), 68 + i % 32: 1 << (i // 32)}
