"""Bit exactness of the production ITQ3_S numpy quantiser (rotaryquant/quants/itq3.py).

The vectorised quantiser must equal the literal scalar transcription of the spec
(`scalar_quantize_block` in tests/quants/itq3_spec.py) bit for bit, with and without an
imatrix, on ordinary and pathological blocks.  Pure numpy; runs in well under a minute.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the shared helpers next to this file
    sys.path.insert(0, str(HERE))

from itq3_spec import (  # noqa: E402
    F32, QK, _special_blocks, scalar_dequantize_block, scalar_pack, scalar_quantize_block)

from rotaryquant.quants import itq3  # noqa: E402


# --------------------------------------------------------------------------
# test data (the special blocks: tests/quants/itq3_spec.py)
# --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bitexact_blocks() -> tuple[list[str], np.ndarray]:
    rng = np.random.default_rng(11)
    sp = _special_blocks()
    names = list(sp)
    rows = [sp[k] for k in names]
    for k in range(6):   # plain Gaussian / heavy-tailed blocks at several magnitudes
        sc = F32(10.0 ** rng.uniform(-4, 1))
        rows.append((rng.standard_normal(QK) * sc).astype(F32))
        names.append(f"gauss#{k}")
        rows.append((rng.standard_t(3, QK) * sc).astype(F32))
        names.append(f"t3#{k}")
    return names, np.stack(rows)


# --------------------------------------------------------------------------
# bit exactness: vectorised == scalar transcription of the spec
# --------------------------------------------------------------------------

def test_vectorised_equals_scalar_spec(bitexact_blocks):
    names, W = bitexact_blocks
    got = itq3.quantize_blocks(W)
    with np.errstate(all="ignore"):
        for i, name in enumerate(names):
            q, d16, m16, _ = scalar_quantize_block(W[i])
            assert bytes(got[i]) == scalar_pack(q, d16, m16), name


def test_vectorised_equals_scalar_spec_imatrix(bitexact_blocks):
    names, W = bitexact_blocks
    rng = np.random.default_rng(12)
    iw = np.exp(1.5 * rng.standard_normal(W.shape)).astype(F32)
    iw[names.index("gauss"), ::3] = 0.0            # zero importances
    iw[names.index("uniform")] = 0.0               # an all-zero imatrix block
    got = itq3.quantize_blocks(W, iw)
    with np.errstate(all="ignore"):
        for i, name in enumerate(names):
            q, d16, m16, _ = scalar_quantize_block(W[i], iw[i])
            assert bytes(got[i]) == scalar_pack(q, d16, m16), name


def _mixed_blocks(n: int, seed: int) -> np.ndarray:
    """Gaussian / t3 / uniform / offset blocks with magnitudes over 10^-6 .. 10^3."""
    rng = np.random.default_rng(seed)
    kind = rng.integers(0, 4, n)
    x = np.where(kind[:, None] == 0, rng.standard_normal((n, QK)),
                 np.where(kind[:, None] == 1, rng.standard_t(3, (n, QK)),
                          np.where(kind[:, None] == 2, rng.uniform(-1, 1, (n, QK)),
                                   rng.standard_normal((n, QK)) + rng.standard_normal((n, 1)))))
    return (x * 10.0 ** rng.uniform(-6, 3, (n, 1))).astype(F32)


@pytest.mark.parametrize("with_imatrix", [False, True])
def test_intermediates_equal_scalar_spec(bitexact_blocks, with_imatrix):
    """Every float32 intermediate (moments, start step, chosen candidate, Lloyd result, the
    unrounded d and m, the imatrix refit sums) equals the scalar transcription bit for bit."""
    names, W0 = bitexact_blocks
    W = np.concatenate([W0, _mixed_blocks(96, 41)])
    iw = np.exp(2.0 * np.random.default_rng(42).standard_normal(W.shape)).astype(F32) if with_imatrix else None
    q, d16, m16, tr = itq3._quantize_trace(W, iw)
    with np.errstate(all="ignore"):
        for i in range(W.shape[0]):
            sq, sd16, sm16, st = scalar_quantize_block(W[i], None if iw is None else iw[i])
            label = names[i] if i < len(names) else f"mixed#{i - len(names)}"
            assert list(q[i]) == sq, label
            for key, val in st.items():
                assert F32(val).view(np.uint32) == F32(tr[key][i]).view(np.uint32), (label, key, val, tr[key][i])


def test_dequantize_equals_scalar(bitexact_blocks):
    names, W = bitexact_blocks
    b = itq3.quantize_blocks(W)
    deq = itq3.dequantize_blocks(b)
    with np.errstate(all="ignore"):
        for i, name in enumerate(names[:12]):
            np.testing.assert_array_equal(deq[i].view(np.uint32), scalar_dequantize_block(bytes(b[i])).view(np.uint32),
                                          err_msg=name)


def test_special_blocks_behaviour():
    sp = _special_blocks()
    names = list(sp)
    W = np.stack([sp[k] for k in names])
    with np.errstate(all="ignore"):
        q, d16, m16 = itq3.quantize_codes(W)
        Wh = itq3.dequantize_blocks(itq3.pack_blocks(q, d16, m16))
    r = dict(zip(names, range(len(names))))
    # flat blocks: d = 0, m = mean of the rotated block
    for k in ("zero", "spike0", "tiny_1e-30", "denormal"):
        assert d16[r[k]] == 0, k
    assert not Wh[r["zero"]].any()
    # a spike at weight 0 is a constant rotated block: reconstructed up to fp16 rounding of m
    assert abs(float(Wh[r["spike0"], 0]) - 0.37) < 0.37 * 2 ** -11 and not Wh[r["spike0"], 1:].any()
    # saturation instead of inf for every finite block, however large: inputs are clamped to 1e15 so the
    # butterflies and sums of squares cannot overflow (NaN comes out only where NaN went in)
    assert abs(float(d16[r["huge_1e18"]])) == 65504.0 and np.isfinite(m16[r["huge_1e18"]])
    finite_in = np.isfinite(W).all(axis=1)
    assert np.isfinite(d16[finite_in].astype(np.float32)).all() and np.isfinite(m16[finite_in].astype(np.float32)).all()
    assert abs(float(m16[r["big_1e4"]])) <= 65504.0
    # ordinary blocks reconstruct well
    for k in ("uniform", "gauss", "gauss_offset", "outlier_cols", "integers"):
        e = np.linalg.norm(Wh[r[k]] - W[r[k]]) / np.linalg.norm(W[r[k]])
        assert e < 0.25, (k, e)


def test_rows_api_and_chunking():
    rng = np.random.default_rng(9)
    W = rng.standard_normal((7, 3 * QK)).astype(F32)
    imat = np.exp(rng.standard_normal(3 * QK)).astype(F32)
    for im in (None, imat):
        rows = itq3.quantize_rows(W, im)
        assert rows.shape == (7, 300) and rows.dtype == np.uint8
        if im is None:
            np.testing.assert_array_equal(rows.reshape(21, 100), itq3.quantize_blocks(W.reshape(21, QK)))
        else:  # rows with an imatrix: LDLQ with H = diag(imatrix) (tests/quants/test_itq3_ldlq.py)
            np.testing.assert_array_equal(rows, itq3.quantize_rows_ldlq(W, imatrix=im))
        np.testing.assert_array_equal(itq3.dequantize_rows(rows), itq3.dequantize_blocks(rows.reshape(21, 100))
                                      .reshape(7, 3 * QK))
    # (256,) imatrix broadcasts to every block
    np.testing.assert_array_equal(itq3.quantize_blocks(W.reshape(21, QK), imat[:QK]),
                                  itq3.quantize_blocks(W.reshape(21, QK), np.tile(imat[:QK], (21, 1))))
    # results do not depend on the chunking (more blocks than one chunk)
    big = rng.standard_normal((itq3._CHUNK * 2 + 5, QK)).astype(F32)
    full = itq3.quantize_blocks(big)
    np.testing.assert_array_equal(full[-7:], itq3.quantize_blocks(big[-7:]))
    with pytest.raises(ValueError):
        itq3.quantize_rows(np.zeros((2, 300), F32))
    with pytest.raises(ValueError):
        itq3.quantize_rows(W, imat[:QK])
