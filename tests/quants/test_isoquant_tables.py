"""Tests of the ISOQUANT3_0 offline tables and of the rotations of the numpy reference.

Pure numpy (the derivation --check additionally needs scipy); runs in a few seconds.
Shared helpers: tests/quants/isoquant_spec.py; the `gauss` fixture: tests/quants/conftest.py.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the shared helpers next to this file
    sys.path.insert(0, str(HERE))

from isoquant_spec import DIM, F32, PRED_REL_MSE, ROOT, _lloyd_update  # noqa: E402

from rotaryquant.quants import isoquant as iq  # noqa: E402
from rotaryquant.quants import isoquant_tables as tables  # noqa: E402


# --------------------------------------------------------------------------
# offline tables
# --------------------------------------------------------------------------

def test_derivation_check_passes():
    pytest.importorskip("scipy")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "derive_isoquant_tables.py"),
                        "--check"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_header_matches_python_tables():
    """The C header literals parse to exactly the float32 values of the Python tables."""
    text = (ROOT / "ggml-patches" / "src" / "isoquant-tables.h").read_text()
    assert "#pragma once" in text

    def array(name):
        body = text.split(f"static const float {name}")[1].split("};")[0].split("= {", 1)[1]
        body = "\n".join(line.split("/*")[0] for line in body.splitlines())
        return np.array([F32(float(t.strip().rstrip("f")))
                         for t in body.replace("{", ",").replace("}", ",").split(",")
                         if t.strip()], dtype=F32)

    np.testing.assert_array_equal(array("iq3_codebook"), iq.CODEBOOK)
    np.testing.assert_array_equal(array("iq3_bounds"), iq.BOUNDS)
    np.testing.assert_array_equal(array("iq3_so4"), iq.SO4.reshape(-1))
    np.testing.assert_array_equal(array("iq3_so3"), iq.SO3.reshape(-1))
    signs = array("iq3_signs")
    np.testing.assert_array_equal(signs, iq.SIGNS)
    assert signs.shape == (DIM,)
    for line in text.split("iq3_signs[128] = {")[1].split("};")[0].split(","):
        assert line.strip() in ("1.0f", "-1.0f", "")      # literally exact +-1
    scale = text.split("iq3_wht_scale =")[1].split(";")[0].strip().rstrip("f")
    assert F32(float(scale)) == iq.WHT_SCALE == F32(1.0 / math.sqrt(DIM))


def test_tables_are_exact_float32():
    for name in ("CODEBOOK", "BOUNDS", "WHT_SCALE", "SIGNS"):
        v = np.atleast_1d(np.asarray(getattr(tables, name), dtype=np.float64))
        np.testing.assert_array_equal(v.astype(F32).astype(np.float64), v)
    for name in ("SO4", "SO3"):
        v = np.asarray(getattr(tables, name), dtype=np.float64)
        assert v.shape == (32, 16)
        np.testing.assert_array_equal(v.astype(F32).astype(np.float64), v)


def test_signs_recipe_and_spread():
    """S = 1 - 2 * default_rng(SEED + 1).integers(0, 2, 128) (documented recipe), exactly
    +-1, and not close to a Walsh function: the constant vector must be spread by the WHT."""
    bits = np.random.default_rng(tables.SEED + 1).integers(0, 2, DIM)
    np.testing.assert_array_equal(iq.SIGNS, (1 - 2 * bits).astype(F32))
    assert set(np.unique(iq.SIGNS).tolist()) == {-1.0, 1.0}
    assert iq.SIGNS.dtype == F32 and not iq.SIGNS.flags.writeable
    w = iq.fwht128(iq.SIGNS[None] / F32(math.sqrt(DIM)))[0].astype(np.float64)  # WHT of a unit DC
    assert np.abs(w).max() < 0.3 and (w * w).sum() == pytest.approx(1.0, rel=1e-6)


def test_defaults_are_preserve():
    import inspect
    assert iq.DEFAULT_NORM_MODE == "preserve"
    for fn in (iq.quantize_blocks, iq.quantize_row, iq.quantize_indices):
        assert inspect.signature(fn).parameters["norm_mode"].default == "preserve", fn.__name__
    x = np.random.default_rng(4).standard_normal((3, DIM)).astype(F32)
    np.testing.assert_array_equal(iq.quantize_blocks(x), iq.quantize_blocks(x, norm_mode="preserve"))
    assert not np.array_equal(iq.quantize_blocks(x), iq.quantize_blocks(x, norm_mode="raw"))


def test_codebook_is_lloyd_max_fixed_point():
    cb = iq.CODEBOOK.astype(np.float64)
    bnd = iq.BOUNDS.astype(np.float64)
    assert np.all(np.diff(cb) > 0) and np.all(np.diff(bnd) > 0)
    np.testing.assert_array_equal(iq.CODEBOOK, -iq.CODEBOOK[::-1])      # exactly symmetric
    assert iq.BOUNDS[3] == 0.0
    # nearest-neighbour condition: boundaries are the float32 midpoints
    np.testing.assert_allclose(bnd, 0.5 * (cb[:-1] + cb[1:]), rtol=0, atol=1e-8)
    # centroid condition: one Lloyd step (independent numpy quadrature) is a no-op
    new, mse = _lloyd_update(cb, bnd)
    np.testing.assert_allclose(new, cb, rtol=0, atol=5e-9)
    assert mse == pytest.approx(tables.LLOYD_MSE_PER_COORD, rel=1e-5)
    # sanity: close to the Gaussian 3-bit Lloyd-Max levels scaled by 1/sqrt(d)
    gauss = np.array([0.2451, 0.7560, 1.3440, 2.1520]) / math.sqrt(DIM)
    np.testing.assert_allclose(cb[4:], gauss, rtol=0.02)
    assert 0.030 < PRED_REL_MSE < 0.0346   # below the Gaussian Lloyd-Max 0.03454


def test_codebook_is_locally_optimal():
    cb = iq.CODEBOOK.astype(np.float64)
    _, base = _lloyd_update(cb, 0.5 * (cb[:-1] + cb[1:]))
    for k in range(4, 8):
        for eps in (-1e-3, 1e-3):
            c = cb.copy()
            c[k] += eps
            c[7 - k] -= eps
            _, mse = _lloyd_update(c, 0.5 * (c[:-1] + c[1:]))
            assert mse > base


def _hamilton(p, q):
    a1, b1, c1, d1 = p
    a2, b2, c2, d2 = q
    return np.array([a1 * a2 - b1 * b2 - c1 * c2 - d1 * d2,
                     a1 * b2 + b1 * a2 + c1 * d2 - d1 * c2,
                     a1 * c2 - b1 * d2 + c1 * a2 + d1 * b2,
                     a1 * d2 + b1 * c2 - c1 * b2 + d1 * a2])


def test_quaternions_and_rotation_matrices():
    q = np.asarray(tables.QUATERNIONS, dtype=np.float64)
    assert q.shape == (32, 2, 4)
    np.testing.assert_allclose(np.linalg.norm(q, axis=-1), 1.0, rtol=0, atol=1e-14)
    eye = np.eye(4)
    for name, mats in (("so4", iq.SO4), ("so3", iq.SO3)):
        m = mats.astype(np.float64)
        np.testing.assert_allclose(m @ m.transpose(0, 2, 1), np.broadcast_to(eye, m.shape),
                                   rtol=0, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(np.linalg.det(m), 1.0, atol=1e-6, err_msg=name)
    rng = np.random.default_rng(5)
    for g in range(32):
        ql, qr = q[g]
        v = rng.standard_normal(4)
        conj = np.array([1.0, -1.0, -1.0, -1.0])
        want4 = _hamilton(_hamilton(ql, v), qr * conj)
        want3 = _hamilton(_hamilton(ql, v), ql * conj)
        np.testing.assert_allclose(iq.SO4[g].astype(np.float64) @ v, want4, atol=2e-7)
        np.testing.assert_allclose(iq.SO3[g].astype(np.float64) @ v, want3, atol=2e-7)
    # SO(3) blocks keep e_0 exactly; the SO(4) blocks do not
    np.testing.assert_array_equal(iq.SO3[:, 0, :], np.broadcast_to([1, 0, 0, 0], (32, 4)))
    np.testing.assert_array_equal(iq.SO3[:, :, 0], np.broadcast_to([1, 0, 0, 0], (32, 4)))
    assert np.all(np.abs(iq.SO4[:, 0, 0]) < 0.999)


# --------------------------------------------------------------------------
# rotations
# --------------------------------------------------------------------------

def test_fwht_matches_hadamard_matrix(gauss):
    h = np.array([[1.0]])
    while h.shape[0] < DIM:
        h = np.block([[h, h], [h, -h]])
    want = gauss[:50].astype(np.float64) @ h.T / math.sqrt(DIM)
    np.testing.assert_allclose(iq.fwht128(gauss[:50]), want, rtol=0, atol=2e-5)
    np.testing.assert_allclose(iq.fwht128(iq.fwht128(gauss[:50])), gauss[:50], atol=2e-6)


@pytest.mark.parametrize("variant", iq.VARIANTS)
def test_rotation_round_trip_and_inner_products(gauss, variant):
    x = gauss[:2000]
    y = iq.rotate(x, variant)
    assert y.dtype == F32 and y.shape == x.shape
    back = iq.rotate_inverse(y, variant)
    np.testing.assert_allclose(back, x, rtol=0, atol=3e-6)
    a, b = x[:1000].astype(np.float64), x[1000:].astype(np.float64)
    ra, rb = y[:1000].astype(np.float64), y[1000:].astype(np.float64)
    np.testing.assert_allclose((ra * rb).sum(1), (a * b).sum(1), rtol=0, atol=1e-4)
    np.testing.assert_allclose((ra * ra).sum(1), (a * a).sum(1), rtol=2e-6)


def test_sign_flip_is_applied_around_the_wht(gauss):
    """v3/v1 rotate S*x (S exactly +-1) before the WHT and multiply by S after the inverse
    WHT; v2/none do not use S."""
    x = gauss[:100]
    w = iq.fwht128(x * iq.SIGNS)
    np.testing.assert_array_equal(iq.rotate(x, "v3"), iq._block_apply(w, iq.SO4))
    np.testing.assert_array_equal(iq.rotate(x, "v2"), iq._block_apply(x, iq.SO4))
    np.testing.assert_array_equal(iq.rotate(x, "none"), x)
    y = iq.rotate(x, "v3")
    np.testing.assert_array_equal(
        iq.rotate_inverse(y, "v3"),
        iq.fwht128(iq._block_apply(y, np.ascontiguousarray(iq.SO4.transpose(0, 2, 1)))) * iq.SIGNS)


def test_v1_leaves_one_direction_per_group_unmixed(gauss):
    """With S the WHT input is S*x, so v1's un-mixed direction of group g is no longer
    "the input whose WHT is e_4g" but u_g = S * WHT(e_4g) (WHT is its own inverse):
    in the rotated domain, v1's coordinate 4g is exactly the WHT coordinate 4g of S*x."""
    w = iq.fwht128(gauss[:100] * iq.SIGNS)
    np.testing.assert_array_equal(iq.rotate(gauss[:100], "v1")[:, 0::4], w[:, 0::4])
    # ... so u_g is left (up to WHT rounding) on e_4g by v1,
    e = np.zeros((32, DIM), dtype=F32)
    e[np.arange(32), 4 * np.arange(32)] = 1.0
    u = iq.fwht128(e) * iq.SIGNS
    y1, y3 = iq.rotate(u, "v1"), iq.rotate(u, "v3")
    np.testing.assert_allclose(y1, e, atol=1e-6)
    # while v3 mixes it into the other three coordinates of its group
    assert np.all(np.abs(y3[np.arange(32), 4 * np.arange(32)]) < 0.999)
    assert np.all(np.abs(y3 - e).max(axis=1) > 1e-3)
    # the constant vector is NOT such a direction any more (it was u_0 without S)
    dc = iq.rotate(np.full((1, DIM), 1.0 / math.sqrt(DIM), F32), "v1")[0]
    assert np.abs(dc).max() < 0.3


def test_v3_spreads_a_spike():
    x = np.zeros((1, DIM), dtype=F32)
    x[0, 17] = 5.0
    y = iq.rotate(x, "v3")[0].astype(np.float64)
    assert np.abs(y).max() < 0.5 * 5.0 and np.abs(y).max() < 4.0 * 5.0 / math.sqrt(DIM)
