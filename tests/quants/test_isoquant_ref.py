"""Tests of the ISOQUANT3_0 bit-exact numpy reference: vectorised == the literal scalar transcription of
the spec (tests/quants/isoquant_spec.py), golden bytes, packing / layout and robustness.

Pure numpy; runs in a few seconds.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the shared helpers next to this file
    sys.path.insert(0, str(HERE))

from isoquant_spec import DIM, F32, _edge_blocks, _spec_dequantize, _spec_quantize  # noqa: E402

from rotaryquant.quants import isoquant as iq  # noqa: E402


# --------------------------------------------------------------------------
# bit-exact spec transcription (scalar, literal) vs the vectorised reference
# --------------------------------------------------------------------------

@pytest.mark.parametrize("mode", iq.NORM_MODES)
def test_bit_exact_vs_scalar_spec(mode):
    x = _edge_blocks()
    got = iq.quantize_blocks(x, norm_mode=mode)
    deq = iq.dequantize_blocks(got)
    for i in range(x.shape[0]):
        want = _spec_quantize(x[i], mode)
        assert bytes(got[i]) == want, f"block {i}"
        np.testing.assert_array_equal(deq[i].view(np.uint32),
                                      _spec_dequantize(got[i]).view(np.uint32))


@pytest.mark.parametrize("variant", ["v2", "v1", "none"])
def test_bit_exact_vs_scalar_spec_variants(variant):
    x = _edge_blocks()[[0, 1, 2, 6, 7]]
    got = iq.quantize_blocks(x, variant=variant)
    deq = iq.dequantize_blocks(got, variant=variant)
    for i in range(x.shape[0]):
        assert bytes(got[i]) == _spec_quantize(x[i], "preserve", variant)
        np.testing.assert_array_equal(deq[i].view(np.uint32),
                                      _spec_dequantize(got[i], variant).view(np.uint32))


def test_golden_bytes():
    """Frozen output of the format defaults (v3, S, "preserve") on exact-integer inputs --
    a cross-implementation test vector."""
    rng = np.random.default_rng(2026)
    x = (rng.integers(-2048, 2048, (256, DIM)) / 256.0).astype(F32)
    b = iq.quantize_blocks(x)
    assert bytes(b[0]) == _spec_quantize(x[0], "preserve")
    assert b[0].tobytes().hex() == GOLDEN_BLOCK0
    assert hashlib.sha256(b.tobytes()).hexdigest() == GOLDEN_SHA256
    assert hashlib.sha256(iq.dequantize_blocks(b).tobytes()).hexdigest() == GOLDEN_DEQ_SHA256


GOLDEN_BLOCK0 = ("1652c262cf635b31db368e26dbdaec4093894e8913356c4e6755"
                 "2ba8aae7582ea6b0a4addb75ea8c37586cc4296d8966d976")
GOLDEN_SHA256 = "a2db0a5a6aa0a914e1dba44606aa01f61ab8dbdfb8b04b692fe8780ab202a03a"
GOLDEN_DEQ_SHA256 = "d01cfd5101a85e543ce0e79e6cfce28c85283b8c11d02e175e4f57b19544a13d"


# --------------------------------------------------------------------------
# packing / layout
# --------------------------------------------------------------------------

def test_pack_layout_and_row_api():
    rng = np.random.default_rng(3)
    idx = rng.integers(0, 8, (5, DIM)).astype(np.uint8)
    qs = iq.pack_indices(idx)
    assert qs.shape == (5, 48) and qs.dtype == np.uint8
    np.testing.assert_array_equal(iq.unpack_indices(qs), idx)
    w = int(qs[2, 3]) | int(qs[2, 4]) << 8 | int(qs[2, 5]) << 16     # group 1 of block 2
    assert [(w >> (3 * k)) & 7 for k in range(8)] == list(idx[2, 8:16])

    x = rng.standard_normal(3 * DIM).astype(F32)
    row = iq.quantize_row(x)
    assert row.shape == (150,) and row.dtype == np.uint8
    np.testing.assert_array_equal(row.reshape(3, 50), iq.quantize_blocks(x.reshape(3, DIM)))
    np.testing.assert_array_equal(iq.dequantize_row(row),
                                  iq.dequantize_blocks(row.reshape(3, 50)).reshape(-1))
    # d: little-endian fp16 of ||x|| / ||c|| (default "preserve"); of ||x|| in "raw" mode
    idx = iq.unpack_indices(row[2:50].reshape(1, 48))[0]
    c = iq.CODEBOOK[idx].astype(np.float64)
    d = np.frombuffer(row[:2].tobytes(), dtype="<f2")[0]
    want = np.linalg.norm(x[:DIM].astype(np.float64)) / np.linalg.norm(c)
    assert d == np.float16(np.float32(want))
    d_raw = np.frombuffer(iq.quantize_row(x, norm_mode="raw")[:2].tobytes(), dtype="<f2")[0]
    assert d_raw == np.float16(np.float32(np.linalg.norm(x[:DIM].astype(np.float64))))
    with pytest.raises(ValueError):
        iq.quantize_row(np.zeros(100, F32))
    with pytest.raises(ValueError):
        iq.dequantize_row(np.zeros(49, np.uint8))
    with pytest.raises(ValueError):
        iq.quantize_blocks(x, variant="v4")
    with pytest.raises(ValueError):
        iq.quantize_blocks(x.reshape(3, DIM), norm_mode="bogus")


# --------------------------------------------------------------------------
# robustness
# --------------------------------------------------------------------------

@pytest.mark.parametrize("variant", iq.VARIANTS)
@pytest.mark.parametrize("mode", iq.NORM_MODES)
def test_extreme_inputs_are_finite(variant, mode):
    x = _edge_blocks()
    b = iq.quantize_blocks(x, variant=variant, norm_mode=mode)
    d = np.ascontiguousarray(b[:, :2]).view("<f2").reshape(-1)
    assert np.all(np.isfinite(d)) and np.all(d >= 0)
    y = iq.dequantize_blocks(b, variant=variant)
    assert np.all(np.isfinite(y))
    np.testing.assert_array_equal(y[2], 0.0)          # zeros -> zeros
    assert d[2] == 0
    assert d[3] == 0                                  # 1e-30 * sqrt(128) underflows fp16
    assert d[4] == np.float16(65504)                  # huge: clamped, not inf
    # NaN / inf inputs: defined (C-identical) garbage, but never NaN/inf output
    if mode != "unbiased":
        assert np.all(d[-3:] == np.float16(65504))


def test_fp16_scale_edge_values():
    # raw: sd just below/above fp16 max: clamped to 65504; tiny norms round to subnormal fp16
    x = np.zeros((4, DIM), dtype=F32)
    x[0, 0], x[1, 0], x[2, 0], x[3, 0] = 65519.0, 65520.0, 1e-7, 6e-8
    d = np.ascontiguousarray(iq.quantize_blocks(x, norm_mode="raw")[:, :2]).view("<f2").reshape(-1)
    assert d[0] == np.float16(65504) and d[1] == np.float16(65504)
    assert d[2] == np.float16(np.float32(1e-7)) and d[2] > 0     # subnormal fp16
    assert d[3] == np.float16(np.float32(6e-8))
    # preserve (default): D = sd / ||c|| goes through the same clamp and roundings
    x = np.zeros((5, DIM), dtype=F32)
    x[:, 0] = [6e4, 7e4, 1e5, 1e-7, 1.0]
    b = iq.quantize_blocks(x)
    d = np.ascontiguousarray(b[:, :2]).view("<f2").reshape(-1)
    cn = np.linalg.norm(iq.CODEBOOK[iq.unpack_indices(b[:, 2:])].astype(np.float64), axis=1)
    want = np.minimum(x[:, 0].astype(np.float64) / cn, 65504.0).astype(F32).astype(np.float16)
    np.testing.assert_array_equal(d, want)
    assert d[2] == np.float16(65504) and 0 < d[3] < np.float16(6.2e-5)   # clamped / subnormal
